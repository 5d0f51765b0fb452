"""The DPO handoff: pairs Parquet in the contract's shape -> real TRL steps -> a saved policy."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from jobs.make_tiny_models import make_tiny_models
from jobs.train_reward_transformer import main
from pipeline.errors import InputError
from pipeline.training.dpo import load_pairs

SUBJECTS = ["the lamp", "the battery", "the blender", "the camera", "the app", "the keyboard", "the jacket",
            "the delivery"]


@pytest.fixture(scope="module")
def generator(tmp_path_factory) -> Path:
    return make_tiny_models(tmp_path_factory.mktemp("models"))["generator"]


def write_pairs(directory: Path, rows: int = 8) -> Path:
    """A build output in the contract's shape: extra columns, a _rejects/ dir, and an empty third
    shard (what a shard whose prompts were all rejected leaves)."""
    directory.mkdir(parents=True, exist_ok=True)
    table = pa.table({
        "prompt_id": [f"{i:016x}" for i in range(rows)],
        "prompt": [f"<s><|user|>Write a review of {SUBJECTS[i % len(SUBJECTS)]}.\n<|assistant|>" for i in range(rows)],
        "chosen": [f"{SUBJECTS[i % len(SUBJECTS)].capitalize()} works great, and I would buy it." for i in range(rows)],
        "rejected": [f"{SUBJECTS[i % len(SUBJECTS)].capitalize()} broke badly." for i in range(rows)],
        "chosen_score": pa.array([1.0 + i for i in range(rows)], pa.float64()),
        "rejected_score": pa.array([-1.0 - i for i in range(rows)], pa.float64()),
        "strategy": ["sbon"] * rows,
    })
    half = rows // 2
    pq.write_table(table.slice(0, half), directory / "part-00000.parquet")
    pq.write_table(table.slice(half), directory / "part-00001.parquet")
    pq.write_table(table.schema.empty_table(), directory / "part-00002.parquet")
    (directory / "_rejects").mkdir(exist_ok=True)
    return directory


def test_load_pairs_keeps_only_trl_columns(tmp_path):
    pairs = write_pairs(tmp_path / "pairs")
    for uri in (str(pairs), str(pairs / "part-*.parquet")):
        ds = load_pairs(uri)
        assert ds.column_names == ["prompt", "chosen", "rejected"]
        assert len(ds) == 8
    assert len(load_pairs(str(pairs / "part-00001.parquet"))) == 4


def test_load_pairs_input_errors(tmp_path):
    tmp_path.joinpath("pairs").mkdir()
    pq.write_table(pa.table({"prompt": ["p"], "chosen": ["c"]}), tmp_path / "pairs" / "part-00000.parquet")
    with pytest.raises(InputError, match="missing column.*rejected"):
        load_pairs(str(tmp_path / "pairs"))
    empty = write_pairs(tmp_path / "empty", rows=0)
    with pytest.raises(InputError, match="0 rows"):
        load_pairs(str(empty))


def test_train_job_updates_the_policy(tmp_path, generator, capsys):
    from transformers import AutoModelForCausalLM

    pairs = write_pairs(tmp_path / "pairs")
    output = tmp_path / "policy"
    code = main(["--pairs", str(pairs), "--generator", str(generator), "--output", str(output), "--dpo",
                 "--dpo-steps", "2", "--batch-size", "4", "--dpo-learning-rate", "1e-3", "--max-steps", "1",
                 "--hidden-size", "8", "--no-progress"])
    assert code == 0
    captured = capsys.readouterr()
    assert "dpo_steps: 2" in captured.out and f"output: {output}" in captured.out
    # Without tqdm, the round still says how far it is.
    assert "DPO step 2/2: loss" in captured.err

    trained = AutoModelForCausalLM.from_pretrained(output)
    initial = AutoModelForCausalLM.from_pretrained(generator)
    assert trained.state_dict().keys() == initial.state_dict().keys()
    assert (output / "tokenizer_config.json").exists()
    # DPO moved the implicit reward margin: log pi(chosen) - log pi(rejected) grew against the
    # reference (the initial policy) on the training pairs.
    from pipeline.engines.hf import load_tokenizer

    tok = load_tokenizer(str(generator))
    ds = pq.read_table(pairs / "part-00000.parquet").to_pylist() + pq.read_table(pairs / "part-00001.parquet").to_pylist()

    def margin(model) -> float:
        return sum(response_logp(model, tok, r["prompt"], r["chosen"]) - response_logp(model, tok, r["prompt"], r["rejected"])
                   for r in ds) / len(ds)

    assert margin(trained) > margin(initial) + 1e-3


@torch.no_grad()
def response_logp(model, tok, prompt: str, response: str) -> float:
    """log pi(response | prompt), summed over the response's tokens."""
    p = tok(prompt, add_special_tokens=False).input_ids
    r = tok(response, add_special_tokens=False).input_ids
    logp = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1:-1].log_softmax(-1)  # [len(r), V]
    return float(logp.gather(-1, torch.tensor(r)[:, None]).sum())


