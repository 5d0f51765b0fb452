"""The docs match the code (issue 30, item 9): README is a guide of at most 300 lines; every console
script, config key, job flag and file it names exists; every relative link resolves; every
measurement section of docs/benchmarks.md carries a command and a date."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from pipeline.config import key_docs

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
DOCS = {p: p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]}
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


def test_every_measurement_in_docs_benchmarks_has_a_command_and_a_date():
    text = (REPO / "docs" / "benchmarks.md").read_text()
    sections = re.split(r"^### ", text, flags=re.M)[1:]
    assert sections
    for section in sections:
        title = section.splitlines()[0]
        body = section.split("\n## ")[0]
        assert re.search(r"20\d\d-\d\d-\d\d", body), f"no date: {title}"
        # A figure the README once gave without its command says so, and names the test that checks it.
        assert re.search(r"python\s+-m\s|make [a-z]|bon-[a-z]|recorded no command", body), f"no command: {title}"


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
