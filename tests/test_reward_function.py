"""Rewards from a Python function (models.reward: module:function, TRL GRPOTrainer signature):
FunctionScorer, the input's other columns reaching it row by row and kept in the output, partial
responses flagged, Best-of-N and speculative rejection through the build job, plan-time errors."""

import json
import math

import pyarrow.parquet as pq
import pytest

from jobs.build_dataset import main
from pipeline.data.store import OutputStore
from pipeline.engines.rewards import FunctionScorer, is_reward_function
from tests.conftest import write_jsonl

CALLS: list[dict] = []
"""Every call of ``letter_reward`` in this process (the in-process builds run it here)."""


def letter_reward(prompts, completions, letter, weights=None, partial=None, **kwargs):
    """A reward function as TRL calls one: the count of ``letter`` in the completion times the row's
    ``weights["scale"]``, minus 100 for a partial completion (so a test can tell which was which)."""
    CALLS.append({"prompts": list(prompts), "completions": list(completions), "letter": list(letter),
                  "weights": list(weights or []), "partial": list(partial or []), "other": sorted(kwargs)})
    out = []
    for text, ch, w, cut in zip(completions, letter, weights or [None] * len(completions), partial):
        text = text if isinstance(text, str) else text[0]["content"]
        scale = (w or {}).get("scale") or 1.0
        out.append(text.count(ch) * scale - (100.0 if cut else 0.0) + len(text) * 1e-3)
    return out


def none_reward(prompts, completions, **kwargs):
    return [None] * len(completions)


def short_reward(prompts, completions, **kwargs):
    return [1.0]


def test_spec_is_told_from_a_model_path():
    assert is_reward_function("pipeline.judge:ifeval_reward")
    assert is_reward_function("tests.test_reward_function:letter_reward")
    for model in ("HuggingFaceTB/SmolLM2-135M", ".cache/real-models/reward", "/abs/dir", "s3://b/k", "", "a:b:c"):
        assert not is_reward_function(model), model


def test_function_scorer_passes_columns_partial_and_conversations():
    CALLS.clear()
    scorer = FunctionScorer("tests.test_reward_function:letter_reward")
    scores = scorer.score(["p1", [{"role": "user", "content": "p2"}]], ["aab", "a"], finished=[True, False],
                          columns=[{"letter": "a", "weights": {"scale": 2.0}}, {"letter": "b"}])
    assert scores == pytest.approx([4.003, -100 + 0.001])
    call = CALLS[-1]
    assert call["completions"] == ["aab", [{"role": "assistant", "content": "a"}]]
    assert call["letter"] == ["a", "b"] and call["weights"] == [{"scale": 2.0}, None]
    assert call["partial"] == [False, True]
    # Sessions: rows are prompt index * num_samples + sample, as the generator's.
    scorer.open("s", ["p1", "p2"], 2, columns=[{"letter": "x"}, {"letter": "y"}])
    assert scorer.extend("s", [3, 0], ["yy", "xxx"], finished=[False, True]) == pytest.approx(
        [2 - 100 + 0.002, 3 + 0.003])
    assert CALLS[-1]["letter"] == ["y", "x"] and CALLS[-1]["prompts"] == ["p2", "p1"]
    with pytest.raises(ValueError, match="outside"):
        scorer.extend("s", [4], ["z"])
    scorer.close("s")
    assert scorer.stats()["open_sessions"] == 0


def test_function_scorer_turns_none_into_nan_and_refuses_a_wrong_count():
    assert all(math.isnan(s) for s in FunctionScorer("tests.test_reward_function:none_reward").score(["p"] * 2, ["a", "b"]))
    with pytest.raises(ValueError, match="returned 1 values for 2 completions"):
        FunctionScorer("tests.test_reward_function:short_reward").score(["p"] * 2, ["a", "b"])


