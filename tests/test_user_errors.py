"""Every user error of the build job is one line on stderr and exit code 2, found at plan time before
any worker starts: s3:// without (valid) credentials, lengths beyond the model's context, a missing
or wrong model, non-finite numbers in the config, a wrong prompt column (issue 27, item 7)."""

from __future__ import annotations

import json
import math

import pytest
import yaml

import actors
from jobs.build_dataset import main
from pipeline.config import Config, ConfigError, SamplingConfig, load_config
from tests.conftest import GOOD_PROMPTS, moto_s3, write_jsonl


def write_config(tmp_path, strategy: dict) -> str:
    """A config for the strategy alone (configs/demo.yaml's sbon parameters would make --strategy print a
    note, and these tests want stderr to hold the error line only)."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"strategy": strategy, "data": {"shard_size": 4}}))
    return str(path)


def build(tiny_models, tmp_path, *extra: str, strategy: dict | None = None, prompts=None) -> int:
    prompts = prompts or write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:2]])
    return main(["--config", write_config(tmp_path, strategy or {"name": "best_of_n"}),
                 "--prompts", str(prompts), "--output", str(tmp_path / "out"),
                 "--set", f"models.generator={tiny_models['generator']}",
                 "--set", f"models.reward={tiny_models['reward']}", "--set", f"models.draft={tiny_models['draft']}",
                 "--set", "runtime.local=true", "--num-samples", "2", "--max-new-tokens", "4", "--no-progress", *extra])


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def no_workers(monkeypatch):
    """Planning must refuse before any worker (or cluster) starts: starting one fails the test."""
    def refuse(config):
        raise AssertionError("workers started before the user error was found")

    monkeypatch.setattr(actors, "start_workers", refuse)


# -- non-finite numbers ---------------------------------------------------------------------------

@pytest.mark.parametrize("setting,key", [
    ("sampling.temperature=.nan", "sampling.temperature"),
    ("sampling.top_p=-.inf", "sampling.top_p"),
    ("strategy.rejection_rate=.nan", "strategy.rejection_rate"),
    ("strategy.decision_token=[4, .inf]", "strategy.decision_token[1]"),
    ("data.min_margin=.inf", "data.min_margin"),
    ("runtime.call_timeout_s=.inf", "runtime.call_timeout_s"),
])
def test_non_finite_numbers_are_refused_naming_the_key(setting, key, tiny_models, tmp_path, capsys, no_workers):
    # Before: NaN passed every range check (each comparison is false); the build ran, rejected every
    # prompt and wrote NaN into the manifest, exit 0.
    assert build(tiny_models, tmp_path, "--set", setting, strategy={"name": "sbon"}) == 2
    line = one_error_line(capsys)
    assert key in line and "finite" in line


def test_non_finite_numbers_are_refused_in_a_config_built_in_code():
    with pytest.raises(ConfigError, match="sampling.temperature"):
        Config(sampling=SamplingConfig(temperature=math.nan))
    assert load_config(None, ["sampling.temperature=0.5"]).sampling.temperature == 0.5


# -- lengths beyond the context (the tiny models' is 512) --------------------------------------------

def test_max_new_tokens_beyond_the_context(tiny_models, tmp_path, capsys, no_workers):
    # Before: a ValueError traceback from PromptFormatter (max_prompt_tokens = 512 - 600 < 1).
    assert build(tiny_models, tmp_path, "--max-new-tokens", "600") == 2
    line = one_error_line(capsys)
    assert "sampling.max_new_tokens" in line and "512" in line


def test_max_prompt_tokens_plus_max_new_tokens_beyond_the_context(tiny_models, tmp_path, capsys, no_workers):
    # Before: accepted; prompts of up to 510 tokens then decoded past position 512.
    assert build(tiny_models, tmp_path, "--set", "data.max_prompt_tokens=510", "--max-new-tokens", "8") == 2
    line = one_error_line(capsys)
    assert "data.max_prompt_tokens" in line and "504" in line
    from pipeline.preflight import max_prompt_tokens

    at_limit = load_config(None, ["data.max_prompt_tokens=508", "sampling.max_new_tokens=4"])
    assert max_prompt_tokens(at_limit, 512) == 508
    assert max_prompt_tokens(load_config(None, ["sampling.max_new_tokens=4"]), 512) == 508  # the default


# -- every model checked at plan time -------------------------------------------------------------------

@pytest.mark.parametrize("case", ["reward missing", "reward is a causal LM", "generator is a classifier",
                                  "draft missing (dsbd)", "generator missing"])
def test_models_are_checked_before_any_worker_starts(case, tiny_models, tmp_path, capsys, no_workers):
    # Before: the reward and draft models were first loaded by the actors (an OSError or ValueError
    # traceback after the cluster had started); a causal LM as reward model failed in RewardScorer.
    missing = str(tmp_path / "no-such-model")
    key, value, strategy, words = {
        "reward missing": ("reward", missing, "best_of_n", ["no such model directory"]),
        "reward is a causal LM": ("reward", tiny_models["generator"], "best_of_n", ["LlamaForCausalLM",
                                                                                     "sequence classifier"]),
        "generator is a classifier": ("generator", tiny_models["reward"], "best_of_n",
                                      ["LlamaForSequenceClassification", "causal"]),
        "draft missing (dsbd)": ("draft", missing, "dsbd", ["no such model directory"]),
        "generator missing": ("generator", missing, "best_of_n", ["no such model directory"]),
    }[case]
    assert build(tiny_models, tmp_path, "--set", f"models.{key}={value}", strategy={"name": strategy}) == 2
    line = one_error_line(capsys)
    assert f"models.{key}" in line and all(w in line for w in words), line


def test_a_draft_model_is_checked_only_where_the_strategy_drafts(tiny_models, tmp_path):
    from pipeline.preflight import check_models

    settings = [f"models.generator={tiny_models['generator']}", f"models.reward={tiny_models['reward']}",
                f"models.draft={tmp_path / 'no-such-model'}"]
    tokenizer, context = check_models(load_config(None, settings, strategy="best_of_n"))
    assert context == 512 and tokenizer is not None
    with pytest.raises(ConfigError, match="models.draft"):
        check_models(load_config(None, settings, strategy="dsbd"))


def test_a_reward_model_needs_one_label(tiny_models, tmp_path, capsys, no_workers):
    from transformers import AutoConfig

    two_labels = tmp_path / "two-labels"
    model_config = AutoConfig.from_pretrained(tiny_models["reward"])
    model_config.num_labels = 2
    model_config.save_pretrained(two_labels)
    assert build(tiny_models, tmp_path, "--set", f"models.reward={two_labels}") == 2
    assert "2 output labels" in one_error_line(capsys)


# -- input ------------------------------------------------------------------------------------------------

def test_a_wrong_prompt_column_on_jsonl_exits_2_as_on_parquet(tiny_models, tmp_path, capsys, no_workers):
    # Before: every row rejected as "missing prompt", exit 0 (Parquet: one line, exit 2).
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:3]])
    assert build(tiny_models, tmp_path, "--set", "data.prompt_column=question", prompts=prompts) == 2
    line = one_error_line(capsys)
    assert "p.jsonl" in line and "'question'" in line


def test_a_directory_input_names_the_files_it_skips_in_the_manifest(tiny_models, tmp_path, capsys):
    # Before: the hidden file was read (its prompt built), the .csv skipped with no word of it.
    d = tmp_path / "in"
    d.mkdir()
    write_jsonl(d / "a.jsonl", [{"prompt": GOOD_PROMPTS[0]}])
    (d / "b.json").write_text(json.dumps([{"prompt": GOOD_PROMPTS[1]}, {"prompt": GOOD_PROMPTS[2]}]))
    write_jsonl(d / ".scratch.jsonl", [{"prompt": GOOD_PROMPTS[3]}])
    (d / "more.csv").write_text("prompt\nx\n")
    assert build(tiny_models, tmp_path, prompts=d) == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and ".scratch.jsonl (hidden file)" in notes[0] and "more.csv" in notes[0], err
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["input_files_skipped"] == {".scratch.jsonl": "hidden file",
                                               "more.csv": "other format, not .jsonl/.json/.parquet"}
    assert manifest["prompts_in"] == 3 and manifest["pairs"] + manifest["prompts_rejected"] == 3


# -- s3:// without (valid) credentials -----------------------------------------------------------------

@pytest.fixture(scope="module")
def s3_endpoint():
    """A moto server on 127.0.0.1 with bucket/in/p.jsonl (two prompts); yields its endpoint."""
    import boto3

    with moto_s3() as endpoint:
        body = "".join(json.dumps({"prompt": p}) + "\n" for p in GOOD_PROMPTS[:2])
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").put_object(Bucket="bucket", Key="in/p.jsonl", Body=body.encode())
        yield endpoint


@pytest.fixture
def no_aws_environment(monkeypatch, tmp_path):
    """No credentials anywhere botocore looks (environment, shared files, instance metadata)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.mark.parametrize("credentials", ["none", "wrong"])
