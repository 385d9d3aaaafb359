"""tpuattn.decode through the real TPU compiler for v5e and v6e, without a TPU (compiled, not run).

Run with ``JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1`` (as the CI's compile stage does). Each
implementation must compile what it claims to support (status ``ok``) or refuse in words
(``unsupported``); peak HBM is printed (``-s``). The decode roofline's bytes (a lower bound: K and V of
every position plus q and the output) must not exceed what the compiler counts. The split-K kernel must
read the cache in place: its optimised program hands the cache to the kernel alone, makes no cache-sized
array outside it, and accesses at most 1.25x the roofline's bytes.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest
from helpers import require_tpu_compiler

from tpuattn import decode
from tpuattn.decode import kernel as decode_kernel
from tpuattn.errors import UnsupportedInput
from tpuattn.measure import aot
from tpuattn.model import decode_roofline as roofline

require_tpu_compiler()

CHIPS = ("v5e", "v6e")
IMPLS = decode.known_implementations()
# A serving-like shape kept small enough to compile in seconds: 8 sequences of up to 1024 positions,
# 32 query heads on 8 kv heads (group 4), head_dim 128, bf16, pages of 64 rows.
BATCH, HEADS, KV_HEADS, HEAD_DIM, PAGE, PAGES_PER_SEQ = 8, 32, 8, 128, 64, 16
CAPACITY = PAGE * PAGES_PER_SEQ
SHAPES = {"paged-tq1": (True, 1), "paged-tq4": (True, 4), "contiguous-tq1": (False, 1)}
# JAX 0.10.2 lowers the ``sign`` inside ragged_paged_attention's kernel by asking the *local* device for
# its TPU generation (jax/_src/pallas/mosaic/lowering.py, _sign_lowering_rule -> tpu_info.get_tpu_info()),
# so it cannot be compiled for a TPU from a CPU machine; it is refused off a TPU for running too.
NEEDS_LOCAL_TPU = {"jax_ragged": "Unsupported TPU device kind"}


def _args(paged: bool, q_len: int, dtype=jnp.bfloat16):
    q = jax.ShapeDtypeStruct((BATCH, q_len, HEADS, HEAD_DIM), dtype)
    lengths = jax.ShapeDtypeStruct((BATCH,), jnp.int32)
    if paged:
        cache = jax.ShapeDtypeStruct((BATCH * PAGES_PER_SEQ, PAGE, KV_HEADS, HEAD_DIM), dtype)
        return [q, cache, cache, lengths, jax.ShapeDtypeStruct((BATCH, PAGES_PER_SEQ), jnp.int32)]
    cache = jax.ShapeDtypeStruct((BATCH, CAPACITY, KV_HEADS, HEAD_DIM), dtype)
    return [q, cache, cache, lengths]


def compile_row(chip: str, impl: str, paged: bool, q_len: int) -> dict:
    """Compile one implementation for one chip: a row with status, peak HBM and the compiler's bytes."""
    def fn(q, k, v, lengths, table=None):
        return decode.attention(q, k, v, lengths, page_table=table, impl=impl)

    row = dict(chip=chip, impl=impl, paged=paged, q_len=q_len, label=aot.LABEL)
    try:
        facts = aot.compiled_facts(aot.compile_for(chip, fn, _args(paged, q_len)))
    except UnsupportedInput as error:
        return {**row, "status": "unsupported", "error": str(error)}
    except Exception as error:  # noqa: BLE001 - the compiler's errors vary by version
        return {**row, "status": "compile_error", "error": aot.first_error_line(error)}
    return {**row, "status": "ok", "error": None, **facts}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("chip", CHIPS)