ROWS = [{"prompt": f"Write about the number {i}.", "letter": "ab"[i % 2],
         # A nested column whose struct fields differ between rows and shards (as IFEval's kwargs do).
         "weights": {"scale": 1.0 + i} if i % 3 else {"note": f"row {i}"}, "key": i} for i in range(7)]


def build(tiny_models, tmp_path, strategy, *extra):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    out = tmp_path / f"out-{strategy}"
    args = ["--config", "configs/demo.yaml", "--strategy", strategy, "--prompts", str(prompts), "--output", str(out),
            "--set", f"models.generator={tiny_models['generator']}",
            "--set", "models.reward=tests.test_reward_function:letter_reward",
            "--set", "runtime.local=true", "--max-new-tokens", "24", "--num-samples", "4",
            "--set", "data.shard_size=3", "--no-progress", *extra]
    CALLS.clear()
    code = main(args)
    return code, out


@pytest.mark.parametrize("strategy", ["best_of_n", "sbon"])
def test_build_scores_with_the_function_and_keeps_the_columns(tiny_models, tmp_path, strategy):
    extra = ["--set", "strategy.decision_token=8", "--set", "strategy.rejection_rate=0.5"] if strategy == "sbon" else []
    code, out = build(tiny_models, tmp_path, strategy, *extra)
    assert code == 0
    rows = [r for part in OutputStore(str(out)).committed_parts() for r in pq.read_table(part).to_pylist()]
    by_key = {r["key"]: r for r in rows}
    assert len(by_key) == len(rows) and set(by_key) <= set(range(7)) and rows
    for r in rows:
        src = ROWS[r["key"]]
        assert r["raw_prompt"] == src["prompt"] and r["letter"] == src["letter"]
        # The nested column keeps its values; keys other rows have come back as None (one schema).
        assert {k: v for k, v in r["weights"].items() if v is not None} == src["weights"]
        # The scores are the function's on the final texts (no partial penalty on either side).
        scale = src["weights"].get("scale") or 1.0
        for side in ("chosen", "rejected"):
            want = r[side].count(src["letter"]) * scale + len(r[side]) * 1e-3
            assert r[f"{side}_score"] == pytest.approx(want)
    # Every call got its rows' own columns, and partial flags only where the strategy scores prefixes.
    flags = [p for call in CALLS for p in call["partial"]]
    assert (True in flags) == (strategy == "sbon") and False in flags
    for call in CALLS:
        assert call["other"] == ["key"]  # the input's remaining column, passed on as TRL does
        for prompt, letter in zip(call["prompts"], call["letter"]):
            assert ROWS[int(prompt.split()[-1].rstrip("."))]["letter"] == letter
    manifest = json.loads((out / "_manifest.json").read_text())
    assert set(manifest["extra_columns"]) == {"letter", "weights", "key"}


def test_partial_scores_stop_rows_at_the_decision_token(tiny_models, tmp_path):
    """A partial score of -100 ranks every unfinished row below finished ones; with alpha 0.5 half of
    each prompt's live rows stop at tau: the build records rows stopped early."""
    code, out = build(tiny_models, tmp_path, "sbon", "--set", "strategy.decision_token=6",
                      "--set", "strategy.rejection_rate=0.5")
    assert code == 0
    rows = [r for part in OutputStore(str(out)).committed_parts() for r in pq.read_table(part).to_pylist()]
    assert sum(r["stopped_early"] for r in rows) > 0


def test_extra_columns_setting_selects_and_checks_names(tiny_models, tmp_path, capsys):
    code, out = build(tiny_models, tmp_path, "best_of_n", "--set", "data.extra_columns=[letter, weights]")
    assert code == 0
    assert all("key" not in call["other"] for call in CALLS)
    names = pq.read_table(OutputStore(str(out)).committed_parts()[0]).schema.names
    assert "letter" in names and "weights" in names and "key" not in names
    code, _ = build(tiny_models, tmp_path, "best_of_n", "--set", "data.extra_columns=[letters]", "--overwrite")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "no column 'letters' (data.extra_columns)" in err[-1]


