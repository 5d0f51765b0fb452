"""DSBD as a build strategy through Ray actors: with the draft in its own DraftActor the build gives
the pairs of an in-process build with the draft co-located in the generator."""

import json

import pytest

ray = pytest.importorskip("ray")

import pyarrow.parquet as pq  # noqa: E402

from actors import start_workers  # noqa: E402
from jobs.build_dataset import main  # noqa: E402
from pipeline.config import config_from_dict  # noqa: E402
from pipeline.decoding import dsbd  # noqa: E402
from pipeline.decoding.dsbd import DSBDParams  # noqa: E402
from pipeline.decoding.sampling import SamplingParams  # noqa: E402
from tests.conftest import GOOD_PROMPTS, write_jsonl  # noqa: E402

pytestmark = pytest.mark.integration

SAMPLING = SamplingParams(max_new_tokens=10)


def config(tiny_models, placement: str, local: bool = False, draft: bool = True):
    return config_from_dict({
        "models": {"generator": str(tiny_models["generator"]), "reward": str(tiny_models["reward"]),
                   "draft": str(tiny_models["draft"]) if draft else None},
        "strategy": {"name": "dsbd", "draft_width": 3, "num_draft_layers": 2},
        "sampling": {"num_samples": 2, "max_new_tokens": SAMPLING.max_new_tokens},
        "runtime": {"generator": {"num_cpus": 1}, "reward": {"num_cpus": 1}, "draft": {"num_cpus": 0},
                    "draft_placement": placement, "prompts_per_batch": 2, "local": local},
    })


def test_dsbd_without_a_draft_model_starts_workers_that_draft_with_aded(tiny_models):
    workers = start_workers(config(tiny_models, "colocated", local=True, draft=False))
    out = workers.generators[0].search(dsbd.search, [[1, 40, 41]], 1, [0], SamplingParams(max_new_tokens=4),
                                       DSBDParams(draft_width=2))
    assert len(out[0].rows[0].token_ids) <= 4 and out[0].stats["drafted_tokens"] > 0


def test_build_job_with_dsbd_and_no_draft_model_in_process(tiny_models, tmp_path):
    """No models.draft: DSBD drafts with ADED (issue 4, item 9); a batch's pairs are reproducible."""
    prompt_file = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:2]])
    no_draft = ("--set", "models.draft=", "--set", "runtime.local=true")
    manifest, rows = build(tiny_models, prompt_file, tmp_path / "a", *no_draft)
    assert manifest["pairs"] == 2 and not manifest["config"]["models"]["draft"]
    assert {r["strategy"] for r in rows} == {"dsbd"} and all(r["num_candidates"] == 2 for r in rows)
    _, again = build(tiny_models, prompt_file, tmp_path / "b", *no_draft)
    keys = ("prompt_id", "chosen", "rejected", "chosen_score", "rejected_score")
    assert [[r[k] for k in keys] for r in again] == [[r[k] for k in keys] for r in rows]


def build(tiny_models, prompt_file, out, *extra):
    rc = main(["--config", "configs/demo.yaml", "--prompts", str(prompt_file), "--output", str(out),
               "--strategy", "dsbd", "--set", f"models.generator={tiny_models['generator']}",
               "--set", f"models.reward={tiny_models['reward']}", "--set", f"models.draft={tiny_models['draft']}",
               "--num-samples", "2", "--max-new-tokens", "8", "--no-progress", *extra])
    assert rc == 0
    rows = pq.read_table(sorted(out.glob("train-*.parquet"))).to_pylist()
    return json.loads((out / "_manifest.json").read_text()), sorted(rows, key=lambda r: r["prompt_id"])


def test_build_job_with_dsbd_on_ray_draft_actor_matches_in_process(cluster, tiny_models, tmp_path):
    prompt_file = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:4]])
    manifest, rows = build(tiny_models, prompt_file, tmp_path / "ray", "--set", "runtime.draft_placement=actor",
                           "--set", "runtime.draft.num_cpus=0")
    assert manifest["pairs"] == 4
    assert {r["strategy"] for r in rows} == {"dsbd"} and all(r["num_candidates"] == 2 for r in rows)
    _, local = build(tiny_models, prompt_file, tmp_path / "local", "--set", "runtime.local=true")
    keys = ("prompt_id", "chosen", "rejected", "chosen_score", "rejected_score")
    assert [[r[k] for k in keys] for r in rows] == [[r[k] for k in keys] for r in local]
