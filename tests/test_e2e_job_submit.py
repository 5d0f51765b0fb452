"""End to end: `ray start --head` on 127.0.0.1, a build through `ray job submit --working-dir .`,
the pairs loaded with datasets.load_dataset, and the cluster stopped whatever happens."""

import json
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pytest

from tests.conftest import GOOD_PROMPTS, MIXED_BAD_ROWS, MIXED_ROWS, write_jsonl

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    # A private token: the cluster and the job client authenticate with it, nothing else is trusted.
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           "RAY_USAGE_STATS_ENABLED": "0"}
    dashboard = free_port()
    start = subprocess.run([RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={free_port()}",
                            "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", "--num-cpus=2",
                            "--disable-usage-stats"], env=env, capture_output=True, text=True, timeout=180)
    try:
        assert start.returncode == 0, start.stderr[-2000:]
        yield env, f"http://127.0.0.1:{dashboard}"
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)


def test_ray_job_submit_build(head, tiny_models, tmp_path):
    env, address = head
    prompts = write_jsonl(tmp_path / "mixed.jsonl", MIXED_ROWS)
    out = tmp_path / "out"
    job_id = f"build-{secrets.token_hex(4)}"
    cmd = [RAY, "job", "submit", "--address", address, "--submission-id", job_id, "--working-dir", str(REPO), "--",
           sys.executable, "-m", "jobs.build_dataset", "--config", "configs/demo.yaml",
           "--prompts", str(prompts), "--output", str(out), "--no-progress",
           "--set", f"models.generator={tiny_models['generator']}", "--set", f"models.reward={tiny_models['reward']}",
           "--num-samples", "4", "--max-new-tokens", "16", "--set", "strategy.decision_token=6"]
    started = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=480, cwd=REPO)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    status = subprocess.run([RAY, "job", "status", "--address", address, job_id], env=env, capture_output=True,
                            text=True, timeout=60)
    assert f"job '{job_id}' succeeded" in (status.stdout + status.stderr).lower()  # status SUCCEEDED
    assert "pairs/minute" in proc.stdout + proc.stderr
    pairs = datasets.load_dataset("parquet", data_files=str(out / "part-*.parquet"), split="train")
    assert sorted(pairs["raw_prompt"]) == sorted(GOOD_PROMPTS)
    assert {"prompt", "chosen", "rejected"} <= set(pairs.column_names)
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["prompts_rejected"] == len(MIXED_BAD_ROWS)
    assert time.time() - started < 480
