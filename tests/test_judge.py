"""The IFEval judge (pipeline.judge): lm-eval's checkers as IFEval strict calls them, the partial
("broken for good") semantics, the GRPO reward function, and our prompt sets (jobs.make_ifeval_prompts)."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.judge import (PUNKT_INSTRUCTIONS, SUPPORTED, accuracy, accuracy_gain, broken, check, ifeval_reward,
                            registry)

ROOT = Path(__file__).resolve().parents[1]

# (instruction id, kwargs, a response that follows it, one that does not)
KNOWN = [
    ("punctuation:no_comma", {}, "Plants need water and light.", "Plants need water, light and care."),
    ("change_case:english_lowercase", {}, "plants need water and light to grow well in the garden.",
     "Plants need water and light to grow well in the garden."),
    ("change_case:english_capital", {}, "PLANTS NEED WATER AND LIGHT TO GROW WELL IN THE GARDEN.",
     "PLANTS NEED WATER AND LIGHT TO GROW WELL IN THE GARDEn."),
    ("startend:quotation", {}, '"Plants need water."', 'Plants need "water."'),
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, "Water daily. Any other questions?",
     "Any other questions? Water daily."),
    ("detectable_format:title", {}, "<<Garden tips>>\nWater daily.", "Garden tips\nWater daily."),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "Tips:\n* Water daily.\n* Give light.",
     "Tips:\n* Water daily.\n* Give light.\n* Add soil."),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Water daily.\nP.S. Give light too.",
     "Water daily. Give light too."),
    ("keywords:existence", {"keywords": ["light", "water"]}, "Give them Water and LIGHT.", "Give them water."),
    ("keywords:forbidden_words", {"forbidden_words": ["very"]}, "It is everyday care.", "It is Very easy."),
    ("keywords:frequency", {"keyword": "water", "frequency": 2, "relation": "at least"}, "water, more water",
     "water only once"),
    ("keywords:frequency", {"keyword": "water", "frequency": 2, "relation": "less than"}, "water only once",
     "water, more water"),
    ("keywords:letter_frequency", {"letter": "a", "let_frequency": 3, "let_relation": "less than"}, "a cat",
     "a cat sat"),
    ("length_constraints:number_words", {"num_words": 5, "relation": "less than"}, "one two three four",
     "one two three four five"),
    ("length_constraints:number_words", {"num_words": 3, "relation": "at least"}, "one two three", "one two"),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "First part.\n***\nSecond part.",
     "First part.\nSecond part."),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*one* and *two*", "*one* only"),
    ("detectable_content:number_placeholders", {"num_placeholders": 1}, "Dear [name],", "Dear friend,"),
    ("detectable_format:multiple_sections", {"section_spliter": "Section", "num_sections": 2},
     "Section 1\nHello.\nSection 2\nBye.", "Section 1\nHello."),
    ("detectable_format:json_format", {}, '{"a": 1}', "a is 1"),
]


@pytest.mark.parametrize("instruction_id,kwargs,followed,not_followed", KNOWN,
                         ids=[f"{k[0]}-{i}" for i, k in enumerate(KNOWN)])
def test_known_responses(instruction_id, kwargs, followed, not_followed):
    assert check(followed, [instruction_id], [kwargs]) == [True]
    assert check(not_followed, [instruction_id], [kwargs]) == [False]


def test_strict_is_lm_evals_strict():
    """The same verdicts as lm-eval's own test_instruction_following_strict on the KNOWN rows."""
    from lm_eval.tasks.ifeval import utils  # importable once registry() has run

    for instruction_id, kwargs, followed, not_followed in KNOWN:
        example = utils.InputExample(key=0, instruction_id_list=[instruction_id], prompt="p", kwargs=[kwargs])
        for response in (followed, not_followed, "   "):
            expected = utils.test_instruction_following_strict(example, response).follow_instruction_list
            assert check(response, [instruction_id], [kwargs], prompt="p") == expected


def test_blank_response_follows_nothing():
    assert check("  \n", ["punctuation:no_comma", "keywords:forbidden_words"], [{}, {"forbidden_words": ["x"]}]) \
        == [False, False]


def test_supported_leaves_out_punkt_checkers():
    assert PUNKT_INSTRUCTIONS <= set(registry().INSTRUCTION_DICT) and not PUNKT_INSTRUCTIONS & SUPPORTED
    assert {k[0] for k in KNOWN} <= SUPPORTED
    with pytest.raises(ValueError, match="'length_constraints:number_sentences': needs NLTK punkt"):
        check("One. Two.", ["length_constraints:number_sentences"], [{"num_sentences": 2, "relation": "at least"}])


