"""Ragged batches in tpuattn.decode.attention (``q [total_tokens, heads, d]`` with ``cu_q_lens``) against
the float64 oracle (tests/decode_oracle.py): query lengths 0, 1, a chunk, across page boundaries, longer
than the sequence, sequences at the capacity, padding rows and ``num_seqs``; windows, softcap, sinks,
GQA, bf16 and f32, paged and contiguous caches; every implementation, or its refusal; bad arguments."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_oracle import oracle_ragged_decode

from tpuattn import decode
from tpuattn.errors import TpuattnError, UnsupportedInput

IMPLS = decode.implementations()
TOL = {"float32": 2e-5, "bfloat16": 2e-2}  # as tests/test_decode.py (bf16: output and P rounded)
PAGE, PPS, NUM_PAGES = 8, 4, 20  # capacity 32


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    dtype: str = "float32"
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    paged: bool = True
    window: object = None
    softcap: float | None = None
    sinks: bool = False
    # per sequence: (cache length, new queries); the queries are the last ones of the length
    seqs: tuple = ((9, 1), (32, 12), (20, 0), (3, 5), (17, 9))
    padding: int = 3  # rows of q past the last sequence's tokens
    num_seqs: int | None = None
    seed: int = 0
    pallas: tuple = ()


CASES = [
    # q_len 1 (decode), 12 (a chunk ending at the capacity), 0, 5 > length 3 (two rows at negative
    # positions), 9 crossing the page boundary at 16; three padding rows.
    Case("paged-f32-mixed"),
    Case("paged-bf16-window-softcap", dtype="bfloat16", window=(4, 0), softcap=3.0,
         pallas=(("q_block", 4), ("pages_per_step", 1))),
    Case("paged-f32-g4-sinks", heads=8, kv_heads=2, sinks=True, pallas=(("q_block", 8),)),
    Case("contig-f32-window", paged=False, window=6, pallas=(("block_size", 8), ("q_block", 2))),
    # num_seqs 3 of 5: sequences 3 and 4 are not live, their cu_q_lens entries are garbage.
    Case("paged-f32-num-seqs", num_seqs=3, seed=1),
    # all decodes, one of them at the capacity
    Case("paged-bf16-decodes", dtype="bfloat16", seqs=((32, 1), (1, 1), (8, 1), (16, 1)), padding=0,
         kv_heads=1, heads=4),
]


def make_inputs(case: Case):
    rng = np.random.default_rng(case.seed)
    lengths = np.array([s[0] for s in case.seqs], np.int32)
    q_lens = [s[1] for s in case.seqs]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    total = int(cu[-1]) + case.padding
    if case.num_seqs is not None:  # what a caller leaves past the live sequences is not read
        cu[case.num_seqs + 1:] = -7
        total = int(cu[case.num_seqs]) + case.padding
    b = len(case.seqs)
    q = rng.standard_normal((total, case.heads, case.head_dim))
    if case.paged:
        k = rng.standard_normal((NUM_PAGES, PAGE, case.kv_heads, case.head_dim))
        table = rng.permutation(NUM_PAGES)[: b * PPS].reshape(b, PPS).astype(np.int32)
    else:
        k = rng.standard_normal((b, PAGE * PPS, case.kv_heads, case.head_dim))
        table = None
    v = rng.standard_normal(k.shape)
    sinks = rng.standard_normal(case.heads).astype(np.float32) if case.sinks else None
    cast = lambda x: jnp.asarray(x, case.dtype)
    return cast(q), cast(k), cast(v), lengths, table, cu, sinks


def _kwargs(case, table, cu, sinks):
    return dict(page_table=table, cu_q_lens=cu, num_seqs=case.num_seqs, window=case.window,
                softcap=case.softcap, sinks=sinks)


def _expected(case, q, k, v, lengths, table, cu, sinks):
    return oracle_ragged_decode(*(np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v)), lengths,
                                cu, num_seqs=case.num_seqs, page_table=table, window=case.window,
                                softcap=case.softcap, sinks=sinks)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("impl", IMPLS)
def test_ragged_matches_oracle(impl, case):
    q, k, v, lengths, table, cu, sinks = make_inputs(case)
    kw = _kwargs(case, table, cu, sinks)
    record = decode.get_implementation(impl)
    spec = decode.validate(q, k, v, lengths, **{k_: v_ for k_, v_ in kw.items() if k_ != "sinks"}).spec
    reason = None if record.takes_ragged else "cu_q_lens"
    reason = reason or record.supports(spec, "cpu") or (None if record.takes_sinks or not case.sinks
                                                        else "sinks")
    if reason is not None:
        assert impl.startswith("jax_"), reason  # only JAX's kernels refuse a ragged batch
        with pytest.raises(UnsupportedInput, match="cu_q_lens|sinks|does not support this input"):
            decode.attention(q, k, v, lengths, impl=impl, **kw)
        return
    options = dict(case.pallas) if impl == "pallas" else {}
    run = jax.jit(lambda q, k, v, lengths, cu: decode.attention(
        q, k, v, lengths, impl=impl, **{**kw, "cu_q_lens": cu}, **options))
    out = run(q, k, v, jnp.asarray(lengths), jnp.asarray(cu))
    assert out.shape == q.shape and out.dtype == q.dtype
    got = np.asarray(out.astype(jnp.float32), np.float64)
    want = _expected(case, q, k, v, lengths, table, cu, sinks)
    assert np.all(np.isfinite(got))
    live = case.num_seqs if case.num_seqs is not None else len(case.seqs)
    np.testing.assert_array_equal(got[int(cu[live]):], 0.0)  # padding rows
    tol = TOL[case.dtype]
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


def test_ragged_rows_before_position_zero_are_zeros():
    case = CASES[0]  # sequence 3: length 3, 5 new queries: its first two rows sit at positions -2, -1
    q, k, v, lengths, table, cu, _ = make_inputs(case)
    out = np.asarray(decode.attention(q, k, v, lengths, page_table=table, cu_q_lens=cu, impl="reference"))
    start = int(cu[3])
    np.testing.assert_array_equal(out[start:start + 2], 0.0)
    assert np.all(np.abs(out[start + 2:start + 5]).sum(axis=(1, 2)) > 0)


def test_ragged_equals_dense_when_every_sequence_has_the_same_query_length():
    """The dense form is the ragged one with ``cu_q_lens = arange(batch + 1) * q_len`` (the oracle says
    so independently; this checks the two code paths agree on one input)."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((3, 4, 4, 16)).astype(np.float32)
    k = rng.standard_normal((12, PAGE, 2, 16)).astype(np.float32)
    v = rng.standard_normal(k.shape).astype(np.float32)
    table = rng.permutation(12).reshape(3, 4).astype(np.int32)
    lengths = np.array([4, 17, 32], np.int32)
    cu = np.arange(4, dtype=np.int32) * 4
    for impl in [i for i in IMPLS if decode.get_implementation(i).takes_ragged and i != "jax_ragged"]:
        options = {"q_block": 2} if impl == "pallas" else {}
        dense = decode.attention(q, k, v, lengths, page_table=table, window=5, impl=impl)
        ragged = decode.attention(q.reshape(12, 4, 16), k, v, lengths, page_table=table, cu_q_lens=cu,
                                  window=5, impl=impl, **options)
        np.testing.assert_allclose(np.asarray(ragged), np.asarray(dense).reshape(12, 4, 16), atol=2e-6)


