"""IFBench as the second judge (pipeline.judge): its checkers on hand-made responses, the judged
subset (no kind that reads or downloads NLTK data, or reaches spaCy), an import with no network
call, the committed prompt file, and bon-evaluate's IFBench figures on a tiny-model build."""

from __future__ import annotations

import ast
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import judge

KEYWORDS = {"keyword1": "kaleidoscope", "keyword2": "nebula", "keyword3": "whisper", "keyword4": "labyrinth",
            "keyword5": "paradox"}
# kind, its kwargs, a response that follows it, one that does not
KNOWN = [
    ("count:keywords_multiple", KEYWORDS,
     "kaleidoscope " + "nebula " * 2 + "whisper " * 3 + "labyrinth " * 5 + "paradox " * 7,
     "kaleidoscope " + "nebula " * 2 + "whisper " * 3 + "labyrinth " * 5 + "paradox " * 6),
    ("count:numbers", {"N": 3}, "I have 2 cats, 3 dogs and 14 fish.", "I have 2 cats and 3 dogs."),
    ("format:no_whitespace", {}, "Hello,world!", "Hello, world!"),
    ("words:alphabet", {}, "Apples bloom casually, daisies emerge.", "Apples are good."),
    ("words:no_consecutive", {}, "The cat ate lunch.", "Big blue birds sing."),
    ("format:newline", {}, "One\ntwo\nthree", "One two\nthree"),
    ("custom:multiples", {}, "14, 21, 28, 35, 42, 49", "7, 14, 21, 28, 35, 42, 49"),
    ("count:unique_word_count", {"N": 4}, "red green blue yellow", "red red green green"),
]


@pytest.mark.parametrize("kind, kwargs, passing, failing", KNOWN, ids=[k[0] for k in KNOWN])
def test_checkers_judge_known_responses(kind, kwargs, passing, failing):
    assert kind in judge.ifbench_supported()
    assert judge.check(passing, [kind], [kwargs]) == [True]
    assert judge.check(failing, [kind], [kwargs]) == [False]
    assert judge.check("   ", [kind], [kwargs]) == [False]  # strict: a blank response follows nothing


def test_a_checker_that_raises_on_a_response_is_not_followed():
    """IFBench's own checker raises on these short responses (its evaluation would stop); the judge
    counts the instruction as not followed."""
    for kind, kwargs, text in (("format:quote_unquote", {}, "!"),
                               ("ratio:overlap", {"reference_text": "the quick brown fox", "percentage": 50}, "a")):
        checker = judge.ifbench_registry().INSTRUCTION_DICT[kind](kind)
        checker.build_description(**kwargs)
        with pytest.raises((IndexError, ZeroDivisionError)):
            checker.check_following(text)
        assert judge.check(text, [kind], [kwargs]) == [False]


def test_two_instructions_and_the_prompt_argument():
    """Each instruction of a row is checked on its own; repeat:repeat_simple reads the prompt."""
    row = next(r for r in judge.ifbench_test_rows() if r["instruction_id_list"] == ["repeat:repeat_simple"])
    kwargs = row["kwargs"][0]
    checker = judge.ifbench_registry().INSTRUCTION_DICT["repeat:repeat_simple"]("repeat:repeat_simple")
    checker.build_description(**{k: v for k, v in kwargs.items() if v is not None})
    args = checker.get_instruction_args() or {}
    assert judge.check("something else entirely", ["repeat:repeat_simple"], [kwargs], row["prompt"]) == [False]
    if "prompt_to_repeat" in args:  # the checker asks for the request, repeated verbatim
        assert judge.check(args["prompt_to_repeat"], ["repeat:repeat_simple"], [kwargs], row["prompt"]) == [True]
    both = judge.check("Hello,world!", ["format:no_whitespace", "count:numbers"], [{}, {"N": 1}])
    assert both == [True, False]


def test_unsupported_kinds_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="'words:start_verb': IFBench's checker reads NLTK data"):
        judge.check("Run fast.", ["words:start_verb"], [{}])
    with pytest.raises(ValueError, match="'ratio:sentence_type': IFBench's checker downloads NLTK data"):
        judge.check("A. B?", ["ratio:sentence_type"], [{}])
    with pytest.raises(ValueError, match="'count:nosuch': unknown"):
        judge.check("x", ["count:nosuch"], [{}])