def test_errors_name_the_instruction():
    with pytest.raises(ValueError) as err:
        check("text", ["keywords:nosuch"], [{}])
    assert "'keywords:nosuch': unknown" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="'length_constraints:number_words': kwargs keys"):
        check("text", ["length_constraints:number_words"], [{"num_words": 5}])  # no relation: no random draw
    with pytest.raises(ValueError, match="2 instruction ids but 1 kwargs"):
        check("text", ["punctuation:no_comma", "detectable_format:title"], [{}])


def test_none_valued_and_numpy_kwargs():
    """Parquet unifies the struct keys of all rows (nulls where a row has none) and hands lists back
    as numpy arrays."""
    import numpy as np

    kwargs = [{"keywords": None, "num_words": np.int64(5), "relation": "less than"},
              {"keywords": np.array(["light", "water"]), "num_words": None, "relation": None}]
    ids = ["length_constraints:number_words", "keywords:existence"]
    assert check("water and light", ids, kwargs) == [True, True]
    assert check("water and sun and more words", ids, kwargs) == [False, False]


# -- broken for good -----------------------------------------------------------------------------

def test_broken_examples():
    ids = ["punctuation:no_comma", "change_case:english_lowercase", "keywords:forbidden_words",
           "length_constraints:number_words", "startend:quotation", "detectable_format:title"]
    kwargs = [{}, {}, {"forbidden_words": ["very"]}, {"num_words": 4, "relation": "less than"}, {}, {}]
    assert broken("", ids, kwargs) == [False] * 6
    assert broken("  \"it is", ids, kwargs) == [False] * 6
    assert broken('"it is very', ids, kwargs) == [False] * 6  # "very" may still become "verywhere"
    assert broken('"it is very ', ids, kwargs) == [False, False, True, False, False, False]
    assert broken('"it, is', ids, kwargs) == [True, False, False, False, False, False]
    assert broken('"It', ids, kwargs) == [False, True, False, False, False, False]
    assert broken('"one two three four', ids, kwargs) == [False, False, False, True, False, False]
    assert broken(" x", ids, kwargs) == [False, False, False, False, True, False]
    capital = ["change_case:english_capital"]
    assert broken("ALL CAPS 12!", capital, [{}]) == [False] and broken("ALL CAPs", capital, [{}]) == [True]
    bullets = ["detectable_format:number_bullet_lists"]
    assert broken("* a\n* b", bullets, [{"num_bullets": 2}]) == [False]
    assert broken("* a\n* b\n- c", bullets, [{"num_bullets": 2}]) == [True]
    frequency = ["keywords:frequency", "keywords:letter_frequency"]
    kwargs = [{"keyword": "tea", "frequency": 2, "relation": "less than"},
              {"letter": "t", "let_frequency": 2, "let_relation": "less than"}]
    assert broken("tea", frequency, kwargs) == [False, False]  # one "tea", one "t"
    assert broken("Tea, tea", frequency, kwargs) == [True, True]
    kwargs[0]["relation"] = kwargs[1]["let_relation"] = "at least"  # more text can always add more
    assert broken("Tea, tea", frequency, kwargs) == [False, False]


WORDS = ["very", "good", "tea", "water", "light", "home", "it", "is", "cats", "a"]
FRAGMENTS = st.one_of(
    st.sampled_from(WORDS), st.sampled_from([w.upper() for w in WORDS] + [w.title() for w in WORDS]),
    st.sampled_from([" ", " ", ",", ".", "\n", "\n* ", "\n- ", "*", '"', "<<", ">>", "  ", "P.S."]),
    st.characters(codec="utf-8", exclude_categories=("Cs",)),
)
RESPONSES = st.lists(FRAGMENTS, max_size=30).map("".join)
CONSTRAINTS = [
    (["punctuation:no_comma", "change_case:english_lowercase", "startend:quotation"], [{}, {}, {}]),
    (["change_case:english_capital", "keywords:forbidden_words", "detectable_format:number_bullet_lists"],
     [{}, {"forbidden_words": ["very", "good"]}, {"num_bullets": 2}]),
    (["length_constraints:number_words", "keywords:frequency", "keywords:letter_frequency"],
     [{"num_words": 6, "relation": "less than"}, {"keyword": "tea", "frequency": 2, "relation": "less than"},
      {"letter": "a", "let_frequency": 3, "let_relation": "less than"}]),
    (["detectable_format:number_bullet_lists", "keywords:forbidden_words", "detectable_format:title",
      "startend:end_checker"], [{"num_bullets": 1}, {"forbidden_words": ["cat"]}, {}, {"end_phrase": "bye"}]),
]


