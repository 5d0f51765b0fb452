"""Every replay that docs/benchmarks.md gives (its lines ``- R1 `python -m benchmarks...` ``, ``- E1 ...``:
commands that need no model, only committed files) runs on a fresh clone and reproduces the committed
JSON it names, figure by figure; the environment (date, commit, machine) aside."""

from __future__ import annotations

import importlib
import json
import math
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "benchmarks.md"


def replays() -> list[tuple[str, str]]:
    """(label, command) of each replay line of the results page, in order."""
    return re.findall(r"^- ([RE]\d+) `(python -m benchmarks\.[^`]+)`", RESULTS.read_text(), re.M)


def split(command: str) -> tuple[str, list[str], str]:
    """The module, its arguments without --json and --plot, and the committed JSON it names."""
    words = shlex.split(command)
    module, argv = words[2], words[3:]
    assert "--json" in argv, f"a replay names the JSON it reproduces: {command}"
    committed = argv[argv.index("--json") + 1]
    for flag in ("--json", "--plot"):
        if flag in argv:
            i = argv.index(flag)
            del argv[i:i + 2]
    return module, argv, committed


def differences(new, old, path: str = "") -> list[str]:
    """Where the replay ``new`` does not reproduce the committed ``old``: a key of ``old`` missing, a
    length, a value (floats to 1e-9 relative; NaN equal to NaN). ``environment`` (date, commit, packages,
    machine, command line) is not a figure and is skipped; a key only in the replay is output the script
    has added since the JSON was committed (a figure taken before the prompt was counted has no
    ``prompt_tokens``), not a figure that changed."""
    if isinstance(new, dict) and isinstance(old, dict):
        found = [f"{path}.{k}: only in the committed JSON" for k in sorted(set(old) - set(new)) if k != "environment"]
        for key in sorted(set(new) & set(old) - {"environment"}):
            found += differences(new[key], old[key], f"{path}.{key}")
        return found
    if isinstance(new, list) and isinstance(old, list):
        if len(new) != len(old):
            return [f"{path}: {len(new)} items against {len(old)}"]
        return [d for i, (a, b) in enumerate(zip(new, old)) for d in differences(a, b, f"{path}[{i}]")]
    numbers = (int, float)
    if isinstance(new, float) or isinstance(old, float):
        if isinstance(new, numbers) and isinstance(old, numbers) and not isinstance(new, bool) and (
                math.isclose(new, old, rel_tol=1e-9, abs_tol=1e-12) or (math.isnan(new) and math.isnan(old))):
            return []
    elif new == old:
        return []
    return [f"{path}: {new!r} in the replay, {old!r} committed"]


def test_differences_finds_a_changed_figure_and_skips_the_environment():
    old = {"held_out": {"median": 1.45, "low": 0.96}, "points": [1, 2.5], "environment": {"date": "a"}}
    assert differences(json.loads(json.dumps(old)) | {"environment": {"date": "b"}}, old) == []
    assert differences({**old, "held_out": {"median": 1.46, "low": 0.96}}, old) == [
        ".held_out.median: 1.46 in the replay, 1.45 committed"]
    assert differences({**old, "points": [1]}, old) == [".points: 1 items against 2"]
    assert differences({k: v for k, v in old.items() if k != "points"}, old) == [".points: only in the committed JSON"]
    assert differences({**old, "prompt_tokens": 0}, old) == []
    assert differences({"x": float("nan")}, {"x": float("nan")}) == []


def test_the_results_page_gives_replays_of_the_frontier_and_the_rounds_each_naming_a_committed_json():
    found = replays()
    modules = {split(command)[0] for _, command in found}
    assert {"benchmarks.frontier", "benchmarks.ei_rounds"} <= modules, modules
    for label, command in found:
        module, argv, committed = split(command)
        assert committed.startswith("benchmarks/results/") and (REPO / committed).is_file(), (label, committed)
        # What a replay reads is committed too: nothing under .cache or out/.
        for word in argv:
            if "/" in word:
                assert (REPO / word).exists(), (label, word)


@pytest.mark.slow
@pytest.mark.parametrize("label, command", replays(), ids=[label for label, _ in replays()])
def test_each_replay_reproduces_its_committed_json(label, command, tmp_path, monkeypatch):
    """Run in-process from the repository root, as on a fresh clone after `make install`: no model
    directory there, so any tokenizer or model a replay tried to load fails it, even where this
    machine has .cache/real-models."""
    import transformers

    def no_model(*args, **kwargs):
        raise OSError("a replay loads no model (a fresh clone has none)")

    for auto in ("AutoTokenizer", "AutoModelForCausalLM", "AutoModelForSequenceClassification"):
        monkeypatch.setattr(getattr(transformers, auto), "from_pretrained", no_model)
    module, argv, committed = split(command)
    monkeypatch.chdir(REPO)
    out = tmp_path / "replay.json"
    assert importlib.import_module(module).main([*argv, "--json", str(out)]) in (0, None)
    found = differences(json.loads(out.read_text()), json.loads((REPO / committed).read_text()))
    assert found == [], f"{label}: {len(found)} figures differ, e.g. {found[:5]}"
