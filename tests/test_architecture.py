"""The package's shape: layers import only downward and the units of one layer never import each other
(imports plain and relative, and strings naming modules, all count), ARCHITECTURE.md names every module,
and the registry is the only list of implementations."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from cases import CASES
from test_oracle_suite import check_against_oracle

import tpuattn
from tpuattn import registry
from tpuattn.impl.reference import reference_attention
from tpuattn.measure import bench

PACKAGE = Path(tpuattn.__file__).resolve().parent
ROOT = PACKAGE.parent
# The command-line entries: each, imported, is the module it runs (the same object in sys.modules), so
# an edge to one is an edge to the module it stands for. They are the only modules allowed to share a
# name with another (test_no_two_modules_share_a_name).
ALIASES = {"tpuattn.bench": "tpuattn.measure.bench", "tpuattn.aot": "tpuattn.measure.aot"}
# A string literal naming a module or something in one ("tpuattn.impl.xla", "tpuattn.x.function").
DOTTED = re.compile(r"tpuattn(\.[A-Za-z_]\w*)+")


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {_module_name(p, package): p for p in sorted(package.rglob("*.py"))}


def _imports(path: Path, module: str) -> set[str]:
    """Names ``path`` (the module ``module``) reaches, at any depth of the file (function-level imports
    count too): ``import x``, ``from x import y`` (``x`` and ``x.y``), relative imports (``from . import
    y``, ``from ..spec import z``) and string literals naming a ``tpuattn`` module, as in
    ``importlib.import_module("tpuattn.impl.xla")`` or a table of module paths."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: level 1 is this package, 2 its parent, ...
                parts = package.split(".")
                assert node.level <= len(parts), f"{path}: relative import above the package"
                base = ".".join(parts[:len(parts) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module
            found.add(source)
            found.update(f"{source}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and DOTTED.fullmatch(node.value):
            found.add(node.value)
    return found


def _resolve(name: str, modules) -> str | None:
    """The module ``name`` is or lies in (its longest prefix that is a module), aliases followed."""
    parts = name.split(".")
    for stop in range(len(parts), 1, -1):  # never the root: "tpuattn.nothing" names no module
        prefix = ".".join(parts[:stop])
        if prefix in modules:
            return ALIASES.get(prefix, prefix)
    return None


def _graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    modules = _modules(package)
    graph = {}
    for name, path in modules.items():
        deps = set()
        for found in _imports(path, name):
            # "from tpuattn.pallas import compat" names a module; "from tpuattn.spec import MaskSpec" is
            # tpuattn.spec (as "tpuattn.spec.MaskSpec" resolves to it); a plain "import tpuattn" is the root.
            if found in modules or DOTTED.fullmatch(found):
                deps.add(found if found in modules else _resolve(found, modules))
        graph[name] = {ALIASES.get(dep, dep) for dep in deps if dep} - {name, ALIASES.get(name, name)}
    return graph


def test_the_graph_reads_relative_imports_strings_and_aliases(tmp_path):
    pkg = tmp_path / "tpuattn"
    (pkg / "impl").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "spec.py": "",
        "chips.py": "",
        "registry.py": "T = ('tpuattn.impl.xla', 'tpuattn.spec.MaskSpec', 'tpuattn.no', 'see tpuattn.chips')",
        "measure.py": "def f():\n    import importlib\n    return importlib.import_module('tpuattn.bench')",
        "bench.py": "",
        "impl/__init__.py": "from . import xla",
        "impl/xla.py": "from .. import chips\nfrom ..spec import MaskSpec\nfrom . import common",
        "impl/common.py": "from .xla import f",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = _graph(pkg)
    assert graph["tpuattn.registry"] == {"tpuattn.impl.xla", "tpuattn.spec"}
    assert graph["tpuattn.impl"] == {"tpuattn.impl.xla"}
    assert graph["tpuattn.impl.xla"] == {"tpuattn", "tpuattn.chips", "tpuattn.spec", "tpuattn.impl",
                                         "tpuattn.impl.common"}
    assert graph["tpuattn.impl.common"] == {"tpuattn.impl.xla"}
    assert graph["tpuattn.measure"] == {"tpuattn.measure.bench"}  # tpuattn.bench is that module


def _find_cycle(graph):
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle():
    graph = _graph()
    # A package's __init__ importing its own submodules is how a package exposes them, not a cycle
    # between layers; everything else counts.
    for name in graph:
        graph[name] = {dep for dep in graph[name] if not (name + ".").startswith(dep + ".")}
    assert _find_cycle(graph) is None, " -> ".join(_find_cycle(graph))


def test_the_cycle_finder_finds_cycles():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


# The layers ARCHITECTURE.md draws, bottom to top. A module imports only from layers below its own,
# and the units of one layer (the entries of a tuple: a module or a package) are siblings: none
# imports another.
LAYERS = [
    # facts: each imports only the standard library and JAX
    ("tpuattn._checks", "tpuattn.errors", "tpuattn.chips", "tpuattn.softmax", "tpuattn.sharding"),
    ("tpuattn.numerics", "tpuattn.sinks"),  # the one matmul reads the target chip's backend
    ("tpuattn.spec", "tpuattn.options"),
    ("tpuattn.registry", "tpuattn.supports"),
    ("tpuattn.impl", "tpuattn.pallas"),
    ("tpuattn.lesson",),  # notebook 03's kernels as package code, impl="lesson" among them
    ("tpuattn.api",),
    # Beyond one call on one chip: many chips (sharded and ring attention) and decode over a KV cache.
    # Both build on the contract and the kernels below and are measured and modelled by the layers above.
    ("tpuattn.parallel", "tpuattn.decode", "tpuattn.flax"),
    ("tpuattn.lm",),  # in a model: a small transformer trained and served through both contracts
    ("tpuattn.measure",),
    ("tpuattn.model",),
    ("tpuattn.viz", "tpuattn.exercises"),
    ("tpuattn.puzzles",),  # teaching: kernel puzzles, checked by the layers below
]
# Inside a package whose files ARCHITECTURE.md orders, the same two rules, file by file.
INSIDE = {
    "tpuattn.pallas": [("compat",), ("layout",), ("blocks",), ("plan",), ("forward", "backward"), ("vjp",)],
    "tpuattn.puzzles": [("core",), ("forward_puzzles", "backward_puzzles", "capstones")],
}


def _place(module: str, layers) -> tuple[int, str] | None:
    """(index of the layer, the unit) that holds ``module``, or None."""
    for index, units in enumerate(layers):
        for unit in units:
            if module == unit or module.startswith(unit + "."):
                return index, unit
    return None


def _layer_violations(graph, layers) -> list[str]:
    found = []
    for name, deps in sorted(graph.items()):
        here = _place(name, layers)
        for dep in sorted(deps):
            there = _place(dep, layers)
            if here is None or there is None:
                continue
            if there[0] > here[0]:
                found.append(f"{name} imports {dep}, a layer above it")
            elif there[0] == here[0] and there[1] != here[1]:
                found.append(f"{name} imports {dep}, a sibling in its layer ({there[1]} beside {here[1]})")
    return found


def test_layers_import_only_downward_and_siblings_never_import_each_other():
    assert _layer_violations(_graph(), LAYERS) == []


def test_inside_ordered_packages_files_import_only_downward():
    graph = _graph()
    found = []
    for package, order in INSIDE.items():
        layers = [tuple(f"{package}.{name}" for name in units) for units in order]
        inside = {name: {d for d in deps if d.startswith(package + ".")}
                  for name, deps in graph.items() if name.startswith(package + ".")}
        unplaced = [name for name in inside if _place(name, layers) is None]
        assert unplaced == [], f"{unplaced}: add them to the order ARCHITECTURE.md draws for {package}"
        found += _layer_violations(inside, layers)
    assert found == []


def test_the_layer_rules_catch_upward_and_sibling_edges():
    layers = [("a", "b"), ("c",)]
    graph = {"a.x": {"b.y", "a.z"}, "b.y": set(), "a.z": set(), "c": {"a.x"}, "a": {"c"}}
    assert _layer_violations(graph, layers) == ["a imports c, a layer above it",
                                                "a.x imports b.y, a sibling in its layer (b beside a)"]


def test_every_module_has_a_layer():
    # The package root and the command-line entries (aliases of modules below).
    kept_paths = {"tpuattn", *ALIASES}
    assert [name for name in _graph() if _place(name, LAYERS) is None and name not in kept_paths] == []


# The two halves ARCHITECTURE.md draws: the contract and its kernels (`lesson`, notebook 03's kernel, is
# one of the implementations), and the course's instruments that measure, model, draw and teach them.
# The facts beneath (errors, chips, numerics, ...) serve both.
CONTRACT = ("tpuattn.api", "tpuattn.spec", "tpuattn.options", "tpuattn.registry", "tpuattn.softmax",
            "tpuattn.sinks", "tpuattn.impl", "tpuattn.pallas", "tpuattn.lesson", "tpuattn.parallel",
            "tpuattn.decode", "tpuattn.flax")
INSTRUMENTS = ("tpuattn.measure", "tpuattn.model", "tpuattn.viz", "tpuattn.puzzles", "tpuattn.lm",
               "tpuattn.exercises", *ALIASES)


def _in(module: str, half) -> bool:
    return any(module == unit or module.startswith(unit + ".") for unit in half)


def _crossings(graph, lower, upper) -> list[str]:
    """For each module of ``lower`` that reaches a module of ``upper`` at any depth (through any module,
    the package root included), one shortest path ``a -> ... -> b``."""
    found = []
    for start in sorted(name for name in graph if _in(name, lower)):
        parent, queue = {start: None}, [start]
        while queue:
            node = queue.pop(0)
            if _in(node, upper):
                path = [node]
                while parent[path[-1]] is not None:
                    path.append(parent[path[-1]])
                found.append(" -> ".join(reversed(path)))
                break
            for dep in sorted(graph.get(node, ())):
                if dep not in parent:
                    parent[dep] = node
                    queue.append(dep)
    return found


def test_the_contract_half_imports_nothing_from_the_instruments():
    graph = _graph()
    assert [name for name in graph if _in(name, CONTRACT)], "the contract half names no module"
    assert _crossings(graph, CONTRACT, INSTRUMENTS) == []


def test_the_crossing_check_follows_imports_at_any_depth():
    graph = {"tpuattn.api": {"tpuattn.chips"}, "tpuattn.chips": {"tpuattn.model.roofline"},
             "tpuattn.spec": {"tpuattn.errors"}, "tpuattn.errors": set(),
             "tpuattn.model.roofline": {"tpuattn.api"}}
    assert _crossings(graph, CONTRACT, INSTRUMENTS) == [
        "tpuattn.api -> tpuattn.chips -> tpuattn.model.roofline"]


# Names that two modules still share, each pair with why; every other module's last name is its own. A
# command-line entry shares its module's name (ALIASES). Remove a row when its modules are renamed.
SHARED_NAMES = {
    # The decode contract's files mirror the attention contract's (its own spec, registry, api, reference).
    "api": {"tpuattn.api", "tpuattn.decode.api"},
    "spec": {"tpuattn.spec", "tpuattn.decode.spec"},
    "registry": {"tpuattn.registry", "tpuattn.decode.registry"},
    "reference": {"tpuattn.impl.reference", "tpuattn.decode.reference"},
}


def _shared_names(modules) -> dict[str, set[str]]:
    by_name: dict[str, set[str]] = {}
    for module in modules:
        if module != "tpuattn":
            by_name.setdefault(module.rpartition(".")[2], set()).add(ALIASES.get(module, module))
    return {name: found for name, found in by_name.items() if len(found) > 1}


def test_no_two_modules_share_a_name():
    assert _shared_names(_modules()) == SHARED_NAMES
    twins = ["tpuattn.bench", "tpuattn.measure.bench", "tpuattn.pallas.plan", "tpuattn.parallel.plan"]
    assert _shared_names(twins) == {"plan": {"tpuattn.pallas.plan", "tpuattn.parallel.plan"}}


def _architecture_blocks() -> list[str]:
    """ARCHITECTURE.md cut into table rows and paragraphs (a file is named where its package is)."""
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    blocks = []
    for paragraph in re.split(r"\n\s*\n", text):
        rows = paragraph.splitlines()
        blocks += rows if paragraph.lstrip().startswith("|") else [paragraph]
    return blocks


def _named(module: str, blocks) -> bool:
    """``tpuattn.pkg.file`` is named by `tpuattn.pkg.file` or `pkg/file.py` anywhere, or by `file`
    (or `file.py`) in a row or paragraph that names `pkg/`; ``tpuattn.file`` by `file.py`."""
    parts = module.split(".")[1:]
    dotted = re.compile(rf"`[^`]*\b{re.escape(module)}\b[^`]*`")
    path = re.compile(rf"`{re.escape('/'.join(parts))}(\.py|/)?`")
    for block in blocks:
        if dotted.search(block) or path.search(block):
            return True
        if len(parts) > 1 and f"`{'/'.join(parts[:-1])}/`" in block and re.search(
                rf"`{re.escape(parts[-1])}(\.py)?`", block):
            return True
    return False


def test_architecture_names_every_module():
    blocks = _architecture_blocks()
    missing = [name for name in _modules() if name != "tpuattn" and not _named(name, blocks)]
    assert missing == [], f"ARCHITECTURE.md does not name {missing}"


def test_the_name_check_reads_rows_and_paragraphs():
    blocks = ["| x | `impl/` (`reference`, `xla.py`) | ... |", "Inside `pallas/`: `compat` <- `layout`",
              "`tpuattn.bench` is kept; `model/published.py` holds"]
    for module in ("tpuattn.impl.reference", "tpuattn.impl.xla", "tpuattn.pallas.compat", "tpuattn.bench",
                   "tpuattn.model.published", "tpuattn.impl", "tpuattn.pallas"):
        assert _named(module, blocks), module
    for module in ("tpuattn.impl.compat", "tpuattn.pallas.reference", "tpuattn.model", "tpuattn.spec"):
        assert not _named(module, blocks), module


# ---------------------------------------------------------------------------- one registration
def _toy(q, k, v, segment_ids, spec, **options):
    """A new implementation: the reference computed on time-reversed sequences, reversed back."""
    flip = lambda x: None if x is None else x[:, ::-1]
    if spec.causal or spec.window is not None:
        return reference_attention(q, k, v, segment_ids, spec, **options)
    segs = None if segment_ids is None else tuple(flip(s) for s in segment_ids)
    return flip(reference_attention(flip(q), flip(k), flip(v), segs, spec, **options))


@pytest.fixture
def toy():
    tpuattn.implementations()  # load the built-in ones first
    tpuattn.register("toy", _toy, description="reference on reversed sequences",
                     auto_rank=lambda spec, backend: -1.0)
    yield "toy"
    registry.unregister("toy")


def test_one_registration_reaches_every_consumer(toy, tmp_path):
    assert toy in tpuattn.implementations()
    # The oracle suite.
    for case in CASES[:3] + [c for c in CASES if c.name in ("segments", "gqa")]:
        check_against_oracle(toy, case)
    # The auto rule: its rank makes it the automatic choice.
    spec = tpuattn.spec_from_shapes(64, num_q_heads=2)
    assert tpuattn.choose(spec, "cpu").impl == toy
    # The bench CLI.
    results = bench.main(["--impls", f"{toy},reference", "--seq-lens", "16", "--heads", "1",
                          "--head-dim", "8", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path),
                          "--no-progress"])
    assert {row["impl"] for row in results.rows if row["status"] == "ok"} == {toy, "reference"}


def test_duplicate_registration_raises_unless_replace(toy):
    with pytest.raises(ValueError, match=r"^name: an implementation named 'toy' is already registered"):
        tpuattn.register("toy", _toy, description="again")
    record = tpuattn.register("toy", _toy, description="replaced", replace=True)
    assert tpuattn.api.get_implementation("toy") is record


def test_auto_choice_is_observable():
    spec = tpuattn.spec_from_shapes(256, num_q_heads=2, softcap=30.0)
    choice = tpuattn.choose(spec, "cpu")
    assert choice.impl == "blockwise"
    assert ("xla", tpuattn.api.get_implementation("xla").supports(spec, "cpu")) in choice.refused
    assert "blockwise" in str(choice)


def test_int_window_means_both_sides():
    assert tpuattn.spec_from_shapes(64, window=8) == tpuattn.spec_from_shapes(64, window=(8, 8))
    assert tpuattn.spec_from_shapes(64, window=np.int64(8)).window == (8, 8)
    with pytest.raises(ValueError, match=r"^window: expected a non-negative left extent, got -1$"):
        tpuattn.spec_from_shapes(64, window=(-1, 2))
    with pytest.raises(TypeError, match=r"^dtype: expected one of"):
        tpuattn.spec_from_shapes(64, dtype=jnp.int32)