def test_every_implementation_compiles(chip, impl, shape):
    paged, q_len = SHAPES[shape]
    row = compile_row(chip, impl, paged, q_len)
    if impl in NEEDS_LOCAL_TPU and row["status"] == "compile_error":
        assert NEEDS_LOCAL_TPU[impl] in row["error"], row["error"]
        pytest.xfail(f"{impl}: JAX's lowering needs a local TPU ({row['error'][:120]})")
    assert row["status"] in ("ok", "unsupported"), row["error"]
    if impl in ("reference", "pallas"):
        assert row["status"] == "ok", row["error"]
    if row["status"] == "unsupported":
        assert "does not support this input" in row["error"]
        return
    if impl == "pallas":
        assert row["custom_calls"] >= 1  # a Mosaic kernel, not interpret mode
    model = roofline.decode_roofline([CAPACITY] * BATCH, q_len=q_len, heads=HEADS, kv_heads=KV_HEADS,
                                     head_dim=HEAD_DIM, chip=chip,
                                     pages_per_sequence=PAGES_PER_SEQ if paged else 0)
    # The compiler cannot know the lengths: its argument bytes hold the whole cache, the model's lower
    # bound the cache of full sequences (equal up to q and the output), and its bytes accessed more.
    assert model.bytes - model.io_bytes <= row["argument_bytes"], (model.bytes, row["argument_bytes"])
    assert model.bytes <= row["bytes_accessed"], (model.bytes, row["bytes_accessed"])
    print(f"\n{chip} {impl} {shape}: peak HBM {row['peak_hbm_bytes'] / 2**20:.1f} MiB, compiler bytes "
          f"accessed {row['bytes_accessed'] / 2**20:.1f} MiB, modelled bytes {model.bytes / 2**20:.1f} MiB "
          f"({aot.LABEL}; model {roofline.LABEL})")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pallas_compiles_every_option_with_all_kv_heads_in_a_block(dtype):
    # head_dim 64 (not a lane multiple): one block holds every kv head and the kernel loops over them;
    # q_len 2, a window and a soft-cap on top.
    def fn(q, k, v, lengths, table):
        return decode.attention(q, k, v, lengths, page_table=table, impl="pallas", window=40, softcap=20.0)

    cache = jax.ShapeDtypeStruct((32, 32, 2, 64), dtype)
    args = [jax.ShapeDtypeStruct((4, 2, 8, 64), dtype), cache, cache,
            jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((4, 8), jnp.int32)]
    for chip in CHIPS:
        facts = aot.compiled_facts(aot.compile_for(chip, fn, args))
        assert facts["custom_calls"] >= 1 and facts["peak_hbm_bytes"] > 0


@pytest.mark.parametrize("cache_dtype,total,q_block", [("int8", 5, None), ("bfloat16", 40, 16)])
def test_pallas_compiles_a_ragged_batch_with_every_option(cache_dtype, total, q_block):
    # The token-major ragged path with sinks (in the kernel), a window, a soft-cap and k/v scales, head_dim
    # 64 with both kv heads in a block: 5 tokens in one token block larger than q (the default 256, cut to
    # q's sublane tile: 16 rows), and 40 tokens in three blocks of 16 (the last partial).
    def fn(q, k, v, lengths, table, cu, sinks, k_scale, v_scale):
        return decode.attention(q, k, v, lengths, page_table=table, cu_q_lens=cu, impl="pallas", window=40,
                                softcap=20.0, sinks=sinks, k_scale=k_scale, v_scale=v_scale, q_block=q_block)

    cache = jax.ShapeDtypeStruct((32, 32, 2, 64), jnp.dtype(cache_dtype))
    args = [jax.ShapeDtypeStruct((total, 8, 64), jnp.bfloat16), cache, cache,
            jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((4, 8), jnp.int32),
            jax.ShapeDtypeStruct((5,), jnp.int32), jax.ShapeDtypeStruct((8,), jnp.float32),
            jax.ShapeDtypeStruct((2,), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.float32)]
    facts = aot.compiled_facts(aot.compile_for("v5e", fn, args))
    assert facts["custom_calls"] >= 1 and facts["peak_hbm_bytes"] > 0


