"""Reproducible candidates: what a prompt gets does not depend on how the input was sharded,
batched or resumed. Every registered method builds the same prompts twice through the public job,
once one prompt per batch in shards of two, once four prompts per batch in one shard, and the two
outputs must be byte-identical: texts, token ids, token counts, which candidate is chosen and which
rejected. Rewards are compared to float32 rounding (1e-5 relative): the reward model scores a row
inside batches of different shapes and paddings, and CPU matmul kernels sum in a shape-dependent
order, so the last bits of a score may differ while the candidates do not.

What a method may keep between prompts (ULTS's empirical prior, the ADED drafter's tri-gram matrix
in DSBD) must therefore be a function of the prompt alone, or start from the same state for every
candidate (see the search docstrings in pipeline/decoding/ults.py and dsbd.py).
"""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from jobs.build_dataset import main
from pipeline.strategies import STRATEGIES
from tests.conftest import GOOD_PROMPTS, write_jsonl
from tests.test_golden import reward_transformer  # noqa: F401  (fixture: a generator with a trained reward channel)

# (case name, strategy, extra --set overrides): every registered method at least once, plus the
# variants whose state between prompts could leak across a batch (ULTS's empirical prior, DSBD's
# ADED drafter when no draft model is set).
CASES = [
    ("best_of_n", "best_of_n", []),
    ("sbon", "sbon", ["strategy.decision_token=4", "strategy.rejection_rate=0.5"]),
    ("ults", "ults", ["strategy.branching=3"]),
    ("ults_empirical", "ults", ["strategy.branching=3", "strategy.prior=empirical", "strategy.empirical_samples=8"]),
    ("aded", "aded", ["strategy.iterations=20"]),
    ("sla", "sla", ["strategy.step_size=3"]),
    ("dsbd_draft", "dsbd", ["strategy.draft_width=2"]),
    ("dsbd_aded", "dsbd", ["strategy.draft_width=2", "models.draft="]),
]
BATCHINGS = {"one_per_batch": ["data.shard_size=2", "runtime.prompts_per_batch=1"],
             "four_per_batch": ["data.shard_size=64", "runtime.prompts_per_batch=4"]}
KEYS = ("prompt_id", "chosen", "rejected", "chosen_token_ids", "rejected_token_ids", "num_candidates",
        "generated_tokens")
SCORES = ("chosen_score", "rejected_score")


def test_every_registered_method_has_a_case():
    assert {strategy for _, strategy, _ in CASES} == set(STRATEGIES)


def build(tiny_models, generator, out, strategy: str, overrides: list[str]) -> list[dict]:
    out.parent.mkdir(parents=True)
    prompts = write_jsonl(out.parent / "prompts.jsonl", [{"prompt": p} for p in GOOD_PROMPTS])
    args = ["--config", "configs/demo.yaml", "--strategy", strategy, "--prompts", str(prompts), "--output", str(out),
            "--num-samples", "3", "--max-new-tokens", "10", "--seed", "7",
            "--set", f"models.generator={generator}", "--set", f"models.reward={tiny_models['reward']}",
            "--set", f"models.draft={tiny_models['draft']}", "--set", "runtime.local=true", "--no-progress"]
    for item in overrides:
        args += ["--set", item]
    assert main(args) == 0
    rows = [r for part in sorted(out.glob("train-*.parquet")) for r in pq.read_table(part).to_pylist()]
    return sorted(({k: r[k] for k in KEYS + SCORES} for r in rows), key=lambda r: r["prompt_id"])


@pytest.mark.slow
@pytest.mark.parametrize("case,strategy,overrides", CASES, ids=[c[0] for c in CASES])
def test_candidates_do_not_depend_on_sharding_or_batching(case, strategy, overrides, tiny_models,
                                                         reward_transformer, tmp_path):  # noqa: F811
    generator = reward_transformer if strategy == "sla" else tiny_models["generator"]
    built = {name: build(tiny_models, generator, tmp_path / name / "out", strategy, overrides + batching)
             for name, batching in BATCHINGS.items()}
    one, four = built["one_per_batch"], built["four_per_batch"]
    assert len(one) == len(GOOD_PROMPTS)
    assert [r["prompt_id"] for r in one] == [r["prompt_id"] for r in four]
    for a, b in zip(one, four):
        assert {k: a[k] for k in KEYS} == {k: b[k] for k in KEYS}, f"{case}: prompt {a['prompt_id']} differs"
        assert [a[k] for k in SCORES] == pytest.approx([b[k] for k in SCORES], rel=1e-5, abs=1e-6), a["prompt_id"]