@settings(max_examples=300, deadline=None)
@given(response=RESPONSES, constraint=st.sampled_from(CONSTRAINTS))
def test_broken_prefix_means_final_fails(response, constraint):
    """For every cut point: an instruction broken by the prefix is not followed by the full response
    (broken is sound); the reward's partial score bounds the final one from above."""
    ids, kwargs = constraint
    final = check(response, ids, kwargs)
    for cut in range(len(response) + 1):
        for i, is_broken in enumerate(broken(response[:cut], ids, kwargs)):
            assert not (is_broken and final[i]), (ids[i], response[:cut], response)
    partial = ifeval_reward([""] * (len(response) + 1), [response[:c] for c in range(len(response) + 1)],
                            [ids] * (len(response) + 1), [kwargs] * (len(response) + 1),
                            partial=[True] * (len(response) + 1))
    assert all(p >= sum(final) / len(ids) for p in partial)
    assert partial == sorted(partial, reverse=True)  # broken for good stays broken


# -- the reward function -------------------------------------------------------------------------

def test_reward_final_and_partial():
    ids = ["punctuation:no_comma", "keywords:existence", "length_constraints:number_words"]
    kwargs = [{}, {"keywords": ["tea"], "num_words": None}, {"num_words": 5, "relation": "less than"}]
    texts = ["I like tea", "I like, tea", "I like coffee", "I like, coffee a lot more now"]
    final = ifeval_reward(["p"] * 4, texts, [ids] * 4, [kwargs] * 4)
    assert final == [1.0, 2 / 3, 2 / 3, 0.0]
    partial = ifeval_reward(["p"] * 4, texts, [ids] * 4, [kwargs] * 4, partial=[True] * 4)
    # "I like coffee" has broken nothing yet (tea may still come); the last has broken two of three.
    assert partial == [1.0, 2 / 3, 1.0, 1 / 3]
    mixed = ifeval_reward(["p"] * 2, texts[3:] * 2, [ids] * 2, [kwargs] * 2, partial=[True, False])
    assert mixed == [1 / 3, 0.0]


def test_reward_takes_conversational_rows_and_extra_columns():
    prompts = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "Say hi. No commas."}]]
    completions = [[{"role": "assistant", "content": "hi there"}]]
    assert ifeval_reward(prompts, completions, [["punctuation:no_comma"]], [[{}]], key=[3], trainer_state=None) \
        == [1.0]
    completions = [[{"role": "assistant", "content": "hi, there"}]]
    assert ifeval_reward(prompts, completions, [["punctuation:no_comma"]], [[{}]]) == [0.0]


def test_reward_errors_are_one_line():
    with pytest.raises(ValueError) as err:
        ifeval_reward(["p"], ["x"], [["detectable_format:nosuch"]], [[{}]])
    assert "'detectable_format:nosuch'" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="2 completions but 1 instruction_id_list"):
        ifeval_reward(["p", "q"], ["x", "y"], [["punctuation:no_comma"]], [[{}], [{}]])


def test_accuracy_is_ifevals_two_figures():
    figures = accuracy([[True, True], [True, False, False], [False]])
    assert figures == {"prompt_level_strict": 1 / 3, "instruction_level_strict": 3 / 6}


def test_accuracy_gain_point_figures_and_paired_interval():
    # 3 prompts, 2 responses each; prompt 0 has 2 instructions per response.
    before = [[[True, False], [False, False]], [[False], [False]], [[True], [True]]]
    after = [[[True, True], [True, False]], [[True], [False]], [[True], [True]]]
    gain = accuracy_gain(before, after, resamples=2000, seed=1)
    prompt, instr = gain["prompt_level_strict"], gain["instruction_level_strict"]
    assert (prompt["before"], prompt["after"]) == (2 / 6, 4 / 6)
    assert (instr["before"], instr["after"]) == (3 / 8, 6 / 8)  # a ratio of sums, not a mean of prompt ratios
    assert prompt["gain"] == pytest.approx(2 / 6) and instr["gain"] == pytest.approx(3 / 8)
    # No prompt got worse, so no resample shows a loss; the one that did not change can be drawn alone.
    assert prompt["low"] == 0 and instr["low"] == 0
    assert prompt["low"] <= prompt["gain"] <= prompt["high"] <= 1
    assert gain["prompts"] == 3 and gain["resamples"] == 2000
    assert accuracy_gain(before, after, resamples=2000, seed=1) == gain  # seeded
    # The same responses before and after: no gain, and every resample says so.
    same = accuracy_gain(before, before, resamples=500)
    assert all(same[k]["gain"] == same[k]["low"] == same[k]["high"] == 0
               for k in ("prompt_level_strict", "instruction_level_strict"))


