"""The rules of the house, checked on the source (ast, no imports run):

- no import cycle among the modules of pipeline/, actors/, jobs/ and benchmarks/, counting
  module-level and function-level imports alike;
- no upward arrow: every module sits in one layer of LAYERS (data flows down, results flow back
  up) and imports only from its own layer or the layers below, at any depth (an engine never
  imports the strategy registry; the registry never imports an engine);
- one backend registry (pipeline.engines.backends): the strategies' backends follow from what each
  backend declares it serves, and nothing else lists the backends;
- pipeline/data imports nothing from pipeline.strategies, pipeline.engines or pipeline.config, with
  no per-module exception (plan-time checks and provenance live above it: pipeline.preflight,
  pipeline.provenance);
- pipeline/decoding is pure: it imports nothing from engines, config, data, training, actors, jobs,
  ray, vllm or transformers, opens no files and keeps no module-global mutable state;
- one method registry: every method's record is complete, and nothing else keeps a table of them;
- size limits: no class in pipeline/engines over MAX_ENGINE_CLASS_LINES lines, no function or
  method in pipeline/ over MAX_FUNCTION_LINES lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pipeline", "actors", "jobs", "benchmarks")
LAYERS = (
    ("pipeline.errors",),
    ("pipeline.decoding",),
    ("pipeline.data",),
    ("pipeline.engines",),
    ("pipeline.strategies",),
    ("pipeline.config",),
    ("pipeline.observability", "pipeline.judge", "pipeline.preflight", "pipeline.provenance"),
    ("pipeline.coordinator", "pipeline.training", "pipeline.evaluation"),
    ("pipeline.build",),
    ("actors",),
    ("jobs",),
    ("benchmarks",),
)
"""The layers, bottom first: a module's layer is that of the longest prefix naming it. Files and
errors at the bottom; the pure algorithms; data in and out (no models); the engines (models); the
strategy registry over the algorithms; the config over the registry; then what runs strategies
(coordinator), builds, actors, jobs and benchmarks."""
FORBIDDEN_IN_DECODING = ("pipeline.engines", "pipeline.config", "pipeline.data", "pipeline.training",
                         "pipeline.strategies", "pipeline.build", "pipeline.coordinator", "pipeline.evaluation",
                         "actors", "jobs", "benchmarks", "ray", "vllm", "transformers")
# Calls that read or write files: the builtin open(), and these methods or functions of any module
# (np.load, torch.save, Path.read_text, safetensors' load_file, ...). A Protocol's .open() is a session.
FILE_IO = {"load", "save", "savez", "read_text", "write_text", "read_bytes", "write_bytes", "load_file",
           "save_file", "from_pretrained", "save_pretrained", "read_table", "write_table"}


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imports(path: Path, name: str, known: set[str]) -> list[tuple[str, int]]:
    """(imported name, line) for every import in the file, at any depth; relative imports resolved.
    ``from a.b import c`` names the module a.b.c when it exists, else a.b."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.append((full if full in known else base, node.lineno))
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    edges = {}
    for name, path in mods.items():
        targets = set()
        for target, _ in imports(path, name, known):
            # a.b.c imported: the longest project module that prefixes it
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
        edges[name] = targets
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_planted_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def layer(module: str) -> int:
    """The index in LAYERS of ``module``'s layer (longest matching prefix)."""
    best, found = -1, None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), index
    if found is None:
        raise AssertionError(f"{module}: in no layer of LAYERS; add it where it belongs")
    return found


def upward_arrows(edges: dict[str, set[str]]) -> list[str]:
    """Every import of a module from a layer above its own."""
    return sorted(f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
                  for a, targets in edges.items() for b in targets if layer(b) > layer(a))


def test_upward_arrow_finder_finds_a_planted_arrow():
    edges = {"pipeline.engines.hf": {"pipeline.strategies", "pipeline.decoding.tree"},
             "pipeline.strategies": {"pipeline.engines.backends"}}
    assert upward_arrows(edges) == ["pipeline.engines.hf (layer 3) imports pipeline.strategies (layer 4)"]
    with pytest.raises(AssertionError, match="in no layer"):
        layer("pipeline.newthing")