@pytest.mark.parametrize("side", ["input", "output"])
def test_s3_without_valid_credentials_is_one_line_naming_the_uri(side, credentials, s3_endpoint, tiny_models, tmp_path,
                                                                   capsys, monkeypatch, no_aws_environment,
                                                                   no_workers):
    # Before: a NoCredentialsError (or PermissionError) traceback of 60 to 144 lines of botocore.
    options = {"endpoint_url": s3_endpoint, "client_kwargs": {"region_name": "us-east-1"}}
    if credentials == "wrong":
        import moto.settings

        # moto checks signatures only when asked; keys it never issued are then refused with a 403.
        monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
        options.update(key="AKIAIOSFODNN7EXAMPLE", secret="not-the-secret-f00d")
    if side == "input":
        uri, paths = "s3://bucket/in/p.jsonl", ["--prompts", "s3://bucket/in/p.jsonl"]
    else:
        uri, paths = "s3://bucket/out/run", ["--output", "s3://bucket/out/run"]
    assert build(tiny_models, tmp_path, *paths, "--set", f"data.storage_options={json.dumps(options)}") == 2
    line = one_error_line(capsys)
    assert uri in line and ("no S3 credentials" if credentials == "none" else "access denied") in line
    assert "not-the-secret-f00d" not in line
