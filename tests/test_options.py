"""Typed options: every implementation's options are one frozen record (tpuattn.options), validated on
construction with the field, what was expected and what was given; listed by tpuattn.options_of and in
tpuattn.choose's answer; one Blocks type for every tiled implementation (old spellings read into it);
tpuattn.parallel forwards only what its local kernel declares; interpret resolved one way. The decode
contract's split-K kernel reads DecodeKernelOptions (listed by tpuattn.decode.options_of) and the lesson
kernel LessonOptions.

Values are checked against the float64 NumPy oracle (tests/oracle.py); that block sizes reach a
kernel is read from the Pallas grid of the traced program (``q_len // block_q`` query blocks).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_grads_close, random_qkv
from jax.sharding import Mesh
from oracle import oracle_attention, oracle_grads

import tpuattn
from tpuattn import api, chips, decode, options, parallel
from tpuattn.errors import TpuattnError, UnsupportedInput
from tpuattn.options import (
    Blocks,
    BlockwiseOptions,
    DecodeKernelOptions,
    LessonOptions,
    PallasOptions,
    SplashOptions,
)

TILED = ("blockwise", "splash", "pallas", "lesson")


def _pallas_grids(fn, *args) -> list[tuple[int, ...]]:
    """The grid of every ``pallas_call`` in the traced program of ``fn(*args)``, nested jaxprs included."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found.append(tuple(eqn.params["grid_mapping"].grid))
            for param in eqn.params.values():
                for sub in param if isinstance(param, tuple | list) else (param,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


# ---------------------------------------------------------------------------- construction
@pytest.mark.parametrize("field,value", [("block_q", 0), ("block_kv", -128), ("backward_block_q", True),
                                         ("backward_block_kv", 1.5), ("block_q", "128")])
def test_blocks_refuse_a_bad_size_naming_the_field_expectation_and_value(field, value):
    with pytest.raises(TpuattnError, match=rf"^blocks\.{field}: expected a positive int, got {value!r} "
                                           rf"\(or None: the implementation's default\)$"):
        Blocks(**{field: value})


def test_blocks_are_frozen_and_numpy_ints_become_python_ints():
    blocks = Blocks(block_q=np.int64(256))
    assert blocks.block_q == 256 and type(blocks.block_q) is int
    with pytest.raises(dataclasses.FrozenInstanceError):
        blocks.block_q = 128


@pytest.mark.parametrize("record,blocks,field,multiple", [
    (PallasOptions, Blocks(block_q=12), "block_q", 8),
    (PallasOptions, Blocks(block_kv=200), "block_kv", 128),
    (PallasOptions, Blocks(backward_block_q=64), "backward_block_q", 128),
    (SplashOptions, Blocks(block_q=64), "block_q", 128),
    (SplashOptions, Blocks(backward_block_kv=136), "backward_block_kv", 128),
])
def test_a_record_refuses_a_block_off_its_tile_saying_why(record, blocks, field, multiple):
    value = blocks.set()[field]
    with pytest.raises(TpuattnError, match=rf"^blocks\.{field}: expected a multiple of {multiple}, got "
                                           rf"{value} \(impl='{record.IMPL}': .*lanes\)$"):
        record(blocks=blocks)


def test_blockwise_refuses_backward_blocks_it_would_ignore():
    with pytest.raises(TpuattnError, match=r"^blocks\.backward_block_q: expected None for impl='blockwise' "
                                           r"\(it takes \['block_kv', 'block_q'\]\), got 256$"):
        BlockwiseOptions(blocks=Blocks(backward_block_q=256))
    assert BlockwiseOptions(blocks=Blocks(block_q=3, block_kv=5)).blocks.forward == (3, 5)  # any positive


@pytest.mark.parametrize("kwargs,message", [
    (dict(backward="slow"), r"^backward: expected one of \('exact', 'fast'\) \(or None for 'exact'\) for "
                            r"impl='pallas', got 'slow'$"),
    (dict(interpret="yes"), r"^interpret: expected None, True, False, 'simulate' or a pltpu.InterpretParams "
                            r"for impl='pallas', got 'yes'$"),
    (dict(blocks="big"), r"^blocks: expected None, a tpuattn.options.Blocks or a positive int \(every "
                         r"extent\), got 'big'$"),
])
def test_pallas_options_refuse_bad_values_by_name(kwargs, message):
    with pytest.raises(TpuattnError, match=message):
        PallasOptions(**kwargs)


def test_splash_interpret_takes_only_none_or_a_bool():
    with pytest.raises(TpuattnError, match=r"^interpret: expected a bool or None for impl='splash', "
                                           r"got 'simulate'$"):
        SplashOptions(interpret="simulate")


# ---------------------------------------------------------------------------- old spellings
def test_old_spellings_are_read_into_blocks():
    assert PallasOptions.parse({"block_q": 128}).blocks == Blocks(block_q=128)
    assert BlockwiseOptions.parse({"block_q": 64, "block_kv": 32}).blocks == Blocks(64, 32)
    assert SplashOptions.parse({"block_kv": 256}).blocks == Blocks(block_kv=256)
    from tpuattn.pallas import BackwardBlocks, BlockSizes, ForwardBlocks

    sizes = BlockSizes(ForwardBlocks(256, 512), BackwardBlocks(128, 256))
    assert PallasOptions.parse({"block_sizes": sizes}).blocks == Blocks(256, 512, 128, 256)
    assert PallasOptions.parse({"block_sizes": ForwardBlocks(8, 128)}).blocks == Blocks(8, 128)
    assert PallasOptions.parse({"block_sizes": 256}).blocks == Blocks.uniform(256)


def test_block_sizes_given_two_ways_are_refused():
    with pytest.raises(TpuattnError, match=r"^pallas: expected block sizes one way, got blocks= and "
                                           r"\['block_q'\] \(the old spelling of blocks=\)$"):
        PallasOptions.parse({"blocks": Blocks(block_kv=128), "block_q": 128})
    with pytest.raises(TpuattnError, match=r"^pallas: expected block sizes one way, got block_sizes= and "
                                           r"\['block_kv'\]$"):
        PallasOptions.parse({"block_sizes": 128, "block_kv": 128})


def test_an_unknown_option_is_refused_naming_what_the_implementation_takes():
    with pytest.raises(TpuattnError, match=r"^splash: unknown option\(s\) \['backward'\]; expected a subset "
                                           r"of \['block_kv', 'block_q', 'blocks', 'interpret'\]$"):
        SplashOptions.parse({"backward": "fast"})


# ---------------------------------------------------------------------------- listed
def test_every_implementation_declares_a_record_and_options_of_lists_it():
    for name in tpuattn.implementations():
        record = api.get_implementation(name).options
        if name not in api.IMPLEMENTATION_MODULES or not isinstance(record, type):
            continue  # a registration of its own may declare names only
        assert issubclass(record, options.Options), name
        listed = tpuattn.options_of(name)
        assert tuple(listed) == record.names(), name
        for field in dataclasses.fields(record):
            assert listed[field.name].endswith(f"= {field.default!r}"), (name, field.name)
        assert ("blocks" in record.fields()) == (name in TILED), name
    assert tpuattn.options_of("reference") == {}
    assert tpuattn.options_of("pallas")["block_q"] == "old spelling, read as blocks.block_q"


def test_choose_shows_the_chosen_implementations_options():
    q, k, v = random_qkv(np.random.default_rng(0), 16, 16)
    spec = tpuattn.make_spec(q, k, v)[-1]
    for backend in ("cpu", "tpu"):
        choice = tpuattn.choose(spec, backend)
        record = api.get_implementation(choice.impl).options
        assert choice.options == record.fields()
        assert set(choice.options) <= set(tpuattn.options_of(choice.impl))
        assert f"options={choice.options!r}" in repr(choice)


# ---------------------------------------------------------------------------- blocks reach the kernels
@pytest.mark.parametrize("impl", TILED)
def test_blocks_and_their_old_spelling_give_the_oracles_answer(impl):
    if impl not in tpuattn.implementations():
        pytest.skip(f"{impl} not available")
    q, k, v = random_qkv(np.random.default_rng(1), 256, 256, q_heads=2, kv_heads=1, head_dim=32)
    want = oracle_attention(q, k, v, causal=True)
    for kwargs in (dict(blocks=Blocks(block_q=128, block_kv=128)), dict(block_q=128, block_kv=128)):
        got = tpuattn.attention(q, k, v, causal=True, impl=impl, **kwargs)
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", ["splash", "pallas"])
def test_backward_blocks_of_their_own_give_the_oracles_gradients(impl):
    if impl not in tpuattn.implementations():
        pytest.skip(f"{impl} not available")
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, 256, 256, q_heads=2, kv_heads=1, head_dim=32)
    d_out = rng.standard_normal(q.shape).astype(np.float32)
    blocks = Blocks(block_q=128, block_kv=128, backward_block_q=256, backward_block_kv=256)
    loss = lambda q, k, v: jnp.sum(tpuattn.attention(q, k, v, causal=True, impl=impl, blocks=blocks) * d_out)
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert_grads_close(grads, oracle_grads(q, k, v, d_out, causal=True), tol=1e-4)


