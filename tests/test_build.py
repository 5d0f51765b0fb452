"""The build job in-process (runtime.local=true): counts, rejects, manifest, resume, CLI errors."""

import json
import math
import subprocess
import sys

import datasets
import pyarrow.parquet as pq
import pytest

from jobs.build_dataset import main
from tests.conftest import GOOD_PROMPTS, MIXED_BAD_ROWS, MIXED_ROWS, write_jsonl


def build_args(tiny_models, prompts, output, *extra, tau=8):
    sbon = ["--set", f"strategy.decision_token={tau}"] if tau else []
    return [*sbon, "--config", "configs/demo.yaml", "--prompts", str(prompts), "--output", str(output),
            "--set", f"models.generator={tiny_models['generator']}", "--set", f"models.reward={tiny_models['reward']}",
            "--set", "runtime.local=true", "--max-new-tokens", "24", "--num-samples", "4",
            "--set", "data.shard_size=5", "--no-progress", *extra]


@pytest.fixture(scope="module")
def mixed_build(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("build")
    prompts = write_jsonl(tmp / "mixed.jsonl", MIXED_ROWS)
    assert main(build_args(tiny_models, prompts, tmp / "out")) == 0
    return tmp / "out", prompts


def test_one_pair_per_good_prompt_and_every_bad_row_rejected(mixed_build):
    out, _ = mixed_build
    pairs = datasets.load_dataset("parquet", data_files=str(out / "train-*.parquet"), split="train")
    assert sorted(pairs["raw_prompt"]) == sorted(GOOD_PROMPTS)
    assert len(set(pairs["prompt_id"])) == len(GOOD_PROMPTS)
    assert sorted(pairs["source_row"]) == [0, 2, 4, 6, 9, 11]
    rejects = datasets.load_dataset("parquet", data_files=str(out / "_rejects" / "*.parquet"), split="train")
    assert sorted(rejects["source_row"]) == sorted(MIXED_BAD_ROWS)
    for row, reason in zip(rejects["source_row"], rejects["reason"]):
        assert reason.startswith(MIXED_BAD_ROWS[row])
    assert set(rejects["stage"]) == {"input"}


def test_output_contract_columns_and_manifest(mixed_build):
    out, _ = mixed_build
    table = pq.read_table(out / "train-00000.parquet")
    types = {f.name: str(f.type) for f in table.schema}
    for col, typ in {"prompt_id": "string", "prompt": "string", "chosen": "string", "rejected": "string",
                     "chosen_score": "double", "rejected_score": "double", "strategy": "string",
                     "num_candidates": "int64", "generated_tokens": "int64"}.items():
        assert types[col] == typ, col
    rows = table.to_pylist()
    assert all(r["chosen_score"] > r["rejected_score"] and r["num_candidates"] == 4 for r in rows)
    assert all(r["strategy"] == "sbon" and not r["chosen"].endswith("</s>") for r in rows)
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["prompts_in"] == len(MIXED_ROWS)
    assert manifest["pairs"] == len(GOOD_PROMPTS)
    assert manifest["prompts_rejected"] == len(MIXED_BAD_ROWS)
    assert manifest["config"]["strategy"]["decision_token"] == 8
    assert manifest["wall_seconds"] > 0 and manifest["shards"] == 3
    report = json.loads((out / "_report.json").read_text())  # this (first) run's figures
    assert report["pairs"] == len(GOOD_PROMPTS) and report["shards_written"] == 3
    assert report["tokens_per_pair"] == round(report["generated_tokens"] / report["pairs"], 2)
    assert report["pairs_per_hour"] > 0 and report["actor_restarts"] == 0
    # one definition of the rate: this run's pairs over its wall time, wherever it is printed
    assert report["pairs_per_hour"] == report["metrics"]["pairs_per_hour"]
    # (wall_seconds is rounded to the millisecond: a short run needs the looser tolerance)
    assert report["pairs_per_hour"] == pytest.approx(report["pairs"] / report["wall_seconds"] * 3600, rel=1e-2)
    assert manifest["pairs_per_minute"] == pytest.approx(report["pairs_per_hour"] / 60, abs=0.01)
    assert report["metrics"]["pairs"] == len(GOOD_PROMPTS)
    assert report["metrics"]["tokens_saved"] == report["tokens_saved"] > 0


def test_speculative_rejection_generates_fewer_tokens_than_a_real_best_of_n_build(mixed_build, tiny_models, tmp_path):
    """Measured, not estimated: the same prompts and seed built with best_of_n generate more."""
    out, prompts = mixed_build
    assert main(build_args(tiny_models, prompts, tmp_path / "bon", "--strategy", "best_of_n", tau=None)) == 0
    sbon = json.loads((out / "_manifest.json").read_text())
    bon = json.loads((tmp_path / "bon" / "_manifest.json").read_text())
    assert bon["generated_tokens"] == bon["bon_equivalent_tokens"]
    assert sbon["generated_tokens"] < bon["generated_tokens"]


def test_rerun_skips_committed_shards(mixed_build, tiny_models):
    out, prompts = mixed_build
    before = (out / "train-00001.parquet").stat().st_mtime_ns
    assert main(build_args(tiny_models, prompts, out)) == 0
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["shards_skipped"] == [0, 1, 2] and manifest["pairs"] == len(GOOD_PROMPTS)
    assert (out / "train-00001.parquet").stat().st_mtime_ns == before
    report = json.loads((out / "_report.json").read_text())
    assert (report["pairs"], report["shards_skipped"], report["tokens_per_pair"]) == (0, 3, None)


def test_best_of_n_strategy_spends_full_budget(tiny_models, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:3]])
    assert main(build_args(tiny_models, prompts, tmp_path / "out", "--strategy", "best_of_n", tau=None)) == 0
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["pairs"] == 3
    assert manifest["generated_tokens"] == manifest["bon_equivalent_tokens"]


