"""Integration on a local Ray cluster (num_cpus=2, one per module): actors, coordinator, build."""

import json

import pytest

ray = pytest.importorskip("ray")

from actors import start_workers  # noqa: E402
from actors.factory import local_generator, local_scorer  # noqa: E402
from jobs.build_dataset import main  # noqa: E402
from pipeline.config import config_from_dict  # noqa: E402
from pipeline.coordinator import Coordinator  # noqa: E402
from pipeline.decoding.domain import PromptInput  # noqa: E402
from pipeline.decoding.sampling import SamplingParams  # noqa: E402
from tests.conftest import GOOD_PROMPTS, MIXED_BAD_ROWS, MIXED_ROWS, write_jsonl  # noqa: E402

pytestmark = pytest.mark.integration


def config(tiny_models, **runtime):
    return config_from_dict({
        "models": {"generator": str(tiny_models["generator"]), "reward": str(tiny_models["reward"])},
        "strategy": {"name": "sbon", "decision_token": 6, "rejection_rate": 0.5},
        "sampling": {"num_samples": 4, "max_new_tokens": 16},
        "runtime": {"generator": {"num_cpus": 1}, "reward": {"num_cpus": 1}, "prompts_per_batch": 2, **runtime},
    })


def prompts(engine, n=5):
    return [PromptInput(f"id{i}", t, t, engine.tokenizer(t).input_ids) for i, t in enumerate(GOOD_PROMPTS[:n])]


def test_ray_actors_give_the_same_candidates_as_in_process(cluster, tiny_models, engine, scorer):
    cfg = config(tiny_models)
    sampling = SamplingParams(max_new_tokens=16)
    local = Coordinator("sbon", cfg.strategy.params, sampling, 4, 0, [local_generator(engine, timed=False)],
                        [local_scorer(scorer, timed=False)], 2, 2)
    expected = {r.prompt.prompt_id: [(c.text, c.stopped_early) for c in r.candidates] for r in local.run(prompts(engine))}
    workers = start_workers(cfg)
    try:
        remote = Coordinator("sbon", cfg.strategy.params, sampling, 4, 0, workers.generators, workers.scorers, 2, 2)
        got = {r.prompt.prompt_id: [(c.text, c.stopped_early) for c in r.candidates] for r in remote.run(prompts(engine))}
        stats = workers.stats()
    finally:
        workers.shutdown()
    assert got == expected
    assert stats["generated_tokens"] > 0 and stats["reward_forward_passes"] > 0


def test_continuous_batching_on_a_threaded_actor_gives_the_same_candidates(cluster, tiny_models, engine, scorer):
    """Batches admitted by rows in flight share the actor's decoding steps (a threaded actor): the
    candidates are those of one batch at a time in-process, in fewer forward passes."""
    cfg = config(tiny_models, continuous_batching=True, batches_in_flight=4, rows_in_flight=10, prompts_per_batch=1)
    sampling = SamplingParams(max_new_tokens=16)
    passes = engine.forward_passes
    local = Coordinator("sbon", cfg.strategy.params, sampling, 4, 0, [local_generator(engine, timed=False)],
                        [local_scorer(scorer, timed=False)], 1, 1)
    expected = {r.prompt.prompt_id: [(c.token_ids, c.stopped_early) for c in r.candidates]
                for r in local.run(prompts(engine))}
    alone = engine.forward_passes - passes
    workers = start_workers(cfg)
    try:
        remote = Coordinator("sbon", cfg.strategy.params, sampling, 4, 0, workers.generators, workers.scorers, 1, 4,
                             rows_in_flight=10)
        got = {r.prompt.prompt_id: [(c.token_ids, c.stopped_early) for c in r.candidates]
               for r in remote.run(prompts(engine))}
        stats = workers.stats()
    finally:
        workers.shutdown()
    assert got == expected
    assert stats["generator_forward_passes"] < alone


def test_build_job_on_local_ray_with_mixed_input(cluster, tiny_models, tmp_path):
    prompt_file = write_jsonl(tmp_path / "mixed.jsonl", MIXED_ROWS)
    rc = main(["--config", "configs/demo.yaml", "--prompts", str(prompt_file), "--output", str(tmp_path / "out"),
               "--set", f"models.generator={tiny_models['generator']}", "--set", f"models.reward={tiny_models['reward']}",
               "--num-samples", "4", "--max-new-tokens", "16", "--set", "strategy.decision_token=6", "--no-progress"])
    assert rc == 0
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["pairs"] == len(GOOD_PROMPTS)
    assert manifest["prompts_rejected"] == len(MIXED_BAD_ROWS)
    assert manifest["prompts_in"] == len(MIXED_ROWS)


def test_a_reward_function_runs_in_the_ray_reward_actors(cluster, tiny_models, tmp_path):
    """models.reward as module:function on Ray: the function is imported and called inside the
    reward actor (its module must import there), with each row's columns, and the output keeps them."""
    import pyarrow.parquet as pq

    from pipeline.data.store import OutputStore

    rows = [{"prompt": p, "letter": "aeiou"[i % 5]} for i, p in enumerate(GOOD_PROMPTS)]
    prompt_file = write_jsonl(tmp_path / "p.jsonl", rows)
    rc = main(["--config", "configs/demo.yaml", "--prompts", str(prompt_file), "--output", str(tmp_path / "out"),
               "--set", f"models.generator={tiny_models['generator']}",
               "--set", "models.reward=tests.test_reward_function:letter_reward",
               "--num-samples", "4", "--max-new-tokens", "16", "--set", "strategy.decision_token=6", "--no-progress"])
    assert rc == 0
    pairs = [r for part in OutputStore(str(tmp_path / "out")).committed_parts() for r in pq.read_table(part).to_pylist()]
    letters = {r["prompt"]: r["letter"] for r in rows}
    assert pairs
    for p in pairs:
        assert p["letter"] == letters[p["raw_prompt"]]
        assert p["chosen_score"] == pytest.approx(p["chosen"].count(p["letter"]) + len(p["chosen"]) * 1e-3)