@given(st.lists(st.tuples(st.lists(st.lists(st.booleans(), min_size=1, max_size=3), min_size=1, max_size=3),
                          st.lists(st.lists(st.booleans(), min_size=1, max_size=3), min_size=1, max_size=3)),
                min_size=1, max_size=6), st.integers(0, 2**16))
@settings(max_examples=60, deadline=None)
def test_accuracy_gain_swapped_is_negated(prompts, seed):
    before, after = [b for b, _ in prompts], [a for _, a in prompts]
    forward = accuracy_gain(before, after, resamples=200, seed=seed)
    backward = accuracy_gain(after, before, resamples=200, seed=seed)
    for key in ("prompt_level_strict", "instruction_level_strict"):
        f, b = forward[key], backward[key]
        assert -1 <= f["low"] <= f["high"] <= 1
        assert f["gain"] == pytest.approx(-b["gain"])
        assert (f["low"], f["high"]) == pytest.approx((-b["high"], -b["low"]))


def test_accuracy_gain_prompts_to_clear_zero():
    """The prompts an interval needs is a property of the gain and its per-prompt spread, not of how
    many prompts measured it: four copies of the same prompts halve the spread and need as many."""
    rng = random.Random(3)
    before = [[[rng.random() < 0.3] for _ in range(4)] for _ in range(40)]
    after = [[[rng.random() < 0.4] for _ in range(4)] for _ in range(40)]
    one, four = (accuracy_gain(before * k, after * k, resamples=4000, seed=2)["prompt_level_strict"] for k in (1, 4))
    assert one["gain"] > 0 and four["gain"] == pytest.approx(one["gain"])
    assert four["se"] == pytest.approx(one["se"] / 2, rel=0.1)
    assert one["prompts_to_clear_zero"] == math.ceil(40 * (1.959964 * one["se"] / one["gain"]) ** 2)
    assert four["prompts_to_clear_zero"] == pytest.approx(one["prompts_to_clear_zero"], rel=0.2)
    # This interval is already above 0: it needs fewer prompts than it has.
    assert one["low"] > 0 and one["prompts_to_clear_zero"] < 40
    assert accuracy_gain(after, before, resamples=500)["prompt_level_strict"]["prompts_to_clear_zero"] is None


def test_accuracy_gain_by_groups_draws_whole_groups():
    """A cluster bootstrap: groups of one prompt each draw as no groups; two identical prompts per
    group resample as one prompt does (the interval of the undoubled data, wider than resampling the
    doubled prompts one by one); the point figures do not depend on the groups."""
    rng = random.Random(5)
    before = [[[rng.random() < 0.3, rng.random() < 0.5] for _ in range(4)] for _ in range(12)]
    after = [[[rng.random() < 0.45, rng.random() < 0.6] for _ in range(4)] for _ in range(12)]
    plain = accuracy_gain(before, after, resamples=3000, seed=4)
    assert accuracy_gain(before, after, resamples=3000, seed=4, groups=[f"t{i}" for i in range(12)]) == {
        **plain, "groups": 12}
    doubled_b = [p for p in before for _ in range(2)]
    doubled_a = [p for p in after for _ in range(2)]
    labels = [i for i in range(12) for _ in range(2)]
    by_prompt = accuracy_gain(doubled_b, doubled_a, resamples=3000, seed=4)
    by_group = accuracy_gain(doubled_b, doubled_a, resamples=3000, seed=4, groups=labels)
    assert by_group["groups"] == 12 and by_group["prompts"] == 24 and "groups" not in by_prompt
    for key in ("prompt_level_strict", "instruction_level_strict"):
        g, p = by_group[key], by_prompt[key]
        assert (g["before"], g["after"], g["gain"]) == (p["before"], p["after"], p["gain"])
        assert (g["low"], g["high"]) == pytest.approx((plain[key]["low"], plain[key]["high"]))
        assert g["high"] - g["low"] > p["high"] - p["low"]
    with pytest.raises(ValueError, match="3 group labels for 12 prompts"):
        accuracy_gain(before, after, groups=["a", "b", "c"])