def test_the_two_registries_share_no_id_and_judge_of_tells_them_apart():
    ifeval, ifbench = set(judge.registry().INSTRUCTION_DICT), set(judge.ifbench_registry().INSTRUCTION_DICT)
    assert ifeval and ifbench and not ifeval & ifbench
    assert judge.judge_of(["punctuation:no_comma"]) == "IFEval"
    assert judge.judge_of(["count:numbers", "words:start_verb"]) == "IFBench"
    with pytest.raises(ValueError, match="mixed"):
        judge.judge_of(["punctuation:no_comma", "count:numbers"])


DATA_FREE_CALLS = {"nltk.ngrams", "nltk.tokenize.RegexpTokenizer"}
"""NLTK calls that read no NLTK data (character n-grams, a regular-expression tokenizer)."""


def nltk_calls(node) -> set[str]:
    """The NLTK calls under ``node`` that may read or download NLTK data (any but DATA_FREE_CALLS),
    and "spacy" where it names spaCy."""
    found = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            name = ast.unparse(n.func)
            if (name.startswith("nltk.") or ".nltk." in name) and name not in DATA_FREE_CALLS:
                found.add(name.split("nltk.", 1)[1].join(["nltk.", ""]))
        if isinstance(n, ast.Name) and n.id == "spacy" or isinstance(n, ast.Attribute) and n.attr == "spacy":
            found.add("spacy")
    return found


def test_the_subset_excludes_every_kind_that_reaches_nltk_data_or_spacy():
    """Read from the installed package's source: a kind is excluded exactly when its checker class
    (its bases included) calls NLTK beyond DATA_FREE_CALLS, names spaCy, or calls an
    instructions_util function that does; those that only call nltk.download are
    IFBENCH_NLTK_DOWNLOAD, the rest IFBENCH_NLTK_DATA. Then the subset's counts."""
    registry = judge.ifbench_registry()
    instructions = sys.modules["ifbench.instructions"]
    util = sys.modules["ifbench.instructions_util"]
    util_calls = {f.name: nltk_calls(f) for f in ast.parse(inspect.getsource(util)).body
                  if isinstance(f, ast.FunctionDef)}
    util_calls = {name: calls for name, calls in util_calls.items() if calls}
    assert "count_stopwords" in util_calls and "split_into_sentences" not in util_calls
    classes = {c.name: c for c in ast.parse(inspect.getsource(instructions)).body if isinstance(c, ast.ClassDef)}
    reaching = {}
    for kind, cls in registry.INSTRUCTION_DICT.items():
        calls = set()
        for base in cls.__mro__:
            if base.__name__ in classes:
                node = classes[base.__name__]
                calls |= nltk_calls(node)
                for n in ast.walk(node):
                    if isinstance(n, ast.Attribute) and ast.unparse(n.value) == "instructions_util":
                        calls |= util_calls.get(n.attr, set())
        if calls:
            reaching[kind] = calls
    assert set(reaching) == judge.IFBENCH_EXCLUDED
    assert {k for k, calls in reaching.items() if calls == {"nltk.download"}} == judge.IFBENCH_NLTK_DOWNLOAD
    assert judge.ifbench_supported() == set(registry.INSTRUCTION_DICT) - set(reaching)
    assert judge.ifbench_subset() == {"kinds": 43, "of_kinds": 58, "prompts": 203, "of_prompts": 294,
                                      "instructions": 220, "of_instructions": 335, "version": judge.IFBENCH_VERSION}


