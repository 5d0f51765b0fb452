"""Quality figures from the IFEval judge: pipeline.evaluation's response and pair figures, and
jobs.evaluate on a build's committed pairs (and on decoding methods, with tiny models)."""

from __future__ import annotations

import json
import math

import pytest

from jobs.evaluate import main
from pipeline.data.schema import ExtraColumns
from pipeline.data.store import OutputStore
from pipeline.evaluation import evaluate_pairs, evaluate_responses, instructions

NO_COMMA = (["punctuation:no_comma"], [{}])
SHORT_LOWER = (["change_case:english_lowercase", "length_constraints:number_words"],
               [{}, {"num_words": 8, "relation": "less than"}])
# prompt, its instructions, chosen, rejected
PAIRS = [
    ("Say hi. Do not use commas.", NO_COMMA, "hi there", "hi, there"),                    # told apart, right
    ("Say bye. Do not use commas.", NO_COMMA, "bye, now", "bye now"),                      # told apart, wrong
    ("Describe a cat in lowercase briefly.", SHORT_LOWER, "the cat sat on the mat",
     "The cat sat on the mat with a big dog"),  # right
    ("Name a fruit in lowercase briefly.", SHORT_LOWER, "Apple", "Pear"),                  # a tie: not told apart
]


def pair_rows():
    return [{"prompt": p, "instruction_id_list": ids, "kwargs": kw, "chosen": c, "rejected": r}
            for p, (ids, kw), c, r in PAIRS]


def test_evaluate_pairs_figures():
    """IFEval strict as is: "Apple" is not lowercase, and langdetect calls very short texts other
    languages (so a lowercase check needs a sentence)."""
    report = evaluate_pairs(pair_rows())
    # chosen: 1/1, 0/1, 2/2, 1/2 followed; rejected: 0/1, 1/1, 0/2, 1/2.
    assert report["chosen"] == {"prompt_level_strict": 2 / 4, "instruction_level_strict": 4 / 6}
    assert report["rejected"] == {"prompt_level_strict": 1 / 4, "instruction_level_strict": 2 / 6}
    assert report["pairs"] == 4 and report["pairs_told_apart"] == 3 and report["pair_accuracy"] == 2 / 3


def test_evaluate_pairs_none_told_apart_and_messages():
    rows = [{"prompt": [{"role": "user", "content": "p"}], "instruction_id_list": NO_COMMA[0], "kwargs": NO_COMMA[1],
             "chosen": [{"role": "assistant", "content": "a b"}], "rejected": [{"role": "assistant", "content": "c"}]}]
    report = evaluate_pairs(rows)
    assert report["chosen"]["prompt_level_strict"] == 1.0 and report["pairs_told_apart"] == 0
    assert math.isnan(report["pair_accuracy"])


def test_evaluate_responses_is_a_single_sample_accuracy():
    rows = [("hi there", *NO_COMMA), ("hi, there", *NO_COMMA), ("the cat sat on the mat", *SHORT_LOWER)]
    assert evaluate_responses(rows) == {"responses": 3, "prompt_level_strict": 2 / 3,
                                        "instruction_level_strict": 3 / 4}
    with pytest.raises(ValueError, match="'keywords:nosuch'"):
        evaluate_responses([("x", ["keywords:nosuch"], [{}])])


def test_instructions_reads_json_text_columns():
    assert instructions({"prompt": "p"}) is None
    assert instructions({"instruction_id_list": '["punctuation:no_comma"]', "kwargs": "[{}]"}) == NO_COMMA
    assert instructions({"instruction_id_list": ["detectable_format:title"], "kwargs": [None]}) == \
        (["detectable_format:title"], [{}])
    with pytest.raises(ValueError, match="malformed"):
        instructions({"instruction_id_list": "[not json", "kwargs": "[{}]"})


