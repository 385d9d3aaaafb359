"""The package's shape: layers import only downward, and the registry is the only list of implementations."""

from __future__ import annotations

import ast
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


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """tpuattn modules ``path`` imports, at any depth of the file (function-level imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "tpuattn" or name.startswith("tpuattn.")}


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        # "from tpuattn.pallas import compat" names a module; "from tpuattn.spec import MaskSpec" does not.
        graph[name] = {dep for dep in _imports(path) if dep in modules and dep != name}
    return graph


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


# Lower layers never import higher ones (the order ARCHITECTURE.md draws).
LAYERS = [
    ("tpuattn._checks", "tpuattn.errors", "tpuattn.chips"),
    ("tpuattn.spec",),
    ("tpuattn.registry",),
    ("tpuattn.impl", "tpuattn.pallas"),
    ("tpuattn.api",),
    # Beyond one call on one chip: many chips (sharded and ring attention) and decode over a KV cache.
    # Both build on the contract and the kernels below and are measured and modelled by the layers above.
    ("tpuattn.parallel", "tpuattn.decode"),
    ("tpuattn.measure",),
    ("tpuattn.model",),
    ("tpuattn.viz", "tpuattn.exercises"),
]


def _layer(module: str) -> int | None:
    for index, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    return None


def test_layers_import_only_downward():
    upward = []
    for name, deps in _graph().items():
        here = _layer(name)
        for dep in deps:
            there = _layer(dep)
            if here is not None and there is not None and there > here:
                upward.append(f"{name} imports {dep}")
    assert not upward, upward


def test_every_module_has_a_layer():
    # The package root, two kept import paths and the compile-report CLI (aliases of modules below).
    kept_paths = {"tpuattn", "tpuattn.bench", "tpuattn.roofline", "tpuattn.aot"}
    assert [name for name in _graph() if _layer(name) is None and name not in kept_paths] == []


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
