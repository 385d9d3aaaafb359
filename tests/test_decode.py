"""tpuattn.decode against the float64 oracle (tests/decode_oracle.py): every implementation, ragged
batches, random page tables, GQA, q_len 1 and 4, window, softcap, bf16 and f32; refusals and errors."""

from __future__ import annotations

import dataclasses
import math
import re

import decode_oracle
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_oracle import oracle_decode, oracle_partial

from tpuattn import chips, decode, softmax
from tpuattn.decode import kernel as decode_kernel
from tpuattn.errors import UnsupportedInput

IMPLS = decode.implementations()

# Tolerances (max abs and rel error against float64, inputs ~N(0, 1)).
# float32: the kernels accumulate in float32 with full-precision matmuls: ~1e-6 seen, 2e-5 allowed.
# bfloat16: the output is rounded to bf16 (relative 2**-8 = 3.9e-3 of values up to ~3) and the Pallas
# kernel, like every flash kernel on the MXU, rounds the probabilities to bf16 before P @ V (another
# relative 2**-8 per term, averaging out over the keys): 2e-2 covers both with margin (~8e-3 seen).
# JAX's paged_attention rounds K and V to bf16 inside the kernel even for float32 inputs (its
# _maybe_dequantize casts to bfloat16), so it gets the bf16 tolerance at both dtypes.
TOL = {"float32": 2e-5, "bfloat16": 2e-2}
BF16_INSIDE = {"jax_paged"}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    dtype: str
    heads: int
    kv_heads: int
    q_len: int
    head_dim: int = 32
    paged: bool = True
    page_size: int = 8
    max_len: int = 32  # capacity (pages_per_sequence * page_size when paged)
    window: object = None
    softcap: float | None = None
    scale: float | None = None
    seed: int = 0
    pallas: tuple = ()  # pallas options: several split-K chunks, partial blocks

    def lengths(self):
        # ragged: empty, shorter than q_len (4), not a page multiple, full
        return np.array([0, 3, 13, self.max_len], np.int32)


CASES = [
    Case("paged-f32-g1-tq1", "float32", 2, 2, 1, pallas=(("chunk_blocks", 1), ("pages_per_step", 1))),
    Case("paged-bf16-g2-tq4-window", "bfloat16", 4, 2, 4, window=5,
         pallas=(("chunk_blocks", 2), ("pages_per_step", 2))),  # 2 chunks of one step of 2 pages
    Case("paged-f32-g8-tq4-softcap-d64", "float32", 8, 1, 4, head_dim=64, softcap=2.0, scale=0.3),
    Case("contig-bf16-g8-tq1-softcap-d128", "bfloat16", 16, 2, 1, head_dim=128, paged=False, max_len=40,
         softcap=5.0, pallas=(("block_size", 16), ("chunk_blocks", 1))),  # 40 rows: last block partial
    Case("contig-f32-g2-tq4-window-d128", "float32", 4, 2, 4, head_dim=128, paged=False, max_len=40,
         window=(3, 0), pallas=(("block_size", 8), ("chunk_blocks", 2))),  # 5 blocks: last chunk half
    Case("paged-f32-g1-tq1-window-d128", "float32", 2, 2, 1, head_dim=128, page_size=16, max_len=48,
         window=(7, 2), pallas=(("chunk_blocks", 2), ("pages_per_step", 2))),  # 3 pages: slot 4 past the end
    # 16 kv heads: the kernel reads them as two head groups of 8 (heads 8-15 from the second), each kv
    # head a strided row of its page.
    Case("paged-bf16-g2-tq2-kv16", "bfloat16", 32, 16, 2, pallas=(("chunk_blocks", 2),)),
]


