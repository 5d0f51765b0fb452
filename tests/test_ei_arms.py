"""benchmarks.ei_rounds --against: two arms of expert iteration (sbon pairs and Best-of-N pairs, say)
compared policy by policy on the same held-out prompts, resampled by base task, with both arms'
lengths and build compute; on two small data directories written here in DATA's layout."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from benchmarks.ei_rounds import main, policy_file, write_json_gz

ROOT = Path(__file__).resolve().parents[1]
ROWS = (0, 1, 32, 33)
"""Held-out rows 0 and 32 share a base task, 1 and 33 another (the file cycles through its 32)."""


def held_out(tmp_path: Path) -> tuple[Path, list[dict]]:
    lines = (ROOT / "configs" / "prompts" / "ifeval-eval.jsonl").read_text().splitlines(True)
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(lines[i] for i in ROWS))
    return path, [json.loads(lines[i]) for i in ROWS]


def ifbench_file(tmp_path: Path) -> Path:
    path = tmp_path / "ifbench.jsonl"
    path.write_text("".join((ROOT / "configs" / "prompts" / "ifbench-test.jsonl").read_text().splitlines(True)[:3]))
    return path


def record(name: str, prompts: Path, rows: list, passing: set[int], tokens: int, samples: int = 2) -> dict:
    """A kept policy record: every response to a prompt in ``passing`` follows all its instructions,
    every other response none; each response ``tokens`` long."""
    sizes = [len(r["instruction_id_list"]) if isinstance(r, dict) else r for r in rows]
    return {"policy": name, "settings": {"prompts_sha256": hashlib.sha256(prompts.read_bytes()).hexdigest(),
                                         "samples": samples},
            "responses": samples * len(rows),
            "verdicts": [[[i in passing] * n for _ in range(samples)] for i, n in enumerate(sizes)],
            "reward_scores": [[0.5] * samples for _ in rows], "tokens": [[tokens] * samples for _ in rows]}


def arm(data: Path, strategy: str, build_tokens: int, round_1: dict, start: dict, bench: list | None = None) -> Path:
    """An arm's DATA: schedule.json with round 0's build and the start and round-1 policies' records."""
    data.mkdir(parents=True)
    (data / "schedule.json").write_text(json.dumps({
        "schedule": strategy, "key": {}, "policies": ["start", "round 1"],
        "rounds": {"0": {"strategy": strategy, "build": {"pairs": 2, "generated_tokens": build_tokens}}}}))
    write_json_gz(policy_file(data, "start"), start)
    write_json_gz(policy_file(data, "round 1"), round_1)
    for name, kept in zip(("start", "round 1"), bench or []):
        write_json_gz(policy_file(data, name, "IFBench"), kept)
    return data