def test_a_column_named_like_an_output_column_is_left_out_with_a_note(tiny_models, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a b", "chosen": "x", "letter": "a"},
                                                 {"prompt": "c d", "chosen": "y", "letter": "b"}])
    code = main(["--config", "configs/demo.yaml", "--strategy", "best_of_n", "--prompts", str(prompts),
                 "--output", str(tmp_path / "o"), "--set", f"models.generator={tiny_models['generator']}",
                 "--set", "models.reward=tests.test_reward_function:letter_reward", "--set", "runtime.local=true",
                 "--max-new-tokens", "8", "--num-samples", "2", "--no-progress"])
    assert code == 0
    assert "column(s) chosen not kept in the output" in capsys.readouterr().err
    manifest = json.loads((tmp_path / "o" / "_manifest.json").read_text())
    assert manifest["extra_columns_left_out"] == ["chosen"] and "letter" in manifest["extra_columns"]


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_here:fn", "cannot import 'no_such_module_here' (ModuleNotFoundError"),
    ("tests.test_reward_function:nothing", "has no function 'nothing'"),
])
def test_a_bad_reward_function_is_one_line_and_exit_2(tiny_models, tmp_path, capsys, spec, message):
    prompts = write_jsonl(tmp_path / "p.jsonl", ROWS[:2])
    code = main(["--config", "configs/demo.yaml", "--prompts", str(prompts), "--output", str(tmp_path / "o"),
                 "--set", f"models.generator={tiny_models['generator']}", "--set", f"models.reward={spec}",
                 "--set", "runtime.local=true", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].count(message) == 1 and "models.reward" in err[0]
    assert not (tmp_path / "o").exists()


def test_a_reward_function_whose_columns_the_input_lacks_is_refused_at_plan_time(tiny_models, tmp_path, capsys):
    """letter_reward needs a ``letter`` column: an input without one is refused in one line, exit 2,
    before any model loads and before the output exists (issue 49: it used to run until the first
    reward call, then die with a TypeError)."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": r["prompt"], "key": r["key"]} for r in ROWS[:2]])
    code = main(["--config", "configs/demo.yaml", "--prompts", str(prompts), "--output", str(tmp_path / "o"),
                 "--set", f"models.generator={tiny_models['generator']}",
                 "--set", "models.reward=tests.test_reward_function:letter_reward",
                 "--set", "runtime.local=true", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].endswith("models.reward: tests.test_reward_function:letter_reward needs the input column(s) letter, "
                           f"which {prompts} lacks (its other columns: key)")
    assert not (tmp_path / "o").exists()


def test_a_column_of_empty_dicts_is_kept_as_json_text(tiny_models, tmp_path):
    """IFEval's kwargs of instructions without arguments are [{}]: a struct with no fields, which
    Parquet cannot hold; when no row gives it a field the column is written as JSON text."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a b", "letter": "a", "kwargs": [{}]},
                                                 {"prompt": "c d", "letter": "b", "kwargs": [{}, {}]}])
    code = main(["--config", "configs/demo.yaml", "--strategy", "best_of_n", "--prompts", str(prompts),
                 "--output", str(tmp_path / "o"), "--set", f"models.generator={tiny_models['generator']}",
                 "--set", "models.reward=tests.test_reward_function:letter_reward", "--set", "runtime.local=true",
                 "--max-new-tokens", "8", "--num-samples", "3", "--no-progress"])
    assert code == 0
    rows = [r for part in OutputStore(str(tmp_path / "o")).committed_parts() for r in pq.read_table(part).to_pylist()]
    assert rows and all(json.loads(r["kwargs"]) in ([{}], [{}, {}]) for r in rows)
    assert json.loads((tmp_path / "o" / "_manifest.json").read_text())["extra_columns"]["kwargs"] == "json text"
