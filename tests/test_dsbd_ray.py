"""DSBD as a build strategy through Ray actors: with the draft in its own DraftActor it gives the
candidates of an in-process run with the draft co-located in the generator."""

import json

import pytest

ray = pytest.importorskip("ray")

import pyarrow.parquet as pq  # noqa: E402

from actors import start_workers  # noqa: E402
from jobs.build_dataset import main  # noqa: E402
from pipeline.config import ConfigError, config_from_dict  # noqa: E402
from pipeline.coordinator import Coordinator  # noqa: E402
from pipeline.decoding.protocols import PromptInput  # noqa: E402
from pipeline.decoding.sampling import SamplingParams  # noqa: E402
from tests.conftest import GOOD_PROMPTS, write_jsonl  # noqa: E402

pytestmark = pytest.mark.integration

SAMPLING = SamplingParams(max_new_tokens=10)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def config(tiny_models, placement: str, local: bool = False, draft: bool = True):
    return config_from_dict({
        "models": {"generator": str(tiny_models["generator"]), "reward": str(tiny_models["reward"]),
                   "draft": str(tiny_models["draft"]) if draft else None},
        "strategy": {"name": "dsbd", "draft_width": 3, "num_draft_layers": 2},
        "sampling": {"num_samples": 2, "max_new_tokens": SAMPLING.max_new_tokens},
        "runtime": {"generator": {"num_cpus": 1}, "reward": {"num_cpus": 1}, "draft": {"num_cpus": 0},
                    "draft_placement": placement, "prompts_per_batch": 2, "local": local},
    })


def candidates(cfg, tokenizer):
    prompts = [PromptInput(f"id{i}", t, t, tokenizer(t).input_ids) for i, t in enumerate(GOOD_PROMPTS[:2])]
    workers = start_workers(cfg)
    try:
        coord = Coordinator("dsbd", cfg.strategy.params, SAMPLING, 2, 0, workers.generators, workers.scorers, 2, 2)
        return {r.prompt.prompt_id: [(c.text, round(c.score, 5)) for c in r.candidates] for r in coord.run(prompts)}
    finally:
        workers.shutdown()


def test_draft_actor_matches_colocated_in_process_draft(cluster, tiny_models, engine):
    expected = candidates(config(tiny_models, "colocated", local=True), engine.tokenizer)
    assert candidates(config(tiny_models, "actor"), engine.tokenizer) == expected


def test_dsbd_without_a_draft_model_is_a_config_error(tiny_models):
    with pytest.raises(ConfigError, match="models.draft"):
        start_workers(config(tiny_models, "colocated", local=True, draft=False))


def test_build_job_with_dsbd_on_ray(cluster, tiny_models, tmp_path):
    prompt_file = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:4]])
    out = tmp_path / "out"
    rc = main(["--config", "configs/demo.yaml", "--prompts", str(prompt_file), "--output", str(out),
               "--strategy", "dsbd", "--set", f"models.generator={tiny_models['generator']}",
               "--set", f"models.reward={tiny_models['reward']}", "--set", f"models.draft={tiny_models['draft']}",
               "--set", "runtime.draft_placement=actor", "--set", "runtime.draft.num_cpus=0",
               "--num-samples", "2", "--max-new-tokens", "8", "--no-progress"])
    assert rc == 0
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["pairs"] == 4
    table = pq.read_table(sorted(out.glob("part-*.parquet"))[0]).to_pylist()
    assert {r["strategy"] for r in table} == {"dsbd"} and all(r["num_candidates"] == 2 for r in table)