def test_jaxs_paged_kernel_refuses_a_ragged_batch_by_name():
    case = CASES[0]
    q, k, v, lengths, table, cu, _ = make_inputs(case)
    if "jax_paged" not in IMPLS:
        pytest.skip("JAX's paged_attention is not available on this JAX")
    with pytest.raises(UnsupportedInput, match=re.escape("a ragged batch (cu_q_lens)")):
        decode.attention(q, k, v, lengths, page_table=table, cu_q_lens=cu, impl="jax_paged")
    spec = decode.validate(q, k, v, lengths, table, cu_q_lens=cu).spec
    assert decode.get_implementation("jax_paged").supports(spec, "tpu").startswith("cu_q_lens: ")


def test_ragged_translation_through_jaxs_reference():
    """JAX's ragged kernel cannot run off a TPU; its reference takes the same arguments, so the native
    ragged form handed to it (cu_q_lens and num_seqs unchanged) is checked through it. JAX's kernel
    needs every sequence's query length at most its length, and head_dim 128."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import ref_ragged_paged_attention

    from tpuattn.decode import native

    case = Case("jax", head_dim=128, seqs=((9, 1), (32, 12), (20, 0), (3, 3), (17, 9)), window=(6, 0),
                softcap=4.0)
    q, k, v, lengths, table, cu, _ = make_inputs(case)
    x = decode.validate(q, k, v, lengths, table, cu_q_lens=cu, window=case.window, softcap=case.softcap)
    cu_n, n = np.asarray(x.cu_q_lens), np.asarray(x.num_seqs)
    out = jax.jit(lambda q, k, v: native.ragged_translation(
        ref_ragged_paged_attention, q, k, v, lengths, table, x.spec, cu_q_lens=cu_n, num_seqs=n))(q, k, v)
    want = _expected(case, q, k, v, lengths, table, cu, None)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=1e-4, rtol=1e-4)


def _good():
    rng = np.random.default_rng(0)
    return dict(q=jnp.asarray(rng.standard_normal((6, 4, 8)), jnp.float32),
                k_cache=jnp.zeros((6, 4, 2, 8), jnp.float32), v_cache=jnp.zeros((6, 4, 2, 8), jnp.float32),
                lengths=np.array([3, 8], np.int32), page_table=np.array([[0, 1], [2, 3]], np.int32),
                cu_q_lens=np.array([0, 2, 6], np.int32))


BAD = [
    ("rank 4 with cu_q_lens", dict(q=jnp.zeros((2, 3, 4, 8))), ValueError,
     "q: expected rank 3 [total_tokens, heads, head_dim] with cu_q_lens (ragged), got shape (2, 3, 4, 8)"),
    ("rank 3 without", dict(cu_q_lens=None), ValueError,
     "q: expected rank 4 [batch, q_len, heads, head_dim] (a rank-3 ragged q needs cu_q_lens)"),
    ("cu shape", dict(cu_q_lens=np.array([0, 6], np.int32)), TpuattnError,
     "cu_q_lens: expected shape (3,) (batch + 1: one more than lengths), got (2,)"),
    ("cu dtype", dict(cu_q_lens=np.array([0.0, 2.0, 6.0])), TypeError,
     "cu_q_lens: expected an integer dtype (int32), got float64"),
    ("cu start", dict(cu_q_lens=np.array([1, 2, 6], np.int32)), TpuattnError,
     "cu_q_lens: expected 0 first (the start of sequence 0's tokens), got 1"),
    ("cu decreasing", dict(cu_q_lens=np.array([0, 4, 3], np.int32)), TpuattnError,
     "cu_q_lens: expected non-decreasing values (query lengths >= 0), got 3 after 4 at [2]"),
    ("cu past q", dict(cu_q_lens=np.array([0, 2, 7], np.int32)), TpuattnError,
     "cu_q_lens: expected values at most 6 (q's total_tokens), got 7 at [2]"),
    ("num_seqs range", dict(num_seqs=3), TpuattnError,
     "num_seqs: expected a value in [0, 2] (the batch), got 3"),
    ("num_seqs negative", dict(num_seqs=np.array([-1], np.int32)), TpuattnError,
     "num_seqs: expected a value in [0, 2] (the batch), got -1"),
    ("num_seqs shape", dict(num_seqs=np.array([1, 1], np.int32)), TpuattnError,
     "num_seqs: expected an int or an integer array of one element, got shape (2,) of int32"),
    ("num_seqs dense", dict(q=jnp.zeros((2, 1, 4, 8)), cu_q_lens=None, num_seqs=2), TpuattnError,
     "num_seqs: counts the live sequences of a ragged batch; expected None without cu_q_lens, got 2"),
]


@pytest.mark.parametrize("name,change,error,message", BAD, ids=[b[0] for b in BAD])
def test_bad_ragged_arguments_are_refused_with_a_clear_message(name, change, error, message):
    args = {**_good(), **change}
    with pytest.raises(error, match=re.escape(message)):
        decode.attention(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), args.pop("lengths"),
                         impl="reference", **args)


def test_num_seqs_hides_the_entries_past_it():
    """With num_seqs 1 the second sequence's entries are not read (a bad one is fine) and its rows are
    zeros; cu_q_lens of the live sequences is still checked."""
    args = _good()
    out = decode.attention(args["q"], args["k_cache"] + 1, args["v_cache"] + 1, args["lengths"],
                           page_table=args["page_table"], cu_q_lens=np.array([0, 2, -5], np.int32),
                           num_seqs=1, impl="reference")
    np.testing.assert_array_equal(np.asarray(out)[2:], 0.0)
    np.testing.assert_allclose(np.asarray(out)[:2], 1.0, rtol=1e-6)  # every value 1


@pytest.mark.parametrize("seed", [12, 13])
def test_fuzz_ragged_batches(seed):
    """Random ragged batches: query lengths from 0 to past the sequence's length, lengths from 0 to the
    capacity, a random page table, GQA, a window or none, per-kv-head int8 scales on odd seeds; every
    implementation that takes them against the oracle (pallas with a random q_block)."""
    rng = np.random.default_rng(seed)
    b, heads, kv_heads, d = int(rng.integers(1, 6)), 4, int(rng.choice([1, 2, 4])), 16
    lengths = rng.integers(0, PAGE * PPS + 1, b).astype(np.int32)
    lengths[rng.integers(b)] = PAGE * PPS  # one at the capacity
    q_lens = np.minimum(rng.integers(0, 14, b), lengths + 2)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    total = max(int(cu[-1]) + int(rng.integers(0, 3)), 1)
    q = rng.standard_normal((total, heads, d)).astype(np.float32)
    k = rng.standard_normal((b * PPS + 2, PAGE, kv_heads, d)).astype(np.float32)
    v = rng.standard_normal(k.shape).astype(np.float32)
    table = rng.permutation(b * PPS + 2)[: b * PPS].reshape(b, PPS).astype(np.int32)
    window = None if rng.random() < 0.5 else (int(rng.integers(0, 20)), 0)
    scales = {}
    if seed % 2:
        k, ks = decode.quantize(k, "int8")
        v, vs = decode.quantize(v, "int8")
        scales = dict(k_scale=ks, v_scale=vs)
    want = oracle_ragged_decode(q, k, v, lengths, cu, page_table=table, window=window, **scales)
    for impl in [i for i in IMPLS if decode.get_implementation(i).takes_ragged and i != "jax_ragged"]:
        options = {"q_block": int(rng.integers(3, 9))} if impl == "pallas" else {}
        out = decode.attention(q, k, v, lengths, page_table=table, cu_q_lens=cu, window=window, impl=impl,
                               **scales, **options)
        np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=2e-5, rtol=2e-5,
                                   err_msg=f"{impl} {options}")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_visits_cover_each_token_block_once_per_sequence_within_the_static_bound(seed):
    """The token-major kernel's visit table (kernel.visits) against a plain enumeration: every (token
    block, sequence) with a query of the sequence in the block is one useful visit, in block order, with
    the block's rows of that sequence, their first position and the cache blocks they see; each block has
    one first and one last visit (a block of padding only: one visit, nothing to compute); the table's
    size is the static bound ceil(total / T) + batch - 1; a visit with nothing to compute asks for the
    sequence and cache block of the last useful visit (no new DMA)."""
    from tpuattn.decode import kernel

    rng = np.random.default_rng(seed)
    b, tokens, block, capacity = int(rng.integers(1, 7)), 8, 4, 32
    lengths = rng.integers(0, capacity + 1, b)
    q_lens = np.minimum(rng.integers(0, 20, b), lengths + 3)
    q_lens[rng.integers(b)] = 0
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    total = int(cu[-1]) + int(rng.integers(0, 12)) + 1
    left = None if seed == 0 else int(rng.integers(0, 9))
    table = np.asarray(kernel.visits(cu, lengths, total, tokens, block, capacity, left))
    f = {name: table[i] for i, name in enumerate(kernel.VISIT_FIELDS)}
    num_blocks = -(-total // tokens)
    assert table.shape == (len(kernel.VISIT_FIELDS), num_blocks + b - 1)
    want = []  # (block, seq, lo, hi, first position, first cache block, last cache block)
    for i in range(num_blocks):
        for s in range(b):
            rows = [t for t in range(tokens) if cu[s] <= i * tokens + t < cu[s + 1]]
            positions = [lengths[s] - q_lens[s] + i * tokens + t - cu[s] for t in rows]
            if rows and positions[-1] >= 0:
                first = 0 if left is None else max(positions[0] - left, 0) // block
                want.append((i, s, rows[0], rows[-1] + 1, positions[0], first, positions[-1] // block))
    use = f["use"] == 1
    got = [(f["block"][v], f["seq"][v], f["lo"][v], f["hi"][v], f["pos"][v] + f["lo"][v], f["kv_first"][v],
            f["kv_last"][v]) for v in np.flatnonzero(use)]
    assert got == want
    assert np.all(np.diff(f["block"]) >= 0)
    for i in range(num_blocks):  # first at the block's first visit, last at its last (then padding)
        mine = np.flatnonzero(f["block"] == i)
        end = mine[0] + int(np.flatnonzero(f["last"][mine])[0]) + 1
        assert f["first"][mine].sum() == 1 and f["last"][mine].sum() == 1 and f["first"][mine[0]] == 1
        assert i == num_blocks - 1 or end == mine[-1] + 1
        assert not np.any(table[kernel.VISIT_FIELDS.index("first"):, end:mine[-1] + 1])
    held = None
    for v in range(table.shape[1]):
        if use[v]:
            held = (f["seq"][v], f["kv_last"][v])
        elif held is not None:
            assert (f["seq"][v], f["kv_first"][v], f["kv_last"][v]) == (held[0], held[1], held[1])


def test_a_ragged_batch_has_no_split_k_chunks():
    args = _good()
    with pytest.raises(ValueError, match=re.escape(
            "chunk_blocks: a ragged batch (cu_q_lens) has no split-K chunks (each visit walks its sequence's "
            "cache); expected None, got 2")):
        decode.attention(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), args.pop("lengths"),
                         impl="pallas", chunk_blocks=2, **args)
