"""The registry machinery: lazy, order-free registration, one ``choose``/``resolve`` for every contract.

The subprocess tests start a fresh interpreter, so what ``import tpuattn`` loads is not hidden by
modules this test session imported already.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import tpuattn
from tpuattn import api, decode, registry
from tpuattn.errors import TpuattnError, UnavailableImplementation, UnsupportedInput
from tpuattn.impl.reference import reference_attention
from tpuattn.registry import Implementation, Registry, Subset

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _run(script: str) -> str:
    """Run ``script`` in a fresh interpreter (tests/ and the repository on its path); its stdout."""
    path = os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


# ---------------------------------------------------------------------------- lazy
KERNEL_PREFIXES = ("tpuattn.impl.", "tpuattn.pallas", "tpuattn.decode.kernel", "tpuattn.decode.native",
                          "tpuattn.decode.reference", "tpuattn.parallel", "jax.experimental.pallas")


def test_importing_the_bottom_layers_loads_no_implementation():
    out = _run(f"""
        import sys
        import tpuattn, tpuattn.chips, tpuattn.spec, tpuattn.registry, tpuattn.api
        prefixes = {KERNEL_PREFIXES!r}
        loaded = sorted(m for m in sys.modules if m.startswith(prefixes) or m in ("tpuattn.impl",))
        assert not loaded, loaded
        # Names are known without importing anything.
        assert tpuattn.known_implementations() == ("reference", "xla", "blockwise", "pallas", "splash",
                                                   "tokamax", "lesson")
        assert tpuattn.decode.known_implementations()[:2] == ("reference", "pallas")
        assert not [m for m in sys.modules if m.startswith(prefixes)]
        # A named implementation imports its own module only.
        tpuattn.api.get_implementation("xla")
        assert "tpuattn.impl.xla" in sys.modules and "tpuattn.pallas" not in sys.modules
        print("ok")
        """)
    assert out.strip().endswith("ok")


def test_a_failing_dependency_leaves_the_others_working():
    # JAX 0.9.2's Pallas interpreter imports absl, which JAX does not declare: without absl, importing
    # jax.experimental.pallas fails. Blocking absl alone does not break Pallas on every JAX, so the
    # finder also makes importing Pallas import absl, as 0.9.2 does.
    out = _run("""
        import importlib.abc, sys

        class NoAbsl(importlib.abc.MetaPathFinder):
            def find_spec(self, fullname, path, target=None):
                if fullname == "absl" or fullname.startswith("absl."):
                    raise ModuleNotFoundError("No module named 'absl'", name="absl")
                if fullname == "jax.experimental.pallas" or fullname.startswith("jax.experimental.pallas."):
                    import absl  # noqa: F401  (what JAX 0.9.2's Pallas interpreter does)
                return None

        assert "absl" not in sys.modules
        sys.meta_path.insert(0, NoAbsl())
        import numpy as np
        import tpuattn
        from oracle import oracle_attention

        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((1, 32, 2, 16)).astype(np.float32) for _ in range(3))
        want = oracle_attention(q, k, v, causal=True)
        for impl in ("xla", "reference", "blockwise", "auto"):
            got = np.asarray(tpuattn.attention(q, k, v, causal=True, impl=impl), np.float64)
            np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5, err_msg=impl)

        reason = "importing tpuattn.pallas failed: ModuleNotFoundError: No module named 'absl'"
        try:
            tpuattn.attention(q, k, v, impl="pallas")
        except tpuattn.UnavailableImplementation as error:
            assert reason in str(error), str(error)
            assert str(error).startswith("impl: 'pallas' is not available on backend 'cpu' ("), str(error)
        else:
            raise AssertionError("impl='pallas' ran without Pallas")
        assert "pallas" not in tpuattn.implementations()
        assert "pallas" in tpuattn.known_implementations()
        assert reason in tpuattn.unavailable_implementations()["pallas"]
        spec = tpuattn.make_spec(q, k, v, causal=True)[-1]
        refused = dict(tpuattn.choose(spec, "tpu").refused)
        assert reason in refused["pallas"], refused

        # The other contracts: decode's kernel imports Pallas, its reference does not; the local kernel
        # of tpuattn.parallel falls back to the next partial rank on a TPU.
        from tpuattn import decode, parallel
        assert decode.implementations() == ("reference",), decode.implementations()
        assert "No module named 'absl'" in dict(decode.choose(
            decode.decode_spec_from_shapes(batch=1, q_len=1, num_q_heads=2, num_kv_heads=2, head_dim=16,
                                           capacity=32), "tpu").refused)["pallas"]
        assert parallel._local_impl("auto", spec, "tpu").name == "blockwise"
        assert "jax.experimental.pallas" not in sys.modules
        print("ok")
        """)
    assert out.strip().endswith("ok")


# ---------------------------------------------------------------------------- order-free
def _fn(q, k, v, segment_ids, spec, **options):
    return reference_attention(q, k, v, segment_ids, spec, **options)


@pytest.mark.parametrize("order", [("_tie_low", "_tie_high"), ("_tie_high", "_tie_low")])
def test_auto_ties_go_to_the_lower_priority_whatever_the_order(order):
    priorities = {"_tie_low": 1, "_tie_high": 2}
    spec = tpuattn.spec_from_shapes(64, num_q_heads=2)
    try:
        for name in order:
            tpuattn.register(name, _fn, description="a tie", auto_rank=lambda spec, backend: -5.0,
                             priority=priorities[name])
        choice = tpuattn.choose(spec, "cpu")
        assert choice.impl == "_tie_low"
        assert "priority 1 breaking the tie" in choice.reason
    finally:
        for name in order:
            registry.unregister(name)


def test_equal_priorities_go_by_name_not_order():
    spec = tpuattn.spec_from_shapes(64, num_q_heads=2)
    for order in (("_tie_b", "_tie_a"), ("_tie_a", "_tie_b")):
        try:
            for name in order:
                tpuattn.register(name, _fn, description="a tie", auto_rank=lambda spec, backend: -5.0)
            assert tpuattn.choose(spec, "cpu").impl == "_tie_a"
        finally:
            for name in order:
                registry.unregister(name)


def test_builtins_carry_their_declared_priorities():
    priorities = {name: api.get_implementation(name).priority for name in api.known_implementations()}
    assert priorities == {name: priority for name, (_, priority) in api.IMPLEMENTATION_MODULES.items()}
    assert len(set(priorities.values())) == len(priorities)
    declared = {name: priority for name, (_, priority) in decode.IMPLEMENTATION_MODULES.items()}
    names = decode.known_implementations()
    assert {name: decode.get_implementation(name).priority for name in names} == declared
    assert tpuattn.register("_user", _fn, description="user").priority == registry.DEFAULT_PRIORITY
    registry.unregister("_user")


def test_declared_module_loads_on_first_use(tmp_path, monkeypatch):
    (tmp_path / "lazy_impl_module.py").write_text(textwrap.dedent("""
        import reg_holder
        reg_holder.REGISTRY.register("lazy", lambda *a: "ran", description="lazily imported",
                                     auto_rank=lambda spec, backend: 3.0)
        """))
    (tmp_path / "broken_impl_module.py").write_text("raise RuntimeError('no such accelerator library')\n")
    holder = type(sys)("reg_holder")
    holder.REGISTRY = Registry(Implementation)
    monkeypatch.setitem(sys.modules, "reg_holder", holder)
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = holder.REGISTRY
    reg.declare("broken", "broken_impl_module", priority=1)
    reg.declare("lazy", "lazy_impl_module", priority=2)
    reg.declare("missing", "no_module_of_this_name", priority=3)
    assert reg.known() == ("broken", "lazy", "missing")
    assert "lazy_impl_module" not in sys.modules
    assert reg.get("lazy").priority == 2 and reg.get("lazy").fn() == "ran"
    assert reg.available() == ("lazy",)
    why = reg.unavailable()
    assert why["broken"] == ("not available on this machine: importing broken_impl_module failed: "
                             "RuntimeError: no such accelerator library")
    assert "ModuleNotFoundError: No module named 'no_module_of_this_name'" in why["missing"]
    spec = tpuattn.spec_from_shapes(64, num_q_heads=2)
    choice = reg.choose(spec, "cpu")
    assert choice.impl == "lazy"
    assert dict(choice.refused) == {"broken": why["broken"], "missing": why["missing"]}
    expected = r"^impl: 'broken' is not available on backend '\w+' \(importing broken_impl_module failed: "
    with pytest.raises(UnavailableImplementation, match=expected + "RuntimeError"):
        reg.resolve("broken", spec, "cpu")
    with pytest.raises(UnavailableImplementation, match="no such accelerator library"):
        reg.get("broken").fn()
    # A user's registration replaces the stand-in of a module that failed.
    reg.register("broken", lambda *a: "fixed", description="now here")
    assert reg.resolve("broken", spec, "cpu").fn() == "fixed"
    sys.modules.pop("lazy_impl_module", None)


# ---------------------------------------------------------------------------- one machinery, one family
def test_errors_are_one_family_of_value_errors():
    assert issubclass(UnsupportedInput, TpuattnError) and issubclass(UnavailableImplementation, TpuattnError)
    assert issubclass(TpuattnError, ValueError)
    spec = tpuattn.spec_from_shapes(64, num_q_heads=2)
    with pytest.raises(TpuattnError, match=r"^impl: expected one of \[.*'reference'.*'auto'\], got 'nope'$"):
        api.resolve("nope", spec, "cpu")
    with pytest.raises(TpuattnError, match=r"^backend: expected one of \['cpu', 'gpu', 'tpu'\], got 'npu'$"):
        tpuattn.choose(spec, "npu")


def test_decode_uses_the_same_machinery():
    assert isinstance(decode.registry.REGISTRY, Registry) and isinstance(api.REGISTRY, Registry)
    spec = decode.decode_spec_from_shapes(batch=2, q_len=2, num_q_heads=4, num_kv_heads=2, head_dim=128,
                                          page_size=16, num_pages=8, pages_per_sequence=4)
    choice = decode.choose(spec, "cpu")
    assert isinstance(choice, tpuattn.Choice) and choice.impl == "reference"
    refused = dict(choice.refused)
    assert refused["pallas"] == "not an automatic choice on cpu"
    assert refused["jax_paged"] == decode.get_implementation("jax_paged").supports(spec, "cpu")
    with pytest.raises(TpuattnError, match=r"^impl: expected one of \[.*'jax_paged'.*'auto'\], got 'nope'$"):
        decode.attention(np.zeros((2, 1, 4, 8), np.float32), np.zeros((2, 16, 2, 8), np.float32),
                         np.zeros((2, 16, 2, 8), np.float32), np.array([3, 5]), impl="nope")
    with pytest.raises(TpuattnError, match=r"^name: a decode implementation named 'reference' is already"):
        decode.registry.register("reference", _fn, description="again")


def test_parallel_chooses_its_local_kernel_by_partial_rank():
    from tpuattn import parallel

    spec = tpuattn.spec_from_shapes(256, num_q_heads=2)
    assert parallel._local_impl("auto", spec, "cpu").name == "blockwise"
    assert parallel._local_impl("auto", spec, "tpu").name == "pallas"
    choice = tpuattn.choose(spec, "tpu", subset=api.RETURNS_PARTIALS)
    assert choice.impl == "pallas"
    assert dict(choice.refused)["xla"] == "not an implementation that returns partial results"
    assert set(parallel.local_implementations()) == {"reference", "blockwise", "pallas"}
    expected = r"^impl: expected an implementation that returns partial results \(one of \[.*'blockwise'.*\] "
    with pytest.raises(UnsupportedInput, match=expected + r"or 'auto'\), got 'xla'$"):
        parallel._local_impl("xla", spec, "cpu")
    # A user implementation with partial results and a better partial rank takes over.
    partial = api.get_implementation("reference").partial
    tpuattn.register("_local", _fn, description="partials", partial=partial,
                     partial_rank=lambda spec, backend: -1.0)
    try:
        assert parallel._local_impl("auto", spec, "cpu").name == "_local"
    finally:
        registry.unregister("_local")


def test_subset_filters_and_ranks_by_its_field():
    reg = Registry(Implementation)
    reg.register("a", _fn, description="a", auto_rank=lambda s, b: 0.0, partial_rank=lambda s, b: 5.0,
                 partial=api.get_implementation("reference").partial)
    reg.register("b", _fn, description="b", auto_rank=lambda s, b: 1.0, partial_rank=lambda s, b: 2.0,
                 partial=api.get_implementation("reference").partial)
    reg.register("c", _fn, description="c", auto_rank=lambda s, b: -1.0)
    spec = tpuattn.spec_from_shapes(64, num_q_heads=2)
    assert reg.choose(spec, "cpu").impl == "c"
    choice = reg.choose(spec, "cpu", subset=api.RETURNS_PARTIALS)
    assert (choice.impl, choice.reason) == ("b", "lowest partial rank (2) among the candidates; then a (5)")
    never = Subset("is never picked", lambda record: False)
    with pytest.raises(UnsupportedInput, match=r"^impl: no registered implementation that is never picked "
                                               r"supports this input on cpu: a: not an implementation"):
        reg.choose(spec, "cpu", subset=never)
