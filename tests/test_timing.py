"""Where the build's time goes: the actors' timelines (pipeline.observability), the forward-pass
clock (pipeline.engines.rows), and the run report's startup / run split and actor_time, in-process
and on Ray. Nothing here asserts a speed: only that the parts are measured, add up and agree."""

import json

import pytest

from jobs.build_dataset import main
from pipeline.engines.rows import ForwardClock, RowBatch, forward_clock
from pipeline.observability import ActorTimeline, CallLedger, CallTiming
from tests.conftest import GOOD_PROMPTS, write_jsonl


class FakeClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_timeline_splits_the_span_between_calls_into_ray_waiting_and_work():
    clock = FakeClock(0.0)
    open_batches = [0]
    timeline = ActorTimeline(lambda: open_batches[0], "sampling_and_bookkeeping", "waiting_for_rewards", clock=clock)

    def call(sent, start, end, forward=0.0, returned=(), opens=0):
        clock.now = start
        with timeline.call(CallTiming(sent, list(returned))):
            timeline.forward.seconds += forward
            clock.now = end
        open_batches[0] += opens

    call(1.0, 1.5, 3.0, forward=1.0, opens=1)  # dispatched 0.5s; leaves a batch open
    # Its result reached the driver at 3.5 (a return leg), the next call went out at 5.0.
    call(5.0, 5.2, 6.0, returned=[(1.0, 3.5)], opens=-1)
    call(8.0, 8.1, 9.0)  # nothing open before it: waiting for work
    call(8.5, 9.0, 9.5, returned=[(8.0, 9.2)])  # queued behind the previous call; its return overlapped work
    stats = timeline.stats()
    parts = stats["breakdown_seconds"]
    assert stats["span_seconds"] == pytest.approx(9.5 - 1.0)
    assert parts == pytest.approx({"forward": 1.0, "sampling_and_bookkeeping": 0.5 + 0.8 + 0.9 + 0.5,
                                   "waiting_for_rewards": 5.0 - 3.5, "waiting_for_work": 8.0 - 6.0,
                                   "ray_calls": 0.5 + (0.5 + 0.2) + 0.1})
    assert sum(parts.values()) == pytest.approx(stats["span_seconds"])
    assert stats["queued_seconds"] == pytest.approx(0.5) and stats["calls"] == 4
    assert stats["busy_seconds"] == pytest.approx(1.0 + 2.7)


def test_a_call_without_driver_timing_counts_as_started_when_sent():
    clock = FakeClock(0.0)
    timeline = ActorTimeline(lambda: 0, "compute", "waiting", clock=clock)
    for start, end in [(2.0, 3.0), (4.0, 4.5)]:
        clock.now = start
        with timeline.call(None):
            clock.now = end
    stats = timeline.stats()
    assert stats["span_seconds"] == 2.5
    assert stats["breakdown_seconds"] == {"forward": 0.0, "compute": 1.5, "waiting": 0.0, "waiting_for_work": 1.0,
                                          "ray_calls": 0.0}


def test_ledger_stamps_each_call_and_hands_back_the_earlier_round_trips():
    seen = []
    ledger = CallLedger()

    def work(x, timing):
        seen.append(timing)
        return x * 2

    assert [ledger.call(work, 1), ledger.call(work, 2)] == [2, 4]
    assert seen[0].returned == [] and len(seen[1].returned) == 1
    sent, received = seen[1].returned[0]
    assert sent == seen[0].sent_at <= received <= seen[1].sent_at
    assert ledger.calls == 2 and ledger.round_trip_seconds >= 0


def test_forward_clock_times_every_row_batch_pass_and_only_inside_its_block(engine, scorer):
    import torch

    clock, reward_clock = ForwardClock(), ForwardClock()
    with forward_clock(clock):
        rows, _ = RowBatch.prefill(engine.model, [[1, 5, 6], [1, 7]], engine.pad_id, engine.device)
        rows.feed(torch.tensor([[3], [4]]))
    rows.feed(torch.tensor([[5], [6]]))  # outside the block: not timed
    assert (clock.passes, rows.forward_passes) == (2, 3) and clock.seconds > 0
    with forward_clock(reward_clock):
        scorer.score(["a prompt"], ["a response"])  # the reward model's stateless pass, outside RowBatch
    assert reward_clock.passes == 1 and reward_clock.seconds > 0 and clock.passes == 2


def check_report(out, capsys=None) -> dict:
    """The report's startup / run split and actor_time: every part non-negative, the parts adding up
    to each actor's span, every forward pass timed, each span inside the run."""
    report = json.loads((out / "_report.json").read_text())
    manifest = json.loads((out / "_manifest.json").read_text())
    assert report["startup_seconds"] > 0 and report["run_seconds"] > 0
    assert report["startup_seconds"] + report["run_seconds"] <= report["wall_seconds"] + 0.002
    times = report["actor_time"]
    assert set(times) == {"generator", "reward"}
    for role, role_times in times.items():
        for actor in role_times["per_actor"]:
            parts = actor["breakdown_seconds"]
            assert len(parts) == (6 if role == "generator" else 5), (role, parts)  # a generator's kernel warm-up
            assert all(v >= 0 for v in parts.values()), (role, parts)
            # each figure is rounded to the millisecond
            assert sum(parts.values()) == pytest.approx(actor["span_seconds"], abs=0.005), (role, actor)
            assert actor["span_seconds"] <= report["run_seconds"] + 0.002
            assert actor["calls"] > 0 and actor["round_trip_seconds"] >= actor["busy_seconds"] - 0.002
    assert times["generator"]["breakdown_seconds"]["waiting_for_rewards"] >= 0
    assert times["generator"]["forward_passes"] == manifest["run_stats"]["generator_forward_passes"]
    assert times["reward"]["forward_passes"] == manifest["run_stats"]["reward_forward_passes"]
    if capsys is not None:
        summary = capsys.readouterr().out
        assert f"(startup {report['startup_seconds']:.1f}s, run {report['run_seconds']:.1f}s)" in summary
        assert "generator time " in summary and "waiting for rewards" in summary and "ray calls" in summary
    return report


def build_argv(tiny_models, tmp_path, *extra):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:4]])
    return ["--config", "configs/demo.yaml", "--prompts", str(prompts), "--output", str(tmp_path / "out"),
            "--set", f"models.generator={tiny_models['generator']}", "--set", f"models.reward={tiny_models['reward']}",
            "--num-samples", "4", "--max-new-tokens", "16", "--set", "strategy.decision_token=6",
            "--set", "runtime.prompts_per_batch=2", "--no-progress", *extra]


def test_report_splits_startup_from_run_and_breaks_down_actor_time_in_process(tiny_models, tmp_path, capsys):
    assert main(build_argv(tiny_models, tmp_path, "--set", "runtime.local=true")) == 0
    check_report(tmp_path / "out", capsys)


@pytest.mark.integration
def test_report_breaks_down_actor_time_on_ray(cluster, tiny_models, tmp_path, capsys):
    pytest.importorskip("ray")
    assert main(build_argv(tiny_models, tmp_path)) == 0
    report = check_report(tmp_path / "out", capsys)
    generator = report["actor_time"]["generator"]["per_actor"][0]
    assert generator["ray_transit_seconds"] > 0  # a real Ray round trip costs something both ways
