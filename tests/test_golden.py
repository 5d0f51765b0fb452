"""Golden outputs: every registered strategy, built through the public job on the tiny models with
fixed seeds, writes exactly the pairs recorded in tests/golden/pairs.json.

The file was recorded before the architecture refactor (one registry, pure decoding layer, one KV
row-batch), so a refactor that changes what any method generates fails here. Texts, token counts
and candidate counts must match exactly; scores to 1e-5 (relative), since a reordered reduction
in a batched forward pass may move the last float bits.

To record again after an intended change in behaviour: GOLDEN_UPDATE=1 pytest tests/test_golden.py
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from jobs.build_dataset import main
from pipeline.data.store import OutputStore
from pipeline.strategies import STRATEGIES
from tests.conftest import GOOD_PROMPTS, write_jsonl

GOLDEN = Path(__file__).parent / "golden" / "pairs.json"

GOLDEN_CASES = {
    "best_of_n": {"best_of_n": []},
    "sbon": {"sbon": ["strategy.decision_token=4", "strategy.rejection_rate=0.5"]},
    "ults": {"ults": ["strategy.branching=3"]},
    "aded": {"aded": ["strategy.iterations=20"]},
    "sla": {"sla": ["strategy.step_size=3"]},
    "dsbd": {"dsbd_draft": ["strategy.draft_width=2"], "dsbd_aded": ["strategy.draft_width=2", "models.draft="]},
}
"""Registered strategy -> {golden case: its extra --set overrides}. dsbd has two cases: with the
draft model, and with no draft model (ADED drafts)."""
CASES = [(case, strategy, overrides) for strategy, cases in GOLDEN_CASES.items() for case, overrides in cases.items()]


def test_every_registered_strategy_has_a_recorded_golden_case():
    """A strategy added to the registry without a golden case (and its recorded output) fails here."""
    assert sorted(GOLDEN_CASES) == sorted(STRATEGIES)
    recorded = json.loads(GOLDEN.read_text())
    assert all(cases and set(cases) <= set(recorded) for cases in GOLDEN_CASES.values())


@pytest.fixture(scope="module")
def reward_transformer(tiny_models, tmp_path_factory) -> Path:
    from pipeline.engines.hf import load_tokenizer
    from pipeline.engines.reward_transformer import RewardTransformer
    from pipeline.training.reward_channel import train_reward_channel
    from tests.test_reward_transformer import synthetic_pairs

    path = tmp_path_factory.mktemp("golden-rt") / "rt"
    tok = load_tokenizer(str(tiny_models["generator"]))
    rt = RewardTransformer.from_pretrained(str(tiny_models["generator"]), hidden_size=16)
    train_reward_channel(rt, synthetic_pairs(tok, 8), tok.pad_token_id, epochs=1, batch_size=4, progress=False)
    rt.save_pretrained(str(path), tok)
    return path


def build_pairs(tiny_models, reward_transformer, tmp_path, strategy: str, overrides: list[str]) -> list[dict]:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in GOOD_PROMPTS])
    generator = reward_transformer if strategy == "sla" else tiny_models["generator"]
    args = ["--config", "configs/demo.yaml", "--strategy", strategy, "--prompts", str(prompts),
            "--output", str(tmp_path / "out"), "--num-samples", "3", "--max-new-tokens", "10", "--seed", "7",
            "--set", f"models.generator={generator}", "--set", f"models.reward={tiny_models['reward']}",
            "--set", f"models.draft={tiny_models['draft']}", "--set", "runtime.local=true",
            "--set", "data.shard_size=4", "--set", "runtime.prompts_per_batch=2", "--no-progress"]
    for item in overrides:
        args += ["--set", item]
    assert main(args) == 0
    rows = []
    for part in OutputStore.open_build(str(tmp_path / "out")).committed_parts():
        rows += pq.read_table(part).to_pylist()
    keys = ("prompt_id", "chosen", "rejected", "chosen_score", "rejected_score", "num_candidates",
            "generated_tokens")
    return sorted(({k: r[k] for k in keys} for r in rows), key=lambda r: r["prompt_id"])


@pytest.mark.slow
@pytest.mark.parametrize("case,strategy,overrides", CASES, ids=[c[0] for c in CASES])
def test_pairs_equal_the_recorded_ones(case, strategy, overrides, tiny_models, reward_transformer, tmp_path):
    pairs = build_pairs(tiny_models, reward_transformer, tmp_path, strategy, overrides)
    assert len(pairs) >= 4, f"{case}: too few pairs to pin anything down"
    recorded = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    if os.environ.get("GOLDEN_UPDATE"):
        recorded[case] = pairs
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
        return
    assert case in recorded, f"{case}: no recorded output; run with GOLDEN_UPDATE=1 once"
    expected = recorded[case]
    assert [p["prompt_id"] for p in pairs] == [p["prompt_id"] for p in expected]
    for got, want in zip(pairs, expected):
        for key in ("chosen", "rejected", "num_candidates", "generated_tokens"):
            assert got[key] == want[key], f"{case} {got['prompt_id']}: {key} differs"
        for key in ("chosen_score", "rejected_score"):
            assert math.isclose(got[key], want[key], rel_tol=1e-5, abs_tol=1e-6), f"{case}: {key} differs"