def test_pallas_runs_the_blocks_it_is_given():
    q = jnp.zeros((1, 512, 2, 128), jnp.float32)
    for kwargs, block_q in ((dict(block_q=128), 128), (dict(blocks=Blocks(block_q=256, block_kv=128)), 256),
                            (dict(blocks=Blocks.uniform(128)), 128)):
        attend = lambda q, kw=kwargs: tpuattn.attention(q, q, q, causal=True, impl="pallas", **kw)
        grids = _pallas_grids(attend, q)
        assert len(grids) == 1 and grids[0][2] == 512 // block_q, (kwargs, grids)


# ---------------------------------------------------------------------------- parallel: declared options only
def _mesh():
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 CPU devices (conftest sets XLA_FLAGS)")
    return Mesh(np.array(jax.devices()[:2]), ("h",))


def test_parallel_forwards_block_q_to_pallas_as_blocks():
    """Before: tpuattn.parallel's docstring offered block_q for its local kernel, and pallas refused it
    ("pallas: unknown option(s) ['block_q']")."""
    mesh = _mesh()
    q, k, v = random_qkv(np.random.default_rng(2), 256, 256, q_heads=2, kv_heads=2, head_dim=32)
    got = parallel.attention(q, k, v, mesh=mesh, head_axis="h", impl="pallas", causal=True, block_q=128)
    np.testing.assert_allclose(np.asarray(got), oracle_attention(q, k, v, causal=True), atol=2e-5, rtol=2e-5)
    grids = _pallas_grids(lambda q, k, v: parallel.attention(q, k, v, mesh=mesh, head_axis="h", impl="pallas",
                                                             causal=True, block_q=128), q, k, v)
    assert grids and all(grid[2] == 256 // 128 for grid in grids), grids


@pytest.mark.parametrize("impl,kwargs,message", [
    ("blockwise", dict(backward="fast"), r"^blockwise: unknown option\(s\) \['backward'\]"),
    ("blockwise", dict(blocks=Blocks(backward_block_q=128)), r"^blocks\.backward_block_q: expected None for "
                                                             r"impl='blockwise'"),
    ("pallas", dict(block_q=12), r"^blocks\.block_q: expected a multiple of 8, got 12 \(impl='pallas'"),
    ("reference", dict(block_q=128), r"^reference: unknown option\(s\) \['block_q'\]; expected a subset of "
                                     r"\[\]$"),
])
def test_parallel_refuses_what_its_local_kernel_does_not_declare_before_tracing(impl, kwargs, message,
                                                                                 monkeypatch):
    mesh = _mesh()
    q, k, v = random_qkv(np.random.default_rng(3), 16, 16)
    traced = []
    monkeypatch.setattr(jax, "shard_map", lambda *a, **k: traced.append(1) or (lambda *args: None))
    with pytest.raises(TpuattnError, match=message):
        parallel.attention(q, k, v, mesh=mesh, head_axis="h", impl=impl, **kwargs)
    assert not traced  # refused before the shard_map was built


# ---------------------------------------------------------------------------- interpret, one way
def test_interpret_is_resolved_one_way():
    from tpuattn.decode.native import _interpreting as jax_kernels_interpret
    from tpuattn.pallas import resolve_interpret as pallas_interpret

    assert options.resolve_interpret(None, "x", backend="cpu") is True
    assert options.resolve_interpret(None, "x", backend="tpu") is False
    assert options.resolve_interpret(False, "x", backend="tpu") is False
    assert pallas_interpret(None) is (chips.target_backend() != "tpu")
    with chips.target("v5e"):
        assert pallas_interpret(None) is False
    if chips.target_backend() == "tpu":
        pytest.skip("the refusal is for a target that is not a TPU")
    messages = []
    for refuse in (lambda: options.resolve_interpret(False, "splash"), lambda: pallas_interpret(False),
                   lambda: jax_kernels_interpret(False, "splash")):
        with pytest.raises(UnsupportedInput) as error:
            refuse()
        messages.append(str(error.value).replace("impl='pallas'", "impl='splash'"))
    assert len(set(messages)) == 1 and messages[0].startswith("interpret: expected True or None"), messages


# ---------------------------------------------------------------------------- the VMEM-limit rule
def test_scoped_vmem_limit_is_one_rule():
    from tpuattn.pallas import blocks as pallas_blocks

    chip = chips.get("v5e")
    mib = 1 << 20
    default = chip.kernel_vmem_bytes
    assert options.scoped_vmem_limit(default, 1.0, chip) is None  # fits the compiler's default
    assert options.scoped_vmem_limit(10 ** 12, 2.0, None) is None  # no chip: nothing to size for
    need = default // 2 + 1  # twice it is just over the default: rounded up to the next MiB
    assert options.scoped_vmem_limit(need, 2.0, chip) == -(-(2 * need) // mib) * mib
    assert options.scoped_vmem_limit(chip.vmem_bytes, 2.0, chip) == chip.vmem_bytes  # at most the chip's
    # The Pallas kernels' head blocks use it with their margin; one head a step keeps the default.
    assert pallas_blocks.vmem_limit_bytes(need, 2, chip) == options.scoped_vmem_limit(
        need, pallas_blocks.VMEM_MARGIN, chip)
    assert pallas_blocks.vmem_limit_bytes(need, 1, chip) is None


# ---------------------------------------------------------------------------- the lesson kernel's record
def test_lesson_declares_its_record_and_options_of_lists_it():
    from tpuattn.lesson import flash

    assert api.get_implementation("lesson").options is LessonOptions is flash.OPTIONS
    assert LessonOptions in options.RECORDS
    assert tpuattn.options_of("lesson") == {
        "blocks": "Blocks | None = None", "interpret": "bool | None = None",
        "block_q": "old spelling, read as blocks.block_q",
        "block_kv": "old spelling, read as blocks.block_kv"}
    assert LessonOptions.parse({"block_q": 16, "block_kv": 8}).blocks == Blocks(16, 8)
    assert LessonOptions.parse({"blocks": Blocks(block_kv=24)}).blocks.forward == (None, 24)


@pytest.mark.parametrize("kwargs,message", [
    (dict(blocks=Blocks(block_q=12)), r"^blocks\.block_q: expected a multiple of 8, got 12 \(impl='lesson': "
                                      r".*8 sublanes\)$"),
    (dict(blocks=Blocks(block_kv=20)), r"^blocks\.block_kv: expected a multiple of 8, got 20 "
                                       r"\(impl='lesson'"),
    # its dQ and dK/dV kernels walk the forward's tiles: a backward block would be ignored, so refused
    (dict(blocks=Blocks(block_q=8, backward_block_kv=128)), r"^blocks\.backward_block_kv: expected None for "
                                                           r"impl='lesson' \(it takes \['block_kv', "
                                                           r"'block_q'\]\), got 128$"),
    (dict(interpret="simulate"), r"^interpret: expected a bool or None for impl='lesson', got 'simulate'$"),
])
def test_lesson_options_refuse_bad_values_by_name(kwargs, message):
    with pytest.raises(TpuattnError, match=message):
        LessonOptions(**kwargs)


def test_lesson_refuses_a_bad_block_and_an_unknown_option_before_running():
    q, k, v = random_qkv(np.random.default_rng(5), 16, 16)
    with pytest.raises(TpuattnError, match=r"^blocks\.block_kv: expected a multiple of 8, got 12 "):
        tpuattn.attention(q, k, v, impl="lesson", block_kv=12)
    with pytest.raises(TpuattnError, match=r"^lesson: unknown option\(s\) \['block_sizes'\]; expected a "
                                           r"subset of \['block_kv', 'block_q', 'blocks', 'interpret'\]$"):
        tpuattn.attention(q, k, v, impl="lesson", block_sizes=8)
    with pytest.raises(TpuattnError, match=r"^lesson: expected block sizes one way, got blocks= and "
                                           r"\['block_q'\]"):
        tpuattn.attention(q, k, v, impl="lesson", blocks=Blocks(block_kv=8), block_q=8)


def test_lesson_runs_the_blocks_it_is_given():
    q = jnp.zeros((1, 64, 2, 32), jnp.float32)
    for kwargs, block_q in ((dict(), 64), (dict(block_q=16), 16),
                            (dict(blocks=Blocks(block_q=32, block_kv=8)), 32)):
        attend = lambda q, kw=kwargs: tpuattn.attention(q, q, q, causal=True, impl="lesson", **kw)
        grids = _pallas_grids(attend, q)
        assert len(grids) == 1 and grids[0][2] == 64 // block_q, (kwargs, grids)


# ---------------------------------------------------------------------------- the decode kernel's record
DECODE_FIELDS = ("block_size", "chunk_blocks", "pages_per_step", "q_block", "interpret")


def test_decode_pallas_declares_its_record_and_options_of_lists_it():
    from tpuattn.decode import kernel

    record = decode.get_implementation("pallas").options
    assert record is DecodeKernelOptions is kernel.OPTIONS
    assert record.fields() == record.names() == DECODE_FIELDS
    listed = decode.options_of("pallas")
    assert tuple(listed) == DECODE_FIELDS
    assert listed["q_block"] == "int | None = None" and listed["interpret"] == "bool | None = None"
    assert decode.options_of("reference") == {}
    for name in ("jax_paged", "jax_ragged"):
        assert decode.options_of(name) == {"interpret": "bool | None = None"}
    spec = decode.decode_spec_from_shapes(batch=2, q_len=1, num_q_heads=4, num_kv_heads=2, head_dim=32,
                                          capacity=64, page_size=16, num_pages=8, pages_per_sequence=4)
    choice = decode.choose(spec, "tpu")
    assert choice.impl == "pallas" and choice.options == DECODE_FIELDS
    with pytest.raises(TpuattnError, match=r"^impl: expected one of .*got 'nope'"):
        decode.options_of("nope")


def test_every_decode_implementation_declares_a_record():
    """One record per decode implementation, as for the attention contract: unknown names refused
    before anything is traced, naming the implementation and what it takes."""
    from tpuattn.options import DECODE_RECORDS

    declared = {name: decode.get_implementation(name).options for name in decode.implementations()}
    assert all(isinstance(r, type) and issubclass(r, options.Options) for r in declared.values()), declared
    assert set(declared.values()) <= set(DECODE_RECORDS)
    assert {name: r.IMPL for name, r in declared.items()} == {name: name for name in declared}
    q = jnp.zeros((2, 1, 4, 32), jnp.float32)
    cache = jnp.zeros((2, 64, 2, 32), jnp.float32)
    lengths = jnp.array([3, 64], jnp.int32)
    for name in declared:
        if name == "jax_ragged":
            continue  # paged and ragged only; its record is checked on its own below
        with pytest.raises(TpuattnError, match=rf"^{name}: unknown option\(s\) \['tile'\]; expected a subset "
                                               rf"of {re.escape(str(sorted(declared[name].names())))}"):
            decode.attention(q, cache, cache, lengths, impl=name, tile=8)
    with pytest.raises(TpuattnError, match=r"^jax_ragged: unknown option\(s\) \['tile'\]"):
        declared["jax_ragged"].parse({"tile": 8})
    with pytest.raises(TpuattnError, match=r"^interpret: expected a bool or None for impl='jax_paged', "
                                           r"got 'yes'"):
        declared["jax_paged"].parse({"interpret": "yes"})


@pytest.mark.parametrize("field,value", [("q_block", 0), ("q_block", True), ("chunk_blocks", 0),
                                         ("pages_per_step", -2), ("block_size", 8.0)])
def test_decode_kernel_options_refuse_a_bad_size_naming_the_field_and_value(field, value):
    with pytest.raises(TpuattnError, match=rf"^{field}: expected None or a positive int for "
                                           rf"tpuattn\.decode\.attention\(impl='pallas'\), got {value!r}$"):
        DecodeKernelOptions(**{field: value})


def test_decode_kernel_options_take_numpy_ints_and_check_interpret():
    chosen = DecodeKernelOptions.parse({"q_block": np.int64(4), "chunk_blocks": np.int32(2)})
    assert chosen.kwargs() == {"chunk_blocks": 2, "q_block": 4} and type(chosen.q_block) is int
    with pytest.raises(TpuattnError, match=r"^interpret: expected a bool or None for impl='pallas', got 1$"):
        DecodeKernelOptions(interpret=1)


def _decode_inputs(paged: bool, ragged: bool, seed: int = 0):
    """Small decode inputs: 2 sequences, 4 query heads over 2 kv heads of 32, capacity 32 (pages of 8)."""
    rng = np.random.default_rng(seed)
    lengths = np.array([13, 30], np.int32)
    if paged:
        k = rng.standard_normal((10, 8, 2, 32)).astype(np.float32)
        table = np.array([[3, 0, 7, 1], [2, 9, 5, 4]], np.int32)
    else:
        k, table = rng.standard_normal((2, 32, 2, 32)).astype(np.float32), None
    v = rng.standard_normal(k.shape).astype(np.float32)
    extra = dict(page_table=table)
    if ragged:  # 3 and 5 new tokens, then a padding row
        q = rng.standard_normal((9, 4, 32)).astype(np.float32)
        extra["cu_q_lens"] = np.array([0, 3, 8], np.int32)
    else:
        q = rng.standard_normal((2, 2, 4, 32)).astype(np.float32)
    return (q, k, v, lengths), extra


def _refused_before_tracing(monkeypatch):
    from tpuattn.decode import kernel

    traced = []
    monkeypatch.setattr(kernel, "partials", lambda *a, **k: traced.append(1))
    return traced


@pytest.mark.parametrize("kwargs,message", [
    (dict(q_block=0), r"^q_block: expected None or a positive int for tpuattn\.decode\.attention"
                      r"\(impl='pallas'\), got 0$"),
    (dict(q_block="4"), r"^q_block: expected None or a positive int .*, got '4'$"),
    (dict(chunk_blocks=0), r"^chunk_blocks: expected None or a positive int for tpuattn\.decode\.attention"
                           r"\(impl='pallas'\), got 0$"),
    (dict(tile=8), r"^pallas: unknown option\(s\) \['tile'\]; expected a subset of \['block_size', "
                   r"'chunk_blocks', 'interpret', 'pages_per_step', 'q_block'\]$"),
    (dict(interpret="yes"), r"^interpret: expected a bool or None for impl='pallas', got 'yes'$"),
])
def test_decode_pallas_refuses_bad_options_naming_the_option_and_value(kwargs, message, monkeypatch):
    traced = _refused_before_tracing(monkeypatch)
    args, extra = _decode_inputs(paged=True, ragged=True)
    with pytest.raises(TpuattnError, match=message):
        decode.attention(*args, **extra, impl="pallas", **kwargs)
    assert not traced


@pytest.mark.parametrize("paged,ragged,kwargs,message", [
    (True, False, dict(q_block=4), "q_block: tokens per token block of a ragged batch (cu_q_lens); expected "
                                   "None for a dense q, got 4"),
    (True, True, dict(block_size=8), "block_size: a paged cache's block is its page; expected None, got 8"),
    (False, False, dict(pages_per_step=2), "pages_per_step: a contiguous cache has no pages (set "
                                           "block_size); expected None, got 2"),
])
def test_decode_pallas_keeps_the_checks_that_need_the_spec(paged, ragged, kwargs, message):
    args, extra = _decode_inputs(paged, ragged)
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        decode.attention(*args, **extra, impl="pallas", **kwargs)


def test_decode_kernel_geometry_reads_its_sizes_through_the_record():
    from tpuattn.decode import kernel

    spec = decode.decode_spec_from_shapes(batch=2, q_len=1, num_q_heads=4, num_kv_heads=2, head_dim=32,
                                          capacity=64)
    geo = kernel.geometry(spec, block_size=np.int64(16), chunk_blocks=2)
    assert (geo.block, geo.num_blocks, geo.chunk_steps, geo.num_chunks) == (16, 4, 2, 2)
    with pytest.raises(TpuattnError, match=r"^chunk_blocks: expected None or a positive int .*got 0$"):
        kernel.geometry(spec, chunk_blocks=0)
    with pytest.raises(TpuattnError, match=r"^pages_per_step: expected None or a positive int .*got 0$"):
        decode.schedule([5, 9], 8, pages_per_step=0)


@pytest.mark.parametrize("paged,ragged,kwargs", [
    (True, False, dict(chunk_blocks=1, pages_per_step=2, interpret=True)),
    (False, False, dict(block_size=8, chunk_blocks=np.int64(2))),
    (True, True, dict(q_block=2, pages_per_step=1)),
    (False, True, dict(q_block=4, block_size=16)),
])
def test_decode_pallas_with_options_equals_the_reference(paged, ragged, kwargs):
    args, extra = _decode_inputs(paged, ragged, seed=7)
    want = decode.attention(*args, **extra, impl="reference")
    got = decode.attention(*args, **extra, impl="pallas", **kwargs)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert np.abs(np.asarray(want)).max() > 0.1  # not trivially zero
