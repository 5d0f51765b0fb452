"""No secret in any output, log or Ray runtime_env (issue 27, item 5).

A fake credential goes in through every door a user has (``data.storage_options``' key, secret and
token, the AWS_* environment of the driver) and is then looked for, byte for byte, in every file the
build wrote and, on Ray, in every file under the Ray session's directory (runtime_env_agent.log
among them, which logs each actor's runtime_env in plain text) and in the workers' environment.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs.build_dataset import main
from pipeline.config import ConfigError, load_config
from pipeline.provenance import redacted_config
from tests.conftest import GOOD_PROMPTS, moto_s3, write_jsonl

SECRET = "SECRETfake1234567890"  # data.storage_options' secret
TOKEN = "TOKENfake0987654321"  # data.storage_options' session token
ENV_SECRET = "SECRETenvfake5555555"  # the driver's AWS_SECRET_ACCESS_KEY
ENV_TOKEN = "TOKENenvfake6666666"  # the driver's AWS_SESSION_TOKEN
ALL = (SECRET, TOKEN, ENV_SECRET, ENV_TOKEN)


def hits(root: Path) -> list[str]:
    """Every file under ``root`` (binary too: Parquet, Arrow, logs) that holds one of the fake secrets."""
    found = []
    for path in root.rglob("*"):
        if path.is_file():
            try:
                content = path.read_bytes()
            except OSError:  # a socket or a file that went away while we walked
                continue
            found += [f"{path}: {s}" for s in ALL if s.encode() in content]
    return found


def build_args(tiny_models, prompts, out, options: dict, *extra) -> list[str]:
    return ["--config", "configs/demo.yaml", "--prompts", str(prompts), "--output", str(out),
            "--set", f"models.generator={tiny_models['generator']}", "--set", f"models.reward={tiny_models['reward']}",
            "--num-samples", "2", "--max-new-tokens", "6", "--set", "strategy.decision_token=3",
            "--set", f"data.storage_options={json.dumps(options)}", "--no-progress", *extra]


@pytest.fixture
def driver_credentials(monkeypatch):
    """The driver's environment holds AWS credentials, as on a laptop or a CI runner."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAFAKEFAKEFAKE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", ENV_SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", ENV_TOKEN)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")


def test_ray_runtime_env_carries_no_credential_but_the_endpoint_and_region(driver_credentials):
    """Before: the AWS_* credentials of the driver and storage_options' key/secret/token went into
    every actor's runtime_env env_vars."""
    from actors.factory import ray_runtime_env

    env = ray_runtime_env({"key": "AKIAOPTIONS", "secret": SECRET, "token": TOKEN,
                           "endpoint_url": "http://127.0.0.1:5000", "client_kwargs": {"region_name": "us-east-1"}})
    text = json.dumps(env)
    assert not [s for s in ALL + ("AKIAOPTIONS", "AKIAFAKEFAKEFAKE") if s in text], text
    assert env["env_vars"]["AWS_ENDPOINT_URL"] == "http://127.0.0.1:5000"  # storage_options win
    assert env["env_vars"]["AWS_DEFAULT_REGION"] == "eu-west-1"
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"} & set(env["env_vars"])


def test_redacted_config_hides_credentials_at_any_depth_and_keeps_the_rest():
    config = load_config("configs/demo.yaml", [
        "data.storage_options=" + json.dumps({
            "key": "AKIAOPTIONS", "secret": SECRET, "endpoint_url": "http://user:pw@127.0.0.1:5000",
            "anon": False, "client_kwargs": {"region_name": "us-east-1", "aws_session_token": TOKEN},
            "config_kwargs": {"retries": {"max_attempts": 3}}})])
    options = redacted_config(config)["data"]["storage_options"]
    assert options == {"key": "[redacted]", "secret": "[redacted]", "endpoint_url": "http://[redacted]@127.0.0.1:5000",
                       "anon": False, "client_kwargs": {"region_name": "us-east-1", "aws_session_token": "[redacted]"},
                       "config_kwargs": {"retries": {"max_attempts": 3}}}
    assert config.data.storage_options["secret"] == SECRET  # the build itself still has it
    assert redacted_config(config)["sampling"] == config.to_dict()["sampling"]  # max_new_tokens is no token