def write_build(root, with_instructions: bool, finished: bool = True, shards: int = 2):
    """A build's output through the output store: PAIRS split over ``shards`` committed shards, the
    instruction columns kept as a build keeps them (data.extra_columns), and _SUCCESS."""
    store = OutputStore(str(root))
    extra = ExtraColumns()
    rows = []
    for i, (prompt, (ids, kwargs), chosen, rejected) in enumerate(PAIRS):
        row = {"prompt_id": f"id{i}", "prompt": prompt, "raw_prompt": prompt, "chosen": chosen, "rejected": rejected,
               "chosen_score": 1.0, "rejected_score": 0.0, "strategy": "bon", "num_candidates": 2,
               "generated_tokens": 4, "source_row": i}
        if with_instructions:
            row.update(instruction_id_list=ids, kwargs=kwargs)
        rows.append(row)
    if with_instructions:
        extra.add([{"instruction_id_list": r["instruction_id_list"], "kwargs": r["kwargs"]} for r in rows])
    size = -(-len(rows) // shards)
    for shard in range(shards):
        store.commit_shard(shard, rows[shard * size:(shard + 1) * size], [], f"fp{shard}", "cfg",
                           extra=extra if with_instructions else None)
    if finished:
        store.write_success({"pairs": len(rows)})
    return store


def test_job_judges_a_builds_pairs(tmp_path, capsys):
    out = tmp_path / "build"
    write_build(out, with_instructions=True)
    (out / "train-00007.parquet").write_bytes((out / "train-00000.parquet").read_bytes())  # no marker: not read
    report_file = tmp_path / "report.json"
    assert main(["--pairs", str(out), "--report", str(report_file)]) == 0
    printed = capsys.readouterr().out
    assert "chosen" in printed and "66.7%" in printed and "pair accuracy 66.7%" in printed
    report = json.loads(report_file.read_text())
    assert report["pairs"] == 4 and report["pairs_told_apart"] == 3 and report["pair_accuracy"] == 2 / 3
    assert report["chosen"]["instruction_level_strict"] == 4 / 6


def test_job_joins_instructions_from_the_prompt_file(tmp_path, capsys):
    out = tmp_path / "build"
    write_build(out, with_instructions=False)
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"key": i, "prompt": p, "instruction_id_list": ids, "kwargs": kw} for i, (p, (ids, kw), _, _) in
             enumerate(PAIRS)]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    report_file = tmp_path / "report.json"
    assert main(["--pairs", str(out), "--prompts", str(prompts), "--report", str(report_file)]) == 0
    assert json.loads(report_file.read_text())["pair_accuracy"] == 2 / 3
    capsys.readouterr()

    # A pair whose prompt the file lacks: one line naming it, exit 2.
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines[:3]))
    assert main(["--pairs", str(out), "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {out}: pair id3: its prompt 'Name a fruit") and str(prompts) in err
    assert err.count("\n") == 1
    # No instruction columns and no prompt file.
    assert main(["--pairs", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no instruction_id_list/kwargs columns; pass --prompts" in err and err.count("\n") == 1
    # A prompt file without the columns, or none at all.
    (tmp_path / "plain.jsonl").write_text(json.dumps({"prompt": PAIRS[0][0]}) + "\n")
    for path in (tmp_path / "plain.jsonl", tmp_path / "missing.jsonl"):
        assert main(["--pairs", str(out), "--prompts", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and str(path) in err and err.count("\n") == 1


def test_job_reads_committed_shards_only(tmp_path, capsys):
    out = tmp_path / "build"
    write_build(out, with_instructions=True, finished=False)
    assert main(["--pairs", str(out)]) == 2
    err = capsys.readouterr().err
    assert "not a finished build" in err and err.count("\n") == 1
    (out / "_markers" / "part-00001.json").unlink()  # shard 1 not committed: its two pairs are not read
    report_file = tmp_path / "report.json"
    assert main(["--pairs", str(out), "--allow-partial", "--report", str(report_file)]) == 0
    report = json.loads(report_file.read_text())
    assert report["pairs"] == 2 and report["pairs_told_apart"] == 2 and report["pair_accuracy"] == 0.5
    capsys.readouterr()
    assert main(["--pairs", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'nothing'}: not a build's output") and err.count("\n") == 1
    assert not (tmp_path / "nothing").exists()  # reading a build never creates one


def test_job_unknown_instruction_is_one_line(tmp_path, capsys):
    out = tmp_path / "build"
    store = OutputStore(str(out))
    extra = ExtraColumns()
    row = {"prompt_id": "x", "prompt": "p", "raw_prompt": "p", "chosen": "a", "rejected": "b",
           "instruction_id_list": ["keywords:nosuch"], "kwargs": [{"keyword": "x"}]}
    extra.add([{"instruction_id_list": row["instruction_id_list"], "kwargs": row["kwargs"]}])
    store.commit_shard(0, [row], [], "fp", "cfg", extra=extra)
    store.write_success({})
    assert main(["--pairs", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {out}: instruction 'keywords:nosuch': unknown") and err.count("\n") == 1


def test_job_compares_methods_judged_by_ifeval(tiny_models, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    lines = [{"prompt": p, "instruction_id_list": ids, "kwargs": kw} for p, (ids, kw), _, _ in PAIRS[:2]]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    report_file = tmp_path / "methods.json"
    assert main(["--generator", str(tiny_models["generator"]), "--reward", str(tiny_models["reward"]),
                 "--prompts", str(prompts), "--methods", "greedy,temperature,sbon", "--max-new-tokens", "6",
                 "--num-samples", "2", "--report", str(report_file)]) == 0
    report = json.loads(report_file.read_text())
    assert report["judge"] == "ifeval-strict" and list(report["methods"]) == ["greedy", "temperature", "sbon"]
    greedy = report["methods"]["greedy"]
    assert greedy["tie"] == 1.0 and 0 <= greedy["instruction_level_strict"] <= 1
    assert "IFEval" in capsys.readouterr().out
    # Prompts without instructions cannot be judged: one line, exit 2.
    prompts.write_text(json.dumps({"prompt": "Say hi."}) + "\n")
    assert main(["--generator", str(tiny_models["generator"]), "--reward", str(tiny_models["reward"]),
                 "--prompts", str(prompts), "--methods", "greedy"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # beside load progress bars
    assert len(errors) == 1 and errors[0].startswith(f"error: {prompts}: no column 'instruction_id_list'")
    assert main(["--generator", str(tiny_models["generator"]), "--prompts", str(prompts)]) == 2
    assert capsys.readouterr().err == "error: --reward: required with --generator\n"


def test_a_build_rewarded_by_ifeval_then_judged(tiny_models, tmp_path, capsys):
    """End to end: a speculative-rejection build with the IFEval reward function
    (models.reward=pipeline.judge:ifeval_reward) keeps the instruction columns; judged by the same
    checkers, its chosen response beats its rejected one in every pair (a pair needs chosen >
    rejected by the reward, and a partial rejected response's reward bounds its strict score).
    Instructions on which the tiny model's random text varies: word and letter counts."""
    from jobs.build_dataset import main as build

    words = {"num_words": 4, "relation": "at least"}
    letters = {"letter": "e", "let_frequency": 2, "let_relation": "at least"}
    few = {"letter": "i", "let_frequency": 2, "let_relation": "less than"}
    asked = [(["length_constraints:number_words"], [words]), (["keywords:letter_frequency"], [letters]),
             (["keywords:letter_frequency", "length_constraints:number_words"], [few, words]),
             (["length_constraints:number_words", "punctuation:no_comma"], [words, {}])]
    rows = [{"key": i, "prompt": f"{task} Answer in a few words.", "instruction_id_list": ids, "kwargs": kwargs}
            for i, (task, (ids, kwargs)) in enumerate(zip(["Describe a cat.", "Name a season.", "Say hello.",
                                                            "Describe the sea.", "Name a color.", "Say goodbye."],
                                                           asked * 2))]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    assert build(["--config", "configs/demo.yaml", "--prompts", str(prompts), "--output", str(out),
                  "--strategy", "sbon", "--set", "strategy.decision_token=4",
                  "--set", f"models.generator={tiny_models['generator']}",
                  "--set", "models.reward=pipeline.judge:ifeval_reward", "--set", "runtime.local=true",
                  "--set", "data.extra_columns=[instruction_id_list, kwargs]", "--max-new-tokens", "12",
                  "--num-samples", "8", "--no-progress"]) == 0
    capsys.readouterr()
    report_file = tmp_path / "report.json"
    assert main(["--pairs", str(out), "--report", str(report_file)]) == 0
    report = json.loads(report_file.read_text())
    manifest = json.loads((out / "_manifest.json").read_text())
    assert report["pairs"] == manifest["pairs"] >= 1
    assert report["pairs_told_apart"] == report["pairs"] and report["pair_accuracy"] == 1.0
    # The same figures when the instructions come from the prompt file instead.
    assert main(["--pairs", str(out), "--prompts", str(prompts), "--report", str(tmp_path / "joined.json")]) == 0
    assert json.loads((tmp_path / "joined.json").read_text()) == {**report, "prompts": str(prompts)}