def test_accuracy_gain_refuses_unpaired_input():
    with pytest.raises(ValueError, match="2 prompts before but 1 after"):
        accuracy_gain([[[True]], [[False]]], [[[True]]])
    with pytest.raises(ValueError, match="no responses"):
        accuracy_gain([[[True]], []], [[[True]], [[False]]])


def test_import_prints_nothing_and_needs_no_network():
    """lm-eval's instructions_util calls nltk.download("punkt_tab") at import and prints when it
    did; the judge must do neither (no network here, and stdout may carry a job's report)."""
    code = """
import socket, sys
def refuse(*args, **kwargs):
    sys.stderr.write("NETWORK ATTEMPTED\\n")
    raise OSError("no network")
socket.socket.connect = refuse
socket.create_connection = refuse
import pipeline.judge as judge
judge.check("some text", ["punctuation:no_comma", "change_case:english_lowercase"], [{}, {}])
assert "lm_eval.tasks.manager" not in sys.modules, "the harness's task manager was imported"
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and "NETWORK ATTEMPTED" not in done.stderr


# -- the prompt sets -----------------------------------------------------------------------------

def test_committed_prompt_files_are_the_jobs_output(tmp_path, capsys):
    from jobs.make_ifeval_prompts import main

    assert main(["--output", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 2 and "ifeval-train.jsonl: 480 rows" in printed[0] and "64 rows" in printed[1]
    for name in ("ifeval-train.jsonl", "ifeval-eval.jsonl"):
        assert (tmp_path / name).read_bytes() == (ROOT / "configs" / "prompts" / name).read_bytes(), name
    assert main(["--output", str(tmp_path / "other"), "--seed", "1"]) == 0
    assert (tmp_path / "other" / "ifeval-eval.jsonl").read_bytes() != (tmp_path / "ifeval-eval.jsonl").read_bytes()


def test_prompt_sets_columns_counts_and_disjointness():
    from jobs.make_ifeval_prompts import EVAL_TASKS, TRAIN_TASKS

    sets = {name: [json.loads(line) for line in (ROOT / "configs" / "prompts" / f"ifeval-{name}.jsonl").open()]
            for name in ("train", "eval")}
    assert len(sets["train"]) >= 400 and len(sets["eval"]) == 64
    assert len(TRAIN_TASKS) >= 120 and len(EVAL_TASKS) >= 24 and not set(TRAIN_TASKS) & set(EVAL_TASKS)
    rows = sets["train"] + sets["eval"]
    assert len({r["key"] for r in rows}) == len(rows) and len({r["prompt"] for r in rows}) == len(rows)
    conflicts = registry().conflict_make({k: set(v) for k, v in registry().INSTRUCTION_CONFLICTS.items()})
    for name, tasks in (("train", TRAIN_TASKS), ("eval", EVAL_TASKS)):
        used = set()
        for row in sets[name]:
            assert set(row) == {"key", "prompt", "instruction_id_list", "kwargs"} and isinstance(row["key"], int)
            ids = row["instruction_id_list"]
            assert 1 <= len(ids) <= 3 and len(row["kwargs"]) == len(ids) and set(ids) <= SUPPORTED
            assert not any(b in conflicts[a] for n, a in enumerate(ids) for b in ids[n + 1:]), row
            for instruction_id, kwargs in zip(ids, row["kwargs"]):
                checker = registry().INSTRUCTION_DICT[instruction_id](instruction_id)
                assert set(kwargs) == set(checker.get_instruction_args_keys())  # its own args only
            task = next(t for t in tasks if row["prompt"].startswith(t + " "))
            used.add(task)
            assert len(ifeval_reward([row["prompt"]], ["Some answer."], [ids], [row["kwargs"]])) == 1
        assert used == set(tasks)  # every base task used, each only in its own set


def test_base_task_of_every_held_out_prompt():
    """Each of the 64 held-out prompts starts with one of the 32 held-out base tasks, two prompts each."""
    from collections import Counter

    from jobs.make_ifeval_prompts import EVAL_TASKS, TRAIN_TASKS, base_task

    rows = [json.loads(line) for line in (ROOT / "configs" / "prompts" / "ifeval-eval.jsonl").open()]
    tasks = [base_task(row["prompt"]) for row in rows]
    assert len(rows) == 64 and all(t in EVAL_TASKS for t in tasks)
    assert len(set(tasks)) == 32 and set(Counter(tasks).values()) == {2}
    assert base_task(TRAIN_TASKS[0] + " Answer in lowercase.") == TRAIN_TASKS[0]
    assert base_task("Write a haiku about the sea.") is None