def test_in_process_build_writes_no_secret(tiny_models, tmp_path, driver_credentials):
    """Before: _manifest.json held data.storage_options verbatim (key and secret)."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:2]] + [{"prompt": ""}])
    out = tmp_path / "out"
    options = {"key": "AKIAOPTIONS", "secret": SECRET, "token": TOKEN}  # accepted and unused by local paths
    assert main(build_args(tiny_models, prompts, out, options, "--set", "runtime.local=true")) == 0
    assert hits(out) == []
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["config"]["data"]["storage_options"] == {"key": "[redacted]", "secret": "[redacted]",
                                                             "token": "[redacted]"}
    assert manifest["pairs"] == 2 and (out / "_SUCCESS").exists()


@pytest.mark.parametrize("override", [
    "data.storage_options=" + SECRET,  # a string where a mapping belongs: the type error quoted the value
    'data.storage_options={"secret": "' + SECRET + '", ',  # broken YAML: the parser's message quoted the text
])
def test_config_errors_do_not_print_the_value_of_storage_options(override, capsys):
    """Before: the first printed ``got str 'SECRET...'``; the second a YAML traceback quoting it."""
    with pytest.raises(ConfigError) as exc:
        load_config("configs/demo.yaml", [override])
    assert SECRET not in str(exc.value) and "storage_options" in str(exc.value)
    rc = main(["--config", "configs/demo.yaml", "--prompts", "p", "--output", "o", "--set", override])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and SECRET not in err


@pytest.mark.integration
@pytest.mark.reliability
def test_s3_build_on_ray_leaves_no_secret_in_output_logs_or_workers(cluster, tiny_models, tmp_path,
                                                                   driver_credentials):
    """A build on Ray (moto on 127.0.0.1) with the secret in storage_options and in the driver's
    AWS_* environment: not in any output object, not in any file of the Ray session (logs,
    runtime_env_agent.log), not in the workers' environment; the endpoint still reaches them.
    Before: the actors' runtime_env carried key, secret and token (runtime_env_agent.log and the
    workers' os.environ held them) and _manifest.json held storage_options verbatim."""
    import ray
    import s3fs

    from actors import start_workers

    with moto_s3() as endpoint:
        options = {"endpoint_url": endpoint, "key": "AKIAOPTIONS", "secret": SECRET, "token": TOKEN,
                   "client_kwargs": {"region_name": "us-east-1"}}
        fs = s3fs.S3FileSystem(**options)
        prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:2]] + [{"prompt": ""}])
        fs.put(str(prompts), "bucket/in/p.jsonl")

        assert main(build_args(tiny_models, "s3://bucket/in/p.jsonl", "s3://bucket/out/run", options)) == 0
        fs.invalidate_cache()
        local = tmp_path / "copy"
        fs.get("bucket/out/run/", str(local), recursive=True)
        assert (local / "_SUCCESS").exists() and list(local.glob("train-*.parquet"))
        assert hits(local) == []
        assert json.loads((local / "_manifest.json").read_text())["config"]["data"]["storage_options"] == {
            **options, "key": "[redacted]", "secret": "[redacted]", "token": "[redacted]"}

        # What a worker sees: the endpoint, no credential of the driver's.
        config = load_config("configs/demo.yaml", [f"models.generator={tiny_models['generator']}",
                                                   f"models.reward={tiny_models['reward']}",
                                                   f"data.storage_options={json.dumps(options)}"])
        workers = start_workers(config)
        try:
            def environment(actor):
                import os

                return dict(os.environ)

            env = ray.get(workers.handles[0].__ray_call__.remote(environment))
        finally:
            workers.shutdown()
        assert env["AWS_ENDPOINT_URL"] == endpoint
        assert not [s for s in ALL if s in json.dumps(env)]

    session = Path(ray._private.worker._global_node.get_session_dir_path())
    assert list(session.rglob("runtime_env_agent*.log")), "no runtime_env agent log to check"
    assert hits(session) == []
