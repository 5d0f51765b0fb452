"""Builds with ``models.backend: vllm`` through Ray actors (marker ``vllm``: ``make test-vllm`` runs it
in .venv-vllm on vLLM's CPU backend): the GeneratorActor's vLLM engine and its worker processes
start inside a Ray actor of one CPU beside the reward actor, every input row ends as a pair or a
reject, and the pairs are those of the in-process build with the same seed, token for token.

One set of workers serves both strategies (speculative rejection, then Best-of-N) per mode: a vLLM
engine takes 30-90 s to start on 2 cores.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from tests.conftest import GOOD_PROMPTS, MIXED_BAD_ROWS, MIXED_ROWS, write_jsonl

pytestmark = pytest.mark.vllm

STRATEGIES = {"sbon": {"decision_token": [4, 8], "rejection_rate": 0.5}, "best_of_n": {}}
# What a pair and a reject must repeat exactly (scores are compared to float tolerance).
PAIR_COLUMNS = ["source_row", "prompt_id", "chosen_token_ids", "rejected_token_ids", "chosen_sample",
                "rejected_sample", "generated_tokens", "bon_equivalent_tokens", "rejected_is_partial", "stopped_early"]
REJECT_COLUMNS = ["source_row", "prompt_id", "reason", "stage"]


def build_config(generator, reward, prompts, output, strategy: str, local: bool):
    from pipeline.config import config_from_dict

    return config_from_dict({
        "models": {"generator": str(generator), "reward": str(reward), "backend": "vllm"},
        "strategy": {"name": strategy, **STRATEGIES[strategy]},
        "sampling": {"num_samples": 4, "max_new_tokens": 16},
        "data": {"prompts": str(prompts), "output": str(output), "shard_size": 4},
        # Several batches in flight on the one generator actor, which serves them one call at a time.
        "runtime": {"local": local, "generator": {"num_cpus": 1}, "reward": {"num_cpus": 1},
                    "prompts_per_batch": 2, "batches_in_flight": 4},
        "seed": 11,
    })


def build_both(generator, reward, prompts, out, local: bool) -> dict[str, dict]:
    """Both strategies on one set of workers; per strategy its manifest, report, pairs and rejects."""
    from actors import start_workers
    from pipeline.build import plan_build, run_build

    configs = {s: build_config(generator, reward, prompts, out / s, s, local) for s in STRATEGIES}
    workers = start_workers(configs["sbon"])
    try:
        builds = {}
        for strategy, config in configs.items():
            manifest = run_build(plan_build(config), workers, progress=False)
            root = out / strategy
            builds[strategy] = {
                "manifest": manifest, "report": json.loads((root / "_report.json").read_text()),
                "pairs": rows(root.glob("train-*.parquet")), "rejects": rows((root / "_rejects").glob("part-*.parquet"))}
    finally:
        workers.shutdown()
    return builds


def rows(paths) -> list[dict]:
    return sorted((r for p in paths for r in pq.read_table(p).to_pylist()), key=lambda r: r["source_row"])


def engine_processes() -> list[str]:
    """vLLM's engine and worker processes still running under this one (ended ones not yet reaped
    do not count)."""
    import psutil

    running = []
    for child in psutil.Process().children(recursive=True):
        try:
            title = " ".join(child.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if "VLLM::" in title:
            running.append(title)
    return running


def test_a_vllm_build_through_ray_actors_equals_the_in_process_build(cluster, tiny_models, tmp_path, monkeypatch):
    pytest.importorskip("vllm", reason="vllm is not installed (make install-vllm, or pip install .[vllm] on a GPU)")
    from jobs.make_tiny_models import make_vllm_model

    # 1 GiB of KV cache per engine instead of 30% of the machine's memory; the driver's setting
    # reaches the generator actor (actors.factory.VLLM_ENV).
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    generator = make_vllm_model(tmp_path / "vllm-model")
    prompts = write_jsonl(tmp_path / "mixed.jsonl", MIXED_ROWS)
    local = build_both(generator, tiny_models["reward"], prompts, tmp_path / "local", local=True)
    assert engine_processes() == []  # the in-process engine's shutdown ended its processes
    remote = build_both(generator, tiny_models["reward"], prompts, tmp_path / "ray", local=False)

    for strategy in STRATEGIES:
        got, expected = remote[strategy], local[strategy]
        manifest = got["manifest"]
        # Every input row accounted for: one pair or one reject each, none twice.
        assert manifest["prompts_in"] == len(MIXED_ROWS)
        assert manifest["pairs"] + manifest["prompts_rejected"] == len(MIXED_ROWS)
        rows_seen = [r["source_row"] for r in got["pairs"] + got["rejects"]]
        assert sorted(rows_seen) == list(range(len(MIXED_ROWS)))
        assert {r["source_row"] for r in got["rejects"] if r["stage"] == "input"} == set(MIXED_BAD_ROWS)
        assert manifest["pairs"] == len(got["pairs"]) >= 1
        # It ran on Ray actors, with no fault and no retry.
        assert got["report"]["actor_restarts"] == 0 and got["report"]["batch_retries"] == 0
        assert set(manifest["run_stats"]["actor_time"]) == {"generator", "reward"}
        # Same seed, same pairs as in-process. Under continuous batching, rows of speculative
        # rejection go on decoding while their partial rewards are computed, and every token decoded
        # counts (issue 27): how many that is depends on timing, so sbon's token cost is bounded, not
        # repeated exactly.
        columns = [k for k in PAIR_COLUMNS if strategy == "best_of_n" or k != "generated_tokens"]
        assert [[p[k] for k in columns] for p in got["pairs"]] == \
            [[p[k] for k in columns] for p in expected["pairs"]], strategy
        for p in got["pairs"]:
            assert len(p["chosen_token_ids"]) + len(p["rejected_token_ids"]) <= p["generated_tokens"] <= 4 * 16
        for a, b in zip(got["pairs"], expected["pairs"]):
            assert (a["chosen_score"], a["rejected_score"]) == pytest.approx((b["chosen_score"], b["rejected_score"]),
                                                                            rel=1e-5, abs=1e-6)
        assert [[r[k] for k in REJECT_COLUMNS] for r in got["rejects"]] == \
            [[r[k] for k in REJECT_COLUMNS] for r in expected["rejects"]]
        if strategy == "best_of_n":
            assert manifest["generated_tokens"] == expected["manifest"]["generated_tokens"]
    # Speculative rejection stopped rows early, and a stopped row is a prefix of Best-of-N's request
    # for it, so no prompt cost more tokens than under Best-of-N. How many fewer depends on how far
    # the rows ran while the reward actor scored them: with 16 tokens a row can finish first (the
    # last CI run decoded 369 tokens under both). tests/test_vllm_engine.py asserts the strict
    # saving on a stand-in engine whose steps take a known time.
    assert any(p["stopped_early"] for p in remote["sbon"]["pairs"])
    bon_tokens = {p["source_row"]: p["generated_tokens"] for p in remote["best_of_n"]["pairs"]}
    for p in remote["sbon"]["pairs"]:
        assert p["generated_tokens"] <= bon_tokens.get(p["source_row"], 4 * 16), p["source_row"]
    assert remote["sbon"]["manifest"]["generated_tokens"] <= remote["best_of_n"]["manifest"]["generated_tokens"]