def test_missing_pairs_is_a_one_line_user_error(tmp_path, capsys):
    missing = tmp_path / "nope"
    code = main(["--pairs", str(missing), "--generator", "unused", "--output", str(tmp_path / "out")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(missing) in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_dpo_loop_benchmark_measures_the_gain_and_reuses_its_steps(tmp_path, tiny_models):
    """benchmarks.dpo_loop end to end on the tiny models: pairs on IFEval rows, a DPO round, both
    policies judged on the same held-out prompts with the same seeds, the gain's bootstrap
    interval; a rerun reuses every step's result instead of redoing it."""
    from benchmarks.dpo_loop import main as dpo_loop

    root = Path(__file__).resolve().parents[1] / "configs" / "prompts"
    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join((root / "ifeval-train.jsonl").read_text().splitlines(True)[:4]))
    held_out.write_text("".join((root / "ifeval-eval.jsonl").read_text().splitlines(True)[:3]))
    argv = ["--config", str(root.parent / "real.yaml"), "--strategy", "sbon", "--set", f"models.generator={tiny_models['generator']}",
            "--set", f"models.reward=[pipeline.judge:ifeval_reward, {tiny_models['reward']}]",
            "--set", "runtime.local=true", "--set", "sampling.chat_template=never", "--set", "strategy.decision_token=8",
            "--num-samples", "4", "--max-new-tokens", "16", "--eval-max-new-tokens", "16", "--eval-samples", "2",
            "--train-prompts", str(train), "--eval-prompts", str(held_out), "--batch-size", "2", "--max-length", "96",
            "--learning-rate", "1e-3", "--resamples", "300", "--output", str(tmp_path / "loop")]
    assert dpo_loop([*argv, "--json", str(tmp_path / "first.json")]) == 0
    first = json.loads((tmp_path / "first.json").read_text())
    assert first["pair_build"]["prompts"] == 4 and first["dpo"]["steps"] >= 1
    for name in ("before", "after"):
        assert first[name]["prompts"] == 3 and first[name]["responses"] == 6
        assert [len(v) for v in first[name]["verdicts"]] == [2, 2, 2]
    for key in ("prompt_level_strict", "instruction_level_strict"):
        gain = first["gain"][key]
        assert gain["gain"] == pytest.approx(first["after"][key] - first["before"][key])
        assert gain["low"] <= gain["high"]
    assert (tmp_path / "loop" / "policy" / "config.json").exists()

    # Beyond brevity: the same gain over only the instructions a one-word reply fails.
    hard = [i for i, passes in enumerate(first["brief_reply_passes"]) if not all(passes)]
    if first["gain"]["beyond_brevity"] is not None:
        def level(verdicts):
            kept = [[v for v, easy in zip(r, first["brief_reply_passes"][i]) if not easy] for i in hard for r in verdicts[i]]
            return sum(map(sum, kept)) / sum(map(len, kept))
        assert first["gain"]["beyond_brevity"]["prompts"] == len(hard)
        assert first["gain"]["beyond_brevity"]["instruction_level_strict"]["gain"] == pytest.approx(
            level(first["after"]["verdicts"]) - level(first["before"]["verdicts"]))

    # The rerun reuses every step; --against a run of the same policy: a gain of exactly 0.
    assert dpo_loop([*argv, "--json", str(tmp_path / "second.json"), "--against", str(tmp_path / "first.json")]) == 0
    second = json.loads((tmp_path / "second.json").read_text())
    assert second["pair_build"]["pairs_this_run"] == 0
    assert {k: second[k] for k in ("dpo", "before", "after", "gain")} == {k: first[k] for k in ("dpo", "before", "after", "gain")}
    assert second["against"]["strategy"] == "sbon"
    assert second["against"]["prompt_level_strict"]["gain"] == 0 == second["against"]["instruction_level_strict"]["gain"]

    # Another held-out set cannot be compared: one line, exit 2.
    first["after"]["verdicts"] = first["after"]["verdicts"][:2]
    (tmp_path / "other.json").write_text(json.dumps(first))
    with pytest.raises(SystemExit) as stop:
        dpo_loop([*argv, "--against", str(tmp_path / "other.json")])
    assert stop.value.code == 2


def test_brief_reply_passes_the_instructions_brevity_satisfies():
    """The held-out instructions a one-word reply passes: caps (fewer than N words, no commas), not
    demands (a postscript, N highlighted sections, at least N words)."""
    from benchmarks.dpo_loop import brief_reply_passes, beyond_brevity

    held_out = Path(__file__).resolve().parents[1] / "configs" / "prompts" / "ifeval-eval.jsonl"
    rows = [json.loads(line) for line in held_out.read_text().splitlines()]
    passes = brief_reply_passes(str(held_out))
    assert len(passes) == len(rows) and [len(p) for p in passes] == [len(r["instruction_id_list"]) for r in rows]
    by_id = {}
    for row, verdicts in zip(rows, passes):
        for instruction, kwargs, ok in zip(row["instruction_id_list"], row["kwargs"], verdicts):
            by_id.setdefault((instruction, (kwargs or {}).get("relation")), set()).add(ok)
    assert by_id.get(("punctuation:no_comma", None), {True}) == {True}
    assert by_id.get(("detectable_content:postscript", None), {False}) == {False}
    assert by_id.get(("length_constraints:number_words", "at least"), {False}) == {False}
    assert set().union(*by_id.values()) == {True, False}  # some instructions pass a one-word reply, some fail it
    verdicts = [[[True] * len(p)] for p in passes]
    hard, kept = beyond_brevity(verdicts, passes)
    assert kept == [i for i, p in enumerate(passes) if not all(p)]
    assert [len(h[0]) for h in hard] == [sum(not x for x in passes[i]) for i in kept]


def test_dpo_loop_bad_set_is_a_one_line_user_error(tmp_path, capsys):
    from benchmarks.dpo_loop import main as dpo_loop

    with pytest.raises(SystemExit) as stop:
        dpo_loop(["--set", "sampling.chat_template=bogus", "--output", str(tmp_path / "loop")])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: sampling.chat_template") and "Traceback" not in "\n".join(err)
    assert not (tmp_path / "loop").exists()