# ---------------------------------------------------------------------------- the cache read in place
# The split-K kernel must read K and V where they lie: the optimised program hands the cache parameters
# to the Mosaic kernel unchanged (through bitcasts at most), and nothing outside the kernel makes a
# cache-sized array (a copy, concatenate, transpose or relayout of the cache). On a TPU a reshape of
# [..., rows, kv_heads, d] to [..., rows, kv_heads * d] is such a copy (the last two dimensions are
# stored in (8, 128) tiles): an earlier version made one, and the program read 4.6x the modelled bytes.
# At the serving shape of notebook 07 (pages of 64 rows) and at pages of 16 (8 pages per grid step), a
# contiguous cache, 4 queries per sequence, and one kv head (multi-query attention: the kernel views
# [..., rows, 1, d] as [..., rows, d], which the TPU's default layout makes a bitcast).
# (paged, page size, q_len, kv heads)
IN_PLACE = {"pages-64": (True, 64, 1, KV_HEADS), "pages-16": (True, 16, 1, KV_HEADS),
            "pages-64-tq4": (True, 64, 4, KV_HEADS), "contiguous": (False, None, 1, KV_HEADS),
            "pages-64-one-kv-head": (True, 64, 1, 1)}
_DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}
_ARRAY = re.compile(r"\b(bf16|f16|f32|s32|u32|pred|s8|u8)\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([\w-]+)\((.*)$")
_NO_DATA = {"parameter", "bitcast", "get-tuple-element", "tuple", "constant"}


def _entry(hlo: str) -> list[tuple[str, str, str, list[str], str]]:
    """The ENTRY computation's instructions: (name, result shape, opcode, operand names, the rest)."""
    body = re.search(r"^ENTRY .*?\{\n(.*?)^\}", hlo, flags=re.M | re.S).group(1)
    out = []
    for line in body.splitlines():
        match = _INSTRUCTION.match(line)
        if match:
            name, shape, op, rest = match.groups()
            out.append((name, shape, op, re.findall(r"%([\w.\-]+)", rest.split("), ")[0]), rest))
    return out


def _array_bytes(shape: str) -> int:
    return sum(math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[t]
               for t, dims in _ARRAY.findall(shape))


