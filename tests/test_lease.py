"""One writer per output (the lease), and the output-side user errors: a locked, mixed, misplaced,
corrupt or damaged output is refused with one line, or repaired with one line, never silently."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.build_dataset import main
from pipeline.data.lease import LEASE_NAME, LEASE_TMP_PREFIX
from pipeline.data.store import OutputStore, check_location, marker_name, part_name
from pipeline.errors import OutputConflict, OutputLocked
from tests.conftest import GOOD_PROMPTS, MIXED_ROWS, write_jsonl
from tests.test_build import build_args, copy_output

PAIR = {"prompt_id": "x", "prompt": "p", "chosen": "a", "rejected": "b", "chosen_score": 1.0, "rejected_score": 0.0,
        "strategy": "sbon", "num_candidates": 2, "generated_tokens": 3, "source_row": 0}


def error_lines(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def stale_lease(path, host, pid, age, **extra):
    now = time.time()
    path.write_text(json.dumps({"owner": "dead", "host": host, "pid": pid, "started": now - age - 5,
                                "heartbeat": now - age, "config_hash": "old", **extra}))


# -- the lease, on its own ---------------------------------------------------------------------

def test_a_live_lease_blocks_a_second_writer_until_released(tmp_path):
    first, second = OutputStore(str(tmp_path)), OutputStore(str(tmp_path))
    first.acquire_lease("cfg-a")
    lease = json.loads((tmp_path / LEASE_NAME).read_text())
    assert (lease["host"], lease["pid"], lease["config_hash"]) == (socket.gethostname(), os.getpid(), "cfg-a")
    assert lease["pid_namespace"] == os.stat("/proc/self/ns/pid").st_ino
    assert len(lease["owner"]) == 32 and lease["heartbeat"] >= lease["started"]
    with pytest.raises(OutputLocked, match=rf"another build is writing to it \(host {socket.gethostname()}, "
                                           rf"pid {os.getpid()}, heartbeat \d+s ago\)"):
        second.acquire_lease("cfg-b")
    with pytest.raises(RuntimeError, match="needs the output's lease"):
        second.prepare()
    first.release_lease()
    assert not (tmp_path / LEASE_NAME).exists()
    second.acquire_lease("cfg-b")
    second.release_lease()


def test_a_stale_lease_is_taken_over_with_a_line(tmp_path, capsys):
    """Stale: unchanged for the timeout as the taker watches it (an old heartbeat time alone, from
    another host's clock, proves nothing)."""
    stale_lease(tmp_path / LEASE_NAME, "node-7", 4242, age=300)
    store = OutputStore(str(tmp_path))
    store.acquire_lease("cfg", timeout_s=1.0)
    lines = error_lines(capsys)
    assert len(lines) == 2 and "waiting 1s for it to go stale" in lines[0] and "took over the lease" in lines[1]
    assert "host node-7, pid 4242, last heartbeat 300s ago" in lines[1] and "unchanged for the 1s timeout" in lines[1]
    assert json.loads((tmp_path / LEASE_NAME).read_text())["owner"] == store.lease.owner
    store.release_lease()

    # A fresh heartbeat from another host is live ...
    stale_lease(tmp_path / LEASE_NAME, "node-7", 4242, age=5)
    with pytest.raises(OutputLocked, match="host node-7, pid 4242"):
        OutputStore(str(tmp_path)).acquire_lease("cfg", timeout_s=120)
    # ... but on this host a process that is gone (a SIGKILLed build) holds nothing; a pid of another
    # pid namespace (a container with the same hostname) says nothing about its process.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    here = os.stat("/proc/self/ns/pid").st_ino
    stale_lease(tmp_path / LEASE_NAME, socket.gethostname(), dead.pid, age=1, pid_namespace=here + 1)
    with pytest.raises(OutputLocked, match=f"pid {dead.pid}"):
        OutputStore(str(tmp_path)).acquire_lease("cfg", timeout_s=120)
    stale_lease(tmp_path / LEASE_NAME, socket.gethostname(), dead.pid, age=1, pid_namespace=here)
    store = OutputStore(str(tmp_path))
    store.acquire_lease("cfg", timeout_s=120)
    lines = error_lines(capsys)
    assert len(lines) == 1 and f"pid {dead.pid}, last heartbeat 1s ago: its process is gone" in lines[0]
    store.release_lease()


def test_a_silent_lease_is_waited_for_then_taken_over(tmp_path, capsys):
    """A driver killed on another host (a retried RayJob) has stopped beating: the next build waits
    for its lease to go stale instead of failing."""
    now = time.time()
    (tmp_path / LEASE_NAME).write_text(json.dumps({"owner": "gone", "host": "node-8", "pid": 5, "started": now - 9,
                                                   "heartbeat": now - 0.4, "heartbeat_s": 0.05}))
    store = OutputStore(str(tmp_path))
    started = time.monotonic()
    store.acquire_lease("cfg", timeout_s=1.0)
    assert time.monotonic() - started >= 0.5
    lines = error_lines(capsys)
    assert len(lines) == 2 and re.search(r"\(host node-8, pid 5\) has written no heartbeat for \ds; waiting \ds",
                                         lines[0])
    assert "took over the lease of a stopped build (host node-8, pid 5" in lines[1]
    store.release_lease()


def test_the_heartbeat_keeps_a_lease_live_and_a_taken_over_holder_writes_nothing(tmp_path):
    holder = OutputStore(str(tmp_path))
    holder.acquire_lease("cfg", timeout_s=1.0, heartbeat_s=0.05)
    time.sleep(1.5)  # past the timeout: only the heartbeat keeps it live
    with pytest.raises(OutputLocked, match="another build is writing"):
        OutputStore(str(tmp_path)).acquire_lease("cfg", timeout_s=1.0)
    holder.release_lease()

    # The holder froze past the timeout and another build took the lease over: its next beat sees it.
    # (Beaten by hand: a beat already under way could rewrite the lease it read just before.)
    holder.acquire_lease("cfg", heartbeat_s=3600)
    holder.commit_shard(0, [PAIR], [], "fp0", "cfg")
    stale_lease(tmp_path / LEASE_NAME, "node-9", 99, age=0)
    holder.lease.beat()
    with pytest.raises(OutputLocked, match=r"lost its lease \(taken over by host node-9, pid 99\)"):
        holder.commit_shard(1, [PAIR], [], "fp1", "cfg")
    assert not (tmp_path / part_name(1)).exists()
    holder.release_lease()  # not ours any more: left in place
    assert json.loads((tmp_path / LEASE_NAME).read_text())["host"] == "node-9"


def test_prepare_leaves_a_live_builds_temp_files_alone(tmp_path):
    """Before the lease, a starting build deleted another build's in-flight .tmp-* files."""
    running = OutputStore(str(tmp_path))
    running.acquire_lease("cfg")
    in_flight = tmp_path / ".tmp-0123-part-00000.parquet"
    in_flight.write_bytes(b"PAR1 being written")
    starting = OutputStore(str(tmp_path))
    with pytest.raises(OutputLocked):
        starting.acquire_lease("cfg")
    with pytest.raises(RuntimeError, match="needs the output's lease"):
        starting.prepare()
    assert in_flight.exists()
    running.release_lease()  # the writer is gone: now its temp file is a leftover
    starting.acquire_lease("cfg")
    starting.prepare()
    assert not in_flight.exists()
    starting.release_lease()


def test_prepare_leaves_another_builds_lease_attempt_alone(tmp_path):
    """Two builds started together: the holder's prepare() removed the other's lease temp file between
    its write and its link (FileNotFoundError, a traceback, in about 1 run in 3). A lease temp file
    goes only once older than the lease timeout (a killed process's leftover)."""
    holder = OutputStore(str(tmp_path))
    holder.acquire_lease("cfg", timeout_s=60)
    attempt, leftover = tmp_path / f"{LEASE_TMP_PREFIX}aaaa", tmp_path / f"{LEASE_TMP_PREFIX}bbbb"
    attempt.write_bytes(b"{}")
    leftover.write_bytes(b"{}")
    os.utime(leftover, (time.time() - 120, time.time() - 120))
    holder.prepare()
    assert attempt.exists() and not leftover.exists()
    holder.release_lease()


def skew_heartbeat(lease, seconds):
    """A holder whose wall clock is ``seconds`` off: every heartbeat it writes from now on says so."""
    payload = lease._payload

    def skewed():
        record = json.loads(payload())
        record["heartbeat"] += seconds
        return json.dumps(record).encode()

    lease._payload = skewed


def wait_for_lease(read, test, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        try:  # (a local refresh renames the lease away for an instant)
            if test(json.loads(read())):
                return
        except FileNotFoundError:
            pass
        assert time.monotonic() < deadline, "the holder never wrote the lease expected"
        time.sleep(0.01)


def test_a_taker_with_a_shorter_timeout_does_not_take_over_a_live_lease(tmp_path, capsys):
    """Issue 36 (4): staleness was judged with the taker's timeout, so a build started with 5 s took
    over a live build's lease (600 s) six seconds in, and both wrote. The taker judges with the larger
    of the two timeouts, which the lease records."""
    holder = OutputStore(str(tmp_path))
    holder.acquire_lease("cfg", timeout_s=30, heartbeat_s=2.5)  # beats every 2.5 s
    recorded = json.loads((tmp_path / LEASE_NAME).read_text())
    assert (recorded["timeout_s"], recorded["heartbeat_s"]) == (30, 2.5)
    time.sleep(1.0)  # its heartbeat is 1 s old: older than the taker's timeout, well within its own
    with pytest.raises(OutputLocked, match=r"another build is writing to it .* taken over once it stays unchanged "
                                           r"for 30s"):
        OutputStore(str(tmp_path)).acquire_lease("cfg", timeout_s=0.5)
    holder.commit_shard(0, [PAIR], [], "fp0", "cfg")  # still the one writer
    assert json.loads((tmp_path / LEASE_NAME).read_text())["owner"] == holder.lease.owner
    holder.release_lease()

    # A stopped holder's lease is watched for the holder's timeout, not the taker's shorter one.
    now = time.time()
    (tmp_path / LEASE_NAME).write_text(json.dumps({"owner": "gone", "host": "node-5", "pid": 5, "started": now - 90,
                                                   "heartbeat": now - 60, "heartbeat_s": 0.1, "timeout_s": 2}))
    capsys.readouterr()
    taker = OutputStore(str(tmp_path))
    started = time.monotonic()
    taker.acquire_lease("cfg", timeout_s=0.5)
    assert time.monotonic() - started >= 2.0
    lines = error_lines(capsys)
    assert len(lines) == 2 and "waiting 2s for it to go stale" in lines[0]
    assert "took over the lease of a stopped build (host node-5, pid 5" in lines[1] and "2s timeout" in lines[1]
    taker.release_lease()


def test_a_skewed_holder_clock_is_judged_by_observation(tmp_path, capsys):
    """The holder's heartbeat time is its own clock's: a live holder whose clock is 300 s behind was
    taken over at once, and a dead one whose clock was 300 s ahead blocked the output for 300 s. Both
    are judged by watching the lease on the taker's monotonic clock."""
    holder = OutputStore(str(tmp_path))
    holder.acquire_lease("cfg", timeout_s=2.0, heartbeat_s=0.05)
    skew_heartbeat(holder.lease, -300)
    wait_for_lease((tmp_path / LEASE_NAME).read_text, lambda lease: lease["heartbeat"] < time.time() - 250)
    capsys.readouterr()
    with pytest.raises(OutputLocked, match=rf"another build is writing to it \(host {socket.gethostname()}, pid "
                                           rf"{os.getpid()}: its lease changed while this build watched it\)"):
        OutputStore(str(tmp_path)).acquire_lease("cfg", timeout_s=1.0)  # watched for 2 s: the holder's
    assert "has written no heartbeat for 300s; waiting 2s" in error_lines(capsys)[0]
    holder.commit_shard(0, [PAIR], [], "fp0", "cfg")
    holder.release_lease()

    now = time.time()
    (tmp_path / LEASE_NAME).write_text(json.dumps({"owner": "gone", "host": "node-6", "pid": 6, "started": now,
                                                   "heartbeat": now + 300, "heartbeat_s": 0.05}))
    taker = OutputStore(str(tmp_path))
    started = time.monotonic()
    taker.acquire_lease("cfg", timeout_s=1.0)
    assert time.monotonic() - started >= 1.0
    lines = error_lines(capsys)
    assert len(lines) == 2 and "has a heartbeat 300s ahead of this host's clock; waiting 1s" in lines[0]
    assert "(host node-6, pid 6, last heartbeat 300s ahead of this host's clock: unchanged for the 1s timeout)" \
        in lines[1]
    taker.release_lease()


def test_a_holder_writes_nothing_once_its_own_heartbeat_is_older_than_half_the_timeout(tmp_path):
    """check() read only a flag its heartbeat thread sets: a holder that froze past the timeout (its
    thread not run since) wrote over the build that took its lease. Now check() itself renews a
    heartbeat older than half the timeout, with the compare-and-swap, before any write."""
    holder = OutputStore(str(tmp_path))
    holder.acquire_lease("cfg", timeout_s=0.5, heartbeat_s=3600)  # its thread does not beat in this test
    stale_lease(tmp_path / LEASE_NAME, "node-9", 99, age=0)  # taken over while it was frozen
    time.sleep(0.3)
    with pytest.raises(OutputLocked, match=r"lost its lease \(taken over by host node-9, pid 99\)"):
        holder.commit_shard(0, [PAIR], [], "fp0", "cfg")
    assert not (tmp_path / part_name(0)).exists() and not (tmp_path / "_markers").exists()
    (tmp_path / LEASE_NAME).unlink()

    # Its storage fails: the lease cannot be renewed, so nothing is written past half the timeout.
    holder = OutputStore(str(tmp_path))
    holder.acquire_lease("cfg", timeout_s=0.5, heartbeat_s=3600)

    def unreachable(payload, tag):
        raise OSError("storage unreachable")

    holder.lease.file.refresh = unreachable
    time.sleep(0.3)
    with pytest.raises(OutputLocked, match=r"lease was last refreshed 0\.\ds ago \(over half its 0\.5s timeout\)"):
        holder.commit_shard(0, [PAIR], [], "fp0", "cfg")
    assert not (tmp_path / part_name(0)).exists()
    holder.release_lease()

    # Frozen, but nobody took over: the renewal succeeds and the build goes on.
    holder = OutputStore(str(tmp_path))
    holder.acquire_lease("cfg", timeout_s=0.5, heartbeat_s=3600)
    first = json.loads((tmp_path / LEASE_NAME).read_text())["seq"]
    time.sleep(0.3)
    holder.commit_shard(0, [PAIR], [], "fp0", "cfg")
    assert json.loads((tmp_path / LEASE_NAME).read_text())["seq"] > first
    assert [k for k, _ in holder.verify(1, "cfg")] == [0]
    holder.release_lease()


HOLDER = """
import json, os, sys, time
from pipeline.data.store import OutputStore
from pipeline.errors import OutputLocked
out, go, pair = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
store = OutputStore(out)
store.acquire_lease("cfg", timeout_s=1.0, heartbeat_s=60)  # its heartbeat thread is not due again in this test
print("holding", flush=True)
while not os.path.exists(go):
    time.sleep(0.01)
try:
    store.commit_shard(0, [pair], [], "fp0", "cfg")
    print("committed", flush=True)
except OutputLocked as exc:
    print(f"refused: {exc}", flush=True)
"""


def test_a_holder_stopped_past_the_timeout_commits_nothing_after_it_resumes(tmp_path, capsys):
    """A real build process frozen (SIGSTOP) past its lease timeout is taken over; resumed (SIGCONT),
    its next write is refused and nothing of it reaches the output."""
    out, go = tmp_path / "out", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out), str(go), json.dumps(PAIR)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding", holder.stderr.read()
        os.kill(holder.pid, signal.SIGSTOP)
        time.sleep(1.2)  # its last heartbeat no longer looks recent ...
        taker = OutputStore(str(out))
        started = time.monotonic()
        taker.acquire_lease("cfg", timeout_s=1.0)  # ... and its lease stays unchanged for the timeout
        waited = time.monotonic() - started
        go.touch()
        os.kill(holder.pid, signal.SIGCONT)
        said, _ = holder.communicate(timeout=60)
    finally:
        if holder.poll() is None:
            os.kill(holder.pid, signal.SIGCONT)
            holder.kill()
            holder.wait()
    assert said.startswith("refused: ") and f"lost its lease (taken over by host {socket.gethostname()}, pid " \
        f"{os.getpid()})" in said, said
    assert not (out / part_name(0)).exists() and not (out / "_markers").exists()
    assert json.loads((out / LEASE_NAME).read_text())["owner"] == taker.lease.owner
    lines = error_lines(capsys)
    assert waited >= 1.0 and f"took over the lease of a stopped build (host {socket.gethostname()}, pid " \
        f"{holder.pid}" in lines[-1]
    taker.commit_shard(0, [PAIR], [], "fp0", "cfg")
    taker.release_lease()


# -- what the markers say ------------------------------------------------------------------------

def test_verify_rejects_a_marker_of_another_config(tmp_path):
    store = OutputStore(str(tmp_path))
    store.commit_shard(0, [PAIR], [], "fp0", "cfg-a")
    store.commit_shard(1, [PAIR], [], "fp1", "cfg-b")  # a second build got in
    with pytest.raises(OutputConflict, match="shard 1 was written by a build with another config"):
        list(store.verify(2, "cfg-a"))
    assert [k for k, _ in store.verify(1, "cfg-a")] == [0]


def test_overwrite_deletes_only_what_the_markers_name(tmp_path):
    store = OutputStore(str(tmp_path))
    store.commit_shard(0, [PAIR], [], "fp0", "cfg")
    store.commit_shard(1, [PAIR], [], "fp1", "cfg")
    for name in ("_manifest.json", "_report.json", "_SUCCESS"):
        store.write_json(name, {})
    user = {"part-notes.txt": b"my notes", "_rejects/part-notes.txt": b"mine too", "README.md": b"# mine"}
    for rel, content in user.items():
        (tmp_path / rel).write_bytes(content)
    pq.write_table(pa.table({"x": [1]}), tmp_path / "part-99999.parquet")
    store.acquire_lease("cfg-new")
    store.prepare(overwrite=True)
    store.release_lease()
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert left == sorted([*user, "part-99999.parquet"])


def test_output_equal_to_inside_or_holding_the_input_is_refused():
    for output, prompts, where in [("data/in", "data/in", "is the input"),
                                   ("data/in/out", "data/in", "is inside the input"),
                                   ("data", "data/in/p.jsonl", "holds the input"),
                                   ("data/in/../in", "data/in", "is the input"),
                                   ("s3://b/in/", "s3://b/in", "is the input"),
                                   ("s3://b/in/out", "s3://b/in", "is inside the input"),
                                   ("data/in/out", "data/in/**/*.jsonl", "is inside the input"),
                                   ("data/in", "data/in/*.parquet", "is the input")]:
        with pytest.raises(OutputConflict, match=f"data.output: {output} {where}"):
            check_location(output, prompts)
    for output, prompts in [("data/out", "data/in"), ("data/in2", "data/in"), ("s3://b/out", "s3://b/in"),
                            ("data/in", "s3://b/data/in"), ("data/in/out", "data/in/*.jsonl"),
                            ("data/out", "data/in/p.jsonl")]:
        check_location(output, prompts)


# -- through the build job ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def built(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lease")
    prompts = write_jsonl(tmp / "mixed.jsonl", MIXED_ROWS)
    assert main(build_args(tiny_models, prompts, tmp / "out")) == 0
    assert not (tmp / "out" / LEASE_NAME).exists()  # released at the end
    return tmp / "out", prompts


def test_two_builds_started_together_one_is_refused_and_the_output_is_consistent(tiny_models, tmp_path,
                                                                                 monkeypatch, capsys):
    """Before the lease both exited 0, their shards mixed in one output under one _SUCCESS."""
    prompts = write_jsonl(tmp_path / "mixed.jsonl", MIXED_ROWS)
    out = tmp_path / "out"
    together = threading.Barrier(2, timeout=120)
    acquire = OutputStore.acquire_lease

    def at_once(self, *args, **kwargs):  # both planned, both reach for the output in the same instant
        together.wait()
        return acquire(self, *args, **kwargs)

    monkeypatch.setattr(OutputStore, "acquire_lease", at_once)
    codes = {}
    threads = [threading.Thread(target=lambda seed=seed: codes.__setitem__(
        seed, main(build_args(tiny_models, prompts, out, "--seed", str(seed))))) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert sorted(codes.values()) == [0, 2], codes
    errors = [line for line in error_lines(capsys) if line.startswith("error:")]
    assert len(errors) == 1 and "another build is writing to it" in errors[0] and f"pid {os.getpid()}" in errors[0]
    winner = next(seed for seed, rc in codes.items() if rc == 0)
    manifest = json.loads((out / "_manifest.json").read_text())
    success = json.loads((out / "_SUCCESS").read_text())
    assert manifest["config"]["seed"] == winner and manifest["pairs"] == len(GOOD_PROMPTS)
    store = OutputStore(str(out))
    assert {m["config_hash"] for m in store.markers().values()} == {success["config_hash"]}
    assert [k for k, _ in store.verify(3, success["config_hash"])] == [0, 1, 2]
    assert not (out / LEASE_NAME).exists()


def test_output_naming_a_file_is_one_line_exit_2(tiny_models, built, tmp_path, capsys):
    _, prompts = built
    target = tmp_path / "existing.parquet"
    target.write_bytes(b"not a directory")
    assert main(build_args(tiny_models, prompts, target)) == 2
    lines = error_lines(capsys)
    assert lines == [f"error: {target}: is a file; the output must be a directory or an s3:// prefix"]
    assert target.read_bytes() == b"not a directory"


def test_output_equal_to_or_inside_the_input_is_one_line_exit_2(tiny_models, tmp_path, capsys):
    source = tmp_path / "in"
    source.mkdir()
    write_jsonl(source / "p.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:2]])
    for output, where in [(source, "is the input"), (source / "out", "is inside the input")]:
        assert main(build_args(tiny_models, source, output, "--overwrite")) == 2
        lines = error_lines(capsys)
        assert len(lines) == 1 and f"data.output: {output} {where}" in lines[0]
    assert sorted(p.name for p in source.iterdir()) == ["p.jsonl"]
    assert main(build_args(tiny_models, source / "p.jsonl", tmp_path, "--overwrite")) == 2
    assert "holds the input" in error_lines(capsys)[0]


def test_a_corrupt_marker_is_one_line_exit_2(tiny_models, built, tmp_path, capsys):
    out, prompts = built
    out = copy_output(out, tmp_path / "out")
    marker = out / "_markers" / marker_name(1)
    for content in ('{"shard": 1, "rows"', json.dumps({"shard": 1})):
        marker.write_text(content)
        assert main(build_args(tiny_models, prompts, out)) == 2
        lines = error_lines(capsys)
        assert len(lines) == 1 and f"{marker}: unreadable commit marker" in lines[0]
    assert not (out / LEASE_NAME).exists()  # a refused build lets the next one in


def test_a_damaged_committed_shard_is_rebuilt_with_a_line(tiny_models, built, tmp_path, capsys):
    """Resume compared the part file's size only: a flipped byte was skipped, and verify then failed
    every rerun."""
    out, prompts = built
    out = copy_output(out, tmp_path / "out")
    part = out / part_name(1)
    original = part.read_bytes()
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0xFF
    part.write_bytes(bytes(damaged))
    assert main(build_args(tiny_models, prompts, out)) == 0
    warnings = [line for line in error_lines(capsys) if line.startswith("warning:")]
    assert warnings == [f"warning: {part}: does not match its commit marker (sha256); shard 1 is rebuilt"]
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["shards_written"] == [1] and manifest["shards_skipped"] == [0, 2]
    assert pq.read_table(part).num_rows == pq.read_table(pa.BufferReader(original)).num_rows
    assert [k for k, _ in OutputStore(str(out)).verify(3)] == [0, 1, 2]


# -- on S3 ----------------------------------------------------------------------------------------

def test_s3_lease_is_a_conditional_create_and_a_stale_one_is_taken_over(s3, capsys):
    fs, options = s3
    uri, key = "s3://bucket/leased", "bucket/leased/_lease.json"
    holder = OutputStore(uri, options)
    holder.acquire_lease("cfg", timeout_s=1.0, heartbeat_s=0.05)
    assert json.loads(fs.cat(key))["owner"] == holder.lease.owner
    time.sleep(1.5)  # the heartbeat (PUT If-Match) keeps it live past the timeout
    with pytest.raises(OutputLocked, match=f"another build is writing to it .*pid {os.getpid()}"):
        OutputStore(uri, options).acquire_lease("cfg", timeout_s=1.0)
    holder.release_lease()
    fs.invalidate_cache()
    assert not fs.exists(key)
    capsys.readouterr()  # a heartbeat late under load makes the refused build wait first, with a line

    now = time.time()
    fs.pipe(key, json.dumps({"owner": "dead", "host": "node-3", "pid": 7, "started": now - 400,
                             "heartbeat": now - 300, "config_hash": "old"}).encode())
    taker = OutputStore(uri, options)
    taker.acquire_lease("cfg", timeout_s=1.0, heartbeat_s=0.05)  # after watching its ETag for 1 s
    lines = error_lines(capsys)
    assert len(lines) == 2 and "took over the lease" in lines[1] and "host node-3, pid 7" in lines[1]
    taker.commit_shard(0, [PAIR], [], "fp0", "cfg")
    # Someone overwrites it behind the holder's back: its next conditional refresh fails, it stops.
    fs.pipe(key, json.dumps({"owner": "other", "host": "node-4", "pid": 8, "heartbeat": time.time()}).encode())
    taker.lease.beat()  # what its thread does every 0.05 s; by hand, so the test does not race it
    with pytest.raises(OutputLocked, match=r"lost its lease \(taken over by host node-4, pid 8\)"):
        taker.commit_shard(1, [PAIR], [], "fp1", "cfg")
    taker.release_lease()
    fs.invalidate_cache()
    assert json.loads(fs.cat(key))["owner"] == "other"  # not ours: left in place


def test_s3_lease_staleness_is_judged_by_its_etag_and_s3s_clock(s3, capsys):
    """On S3 as locally: a live holder whose clock is 300 s behind is seen alive by its ETag changing;
    a dead one whose clock is 300 s ahead is stale once S3's own clock (Date less LastModified) says
    its lease has been unchanged past the timeout, with no wait and no comparison with ours."""
    fs, options = s3
    uri, key = "s3://bucket/skewed", "bucket/skewed/_lease.json"
    holder = OutputStore(uri, options)
    holder.acquire_lease("cfg", timeout_s=2.0, heartbeat_s=0.05)
    skew_heartbeat(holder.lease, -300)
    wait_for_lease(lambda: (fs.invalidate_cache(), fs.cat(key))[1],
                   lambda lease: lease["heartbeat"] < time.time() - 250)
    capsys.readouterr()
    with pytest.raises(OutputLocked, match="its lease changed while this build watched it"):
        OutputStore(uri, options).acquire_lease("cfg", timeout_s=1.0)
    holder.commit_shard(0, [PAIR], [], "fp0", "cfg")
    holder.release_lease()
    capsys.readouterr()

    now = time.time()
    fs.pipe(key, json.dumps({"owner": "gone", "host": "node-6", "pid": 6, "started": now,
                             "heartbeat": now + 300, "heartbeat_s": 0.05}).encode())
    time.sleep(3.0)  # S3 dates in whole seconds: at least 2 s by its clock, 1 s counted
    taker = OutputStore(uri, options)
    taker.acquire_lease("cfg", timeout_s=0.5)
    lines = error_lines(capsys)  # no line saying it waits
    assert len(lines) == 1 and re.search(r"took over the lease of a stopped build \(host node-6, pid 6, last "
                                         r"heartbeat 29\ds ahead of this host's clock: unchanged for the 0\.5s "
                                         r"timeout\)", lines[0])
    taker.release_lease()


def test_runtime_lease_timeout_s_decides_when_a_lease_is_stale(tiny_models, tmp_path, capsys):
    """The config key reaches the lease: a lease whose heartbeat says 15 s ago is live at the default
    120 s (heartbeat every 10 s) and a dead build's at runtime.lease_timeout_s=3, once unchanged for 3 s."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:2]])
    out = tmp_path / "out"
    out.mkdir()
    stale_lease(out / LEASE_NAME, "node-3", 77, age=15)
    assert main(build_args(tiny_models, prompts, out)) == 2
    assert "host node-3, pid 77" in error_lines(capsys)[-1]
    assert main(build_args(tiny_models, prompts, out, "--set", "runtime.lease_timeout_s=3")) == 0
    assert any("took over the lease" in line and "node-3" in line for line in error_lines(capsys))
