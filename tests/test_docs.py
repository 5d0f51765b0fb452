"""The docs match the code: README is a guide of at most 300 lines, whose Measurements are a short
table linking the results page; every console script, config key, job flag and file it names exists;
every relative link resolves; no heading names an internal issue; the results page
(docs/benchmarks.md) opens with the four questions in at most 700 lines, each row of its tables with
its standing, date, command and committed JSON; every measurement section of the history
(docs/history.md) carries a command and a date."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from pipeline.config import key_docs

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
DOCS = {p: p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "README.md"]}
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
KEYS = {d.key for d in key_docs()}
SECTIONS = ("models", "strategy", "sampling", "data", "runtime")


def test_readme_is_a_guide_of_at_most_300_lines():
    assert len(README.splitlines()) <= 300
    for heading in ("Quick start", "Input", "Output", "Troubleshooting"):
        assert re.search(rf"^#+ .*{heading}", README, re.M | re.I), heading
    assert "make demo" in README and "make test" in README


def test_every_console_script_named_in_the_docs_exists_and_every_script_is_documented():
    named = set(re.findall(r"\b(bon-[a-z-]+[a-z])\b", "\n".join(DOCS.values())))
    named = {n for n in named if not n.startswith("bon-pipeline")}  # the package, and Kubernetes object names
    assert named <= set(SCRIPTS), named - set(SCRIPTS)
    assert set(SCRIPTS) <= set(re.findall(r"\b(bon-[a-z-]+[a-z])\b", README))


def test_every_config_key_the_readme_names_exists():
    """`models.vllm`, `data.split`, ... written in code spans or --set: each a key of --help-config
    (a mapping key's own entries, such as models.vllm.tensor_parallel_size, name the mapping)."""
    named = set(re.findall(rf"(?<![\w.])((?:{'|'.join(SECTIONS)})\.[a-z_]+(?:\.[a-z_]+)*)", README))
    unknown = sorted(k for k in named if not any(k == key or k.startswith(key + ".") or key.startswith(k + ".")
                                                 for key in KEYS))
    assert unknown == []


@pytest.mark.parametrize("doc", sorted(DOCS), ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(doc):
    text = DOCS[doc]
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        assert linked.exists(), f"{doc.name}: {target}"
        if anchor and linked.suffix == ".md":
            slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                     for h in re.findall(r"^#+ (.+)$", linked.read_text(), re.M)}
            assert anchor in slugs, f"{doc.name}: {target}"


def test_every_file_the_readme_names_exists():
    for path in re.findall(r"`((?:configs|infra|jobs|pipeline|benchmarks|docs)/[\w./-]+)`", README):
        assert (REPO / path).exists(), path


def test_every_flag_the_readme_gives_a_job_is_one_that_job_takes(capsys):
    """`bon-X ... --flag` lines of the README against bon-X's own --help."""
    import importlib

    for script, line in re.findall(r"\b(bon-[a-z-]+[a-z]) ([^\n`]*)", README):
        if script not in SCRIPTS:
            continue
        module = importlib.import_module(SCRIPTS[script].split(":")[0])
        with pytest.raises(SystemExit):
            module.main(["--help"])
        helped = capsys.readouterr().out
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", line):
            assert re.search(rf"(?<![\w-]){flag}\b", helped), f"{script} {flag}"


def test_every_measurement_in_the_history_has_a_command_and_a_date():
    text = (REPO / "docs" / "history.md").read_text()
    sections = re.split(r"^### ", text, flags=re.M)[1:]
    assert sections
    for section in sections:
        title = section.splitlines()[0]
        body = section.split("\n## ")[0]
        assert re.search(r"20\d\d-\d\d-\d\d", body), f"no date: {title}"
        # A figure the README once gave without its command says so, and names the test that checks it.
        assert re.search(r"python\s+-m\s|make [a-z]|bon-[a-z]|recorded no command", body), f"no command: {title}"


RESULTS = REPO / "docs" / "benchmarks.md"
QUESTIONS = ["Speed at equal quality", "What the pairs do to a model", "Memory and speed of the engine", "Reliability"]


def test_the_results_page_opens_with_the_four_questions_in_at_most_700_lines():
    text = RESULTS.read_text()
    assert len(text.splitlines()) <= 700
    assert re.findall(r"^## (.+)$", text, re.M)[:4] == QUESTIONS


@pytest.mark.parametrize("doc", sorted(DOCS), ids=lambda p: p.name)
def test_no_heading_names_an_internal_issue(doc):
    """An issue number means nothing to a reader of the docs ("issue 62, item 3")."""
    for heading in re.findall(r"^#+ (.+)$", DOCS[doc], re.M):
        assert not re.search(r"\bissues?\b[^)]*\d", heading, re.I), heading


def result_tables() -> dict[str, list[dict[str, str]]]:
    """Each question's table on the results page: its rows as {column: cell}."""
    tables = {}
    for section in re.split(r"^## ", RESULTS.read_text(), flags=re.M)[1:]:
        title = section.splitlines()[0]
        lines = [line for line in section.splitlines() if line.startswith("| ")]
        if not lines:
            continue
        cells = [[cell.strip() for cell in line.strip().strip("|").split(" | ")] for line in lines]
        header, rows = cells[0], [row for row in cells[2:]]
        assert all(len(row) == len(header) for row in rows), title
        tables[title] = [dict(zip(header, row)) for row in rows]
    return tables


def test_every_row_of_the_results_says_where_it_stands_and_gives_its_date_command_and_json():
    text = RESULTS.read_text()
    defined = set(re.findall(r"^- ([REL]\d+) `", text, re.M))
    tables = result_tables()
    assert list(tables) == QUESTIONS
    for title, rows in tables.items():
        assert rows, title
        for row in rows:
            figure, command, json_cell = list(row.values())[0], row["reproduce"], list(row.values())[-1]
            assert {"held out?", "circular?", "date", "reproduce"} <= set(row), title
            if "not measured" not in row.values():
                assert row["held out?"] and row["circular?"], figure
                assert re.search(r"20\d\d-\d\d-\d\d|every run of the tests", row["date"]), figure
            labels = re.findall(r"\b([REL]\d+)\b", command)
            assert set(labels) <= defined, (figure, set(labels) - defined)
            assert labels or re.search(r"`(?:python -m |make |/usr/bin/time|time make|\.venv)", command), figure
            named = re.findall(r"`([^`]+\.(?:json|py))`", json_cell)
            missing = re.search(r"no committed JSON|none yet", json_cell)
            assert named or missing, figure
            # A row without a committed JSON may name what its run wrote and did not keep.
            for path in [p for p in named if p.startswith("tests/")] if missing else named:
                where = REPO / path if path.startswith("tests/") else REPO / "benchmarks" / "results" / path
                assert where.is_file(), (figure, path)
    for path in re.findall(r"(benchmarks/results/[\w./-]+\.json(?:\.gz)?)", text):
        assert (REPO / path).is_file(), path


def test_the_readme_measurements_are_a_short_table_that_links_the_results_page():
    section = README.split("\n## Measurements\n")[1].split("\n## ")[0]
    assert len(section.strip().splitlines()) + 1 <= 20
    assert re.findall(r"^\| .+ \|$", section, re.M), "a table"
    assert all(line.startswith("|") for line in section.strip().splitlines()), "nothing but the table"
    assert "](docs/benchmarks.md)" in section


def test_the_benchmarks_readme_names_every_script_in_benchmarks():
    listed = set(re.findall(r"`(\w+\.py)`", (REPO / "benchmarks" / "README.md").read_text()))
    assert {p.name for p in (REPO / "benchmarks").glob("*.py")} <= listed


def benchmark_commands() -> list[str]:
    """Every complete ``python -m benchmarks.X ...`` command the docs give (inline code, possibly
    wrapped over lines); spans with placeholders ([...], FILE-like words in brackets) are left out."""
    found = []
    for text in DOCS.values():
        for span in re.findall(r"`([^`]*python -m benchmarks\.[^`]*)`", text):
            command = " ".join(span.replace("\\\n", " ").split())  # shell line continuations joined
            command = command[command.index("python -m benchmarks."):]
            if "[" not in command and "..." not in command:
                found.append(command)
    return sorted(set(found))


@pytest.mark.parametrize("command", benchmark_commands())
def test_every_benchmark_command_in_the_docs_parses(command, monkeypatch):
    """The flags of each documented benchmark command are ones its script takes today (parsed by
    the script's own parser, stopped before it runs anything)."""
    import argparse
    import importlib
    import shlex

    class Parsed(Exception):
        pass

    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        real(self, args, namespace)  # an unknown flag exits 2 here
        raise Parsed

    words = shlex.split(command)
    module, argv = words[2], words[3:]
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    with pytest.raises(Parsed):
        importlib.import_module(module).main(argv)