@pytest.mark.parametrize("shape", sorted(IN_PLACE))
def test_pallas_reads_the_cache_in_place(shape):
    paged, page, q_len, kv_heads = IN_PLACE[shape]
    pages_per_seq = CAPACITY // page if paged else 0
    q = jax.ShapeDtypeStruct((BATCH, q_len, HEADS, HEAD_DIM), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((BATCH,), jnp.int32)
    if paged:
        cache = jax.ShapeDtypeStruct((BATCH * pages_per_seq, page, kv_heads, HEAD_DIM), jnp.bfloat16)
        args = [q, cache, cache, lengths, jax.ShapeDtypeStruct((BATCH, pages_per_seq), jnp.int32)]
    else:
        cache = jax.ShapeDtypeStruct((BATCH, CAPACITY, kv_heads, HEAD_DIM), jnp.bfloat16)
        args = [q, cache, cache, lengths]

    def fn(q, k, v, lengths, table=None):
        return decode.attention(q, k, v, lengths, page_table=table, impl="pallas")

    compiled = aot.compile_for("v5e", fn, args)
    hlo = compiled.as_text()
    entry = _entry(hlo)
    kernels = [i for i in entry if i[2] == "custom-call" and 'custom_call_target="tpu_custom_call"' in i[4]]
    assert len(kernels) == 1, [i[0] for i in kernels]
    kernel = kernels[0][0]
    params = {rest.split(")")[0]: name for name, _, op, _, rest in entry if op == "parameter"}
    operands_of = {name: operands for name, _, _, operands, _ in entry}
    for number in ("1", "2"):  # k and v: each read by the kernel and by nothing else
        views = {params[number]}  # the parameter and its bitcasts (which move no data)
        for name, _, op, operands, _ in entry:
            if op == "bitcast" and views & set(operands):
                views.add(name)
        users = {name for name, _, op, operands, _ in entry if op != "bitcast" and views & set(operands)}
        assert users == {kernel}, (number, users)
        assert views & set(operands_of[kernel])
    # And nothing outside the kernel makes an array of 1/8 of a cache or more.
    cache_bytes = math.prod(cache.shape) * 2
    big = [(name, op, _array_bytes(s)) for name, s, op, _, _ in entry
           if name != kernel and op not in _NO_DATA and _array_bytes(s) >= cache_bytes // 8]
    assert not big, big
    # The compiler's bytes: at least the decode roofline's lower bound (every position full), at most
    # 1.25x of it (the kernel's partials, padded query rows and the merge on top).
    model = roofline.decode_roofline([CAPACITY] * BATCH, q_len=q_len, heads=HEADS, kv_heads=kv_heads,
                                     head_dim=HEAD_DIM, chip="v5e", pages_per_sequence=pages_per_seq)
    accessed = aot.compiled_facts(compiled)["bytes_accessed"]
    assert model.bytes <= accessed <= 1.25 * model.bytes, (accessed, model.bytes, accessed / model.bytes)
    print(f"\nv5e pallas {shape}: compiler bytes accessed {accessed / 2**20:.1f} MiB = "
          f"{accessed / model.bytes:.2f}x the modelled {model.bytes / 2**20:.1f} MiB")


@pytest.mark.parametrize("dtype,page,head_dim", [("float32", 1024, 128), ("bfloat16", 512, 256)])
def test_pallas_compiles_large_pages_of_wide_heads(dtype, page, head_dim, monkeypatch):
    # A block holds 8 kv heads of a page: 1024-row pages of head_dim 128 in float32, and 512-row pages
    # of head_dim 256 in bfloat16, overflow v5e's default scoped VMEM (16 MiB) unless the kernel raises
    # its limit from its VMEM model (kernel.vmem_limit_bytes). (float32 at 512 rows of 256 overflows
    # too, at 7x the compile time.)
    def fn(q, k, v, lengths, table):
        return decode.attention(q, k, v, lengths, page_table=table, impl="pallas")

    cache = jax.ShapeDtypeStruct((4, page, 8, head_dim), dtype)
    args = [jax.ShapeDtypeStruct((2, 1, 32, head_dim), dtype), cache, cache,
            jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct((2, 2), jnp.int32)]
    facts = aot.compiled_facts(aot.compile_for("v5e", fn, args))  # v6e's default limit is 32 MiB
    assert facts["custom_calls"] >= 1
    if dtype != "float32":
        return
    # Without the raised limit the compiler refuses the same program (libtpu 0.0.42 names it
    # CompileTimeScopedVmemOom, 0.0.23 does not; both say which memory): the shape needs it (checked for
    # one of the two: a refused compile costs as much as an accepted one).
    monkeypatch.setattr(decode_kernel, "vmem_limit_bytes", lambda *args: None)
    with pytest.raises(Exception, match="memory space vmem"):
        aot.compile_for("v5e", lambda *a: fn(*a), args)


# ---------------------------------------------------------------------------- a serving engine's step
# The package's kernel and JAX's ragged paged attention (aot.decode_engine_row) at notebook 07's
# serving batch and a mixed batch (4 prefill chunks of 256 beside 60 decodes), over bfloat16, int8 and
# fp8 caches (benchmarks/decode_engine.py prints the whole table for the book). The package's bytes
# accessed stay within 1.1x the decode model's (every sequence's cache full: the compiler cannot know
# the lengths), and its peak HBM at most JAX's kernel's where both compile. JAX's kernel passes no cost
# estimate to Pallas, so XLA's bytes accessed count none of its traffic: the engines compare by peak HBM.
# At the serving batch the split-K kernel's cache is one chunk, finished in the kernel (no float32
# partials, no merge; 1.17x the model with a one-byte cache while they were written out), and every cache
# passes. Compiled with JAX 0.10.2 and libtpu 0.0.42.1 (benchmarks/decode_engine.py): at the mixed batch
# the token-major ragged kernel accesses 1.06x the model with every cache on both chips, and has no
# temporaries in HBM (the visit table's operations live in VMEM; a reduction to a scalar among them
# once left 0.35 MB (v5e) or 0.39 MB (v6e) of temporaries). Both steps take per-tensor scales as
# Python floats compiled in (two float32 [] arguments would add 512 B each as the TPU lays them out). Its
# peak HBM is then the arguments and the output: with a bfloat16 cache 286,204,928 B against JAX's
# kernel's 286,205,440 B (v6e), which takes one 512 B array more (num_seqs). On v5e with a bfloat16
# cache JAX's kernel does not compile (scoped VMEM), so only the bytes are held there.
ENGINE_CASES = [(chip, shape, cache_dtype)
                for chip in CHIPS for shape in aot.DECODE_ENGINE_SHAPES
                for cache_dtype in aot.DECODE_CACHE_DTYPES]


def engine_model(chip: str, shape: str, cache_dtype: str):
    s = aot.DECODE_ENGINE_SHAPES[shape]
    capacity = s["page"] * s["pages_per_sequence"]
    uniform = len(set(s["q_lens"])) == 1
    lengths = [capacity] * len(s["q_lens"])
    ragged = dict(q_len=s["q_lens"][0]) if uniform else dict(q_lens=s["q_lens"])
    return roofline.decode_roofline(lengths, **ragged, **aot.DECODE_ENGINE_HEADS, chip=chip,
                                    pages_per_sequence=s["pages_per_sequence"], cache_dtype=cache_dtype,
                                    scales=None if cache_dtype == "bfloat16" else "tensor")


@pytest.mark.newest_compiler  # bytes against the model and JAX's kernel: the newest compiler's program
@pytest.mark.parametrize("chip, shape, cache_dtype", ENGINE_CASES)
def test_the_decode_engine_step_is_within_the_model_and_at_most_jax_ragged(chip, shape, cache_dtype):
    # In a child process: a failed check inside libtpu aborts the process that compiles.
    ours = aot.decode_engine_row_isolated(chip, "tpuattn", shape, cache_dtype)
    if ours["status"] in ("unsupported", "unavailable") and (shape, cache_dtype) != ("serve", "bfloat16"):
        # the split-K kernel has no such input yet: the contract refuses it by name
        assert "ragged batch" in ours["error"] or "scales" in ours["error"] or "quantized" in ours["error"]
        pytest.xfail(f"the package's kernel does not take this input yet: {ours['error'][:160]}")
    assert ours["status"] == "ok", ours["error"]
    model = engine_model(chip, shape, cache_dtype)
    accessed = ours["bytes_accessed"]
    assert model.bytes <= accessed <= 1.1 * model.bytes, (accessed, model.bytes, accessed / model.bytes)
    theirs = aot.decode_engine_row(chip, "jax_ragged", shape, cache_dtype)
    print(f"\n{chip} {shape} {cache_dtype}: tpuattn bytes accessed {accessed / 1e6:.1f} MB = "
          f"{accessed / model.bytes:.2f}x the modelled {model.bytes / 1e6:.1f} MB, peak HBM "
          f"{ours['peak_hbm_bytes'] / 1e6:.1f} MB; jax_ragged {theirs['status']} ({aot.LABEL})")
    if theirs["status"] != "ok":
        assert theirs["status"] in ("compile_error", "out_of_memory"), theirs["error"]
        return
    # JAX's kernel holds the whole cache (at least the model's cache bytes) and reports none of its
    # traffic to XLA; its peak HBM is the comparison.
    assert theirs["argument_bytes"] >= model.cache_bytes
    assert theirs["bytes_accessed"] < 0.01 * model.bytes
    assert ours["peak_hbm_bytes"] <= theirs["peak_hbm_bytes"], (ours, theirs)


def test_jax_ragged_compiles_for_the_target_chip_only_inside_jax_kernels_see():
    # Outside the context JAX 0.10.2's lowering asks the CPU for its TPU generation; inside, the target's.
    import jax.numpy as jnp

    fn, args = aot._jax_ragged_step(aot._decode_shape("serve"), "bfloat16")
    try:
        from jax._src.pallas.mosaic import tpu_info
    except ImportError:  # JAX 0.7.2
        tpu_info = None
    if hasattr(tpu_info, "get_tpu_info_for_chip"):  # JAX 0.10.2's sign lowering (0.7.2 asks no device)
        blocks = dict(num_kv_pages_per_block=16, num_queries_per_block=8)  # the tuned table asks too
        with pytest.raises(Exception, match="Unsupported TPU device kind"):
            aot.compile_for("v6e", lambda *a: fn(*a, **blocks), args)
    with aot.jax_kernels_see("v6e") as kind:
        assert kind == "TPU v6 lite"
        facts = aot.compiled_facts(aot.compile_for("v6e", fn, args))
    assert facts["custom_calls"] >= 1 and facts["peak_hbm_bytes"] >= 2 * 8 * 16 * 64 * 8 * 128 * 2
    assert jnp.dtype(args[1].dtype) == jnp.bfloat16