def make_inputs(case: Case, poison: bool):
    """q, caches, lengths, page table. Pages: a random permutation, no page shared, 3 unused pages.
    With ``poison`` every position past a sequence's length (unused pages included) holds NaN."""
    rng = np.random.default_rng(case.seed)
    b, lengths = 4, case.lengths()
    q = rng.standard_normal((b, case.q_len, case.heads, case.head_dim))
    if case.paged:
        pps = case.max_len // case.page_size
        num_pages = b * pps + 3
        k = rng.standard_normal((num_pages, case.page_size, case.kv_heads, case.head_dim))
        v = rng.standard_normal(k.shape)
        table = rng.permutation(num_pages)[: b * pps].reshape(b, pps).astype(np.int32)
        if poison:
            valid = np.zeros(k.shape[:2], bool)
            for s in range(b):
                for j in range(lengths[s]):
                    valid[table[s, j // case.page_size], j % case.page_size] = True
            k[~valid], v[~valid] = np.nan, np.nan
    else:
        k = rng.standard_normal((b, case.max_len, case.kv_heads, case.head_dim))
        v = rng.standard_normal(k.shape)
        table = None
        if poison:
            past = np.arange(case.max_len)[None, :] >= lengths[:, None]
            k[past], v[past] = np.nan, np.nan
    cast = lambda x: jnp.asarray(x, case.dtype)
    return cast(q), cast(k), cast(v), lengths, table


def kwargs(case):
    return dict(scale=case.scale, window=case.window, softcap=case.softcap)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_oracle(impl, case):
    poison = impl in ("reference", "pallas")  # the natives read masked rows as data: see native.py
    q, k, v, lengths, table = make_inputs(case, poison)
    spec = decode.make_decode_spec(q, k, v, lengths, table, **kwargs(case))[-1]
    reason = decode.get_implementation(impl).supports(spec, "cpu")
    if reason is not None:
        assert impl.startswith("jax_"), reason  # only JAX's kernels refuse anything
        with pytest.raises(UnsupportedInput, match=f"impl: '{impl}' does not support this input"):
            decode.attention(q, k, v, lengths, page_table=table, impl=impl, **kwargs(case))
        return
    # Under jit: lengths and the page table are traced (the value checks are skipped, not the math).
    options = dict(case.pallas) if impl == "pallas" else {}
    run = jax.jit(lambda q, k, v, lengths, table: decode.attention(
        q, k, v, lengths, page_table=table, impl=impl, **kwargs(case), **options))
    out = run(q, k, v, jnp.asarray(lengths), None if table is None else jnp.asarray(table))
    assert out.shape == q.shape and out.dtype == q.dtype
    expected = oracle_decode(*(np.asarray(x, np.float64) for x in (q, k, v)), lengths, page_table=table,
                             **kwargs(case))
    got = np.asarray(out.astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(got))
    np.testing.assert_array_equal(got[0], 0.0)  # length 0
    if case.q_len == 4:
        np.testing.assert_array_equal(got[1, 0], 0.0)  # length 3 < q_len: row 0 sits at position -1
    tol = TOL["bfloat16" if impl in BF16_INSIDE else case.dtype]
    np.testing.assert_allclose(got, expected, atol=tol, rtol=tol)


def test_native_refusals_name_what_they_cannot_express():
    paged = decode.get_implementation("jax_paged")
    ragged = decode.get_implementation("jax_ragged")
    spec = decode.decode_spec_from_shapes(batch=2, q_len=4, num_q_heads=4, num_kv_heads=2, head_dim=128,
                                          page_size=16, num_pages=8, pages_per_sequence=4)
    assert "q_len 1" in paged.supports(spec, "tpu")
    windowed = dataclasses.replace(spec, attention=dataclasses.replace(
        spec.attention, q_len=1, mask=dataclasses.replace(spec.attention.mask, q_len=1, window=(8, 0))))
    assert "no window" in paged.supports(windowed, "tpu")
    assert ragged.supports(spec, "tpu") is None  # paged, q_len 4: ragged can
    assert "does not run off a TPU" in ragged.supports(spec, "cpu")
    contiguous = decode.decode_spec_from_shapes(batch=2, q_len=1, num_q_heads=4, num_kv_heads=2,
                                                head_dim=128, capacity=64)
    assert "contiguous cache" in ragged.supports(contiguous, "tpu")
    assert "head_dim a multiple of 128" in ragged.supports(
        decode.decode_spec_from_shapes(batch=2, q_len=1, num_q_heads=4, num_kv_heads=2, head_dim=64,
                                       page_size=16, num_pages=8, pages_per_sequence=4), "tpu")


def test_auto_picks_reference_off_tpu_and_pallas_on_tpu():
    spec = decode.decode_spec_from_shapes(batch=2, q_len=1, num_q_heads=4, num_kv_heads=2, head_dim=128,
                                          capacity=64)
    assert decode.choose(spec, "cpu").impl == "reference"
    assert decode.choose(spec, "tpu").impl == "pallas"
    assert dict(decode.choose(spec, "cpu").refused)["pallas"] == "not an automatic choice on cpu"
    with chips.target("v5e"):
        assert decode.choose(spec).impl == "pallas"


# ---------------------------------------------------------------------------- bad inputs
def _good():
    q = jnp.zeros((2, 1, 4, 8), jnp.float32)
    k = jnp.zeros((6, 4, 2, 8), jnp.float32)  # 6 pages of 4 rows
    table = np.array([[0, 1], [2, 3]], np.int32)
    return dict(q=q, k_cache=k, v_cache=k, lengths=np.array([3, 8], np.int32), page_table=table)


BAD = [
    ("q rank", dict(q=jnp.zeros((2, 4, 8))), ValueError,
     "q: expected rank 4 [batch, q_len, heads, head_dim] (a rank-3 ragged q needs cu_q_lens), got shape "
     "(2, 4, 8)"),
    ("k rank", dict(k_cache=jnp.zeros((6, 4, 16))), ValueError,
     "k_cache: expected rank 4 [num_pages, page_size, kv_heads, head_dim], got shape (6, 4, 16)"),
    ("k/v shapes", dict(v_cache=jnp.zeros((5, 4, 2, 8))), ValueError,
     "k_cache and v_cache: expected the same shape, got k_cache (6, 4, 2, 8) and v_cache (5, 4, 2, 8)"),
    ("head_dim", dict(k_cache=jnp.zeros((6, 4, 2, 16)), v_cache=jnp.zeros((6, 4, 2, 16))), ValueError,
     "k_cache: expected head_dim 8 (q's head_dim), got 16"),
    ("gqa", dict(q=jnp.zeros((2, 1, 3, 8))), ValueError,
     "q: expected a number of heads divisible by k_cache's 2 heads (GQA), got 3"),
    ("dtype mix", dict(q=jnp.zeros((2, 1, 4, 8), jnp.bfloat16)), TypeError,
     "q, k_cache, v_cache: expected one dtype (or k_cache and v_cache both of a quantized dtype in "
     "['int8', 'float8_e4m3fn']), got q bfloat16, k_cache float32, v_cache float32"),
    ("int dtype", dict(q=jnp.zeros((2, 1, 4, 8), jnp.int32), k_cache=jnp.zeros((6, 4, 2, 8), jnp.int32),
                       v_cache=jnp.zeros((6, 4, 2, 8), jnp.int32)), TypeError,
     "q, k_cache, v_cache: expected a dtype in ['float32', 'bfloat16', 'float16'], got int32"),
    ("lengths shape", dict(lengths=np.array([3], np.int32)), ValueError,
     "lengths: expected shape (2,) (one per sequence), got (1,)"),
    ("lengths dtype", dict(lengths=np.array([3.0, 8.0])), TypeError,
     "lengths: expected an integer dtype (int32), got float64"),
    ("lengths too long", dict(lengths=np.array([3, 9], np.int32)), ValueError,
     "lengths: expected values in [0, 8] (the cache capacity), got 9"),
    ("lengths negative", dict(lengths=np.array([-1, 2], np.int32)), ValueError,
     "lengths: expected values in [0, 8] (the cache capacity), got -1"),
    ("table shape", dict(page_table=np.zeros((3, 2), np.int32)), ValueError,
     "page_table: expected shape [batch=2, pages_per_sequence >= 1], got (3, 2)"),
    ("table dtype", dict(page_table=np.zeros((2, 2), np.float32)), TypeError,
     "page_table: expected an integer dtype (int32), got float32"),
    ("page id", dict(page_table=np.array([[0, 1], [2, 6]], np.int32)), ValueError,
     "page_table: expected page ids in [0, 6) for the pages in use, got 6 at [1, 1]"),
    ("negative page id", dict(page_table=np.array([[-1, 1], [2, 3]], np.int32)), ValueError,
     "page_table: expected page ids in [0, 6) for the pages in use, got -1 at [0, 0]"),
    ("contiguous batch", dict(page_table=None, k_cache=jnp.zeros((3, 8, 2, 8)),
                              v_cache=jnp.zeros((3, 8, 2, 8))), ValueError,
     "k_cache: expected batch 2 (q's batch), got 3"),
    ("window", dict(window=-1), ValueError, "window: expected a non-negative left extent, got -1"),
    ("softcap", dict(softcap=0.0), ValueError, "softcap: expected a positive finite number, got 0.0"),
    ("impl", dict(impl="nope"), ValueError,
     "impl: expected one of ['jax_paged', 'jax_ragged', 'pallas', 'reference', 'auto'], got 'nope'"),
    ("option", dict(impl="pallas", tile=3), ValueError,
     "pallas: unknown option(s) ['tile']; expected a subset of ['block_size', 'chunk_blocks', 'interpret', "
     "'pages_per_step', 'q_block']"),
    ("q_block dense", dict(impl="pallas", q_block=4), ValueError,
     "q_block: tokens per token block of a ragged batch (cu_q_lens); expected None for a dense q, got 4"),
    ("paged block", dict(impl="pallas", block_size=8), ValueError,
     "block_size: a paged cache's block is its page; expected None, got 8"),
    # Before: Pallas's raw "Only interpret mode is supported on CPU backend", and "reference: unknown
    # option(s) ['block_size']" from an implementation the caller never named.
    ("compiled off a TPU", dict(impl="pallas", interpret=False), UnsupportedInput,
     "interpret: expected True or None (interpret mode) for impl='pallas' on backend 'cpu': False "
     "compiles the Pallas kernel for a TPU"),
    ("jax_paged compiled off a TPU", dict(impl="jax_paged", interpret=False), UnsupportedInput,
     "interpret: expected True or None (interpret mode) for impl='jax_paged' on backend 'cpu'"),
    ("auto with another's option", dict(impl="auto", block_size=8), UnsupportedInput,
     "impl: 'auto' chose 'reference' for this input on cpu (lowest auto rank"),
    ("jax_paged q_len", dict(impl="jax_paged", q=jnp.zeros((2, 2, 4, 8))), UnsupportedInput,
     "impl: 'jax_paged' does not support this input: JAX's paged_attention takes one query per sequence "
     "(q_len 1), got q_len 2"),
]


@pytest.mark.parametrize("name,change,error,message", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_are_refused_with_a_clear_message(name, change, error, message):
    args = {**_good(), **change}
    with pytest.raises(error, match=re.escape(message)):
        decode.attention(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), args.pop("lengths"), **args)


def test_unused_table_entries_are_never_read():
    # -1 past each sequence's used pages is fine (sequence 0 uses 1 page of 4 rows: entry 1 is unused).
    args = _good()
    args["page_table"] = np.array([[0, -1], [2, 3]], np.int32)
    args["lengths"] = np.array([3, 8], np.int32)
    out = decode.attention(args["q"], args["k_cache"], args["v_cache"], args["lengths"],
                           page_table=args["page_table"], impl="reference")
    assert np.all(np.isfinite(np.asarray(out)))


# ---------------------------------------------------------------------------- the schedule
@pytest.mark.parametrize("window,q_len", [(None, 1), (None, 4), (9, 4)])
def test_schedule_counts_match_an_independent_count(window, q_len):
    lengths = np.array([0, 1, 7, 8, 9, 30, 64, 33], np.int64)
    # 16 kv heads: the kernel reads them as two blocks of 8 (a sublane tile), so each (sequence, head
    # group) walks its own blocks.
    block, chunk, capacity, kv_heads, groups = 8, 3, 64, 16, 2
    got = decode.schedule(lengths, block, q_len=q_len, window=window, capacity=capacity, chunk_blocks=chunk,
                          pages_per_step=1, num_kv_heads=kv_heads)
    assert got["head_groups"] == groups
    assert decode.schedule(lengths, block, capacity=capacity, num_kv_heads=2)["head_groups"] == 1  # all heads
    divisor = r"heads_per_block: expected a divisor of num_kv_heads \(16\), got 3"
    with pytest.raises(ValueError, match=divisor):
        decode.schedule(lengths, block, capacity=capacity, num_kv_heads=kv_heads, heads_per_block=3)
    num_blocks = capacity // block
    steps = len(lengths) * groups * math.ceil(num_blocks / chunk) * chunk
    useful = []
    for length in lengths:
        last = math.ceil(length / block) - 1
        first = 0 if window is None else max(0, length - q_len - window) // block
        useful.append(max(0, last - first + 1))
    # Computed: the useful blocks. Fetched: each (sequence, head) fetches its useful blocks once, and a
    # sequence with none still fetches the one block its first step names.
    assert got["steps"] == steps
    assert got["computed"] == groups * sum(useful)
    assert got["skipped"] == got["blocks"] - groups * sum(useful) and got["blocks"] == steps
    assert got["fetched"] == groups * sum(max(1, u) for u in useful)
    if window is None:
        assert sum(useful) == sum(math.ceil(length / block) for length in lengths)


@pytest.mark.parametrize("per_step,chunk", [(3, 5), (4, 8)])
def test_schedule_with_several_pages_per_step(per_step, chunk):
    # A brute-force walk of the grid written here: step s's j-th K BlockSpec asks for page s*n + j held
    # inside [first useful, last useful]; it fetches when that differs from its own previous request.
    lengths, block, capacity, q_len, left = [0, 5, 17, 40, 64, 23], 8, 64, 2, 12
    got = decode.schedule(lengths, block, q_len=q_len, window=left, capacity=capacity, chunk_blocks=chunk,
                          pages_per_step=per_step)
    chunk_steps = math.ceil(chunk / per_step)
    num_chunks = math.ceil(math.ceil(capacity / block) / (per_step * chunk_steps))
    steps = num_chunks * chunk_steps
    fetched = computed = 0
    previous = [None] * per_step
    for b, length in enumerate(lengths):
        last = math.ceil(length / block) - 1
        first = max(0, length - q_len - left) // block
        for s in range(steps):
            for j in range(per_step):
                page = s * per_step + j
                computed += first <= page <= last
                asked = (b, min(max(page, first), max(last, first)))
                fetched += asked != previous[j]
                previous[j] = asked
    assert (got["steps"], got["computed"], got["fetched"]) == (len(lengths) * steps, computed, fetched)
    assert got["skipped"] == len(lengths) * steps * per_step - computed


def test_schedule_uses_the_kernels_own_clamp():
    # The index map's block for each step of one sequence: the useful range, held at its ends.
    steps = np.arange(8)
    asked = decode_kernel.kv_block(steps, 20, 1, None, 8)  # blocks 0..2 useful
    np.testing.assert_array_equal(asked, [0, 1, 2, 2, 2, 2, 2, 2])
    asked = decode_kernel.kv_block(steps, 40, 2, 10, 8)  # window: positions 28..39 -> blocks 3..4
    np.testing.assert_array_equal(asked, [3, 3, 3, 3, 4, 4, 4, 4])
    np.testing.assert_array_equal(decode_kernel.kv_block(steps, 0, 1, None, 8), 0)


# ---------------------------------------------------------------------------- merging partials
@pytest.mark.parametrize("scale", [0.4, 4e3], ids=["logits~1", "logits~1e4"])
@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_chunk_partials_merge_to_the_oracle(chunks, scale):
    # Split-K: each chunk's (output, logsumexp) from the float64 oracle, as softmax.Partials, merged by
    # tpuattn.softmax.merge (the one merge): a chunk that sees nothing, a row no chunk sees, logits of
    # ~1e4 (exp would overflow float32 at 88), and the gradients of the merge.
    rng = np.random.default_rng(5)
    rows, n, d = 6, 24, 16
    q, k, v = rng.standard_normal((rows, d)), rng.standard_normal((n, d)), rng.standard_normal((n, d))
    allowed = rng.random((rows, n)) < 0.6
    allowed[:, 8:16] = False  # the middle third sees nothing
    allowed[4] = False  # row 4 sees no key in any chunk
    cuts = np.linspace(0, n, chunks + 1).astype(int)
    as_partial = lambda out, lse: softmax.from_lse(jnp.asarray(out, jnp.float32)[None, :, None],
                                                   jnp.asarray(lse, jnp.float32)[None, None])
    parts = [as_partial(*oracle_partial(q, k[a:b], v[a:b], allowed[:, a:b], scale))
             for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    merged = softmax.merge(*parts)
    out, lse = np.asarray(merged.out)[0, :, 0], np.asarray(softmax.to_lse(merged))[0, 0]
    expected, expected_lse = oracle_partial(q, k, v, allowed, scale)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(out[4], 0.0)
    assert lse[4] == -np.inf
    seen = [0, 1, 2, 3, 5]
    np.testing.assert_allclose(lse[seen], expected_lse[seen], rtol=1e-5)
    # Gradients: d sum(out * ct) / d out_i is each chunk's share exp(lse_i - lse) of the row.
    ct = rng.standard_normal(merged.out.shape)
    grads = jax.grad(lambda parts: jnp.sum(softmax.merge(*parts).out * ct))(parts)
    for (a, b), g in zip(zip(cuts[:-1], cuts[1:], strict=True), grads, strict=True):
        _, lse_i = oracle_partial(q, k[a:b], v[a:b], allowed[:, a:b], scale)
        with np.errstate(invalid="ignore"):
            share = np.where(np.isfinite(lse_i), np.exp(lse_i - np.where(np.isfinite(expected_lse),
                                                                          expected_lse, 0.0)), 0.0)
        assert all(np.isfinite(np.asarray(x)).all() for x in g)
        np.testing.assert_allclose(np.asarray(g.out)[0, :, 0], share[:, None] * ct[0, :, 0], atol=1e-4,
                                   rtol=1e-4)


def test_kernel_chunks_are_softmax_partials():
    # The kernel's edge: each split-K chunk comes out as a softmax.Partial in the contract layout, a
    # chunk past a sequence's length as the empty state.
    case = CASES[0]
    q, k, v, lengths, table = make_inputs(case, poison=True)
    q, k, v, lengths, table, spec = decode.make_decode_spec(q, k, v, lengths, table, **kwargs(case))
    geo = decode_kernel.geometry(spec, chunk_blocks=1, pages_per_step=1)
    parts = decode_kernel.partials(q, k, v, jnp.asarray(lengths), jnp.asarray(table), spec, geo, True)
    assert len(parts) == geo.num_chunks == 4
    for c, part in enumerate(parts):
        assert isinstance(part, softmax.Partial) and part.out.dtype == jnp.float32
        assert part.out.shape == q.shape and part.m.shape == (4, case.heads, case.q_len)
        for b, length in enumerate(lengths):
            keys = np.arange(c * 8, (c + 1) * 8)
            allowed = (keys < length)[None, :]
            kc = decode_oracle.sequence_cache(k, b, min(int(length), keys[-1] + 1), table)[keys[0]:]
            vc = decode_oracle.sequence_cache(v, b, min(int(length), keys[-1] + 1), table)[keys[0]:]
            for h in range(case.heads):
                if not allowed.any():
                    np.testing.assert_array_equal(np.asarray(part.out[b, :, h]), 0.0)
                    assert np.all(np.asarray(part.m[b, h]) == -np.inf)
                    assert np.all(np.asarray(part.log_l[b, h]) == 0.0)
                    continue
                want, want_lse = oracle_partial(np.asarray(q[b, :, h], np.float64), kc[:, h], vc[:, h],
                                                allowed[:, : len(kc)], spec.scale)
                np.testing.assert_allclose(np.asarray(part.out[b, :, h]), want, atol=2e-5, rtol=2e-5)
                np.testing.assert_allclose(np.asarray(softmax.to_lse(part))[b, h], want_lse, atol=2e-5,
                                           rtol=2e-5)


@pytest.mark.parametrize("case", [c for c in CASES if c.paged and c.q_len == 4], ids=lambda c: c.name)
def test_ragged_translation_through_jaxs_reference(case):
    # JAX's ragged kernel cannot run off a TPU; its reference takes the same arguments, so the adapter's
    # translation (K/V interleaving, cu_q_lens, window -> sliding_window, rows before position 0) is
    # checked through it against the oracle.
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import ref_ragged_paged_attention

    from tpuattn.decode import native

    q, k, v, lengths, table = make_inputs(case, poison=False)
    q, k, v, lengths, table, spec = decode.make_decode_spec(q, k, v, lengths, table, **kwargs(case))
    # One compiled program (the reference runs op by op otherwise); lengths stay concrete for its loop.
    lengths, table = np.asarray(lengths), np.asarray(table)
    out = jax.jit(lambda q, k, v: native.ragged_translation(ref_ragged_paged_attention, q, k, v, lengths,
                                                            table, spec))(q, k, v)
    expected = oracle_decode(*(np.asarray(x, np.float64) for x in (q, k, v)), lengths, page_table=table,
                             **kwargs(case))
    # JAX's reference rounds the probabilities to the cache dtype before P @ V: bf16 tolerance.
    tol = TOL["bfloat16"] if case.dtype == "bfloat16" else 1e-4
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), expected, atol=tol, rtol=tol)


def test_pallas_is_forward_only_and_says_so():
    args = _good()
    fn = lambda q: decode.attention(q, args["k_cache"], args["v_cache"], args["lengths"],
                                    page_table=args["page_table"], impl="pallas").sum()
    with pytest.raises(NotImplementedError, match=re.escape("is forward only (decode is inference)")):
        jax.grad(fn)(args["q"])
    ref = lambda q: decode.attention(q, args["k_cache"], args["v_cache"], args["lengths"],
                                     page_table=args["page_table"], impl="reference").sum()
    assert jax.grad(ref)(args["q"]).shape == args["q"].shape  # plain JAX: differentiable


def test_roofline_counts_the_valid_cache_and_group_times_q_len_flops_per_byte_pair():
    from tpuattn.model import decode_roofline as roofline

    r = roofline.decode_roofline([4096, 100, 0], q_len=2, heads=32, kv_heads=8, head_dim=128, chip="v5e")
    assert r.cache_bytes == (4096 + 100) * 2 * 8 * 128 * 2  # K and V, bf16, valid positions only
    assert r.flops == 4 * 2 * 32 * 128 * (4096 + 100)
    assert r.flops / r.cache_bytes == pytest.approx(4 * 2)  # group 4 x q_len 2 per (K, V) byte pair
    assert r.memory_bound and r.label == "modelled"
    assert r.crossover_q_len == pytest.approx(r.ridge * 2 / (2 * 4))
    windowed = roofline.decode_roofline([4096], q_len=1, heads=8, kv_heads=8, head_dim=128, window_left=255)
    assert windowed.cache_bytes == 256 * 2 * 8 * 128 * 2


def test_plain_decode_baseline_matches_the_oracle():
    # The benchmark's and notebook 07's baseline: contiguous cache, q_len 1, masked by length.
    from oracle import oracle_attention

    rng = np.random.default_rng(5)
    q = rng.standard_normal((3, 1, 4, 16)).astype(np.float32)
    k = rng.standard_normal((3, 20, 2, 16)).astype(np.float32)
    v = rng.standard_normal((3, 20, 2, 16)).astype(np.float32)
    lengths = np.array([20, 7, 0], np.int32)
    got = np.asarray(decode.plain_decode(*(jnp.asarray(x) for x in (q, k, v, lengths))))
    for b, n in enumerate(lengths):
        if n == 0:
            assert not got[b].any()
            continue
        want = oracle_attention(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], causal=True)
        np.testing.assert_allclose(got[b:b + 1], want, atol=2e-5, rtol=2e-5)