def test_two_arms_policy_by_policy_resampled_by_base_task(tmp_path, capsys):
    prompts, rows = held_out(tmp_path)
    bench = ifbench_file(tmp_path)
    start = record("start", prompts, rows, set(), 120)
    bench_start = record("start", bench, [1, 1, 1], {0}, 200)
    # This arm's round 1 follows the two prompts of base task A (rows 0 and 32); the other arm's follows
    # one prompt of base task B (row 1). Lengths 100 and 150 tokens; builds of 1,000 and 1,250 tokens.
    ours = arm(tmp_path / "sbon", "sbon", 1000, record("round 1", prompts, rows, {0, 2}, 100), start,
               [bench_start, record("round 1", bench, [1, 1, 1], {0, 1}, 90)])
    theirs = arm(tmp_path / "bon", "best_of_n", 1250, record("round 1", prompts, rows, {1}, 150), start,
                 [bench_start, record("round 1", bench, [1, 1, 1], {0}, 210)])
    common = ["--replay", "--data", str(ours), "--eval-prompts", str(prompts), "--ifbench-prompts", str(bench),
              "--resamples", "4000"]
    assert main([*common, "--against", str(theirs), "--json", str(tmp_path / "arms.json")]) == 0
    figures = json.loads((tmp_path / "arms.json").read_text())
    against = figures["against"]
    assert against["arms"] == ["sbon", "best_of_n"] and against["data"] == str(theirs)
    assert [p["policy"] for p in against["policies"]] == ["start", "round 1"]
    first = against["policies"][1]
    assert first["build_tokens"] == [1000, 1250] and first["cumulative_build_tokens"] == [1000, 1250]
    assert against["policies"][0]["build_tokens"] == [None, None]

    # By hand: prompt level 4 of 8 responses against 2 of 8. Two base tasks drawn with replacement: A
    # twice (+1), B twice (0 - 1/2), or one each (+1/4): a quarter of the draws at each end, so the 95%
    # interval is [-0.5, +1].
    g = first["IFEval"]
    assert (g["prompts"], g["groups"]) == (4, 2)
    level = g["prompt_level_strict"]
    assert (level["after"], level["before"], level["gain"]) == (0.5, 0.25, 0.25)
    assert (level["low"], level["high"]) == (-0.5, 1.0)
    n = [len(r["instruction_id_list"]) for r in rows]
    instructions = g["instruction_level_strict"]
    assert instructions["after"] == pytest.approx((n[0] + n[2]) / sum(n))
    assert instructions["gain"] == pytest.approx((n[0] + n[2] - n[1]) / sum(n))
    assert g["mean_tokens"] == [100, 150]
    assert against["policies"][0]["IFEval"]["prompt_level_strict"]["gain"] == 0
    # IFBench: each prompt its own group; 2 of 3 prompts against 1 of 3.
    b = first["IFBench"]
    assert (b["prompts"], b["groups"]) == (3, 3) and b["prompt_level_strict"]["gain"] == pytest.approx(1 / 3)
    assert b["mean_tokens"] == [90, 210]
    out = capsys.readouterr().out
    assert ("round 1 (IFEval): sbon 50.0 vs best_of_n 25.0 prompt level: +25.0 [-50.0, +100.0]; instruction level: "
            in out)
    assert ("(2 base tasks); lengths 100.0 / 150.0 tokens; build tokens 1,000 / 1,250 (0.80x; every round up to "
            "it 1,000 / 1,250, 0.80x)" in out)
    assert "round 1 (IFBench): sbon 66.7 vs best_of_n 33.3 prompt level: +33.3" in out and "(3 prompts)" in out

    # Beside the gains over the start by prompt, the same resampled by base task.
    by_task = figures["policies"][1]["gain_over_start_by_base_task"]
    assert by_task["groups"] == 2 and by_task["prompt_level_strict"]["gain"] == pytest.approx(0.5)
    assert figures["policies"][1]["gain_over_start"]["prompt_level_strict"]["gain"] == pytest.approx(0.5)

    # IFBench held by one arm only: IFEval alone is compared.
    for name in ("start", "round 1"):
        policy_file(theirs, name, "IFBench").unlink()
    assert main([*common, "--against", str(theirs), "--json", str(tmp_path / "one.json")]) == 0
    assert all("IFBench" not in p for p in json.loads((tmp_path / "one.json").read_text())["against"]["policies"])


def test_arms_judged_on_other_prompts_or_samples_are_refused(tmp_path, capsys):
    prompts, rows = held_out(tmp_path)
    start = record("start", prompts, rows, set(), 120)
    ours = arm(tmp_path / "sbon", "sbon", 1000, record("round 1", prompts, rows, {0}, 100), start)
    other_prompts = tmp_path / "other.jsonl"
    other_prompts.write_text(prompts.read_text() + "\n")
    cases = {"prompts": record("round 1", other_prompts, rows, {1}, 150),
             "samples": record("round 1", prompts, rows, {1}, 150, samples=3)}
    common = ["--replay", "--data", str(ours), "--eval-prompts", str(prompts), "--resamples", "200"]
    for what, theirs_round_1 in cases.items():
        theirs = arm(tmp_path / f"bon-{what}", "best_of_n", 1250, theirs_round_1, start)
        with pytest.raises(SystemExit) as stop:
            main([*common, "--against", str(theirs)])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        other = "prompt file" if what == "prompts" else "responses per prompt"
        assert err.count("\n") == 1
        assert err.startswith(f"error: --against {theirs}: round 1 judged by IFEval on another {other}")
    with pytest.raises(SystemExit) as stop:
        main([*common, "--against", str(tmp_path / "none")])
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: --against {tmp_path / 'none'}: does not")


def test_without_against_the_committed_replay_has_no_such_figures(tmp_path):
    """The committed arm alone: no ``against``, and the new by-base-task gains beside the old ones
    (tests/test_replays.py checks every committed figure is reproduced)."""
    assert main(["--replay", "--resamples", "500", "--json", str(tmp_path / "r.json")]) == 0
    figures = json.loads((tmp_path / "r.json").read_text())
    assert "against" not in figures
    for row in figures["policies"][1:]:
        by_task = row["gain_over_start_by_base_task"]
        assert (by_task["groups"], by_task["prompts"]) == (32, 64)
        gain = row["gain_over_start"]["prompt_level_strict"]["gain"]
        assert by_task["prompt_level_strict"]["gain"] == pytest.approx(gain)