def test_no_upward_arrows():
    found = upward_arrows(graph())
    assert not found, "imports from a layer above: " + "; ".join(found)


FORBIDDEN_IN_DATA = ("pipeline.strategies", "pipeline.engines", "pipeline.config")


def data_files() -> list[Path]:
    return sorted((ROOT / "pipeline" / "data").glob("*.py"))


@pytest.mark.parametrize("path", data_files(), ids=lambda p: p.name)
def test_data_imports_nothing_from_strategies_engines_or_config(path):
    """The rule for the whole of pipeline/data, every module alike (LAYERS places the package as one
    layer, below the engines, the registry and the config)."""
    mods = modules()
    name = next(n for n, p in mods.items() if p == path)
    bad = [(target, line) for target, line in imports(path, name, set(mods))
           if any(target == f or target.startswith(f + ".") for f in FORBIDDEN_IN_DATA)]
    assert not bad, f"{path.name} imports " + ", ".join(f"{t} (line {n})" for t, n in bad)


def test_data_is_one_layer():
    assert [p for p in (q for layer_ in LAYERS for q in layer_) if p.startswith("pipeline.data")] == ["pipeline.data"]


def decoding_files() -> list[Path]:
    return sorted((ROOT / "pipeline" / "decoding").glob("*.py"))


@pytest.mark.parametrize("path", decoding_files(), ids=lambda p: p.name)
def test_decoding_imports_nothing_it_may_not(path):
    mods = modules()
    name = next(n for n, p in mods.items() if p == path)
    bad = [(target, line) for target, line in imports(path, name, set(mods))
           if any(target == f or target.startswith(f + ".") for f in FORBIDDEN_IN_DECODING)]
    assert not bad, f"{path.name} imports " + ", ".join(f"{t} (line {n})" for t, n in bad)


@pytest.mark.parametrize("path", decoding_files(), ids=lambda p: p.name)
def test_decoding_opens_no_files_and_keeps_no_global_state(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            fn = node.func
            if isinstance(fn, ast.Name):
                assert fn.id != "open" and fn.id not in FILE_IO, f"{path.name}:{node.lineno} calls {fn.id}() (file I/O)"
            elif isinstance(fn, ast.Attribute):
                assert fn.attr not in FILE_IO, f"{path.name}:{node.lineno} calls .{fn.attr}() (file I/O)"
        assert not isinstance(node, ast.Global), f"{path.name}:{node.lineno}: global statement"
    for node in tree.body:  # module level
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
            isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
            and value.func.id in ("dict", "list", "set", "defaultdict", "OrderedDict", "Counter"))
        assert not mutable, f"{path.name}:{node.lineno}: module-level mutable state"


def test_purity_check_catches_a_planted_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from pipeline.engines.hf import HFEngine\n_CACHE: dict = {}\n")
    reads = tmp_path / "reads.py"
    reads.write_text("import numpy as np\ndef f(path):\n    return np.load(path)\n")
    assert imports(bad, "pipeline.decoding.bad", set())[0][0] == "pipeline.engines.hf"
    with pytest.raises(AssertionError, match="module-level mutable state"):
        test_decoding_opens_no_files_and_keeps_no_global_state(bad)
    with pytest.raises(AssertionError, match="file I/O"):
        test_decoding_opens_no_files_and_keeps_no_global_state(reads)


def test_every_strategy_has_one_complete_record():
    from pipeline.engines.backends import BACKENDS, SEARCH, SESSIONS
    from pipeline.strategies import STRATEGIES, lookup

    assert STRATEGIES and all(isinstance(name, str) for name in STRATEGIES)
    for name, record in STRATEGIES.items():
        assert record.name == name and callable(record.run) and record.summary
        assert lookup(name) is record
        for alias in record.aliases:
            assert lookup(alias) is record
        assert record.search is None or callable(record.search)
        assert record.needs == (SEARCH if record.search is not None else SESSIONS)
        # Its backends are exactly those that serve what it needs, and at least one does.
        assert record.backends == tuple(b for b, r in BACKENDS.items() if record.needs in r.serves)
        assert record.backends, f"{name}: no backend serves {record.needs}"
        assert not hasattr(type(record), "__dataclass_fields__") or "backends" not in record.__dataclass_fields__