def test_overlength_reject_mode_records_reason(tiny_models, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": GOOD_PROMPTS[0]}, {"prompt": "very long " * 400}])
    assert main(build_args(tiny_models, prompts, tmp_path / "out", "--set", "data.overlength=reject")) == 0
    rejects = pq.read_table(tmp_path / "out" / "_rejects" / "part-00000.parquet").to_pylist()
    assert [r["source_row"] for r in rejects] == [1] and "too long" in rejects[0]["reason"]


@pytest.mark.parametrize("content, needle", [
    (None, "missing.jsonl: no such file"),
    ('{"prompt": "a"}\n{"prompt": "b"\n', "bad.jsonl:2: malformed JSON line"),
    (b"PAR1 not really parquet", "bad.parquet: unreadable Parquet file"),
])
def test_cli_bad_input_exits_2_with_one_line(tiny_models, tmp_path, content, needle):
    name = "missing.jsonl" if content is None else ("bad.parquet" if isinstance(content, bytes) else "bad.jsonl")
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    proc = subprocess.run([sys.executable, "-m", "jobs.build_dataset", *build_args(tiny_models, path, tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "o" / "train-00000.parquet").exists()


def test_cli_config_errors_exit_2(tiny_models, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "jobs.build_dataset", "--config", "configs/demo.yaml",
                           "--set", "strategy.rejection_rat=0.5"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "strategy.rejection_rat" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "jobs.build_dataset", "--config", "configs/demo.yaml",
                           "--set", f"models.generator={tmp_path}/nope", "--output", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "models.generator" in proc.stderr and "Traceback" not in proc.stderr


def copy_output(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_duplicates_and_blanks_are_counted_in_the_manifest(mixed_build):
    out, _ = mixed_build
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["reject_reasons"] == {"blank prompt": 2, "duplicate prompt": 1, "missing prompt": 2,
                                          "prompt is not a string or a conversation": 1}
    success = json.loads((out / "_SUCCESS").read_text())
    assert success["pairs"] == len(GOOD_PROMPTS) and success["config_hash"] == manifest["config_hash"]


def test_rerun_with_another_config_is_refused_unless_overwrite(mixed_build, tiny_models, tmp_path):
    out, prompts = mixed_build
    out = copy_output(out, tmp_path / "out")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    proc = subprocess.run([sys.executable, "-m", "jobs.build_dataset", *build_args(tiny_models, prompts, out),
                           "--seed", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "different config" in lines[0] and "--overwrite" in lines[0]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert main(build_args(tiny_models, prompts, out, "--seed", "1", "--overwrite")) == 0
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["shards_written"] == [0, 1, 2] and manifest["config"]["seed"] == 1
    assert manifest["pairs"] == len(GOOD_PROMPTS)


def test_rerun_redoes_shards_without_marker_and_ignores_temp_files(mixed_build, tiny_models, tmp_path):
    out, prompts = mixed_build
    out = copy_output(out, tmp_path / "out")
    reference = pq.read_table(out / "train-00001.parquet")
    (out / "_markers" / "part-00001.json").unlink()  # data written, marker not: a run killed in between
    (out / "_SUCCESS").unlink()
    (out / ".tmp-0123-part-00002.parquet").write_bytes(b"PAR1 half-written")
    assert main(build_args(tiny_models, prompts, out)) == 0
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["shards_written"] == [1] and manifest["shards_skipped"] == [0, 2]
    # Same seeds, same rows. Scores may differ in the last float bits: the reward model batches the
    # redone shard's rows with different company (padding) than the first run did.
    redone = pq.read_table(out / "train-00001.parquet").to_pylist()
    want = reference.to_pylist()
    score_keys = ("chosen_score", "rejected_score", "chosen_scores", "rejected_scores")
    assert [{k: v for k, v in r.items() if k not in score_keys} for r in redone] == \
        [{k: v for k, v in r.items() if k not in score_keys} for r in want]
    for key in score_keys:
        flat = [[v for r in rows for v in (r[key] if isinstance(r[key], list) else [r[key]])] for rows in (redone, want)]
        assert flat[0] == pytest.approx(flat[1], abs=1e-5)
    assert (out / "_SUCCESS").exists() and not list(out.rglob(".tmp-*"))
    ids = datasets.load_dataset("parquet", data_files=str(out / "train-*.parquet"), split="train")["prompt_id"]
    assert len(ids) == len(set(ids)) == len(GOOD_PROMPTS)


def test_wrong_column_types_are_rejected_row_by_row(tiny_models, tmp_path):
    import pyarrow as pa

    d = tmp_path / "in"
    d.mkdir()
    pq.write_table(pa.table({"prompt": GOOD_PROMPTS[:2]}), d / "0.parquet")
    pq.write_table(pa.table({"prompt": [3, 4]}), d / "1.parquet")  # an int64 prompt column
    pq.write_table(pa.table({"prompt": pa.array([[1.5], [2.5]])}), d / "2.parquet")  # list<double>
    assert main(build_args(tiny_models, d, tmp_path / "out", "--strategy", "best_of_n", tau=None)) == 0
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["pairs"] == 2 and manifest["reject_reasons"] == {"prompt is not a string or a conversation": 2,
                                                                     "malformed conversation": 2}
    rejects = pq.read_table(tmp_path / "out" / "_rejects" / "part-00000.parquet").to_pylist()
    assert [(r["source_row"], r["value"]) for r in rejects] == [(2, "3"), (3, "4"), (4, "[1.5]")]


class NonFiniteScorer:
    """The real reward model, except: GOOD_PROMPTS[0]'s first two responses get nan and inf, all of
    GOOD_PROMPTS[1]'s get nan, GOOD_PROMPTS[2]'s first gets -inf. Records the finite scores it hands out."""

    def __init__(self, scorer):
        self.scorer = scorer
        self.finite: list[float] = []
        self.calls = 0

    def score(self, prompts, responses, finished=None, columns=None):
        scores = self.scorer.score(prompts, responses)
        seen = {}
        for i, p in enumerate(prompts):
            k = seen[p] = seen.get(p, -1) + 1
            replace = {GOOD_PROMPTS[0]: [math.nan, math.inf], GOOD_PROMPTS[1]: [math.nan] * 4,
                       GOOD_PROMPTS[2]: [-math.inf]}.get(p, [])
            if k < len(replace):
                scores[i] = replace[k]
        self.finite.extend(s for s in scores if math.isfinite(s))
        return scores

    def stats(self):
        return self.scorer.stats()


def test_non_finite_rewards_are_quarantined_and_left_out_of_statistics(tiny_models, engine, scorer, tmp_path):
    from actors.factory import Workers, local_generator, local_scorer
    from pipeline.build import plan_build, run_build
    from pipeline.config import load_config

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:3]])
    args = build_args(tiny_models, prompts, tmp_path / "out", tau=None)
    overrides = [a for a, prev in zip(args, [None] + args) if prev == "--set"]
    config = load_config("configs/demo.yaml", overrides + [
        f"data.prompts={prompts}", f"data.output={tmp_path / 'out'}", "sampling.num_samples=4",
        "sampling.max_new_tokens=24"], strategy="best_of_n")
    flaky = NonFiniteScorer(scorer)
    workers = Workers([local_generator(engine, timed=False)], [local_scorer(flaky, timed=False)])
    manifest = run_build(plan_build(config), workers, progress=False)
    quarantine = pq.read_table(tmp_path / "out" / "_quarantine" / "part-00000.parquet").to_pylist()
    assert sorted({q["score"] for q in quarantine}) == ["-inf", "inf", "nan"]
    assert manifest["candidates_quarantined"] == len(quarantine) == 2 + 4 + 1
    assert manifest["candidates"] == 12
    stats = manifest["reward_stats"]
    assert stats["count"] == len(flaky.finite) == 5
    assert stats["mean"] == pytest.approx(sum(flaky.finite) / 5)
    assert stats["min"] == min(flaky.finite) and stats["max"] == max(flaky.finite)
    pairs = pq.read_table(tmp_path / "out" / "train-00000.parquet").to_pylist()
    assert [p["raw_prompt"] for p in pairs] == [GOOD_PROMPTS[0], GOOD_PROMPTS[2]]
    assert all(math.isfinite(p["chosen_score"]) and math.isfinite(p["rejected_score"]) for p in pairs)
    assert [p["failed_candidates"] for p in pairs] == [2, 1]
    rejects = pq.read_table(tmp_path / "out" / "_rejects" / "part-00000.parquet").to_pylist()
    assert [(r["source_row"], r["reason"], r["stage"]) for r in rejects] == [
        (1, "no completed candidate with a finite reward", "pairing")]


def test_summary_says_the_estimate_may_run_high_with_keep_lowest_off(mixed_build, tiny_models, tmp_path, capsys):
    """Issue 27: the Best-of-N token estimate is 22% high with keep_lowest off and nothing said so."""
    _, prompts = mixed_build
    assert main(build_args(tiny_models, prompts, tmp_path / "off", "--set", "strategy.keep_lowest=false")) == 0
    assert "upper bound" in capsys.readouterr().out
    assert main(build_args(tiny_models, prompts, tmp_path / "on")) == 0
    assert "upper bound" not in capsys.readouterr().out


def test_candidate_scores_give_every_best_of_k_of_one_build(tiny_models, tmp_path):
    """data.candidate_scores: every candidate's score and tokens by sample index; Best-of-K read off
    a Best-of-N build's first K candidates is the Best-of-K build's own choice (row seeds), which is
    what benchmarks.equal_reward relies on."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in GOOD_PROMPTS])

    def build(name, n, *extra):
        args = build_args(tiny_models, prompts, tmp_path / name, "--strategy", "best_of_n", "--set", "seed=7",
                          "--num-samples", str(n), *extra, tau=None)
        assert main(args) == 0
        rows = [r for part in sorted((tmp_path / name).glob("train-*.parquet")) for r in pq.read_table(part).to_pylist()]
        return {r["prompt_id"]: r for r in rows}

    wide = build("wide", 6, "--set", "data.candidate_scores=true")
    narrow = build("narrow", 3)
    assert "candidate_scores" not in next(iter(narrow.values()))
    assert set(wide) == set(narrow)
    for pid, row in wide.items():
        scores, tokens = row["candidate_scores"], row["candidate_tokens"]
        assert len(scores) == len(tokens) == len(row["candidate_stopped_early"]) == 6
        assert sum(tokens) == row["generated_tokens"] and not any(row["candidate_stopped_early"])
        assert scores[row["chosen_sample"]] == row["chosen_score"] == max(scores)
        assert narrow[pid]["chosen_score"] == pytest.approx(max(scores[:3]), abs=1e-4)
        assert sum(tokens[:3]) == narrow[pid]["generated_tokens"]
    manifest = json.loads((tmp_path / "wide" / "_manifest.json").read_text())
    assert "candidate_scores" in (tmp_path / "wide" / "README.md").read_text()
    # another output schema: the build is not resumed into it
    args = build_args(tiny_models, prompts, tmp_path / "wide", "--strategy", "best_of_n", "--set", "seed=7",
                      "--num-samples", "6", tau=None)
    assert main(args) == 2 and manifest["pairs"] == len(wide)
