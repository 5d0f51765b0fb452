"""End to end: `ray start --head` on 127.0.0.1, a build through `ray job submit --working-dir .`,
the pairs loaded with datasets.load_dataset; `ray job stop` of a running build and a resubmit that
resumes; the cluster stopped whatever happens."""

import json
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pyarrow.parquet as pq
import pytest

from pipeline.data.chat import prompt_id
from tests.conftest import GOOD_PROMPTS, MIXED_BAD_ROWS, MIXED_ROWS, write_jsonl

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (all sockets held open together, so no port repeats)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def start_head(env: dict, log) -> tuple[subprocess.Popen, str, int]:
    """`ray start --head` on free ports. Ray's fixed default ports (agent 52365, client 10001) may be
    taken by other local clusters, and Ray picks its own remaining ports at random, which can
    collide with ours: a head that exits while starting is retried on fresh ports."""
    for attempt in range(3):
        dashboard, gcs_port, agent, agent_grpc, metrics, runtime_env, client = free_ports(7)
        # --block keeps `ray start` in the foreground as the owner of this cluster's processes:
        # SIGTERM to it stops exactly this cluster. (`ray stop` would stop every Ray cluster here.)
        head = subprocess.Popen([RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1",
                                 f"--port={gcs_port}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
                                 "--num-cpus=2", f"--dashboard-agent-listen-port={agent}",
                                 f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
                                 f"--runtime-env-agent-port={runtime_env}", f"--ray-client-server-port={client}",
                                 "--disable-usage-stats"], env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        address = f"http://127.0.0.1:{dashboard}"
        # Ready when a job can be submitted (the dashboard answers before its job agent is up).
        deadline = time.time() + 180
        while subprocess.run([RAY, "job", "submit", "--address", address, "--no-wait", "--", "true"], env=env,
                             capture_output=True, timeout=60).returncode != 0:
            if head.poll() is not None:
                break
            assert time.time() < deadline, open(log.name).read()[-2000:]
            time.sleep(2)
        else:
            return head, address, gcs_port
        try:
            os.killpg(head.pid, 9)  # whatever the failed head had started
        except ProcessLookupError:
            pass
        log.write(f"\n--- head exited with {head.returncode} (attempt {attempt + 1}); retrying on new ports ---\n")
        log.flush()
    raise AssertionError(open(log.name).read()[-2000:])


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    # A private token: the cluster and the job client authenticate with it, nothing else is trusted.
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           "RAY_USAGE_STATS_ENABLED": "0"}
    log = open(tmp_path_factory.mktemp("ray-head") / "ray-start.log", "w")
    head, address, gcs_port = start_head(env, log)
    try:
        yield env, address
    finally:
        head.terminate()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, 9)  # the process group this fixture started
            head.wait()
        log.close()
        # `ray stop` would also forget the address; do it for this cluster only.
        current = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / "ray_current_cluster"
        if current.exists() and current.read_text().strip().endswith(f":{gcs_port}"):
            current.unlink()


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
    pairs = datasets.load_dataset("parquet", data_files=str(out / "train-*.parquet"), split="train")
    assert sorted(pairs["raw_prompt"]) == sorted(GOOD_PROMPTS)
    assert {"prompt", "chosen", "rejected"} <= set(pairs.column_names)
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["prompts_rejected"] == len(MIXED_BAD_ROWS)
    assert time.time() - started < 480


@pytest.mark.reliability
def test_ray_job_stop_then_resubmit_resumes(head, tiny_models, tmp_path):
    """A running build is stopped with `ray job stop`; what it committed is whole, and a resubmit
    of the same build skips it and finishes the rest, every prompt exactly once."""
    env, address = head
    texts = [f"{p} Variant {i}." for i in range(2) for p in GOOD_PROMPTS]  # 12 prompts, 6 shards
    prompts = write_jsonl(tmp_path / "good.jsonl", [{"prompt": p} for p in texts])
    out = tmp_path / "out"
    # Slow the reward model down (one batch at a time, >= 2 s each) so the build is still running
    # when it is stopped.
    slow = json.dumps([{"actor": "reward", "method": "extend", "action": "delay", "seconds": 1.0, "times": None}])

    def submit(job_id, *extra):
        return [RAY, "job", "submit", "--address", address, "--submission-id", job_id, "--working-dir", str(REPO),
                *extra, "--", sys.executable, "-m", "jobs.build_dataset", "--config", "configs/demo.yaml",
                "--prompts", str(prompts), "--output", str(out), "--no-progress",
                "--set", f"models.generator={tiny_models['generator']}",
                "--set", f"models.reward={tiny_models['reward']}", "--num-samples", "4", "--max-new-tokens", "16",
                "--set", "strategy.decision_token=6", "--set", "data.shard_size=2", "--set", "runtime.prompts_per_batch=2",
                "--set", "runtime.batches_in_flight=1"]

    first = f"build-{secrets.token_hex(4)}"
    proc = subprocess.run(submit(first, "--no-wait") + ["--set", f"runtime.faults={slow}"], env=env,
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    deadline = time.time() + 300
    while not list((out / "_markers").glob("part-*.json")):
        assert time.time() < deadline, "no shard committed in time"
        time.sleep(0.2)
    stop = subprocess.run([RAY, "job", "stop", "--address", address, first], env=env, capture_output=True,
                          text=True, timeout=120)
    assert stop.returncode == 0, (stop.stdout + stop.stderr)[-2000:]
    status = subprocess.run([RAY, "job", "status", "--address", address, first], env=env, capture_output=True,
                            text=True, timeout=60)
    assert "stopped" in (status.stdout + status.stderr).lower()
    committed = sorted(p.name for p in (out / "_markers").glob("part-*.json"))
    assert 1 <= len(committed) < 6 and not (out / "_SUCCESS").exists()
    parts = sorted(out.glob("train-*.parquet"))  # whatever is visible is whole: every committed shard, readable
    assert len(parts) >= len(committed)
    assert all({"prompt", "chosen", "rejected"} <= set(pq.read_table(part).column_names) for part in parts)

    second = f"build-{secrets.token_hex(4)}"
    proc = subprocess.run(submit(second), env=env, capture_output=True, text=True, timeout=480, cwd=REPO)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    manifest = json.loads((out / "_manifest.json").read_text())
    assert len(manifest["shards_skipped"]) >= len(committed) and manifest["shards_written"]
    ids = datasets.load_dataset("parquet", data_files=str(out / "train-*.parquet"), split="train")["prompt_id"]
    assert sorted(ids) == sorted(prompt_id(p) for p in texts)
    assert (out / "_SUCCESS").exists()