def test_one_backend_registry():
    """Backend names are listed once (pipeline.engines.backends.BACKENDS): no other module compares
    a backend setting with a name, and actors load engines through the registry."""
    import re

    from pipeline.engines.backends import BACKENDS

    names = "|".join(BACKENDS)
    compare = re.compile(rf"""(backend\w*\s*(==|!=|in)\s*\(?["']({names})["'])|(\(["']({names})["'], ["']({names})["']\))""")
    for module, path in modules().items():
        if module == "pipeline.engines.backends":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not compare.search(line), f"{path.relative_to(ROOT)}:{number} lists backends: {line.strip()}"


def test_engines_do_not_look_strategies_up():
    """An engine runs the search function it is given (Generator.search): no engine module names the
    strategy registry, even in a string or a function-level import."""
    for path in sorted((ROOT / "pipeline" / "engines").glob("*.py")):
        text = path.read_text()
        assert "pipeline.strategies" not in text and "STRATEGIES" not in text, path.name


def test_no_second_table_of_methods():
    """The old tables (STRATEGIES, STRATEGY_PARAMS, MODEL_SIDE, USES_DRAFT, VLLM_STRATEGIES) are gone."""
    for path in modules().values():
        text = path.read_text()
        for table in ("STRATEGY_PARAMS", "MODEL_SIDE", "USES_DRAFT", "VLLM_STRATEGIES", "STRATEGIES ="):
            assert table not in text, f"{path.relative_to(ROOT)} keeps its own table {table}"


def test_every_exception_class_is_in_the_errors_module():
    """pipeline/errors.py holds every exception class of the project (a leaf every layer imports)."""
    import builtins

    errors = ast.parse((ROOT / "pipeline" / "errors.py").read_text())
    ours = {n.name for n in errors.body if isinstance(n, ast.ClassDef)}
    exceptions = ours | {name for name, value in vars(builtins).items()
                         if isinstance(value, type) and issubclass(value, BaseException)}
    for module, path in modules().items():
        if module == "pipeline.errors":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                assert not bases & exceptions, f"{path.relative_to(ROOT)}:{node.lineno} defines exception {node.name}"


# -- size limits -------------------------------------------------------------------------------------

MAX_ENGINE_CLASS_LINES = 250
MAX_FUNCTION_LINES = 80


def long_definitions(paths: list[Path], kinds: tuple[type, ...], limit: int) -> dict[str, int]:
    """'path: name' -> lines, for each definition of ``kinds`` (at any depth: methods and nested
    functions too) in ``paths`` longer than ``limit`` lines, from its ``def`` or ``class`` line to
    its last line, docstring included."""
    out = {}
    for path in paths:
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, kinds) and node.end_lineno - node.lineno + 1 > limit:
                out[f"{where}: {node.name}"] = node.end_lineno - node.lineno + 1
    return out


def listing(found: dict[str, int]) -> str:
    return "; ".join(f"{name} ({lines} lines)" for name, lines in sorted(found.items()))


def test_length_check_finds_a_planted_long_function_and_class(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("class Big:\n    def long(self):\n" + "        x = 1\n" * 80 + "\n\ndef short():\n    pass\n")
    functions = long_definitions([planted], (ast.FunctionDef, ast.AsyncFunctionDef), 80)
    assert [(name.rsplit(": ", 1)[1], lines) for name, lines in functions.items()] == [("long", 81)]
    assert list(long_definitions([planted], (ast.ClassDef,), 81).values()) == [82]


def test_no_engine_class_over_the_limit():
    over = long_definitions(sorted((ROOT / "pipeline" / "engines").rglob("*.py")), (ast.ClassDef,),
                            MAX_ENGINE_CLASS_LINES)
    assert not over, f"engine classes over {MAX_ENGINE_CLASS_LINES} lines: {listing(over)}"


def test_no_function_over_the_limit():
    over = long_definitions(sorted((ROOT / "pipeline").rglob("*.py")), (ast.FunctionDef, ast.AsyncFunctionDef),
                            MAX_FUNCTION_LINES)
    assert not over, f"functions in pipeline/ over {MAX_FUNCTION_LINES} lines: {listing(over)}"
