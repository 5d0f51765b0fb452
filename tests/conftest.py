"""Shared fixtures: tiny models built once per session (nothing is downloaded)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import urllib.request
from pathlib import Path

import pytest

from jobs.cli import setup_logging
from jobs.make_tiny_models import make_tiny_models

# Logging as every job sets it up (jobs.cli): the library's notes and warnings reach stderr, where
# tests that call it directly (not through a job's main) read them.
setup_logging("INFO")
# The weights-hash cache (pipeline.provenance.weights_cache_file) of this test run, not the user's.
os.environ.setdefault("BON_CACHE_DIR", tempfile.mkdtemp(prefix="bon-cache-"))
# Inductor's on-disk cache of this test run, not the machine's: a kernel another run compiled (another
# ATEN_CPU_CAPABILITY, another thread count, another torch) is never what a test checks.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-cache-"))
# The paged KV cache gathers its blocks for SDPA (pipeline.engines.kv_cache.KERNEL_ENV) in this run and
# its Ray workers: each new pool shape would compile flex_attention three times (40 s for the first,
# cold, on this CPU). The kernel's own tests turn it back on (``flex_kernel``).
os.environ.setdefault("BON_KV_KERNEL", "gather")


def _compile_settings() -> dict:
    """torch.compile's process-wide settings now: its stance, dynamo's and inductor's configurations."""
    import torch._dynamo
    import torch._inductor.config

    return {"stance": torch._dynamo.eval_frame._stance, "dynamo": torch._dynamo.config.get_config_copy(),
            "inductor": torch._inductor.config.get_config_copy()}


@pytest.fixture(autouse=True)
def _process_state_kept():
    """No test leaves torch's process-wide state changed for the tests after it. The thread count is
    put back (in-process actors set their own, actors.generator); a test that leaves torch.compile's
    stance or dynamo's or inductor's configuration changed fails (the stance is put back too)."""
    import torch

    threads, before = torch.get_num_threads(), _compile_settings()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    after = _compile_settings()
    if after != before:
        changed = [name for name in before if after[name] != before[name]]
        import torch._dynamo

        torch._dynamo.eval_frame._set_stance(before["stance"])
        pytest.fail(f"the test left torch.compile's {' and '.join(changed)} changed")


@pytest.fixture
def flex_kernel(monkeypatch):
    """The paged KV cache's steps through compiled flex_attention, as in a build."""
    monkeypatch.delenv("BON_KV_KERNEL", raising=False)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    return make_tiny_models(tmp_path_factory.mktemp("tiny-models"), seed=0)


@pytest.fixture(scope="session")
def engine(tiny_models):
    from pipeline.engines.hf import HFEngine

    return HFEngine.from_pretrained(str(tiny_models["generator"]))


@pytest.fixture(scope="session")
def scorer(tiny_models):
    from pipeline.engines.rewards import RewardScorer

    return RewardScorer.from_pretrained(str(tiny_models["reward"]))


@pytest.fixture(scope="module")
def cluster():
    """A fresh local Ray cluster on loopback for one test module; address="local" so that it never
    attaches to another cluster this machine happens to run."""
    import ray

    ray.init(address="local", num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def vllm_bench(monkeypatch):
    """benchmarks.vllm_sbon with its builds recorded, not run: (the module, {run name: build job argv})."""
    import benchmarks.vllm_sbon as bench

    argvs = {}

    def run_job(name, argv, output):
        argvs[name] = argv
        return {"run_seconds": 2.0, "startup_seconds": 1.0, "generated_tokens": 10}

    monkeypatch.setattr(bench, "run_job", run_job)
    return bench, argvs


@contextlib.contextmanager
def moto_s3(bucket: str = "bucket"):
    """A real S3 protocol server (moto) on 127.0.0.1 holding one empty bucket and nothing else; yields
    its endpoint URL and stops the server on exit."""
    moto_server = pytest.importorskip("moto.server")
    import boto3

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        # moto keeps its buckets per process, not per server: start each server empty, so that a
        # test never finds another test's output.
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")).close()
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        server.stop()


def s3_options(endpoint: str, key: str = "testing", secret: str = "testing") -> dict:
    """data.storage_options for a moto endpoint."""
    return {"endpoint_url": endpoint, "key": key, "secret": secret, "client_kwargs": {"region_name": "us-east-1"}}


@pytest.fixture(scope="module")
def s3():
    """(s3fs filesystem, storage_options) on a moto server with the bucket "bucket", per test module."""
    import s3fs

    with moto_s3() as endpoint:
        options = s3_options(endpoint)
        yield s3fs.S3FileSystem(**options), options


def write_jsonl(path: Path, rows: list) -> Path:
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


GOOD_PROMPTS = [
    "Write a review of the lamp.",
    "Explain why the battery lasts so long.",
    "Describe how the blender works.",
    "Tell me if the camera is good.",
    "Summarize what you think of the app.",
    "Write a short note about the delivery.",
]

# A prompt file as a new user would write it: good rows mixed with bad ones.
MIXED_ROWS = [
    {"prompt": GOOD_PROMPTS[0]},
    {"prompt": "   \n\t"},  # whitespace only
    {"prompt": GOOD_PROMPTS[1], "id": 7},
    {"text": "no prompt key here"},  # missing prompt
    {"prompt": GOOD_PROMPTS[2]},
    {"prompt": 42},  # not a string
    {"prompt": GOOD_PROMPTS[3]},
    {"prompt": None},  # null
    {"prompt": GOOD_PROMPTS[0]},  # duplicate of row 0
    {"prompt": GOOD_PROMPTS[4]},
    {"prompt": ""},  # empty
    {"prompt": GOOD_PROMPTS[5]},
]
MIXED_BAD_ROWS = {1: "blank prompt", 3: "missing prompt", 5: "prompt is not a string", 7: "missing prompt",
                  8: "duplicate prompt", 10: "blank prompt"}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """``make test-vllm`` sets BON_REQUIRE_VLLM=1: there a vllm-marked test that skips (vllm not
    importable, no engine) fails instead, so the target cannot pass without running them."""
    import os

    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("BON_REQUIRE_VLLM") == "1" and item.get_closest_marker("vllm"):
        report.outcome = "failed"
        report.longrepr = f"BON_REQUIRE_VLLM=1 but the vllm test skipped: {report.longrepr}"