NO_NETWORK = r"""
import json, socket, sys
attempts = []
def refuse(name):
    def call(*args, **kwargs):
        attempts.append([name, repr(args)[:80]])
        raise OSError("network refused by the test")
    return call
socket.getaddrinfo = refuse("getaddrinfo")
socket.create_connection = refuse("create_connection")
socket.socket.connect = refuse("connect")
import nltk
download = nltk.download
from pipeline import judge
judge.ifbench_registry()
for row in judge.ifbench_test_rows():
    if judge.judged_by_subset(row["instruction_id_list"]):
        judge.check("A short answer, with 2 numbers: 14 and 21.", row["instruction_id_list"], row["kwargs"], row["prompt"])
print(json.dumps({"attempts": attempts, "spacy_left": [m for m in ("spacy", "spacy.cli") if m in sys.modules],
                  "download_restored": nltk.download is download}))
"""


def test_import_and_judging_make_no_network_call():
    """In a fresh interpreter with every socket connection refused and recorded: importing IFBench's
    checkers (instructions_util downloads punkt when it finds none; instructions.py downloads a
    spaCy model) and judging a response on every prompt of the subset try no connection, leave no
    stand-in spaCy behind and give nltk.download back."""
    run = subprocess.run([sys.executable, "-c", NO_NETWORK], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {"attempts": [], "spacy_left": [], "download_restored": True}


def test_the_committed_prompt_file_is_the_jobs_output(tmp_path):
    from jobs.make_ifbench_prompts import main

    out = tmp_path / "ifbench-test.jsonl"
    assert main(["--output", str(out)]) == 0
    assert out.read_bytes() == open("configs/prompts/ifbench-test.jsonl", "rb").read()
    provenance = json.loads(out.with_suffix(".provenance.json").read_text())
    assert provenance == json.load(open("configs/prompts/ifbench-test.provenance.json"))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == provenance["subset"]["prompts"] == 203
    assert all(judge.judged_by_subset(r["instruction_id_list"]) for r in rows)
    assert max(len(r["prompt"]) for r in rows) == provenance["max_prompt_chars"]
    assert main(["--output", str(tmp_path / "x.txt")]) == 2


def test_bon_evaluate_reports_ifbench_beside_ifeval(tiny_models, tmp_path, capsys):
    """A tiny-model build on short IFBench prompts (three of the subset, one asking for a kind that
    reads NLTK data), judged offline by bon-evaluate: IFBench's figures with the subset's size, the
    excluded pair counted, and the figures equal to IFBench's own strict evaluation
    (ifbench.evaluation_lib) of the same pairs."""
    from jobs.build_dataset import main as build
    from jobs.evaluate import main as evaluate

    subset = [json.loads(line) for line in open("configs/prompts/ifbench-test.jsonl")]
    short = [next(r for r in subset if r["instruction_id_list"] == kinds and len(r["prompt"]) < 260)
             for kinds in (["count:numbers"], ["format:list", "words:no_consecutive"], ["format:line_indent"])]
    excluded = next(r for r in judge.ifbench_test_rows() if r["instruction_id_list"] == ["words:start_verb"])
    rows = short + [{**excluded, "kwargs": [{}]}]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    assert build(["--config", "configs/demo.yaml", "--prompts", str(prompts), "--output", str(out),
                  "--strategy", "best_of_n", "--set", f"models.generator={tiny_models['generator']}",
                  "--set", f"models.reward={tiny_models['reward']}", "--set", "runtime.local=true",
                  "--set", "data.extra_columns=[instruction_id_list, kwargs]", "--max-new-tokens", "12",
                  "--num-samples", "4", "--no-progress"]) == 0
    capsys.readouterr()
    report_file = tmp_path / "report.json"
    assert evaluate(["--pairs", str(out), "--report", str(report_file)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(report_file.read_text())
    bench = report["ifbench"]
    assert report["pairs"] == 4 and "ifeval_pairs" not in report and "chosen" not in report
    assert bench["pairs"] == 3 and bench["not_judged"] == 1 and bench["subset"]["prompts"] == 203
    assert "IFBench (IFBench's subset without NLTK data: 203 of 294 prompts" in printed
    assert "IFBench strict accuracy, 3 pairs" in printed and "1 IFBench pairs not judged" in printed

    # IFBench's own strict evaluation of the same responses.
    import pyarrow.parquet as pq

    from pipeline.data.store import OutputStore

    evaluation_lib = pytest.importorskip("ifbench.evaluation_lib")
    pairs = [p for part in OutputStore(str(out)).committed_parts() for p in pq.read_table(part).to_pylist()]
    verdicts = []
    for side in ("chosen", "rejected"):
        followed = []
        for pair in sorted(pairs, key=lambda p: p["source_row"]):
            if pair["source_row"] >= len(short):
                continue
            row = short[pair["source_row"]]
            example = evaluation_lib.InputExample(key=row["key"], instruction_id_list=row["instruction_id_list"],
                                                  prompt=row["prompt"], kwargs=[dict(k) for k in row["kwargs"]])
            followed.append(evaluation_lib.test_instruction_following_strict(
                example, {row["prompt"]: pair[side]}).follow_instruction_list)
        assert len(followed) == 3
        assert bench[side] == judge.accuracy(followed)
        verdicts += [v for f in followed for v in f]
    assert True in verdicts and False in verdicts  # the comparison is not all one verdict


def test_ei_rounds_replays_ifbench_figures_beside_ifevals(tmp_path, capsys):
    """benchmarks.ei_rounds --replay on kept records of two policies on both judges' prompts: the
    IFBench figures come under "ifbench", from the IFBench records, printed with the subset's size;
    without IFBench records there are none, and asking for them is one line and exit 2."""
    import gzip

    from benchmarks.ei_rounds import main as ei_rounds

    root = Path(__file__).resolve().parents[1] / "configs" / "prompts"
    files = {}
    for judge_name, source in (("IFEval", "ifeval-eval.jsonl"), ("IFBench", "ifbench-test.jsonl")):
        files[judge_name] = tmp_path / source
        files[judge_name].write_text("".join((root / source).read_text().splitlines(True)[:3]))
    data = tmp_path / "data"
    data.mkdir()
    (data / "schedule.json").write_text(json.dumps({"policies": ["start", "round 1"], "rounds": {}}))

    def record(policy: str, prompt_file: Path, follows: bool) -> dict:
        """Two responses per prompt: none follows at the start; the first follows all after round 1."""
        rows = [json.loads(line) for line in prompt_file.read_text().splitlines()]
        verdicts = [[[follows and s == 0] * len(r["instruction_id_list"]) for s in range(2)] for r in rows]
        return {"policy": policy, "responses": 2 * len(rows), "verdicts": verdicts,
                "reward_scores": [[0.1, 0.2]] * len(rows), "tokens": [[10, 20]] * len(rows)}

    for judge_name, suffix in (("IFEval", ""), ("IFBench", "-ifbench")):
        for policy, name, follows in (("start", "start", False), ("round 1", "round-1", True)):
            (data / f"policy-{name}{suffix}.json.gz").write_bytes(
                gzip.compress(json.dumps(record(policy, files[judge_name], follows)).encode()))
    common = ["--replay", "--data", str(data), "--eval-prompts", str(files["IFEval"]), "--resamples", "200"]
    assert ei_rounds([*common, "--ifbench-prompts", str(files["IFBench"]), "--json", str(tmp_path / "r.json")]) == 0
    printed = capsys.readouterr().out
    figures = json.loads((tmp_path / "r.json").read_text())
    bench = figures["ifbench"]
    assert bench["prompts"] == 3 and bench["subset"]["prompts"] == 203
    assert [r["prompt_level_strict"]["value"] for r in bench["policies"]] == [0.0, 0.5]
    assert bench["policies"][1]["gain_over_start"]["prompt_level_strict"]["gain"] == 0.5
    assert f"IFBench, 3 prompts of {files['IFBench']} (IFBench's subset without NLTK data: 203 of 294 prompts" in printed
    assert "round 1 over start (IFBench): prompt-level 0.0 -> 50.0" in printed

    for name in ("start", "round-1"):
        (data / f"policy-{name}-ifbench.json.gz").unlink()
    assert ei_rounds([*common, "--json", str(tmp_path / "ifeval.json")]) == 0
    assert "ifbench" not in json.loads((tmp_path / "ifeval.json").read_text())
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        ei_rounds([*common, "--ifbench-prompts", str(files["IFBench"])])
    assert stop.value.code == 2 and capsys.readouterr().err.startswith("error: --replay:")
