"""Backward, decode and ring puzzles, in order of difficulty: the dQ kernel, the dK/dV kernel, softcap
and a sliding window inside a tile, split-K decode over pages, one causal ring step with ``ppermute``; plus
three find-the-bug kernels (an index map that fetches hidden blocks, a bfloat16 accumulator, a block
the TPU compiler refuses).

Each puzzle's ``build`` holds everything but the learner's answer; its ``oracle`` is float64 NumPy
written from the formula, apart from ``tpuattn``. Shapes are small (interpret mode runs on CPU) and
tile-legal, so the same kernels compile for v5e. Importing this module registers the puzzles in
:data:`tpuattn.puzzles.core.REGISTRY`. Numbering continues the forward puzzles (1-8, A, B).
Every ``pallas_call`` goes through :func:`tpuattn.puzzles.core.pallas_call` with its operands' names,
so the check walks its index maps over the whole grid and checks its ``"parallel"`` axes.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpuattn.puzzles.core import Puzzle, pallas_call, register

# ---------------------------------------------------------------------------------------------------
# Shapes (small for interpret mode; blocks are multiples of the (8, 128) float32 tile, or the array's
# whole dimension).

HEAD_DIM = 128
SCALE = 1.0 / np.sqrt(HEAD_DIM)
SEQ, BLOCK_Q, BLOCK_KV = 256, 64, 128          # puzzles 9, 10, C: one head, non-causal (9, 10), causal (C)
MASK_SEQ, MASK_BLOCK = 256, 64                 # puzzle 11
WINDOW, SOFTCAP = 96, 5.0                      # puzzle 11: key c visible from row r iff r - 96 < c <= r
DECODE_HEADS, PAGE_SIZE, PAGES_PER_SEQ, PAGES_PER_CHUNK, NUM_PAGES = 8, 16, 8, 4, 16  # puzzle 12
DECODE_LENGTHS = (100, 37)                     # puzzle 12: tokens in each sequence's cache
RING_DEVICES, RING_BLOCK = 4, 32               # puzzle 13: 4 devices, 32 queries and keys each
RING_AXIS = "ring"
BF16_ROWS, BF16_REDUCE, BF16_COLS, BF16_BLOCK = 16, 4096, 128, 128  # bug D: a 4096-long reduction
DELTA_SEQ = 256                                # bug E
BACKWARD_INPUTS = ("q", "k", "v", "do", "lse", "delta")  # the backward kernels' inputs, in order


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _normal(rng, shape, scale: float = 1.0) -> np.ndarray:
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def _params(*semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics)


def _qk(q, k):
    """``q kᵀ`` without a transpose, in float32."""
    return jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _tn(a, b):
    """``aᵀ b`` without a transpose, in float32."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


# ---------------------------------------------------------------------------------------------------
# float64 oracles, from the formulas.

def _f64(*arrays):
    return tuple(np.asarray(a, np.float64) for a in arrays)


def _softmax64(s):
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    return p / p.sum(axis=-1, keepdims=True)


def _probabilities64(q, k, visible=None, softcap=None):
    s = q @ k.T * SCALE
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if visible is not None:
        s = np.where(visible, s, -np.inf)
    return _softmax64(s)


def _gradients64(q, k, v, do, visible=None):
    """``(dq, dk, dv)`` of ``sum(o * do)`` with ``o = softmax(q kᵀ · scale) v``, in float64."""
    q, k, v, do = _f64(q, k, v, do)
    p = _probabilities64(q, k, visible)
    dp = do @ v.T
    ds = p * (dp - (p * dp).sum(axis=1, keepdims=True))
    return ds @ k * SCALE, ds.T @ q * SCALE, p.T @ do


def causal_visible(seq: int) -> np.ndarray:
    """``[seq, seq]`` bool: query ``r`` sees key ``c`` iff ``c <= r``."""
    return np.arange(seq)[None, :] <= np.arange(seq)[:, None]


def window_visible(seq: int = MASK_SEQ, window: int = WINDOW) -> np.ndarray:
    """``[seq, seq]`` bool: query ``r`` sees key ``c`` iff ``r - window < c <= r``."""
    r, c = np.arange(seq)[:, None], np.arange(seq)[None, :]
    return (c <= r) & (c > r - window)


def _backward_inputs(seed: int, visible=None):
    """``q, k, v, do`` float32 ``[SEQ, HEAD_DIM]`` and the forward's ``lse``, ``delta`` ``[SEQ, 1]``
    (from the float64 forward, rounded to float32, as a forward kernel would hand them over)."""
    rng = _rng(seed)
    q, k, v, do = (_normal(rng, (SEQ, HEAD_DIM)) for _ in range(4))
    s = np.asarray(q, np.float64) @ np.asarray(k, np.float64).T * SCALE
    if visible is not None:
        s = np.where(visible, s, -np.inf)
    m = s.max(axis=1, keepdims=True)
    lse = m + np.log(np.exp(s - m).sum(axis=1, keepdims=True))
    o = np.exp(s - lse) @ np.asarray(v, np.float64)
    delta = (o * np.asarray(do, np.float64)).sum(axis=1, keepdims=True)
    return q, k, v, do, lse.astype(np.float32), delta.astype(np.float32)


def fetches(index_map, grid, *prefetch) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Walk ``grid`` in order (the last axis fastest) as the Pallas pipeline does and list
    ``(step, block)`` for every step whose ``index_map(*step, *prefetch)`` names a block other than the
    previous step's: the steps that start a DMA (the first step always does)."""
    out, previous = [], None
    for step in itertools.product(*(range(n) for n in grid)):
        block = tuple(int(b) for b in index_map(*step, *prefetch))
        if block != previous:
            out.append((step, block))
        previous = block
    return out


# ---------------------------------------------------------------------------------------------------
# 9. the dQ kernel: the body. grid (query blocks, kv blocks); kv is the reduction ("arbitrary").

DQ_GRID = (SEQ // BLOCK_Q, SEQ // BLOCK_KV)


def _build_dq(body, *, interpret):
    row = pl.BlockSpec((BLOCK_Q, HEAD_DIM), lambda i, j: (i, 0))
    stat = pl.BlockSpec((BLOCK_Q, 1), lambda i, j: (i, 0))
    kv = pl.BlockSpec((BLOCK_KV, HEAD_DIM), lambda i, j: (j, 0))

    def fn(q, k, v, do, lse, delta):
        return pallas_call(
            body, out_shape=jax.ShapeDtypeStruct(q.shape, jnp.float32), grid=DQ_GRID,
            in_specs=[row, kv, kv, row, stat, stat], out_specs=row,
            scratch_shapes=[pltpu.VMEM((BLOCK_Q, HEAD_DIM), jnp.float32)],
            compiler_params=_params("parallel", "arbitrary"), interpret=interpret,
            in_names=BACKWARD_INPUTS, out_names=("dq",))(q, k, v, do, lse, delta)
    return fn


DQ = register(Puzzle(
    "9. the dQ kernel", _build_dq, lambda: _backward_inputs(9),
    lambda q, k, v, do, lse, delta: _gradients64(q, k, v, do)[0], rtol=1e-4, atol=1e-5, outputs=("dQ",)))


# ---------------------------------------------------------------------------------------------------
# 10. the dK/dV kernel: the body. grid (kv blocks, query blocks); the query axis is the reduction.

DKV_GRID = (SEQ // BLOCK_KV, SEQ // BLOCK_Q)


def _dkv_call(body, grid, block_q, block_kv, q_index_map, *, interpret):
    """The dK/dV ``pallas_call`` of puzzles 10 and C: grid ``(kv block j, q block i)``, the q-side rows
    (Q, dO, lse, delta) at ``q_index_map``, dK and dV accumulated in two float32 scratch blocks."""
    row = pl.BlockSpec((block_q, HEAD_DIM), q_index_map)
    stat = pl.BlockSpec((block_q, 1), q_index_map)
    kv = pl.BlockSpec((block_kv, HEAD_DIM), lambda j, i: (j, 0))

    def fn(q, k, v, do, lse, delta):
        out = jax.ShapeDtypeStruct(k.shape, jnp.float32)
        return pallas_call(
            body, out_shape=(out, out), grid=grid,
            in_specs=[row, kv, kv, row, stat, stat], out_specs=(kv, kv),
            scratch_shapes=[pltpu.VMEM((block_kv, HEAD_DIM), jnp.float32)] * 2,
            compiler_params=_params("parallel", "arbitrary"), interpret=interpret,
            in_names=BACKWARD_INPUTS, out_names=("dk", "dv"))(q, k, v, do, lse, delta)
    return fn


def _build_dkv(body, *, interpret):
    return _dkv_call(body, DKV_GRID, BLOCK_Q, BLOCK_KV, lambda j, i: (i, 0), interpret=interpret)


DKV = register(Puzzle(
    "10. the dK/dV kernel", _build_dkv, lambda: _backward_inputs(10),
    lambda q, k, v, do, lse, delta: _gradients64(q, k, v, do)[1:], rtol=1e-4, atol=1e-5,
    outputs=("dK", "dV")))


# ---------------------------------------------------------------------------------------------------
# 11. softcap and a sliding window in the forward: the body. grid (query blocks, kv blocks), all
# steps run; the mask is applied inside each tile.

MASK_GRID = (MASK_SEQ // MASK_BLOCK, MASK_SEQ // MASK_BLOCK)


def _build_masked(body, *, interpret):
    block = pl.BlockSpec((MASK_BLOCK, HEAD_DIM), lambda i, j: (i, 0))
    kv = pl.BlockSpec((MASK_BLOCK, HEAD_DIM), lambda i, j: (j, 0))

    def fn(q, k, v):
        return pallas_call(
            body, out_shape=jax.ShapeDtypeStruct(q.shape, jnp.float32), grid=MASK_GRID,
            in_specs=[block, kv, kv], out_specs=block,
            scratch_shapes=[pltpu.VMEM((MASK_BLOCK, 1), jnp.float32),
                            pltpu.VMEM((MASK_BLOCK, 1), jnp.float32),
                            pltpu.VMEM((MASK_BLOCK, HEAD_DIM), jnp.float32)],
            compiler_params=_params("parallel", "arbitrary"), interpret=interpret,
            in_names=("q", "k", "v"), out_names=("out",))(q, k, v)
    return fn


def _masked_inputs():
    rng = _rng(11)
    # q scaled by 4: scores of a few units, where the softcap's tanh bends them visibly.
    return _normal(rng, (MASK_SEQ, HEAD_DIM), 4.0), _normal(rng, (MASK_SEQ, HEAD_DIM)), \
        _normal(rng, (MASK_SEQ, HEAD_DIM))


def _masked64(q, k, v):
    q, k, v = _f64(q, k, v)
    return _probabilities64(q, k, window_visible(), SOFTCAP) @ v


MASKED = register(Puzzle(
    "11. softcap and a sliding window", _build_masked, _masked_inputs, _masked64, rtol=1e-4, atol=1e-5))


# ---------------------------------------------------------------------------------------------------
# 12. split-K decode over pages: the page index map and the merge. One query token per sequence with
# DECODE_HEADS query heads sharing one K/V head (the heads are the rows of a tile). The cache is a
# pool of pages k_pages, v_pages [NUM_PAGES, PAGE_SIZE, HEAD_DIM]; sequence b's token t sits in page
# page_table[b, t // PAGE_SIZE] at row t % PAGE_SIZE. grid (sequence b, chunk c, page p in the chunk):
# chunk c of sequence b covers its pages c * PAGES_PER_CHUNK ... + PAGES_PER_CHUNK - 1 and writes one
# partial result (out, m, l); the learner's merge combines a sequence's chunks afterwards.

DECODE_CHUNKS = PAGES_PER_SEQ // PAGES_PER_CHUNK
DECODE_GRID = (len(DECODE_LENGTHS), DECODE_CHUNKS, PAGES_PER_CHUNK)


def decode_tables():
    """``(page_table [B, PAGES_PER_SEQ], lengths [B])`` int32: pages handed out in a shuffled order;
    entries past a sequence's last page are padding (pages of the pool that hold no token of it: never to
    be read)."""
    rng = _rng(12)
    order = rng.permutation(NUM_PAGES)
    table = np.zeros((len(DECODE_LENGTHS), PAGES_PER_SEQ), np.int32)
    used = 0
    for b, length in enumerate(DECODE_LENGTHS):
        n = -(-length // PAGE_SIZE)
        table[b, :n] = order[used:used + n]
        used += n
    for b, length in enumerate(DECODE_LENGTHS):
        n = -(-length // PAGE_SIZE)
        table[b, n:] = order[(used + np.arange(PAGES_PER_SEQ - n)) % NUM_PAGES]
    return table, np.asarray(DECODE_LENGTHS, np.int32)


def _decode_body(page_table_ref, lengths_ref, q_ref, k_ref, v_ref, out_ref, m_out_ref, l_out_ref,
                 m_ref, l_ref, acc_ref):
    b, c, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(p == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    first_token = (c * PAGES_PER_CHUNK + p) * PAGE_SIZE

    @pl.when(first_token < lengths_ref[b])  # a page past the end: nothing to compute
    def _step():
        s = _qk(q_ref[...], k_ref[...]) * SCALE                      # (heads, PAGE_SIZE)
        tokens = first_token + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(tokens < lengths_ref[b], s, -jnp.inf)
        m_old = m_ref[...]
        m_new = jnp.maximum(m_old, s.max(axis=1, keepdims=True))
        pr = jnp.exp(s - m_new)
        alpha = jnp.exp(m_old - m_new)
        l_ref[...] = alpha * l_ref[...] + pr.sum(axis=1, keepdims=True)
        acc_ref[...] = alpha * acc_ref[...] + jnp.dot(pr, v_ref[...], preferred_element_type=jnp.float32)
        m_ref[...] = m_new

    @pl.when(p == PAGES_PER_CHUNK - 1)
    def _write():
        total = l_ref[...]
        # A chunk past the end saw no token: out 0, m -inf, l 0 (the merge must give it no weight).
        out_ref[...] = jnp.where(total > 0, acc_ref[...] / jnp.where(total > 0, total, 1.0), 0.0)
        m_out_ref[...] = m_ref[...]
        l_out_ref[...] = total


def _build_decode(parts, *, interpret):
    table, lengths = decode_tables()
    batch = len(DECODE_LENGTHS)

    def fn(q, k_pages, v_pages):
        page_index_map, merge = parts()
        page = pl.BlockSpec((None, PAGE_SIZE, HEAD_DIM), page_index_map)
        q_spec = pl.BlockSpec((None, DECODE_HEADS, HEAD_DIM), lambda b, c, p, *_: (b, 0, 0))
        out_spec = pl.BlockSpec((None, None, DECODE_HEADS, HEAD_DIM), lambda b, c, p, *_: (b, c, 0, 0))
        stat_spec = pl.BlockSpec((None, None, DECODE_HEADS, 1), lambda b, c, p, *_: (b, c, 0, 0))
        stat = jax.ShapeDtypeStruct((batch, DECODE_CHUNKS, DECODE_HEADS, 1), jnp.float32)
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=DECODE_GRID, in_specs=[q_spec, page, page],
            out_specs=(out_spec, stat_spec, stat_spec),
            scratch_shapes=[pltpu.VMEM((DECODE_HEADS, 1), jnp.float32),
                            pltpu.VMEM((DECODE_HEADS, 1), jnp.float32),
                            pltpu.VMEM((DECODE_HEADS, HEAD_DIM), jnp.float32)])
        out, m, l_sum = pallas_call(
            _decode_body, grid_spec=grid_spec,
            out_shape=(jax.ShapeDtypeStruct((batch, DECODE_CHUNKS, DECODE_HEADS, HEAD_DIM), jnp.float32),
                       stat, stat),
            compiler_params=_params("parallel", "parallel", "arbitrary"), interpret=interpret,
            in_names=("q", "k_pages", "v_pages"), out_names=("out", "m", "l"),
        )(jnp.asarray(table), jnp.asarray(lengths), q, k_pages, v_pages)
        return merge(out, m, l_sum)
    return fn


def _decode_inputs():
    rng = _rng(120)
    return (_normal(rng, (len(DECODE_LENGTHS), DECODE_HEADS, HEAD_DIM), 2.0),
            _normal(rng, (NUM_PAGES, PAGE_SIZE, HEAD_DIM)), _normal(rng, (NUM_PAGES, PAGE_SIZE, HEAD_DIM)))


def _decode64(q, k_pages, v_pages):
    table, lengths = decode_tables()
    q, k_pages, v_pages = _f64(q, k_pages, v_pages)
    out = []
    for b, length in enumerate(lengths):
        k = k_pages[table[b]].reshape(-1, HEAD_DIM)[:length]
        v = v_pages[table[b]].reshape(-1, HEAD_DIM)[:length]
        out.append(_probabilities64(q[b], k) @ v)
    return np.stack(out)


def needed_pages(b: int, c: int, p: int, table, lengths) -> tuple[int, int, int]:
    """The page block step ``(b, c, p)`` should name: its own page, or, past the sequence's end, the
    sequence's last page (already fetched, so no DMA)."""
    last = -(-int(lengths[b]) // PAGE_SIZE) - 1
    return int(table[b, min(c * PAGES_PER_CHUNK + p, last)]), 0, 0


def _decode_audit(parts):
    page_index_map, _ = parts()
    table, lengths = decode_tables()
    got = fetches(page_index_map, DECODE_GRID, table, lengths)
    want = fetches(needed_pages, DECODE_GRID, table, lengths)
    if got == want:
        return None
    valid = {b: set(table[b, :-(-int(n) // PAGE_SIZE)].tolist()) for b, n in enumerate(lengths)}
    for step, block in got:
        if block[0] not in valid[step[0]]:
            return (f"at grid step {step} the page index map fetches page {block[0]}, which sequence "
                    f"{step[0]} does not own ({len(got)} page fetches in all; {len(want)} are needed)")
    return f"the page index map starts {len(got)} page fetches; {len(want)} are needed"


DECODE = register(Puzzle(
    "12. split-K decode over pages", _build_decode, _decode_inputs, _decode64, rtol=1e-4, atol=1e-5,
    audit=_decode_audit))


# ---------------------------------------------------------------------------------------------------
# 13. one ring step, causal: inside shard_map over RING_DEVICES devices, device d holding query block d
# (RING_BLOCK queries) and, at first, K/V block d. The ring's schedule: at step s device d holds K/V
# block (d - s) mod RING_DEVICES, so each step passes K/V to the next device (d -> d + 1). The learner's
# step attends the block it holds (masked causally as that block), merges, and passes K/V on; sent the
# other way, a device holds another block than the one it masks for, and the values are wrong.

def held_block(step: int):
    """The K/V block this device holds at ring step ``step`` by the ring's schedule:
    ``(d - step) mod RING_DEVICES`` with ``d = jax.lax.axis_index(RING_AXIS)`` (traced, int32)."""
    d = jax.lax.axis_index(RING_AXIS)
    return jax.lax.rem(d + RING_DEVICES - step, RING_DEVICES)


def block_partial(q, k, v, kv_block):
    """This device's partial result of its queries (query block ``jax.lax.axis_index(RING_AXIS)`` of the
    whole sequence) against ``k``, ``v`` taken as K/V block ``kv_block``, masked causally (query ``r``
    sees key ``c`` iff ``c <= r``, both positions in the whole sequence): ``(out, m, l)`` with ``out``
    normalised by this block's ``l`` (``[rows, head_dim]``, ``[rows, 1]``, ``[rows, 1]``, float32). A row
    that sees no key of the block gives ``out = 0, m = -inf, l = 0``."""
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * SCALE
    rows = jax.lax.axis_index(RING_AXIS) * q.shape[0] + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
    cols = kv_block * k.shape[0] + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    s = jnp.where(cols <= rows, s, -jnp.inf)
    m = s.max(axis=1, keepdims=True)
    p = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m))  # a row that sees nothing: p = 0, not NaN
    l_sum = p.sum(axis=1, keepdims=True)
    out = jnp.dot(p, v, preferred_element_type=jnp.float32) / jnp.where(l_sum > 0, l_sum, 1.0)
    return out, m, l_sum


def _ring(step):
    """Every device's whole ring: RING_DEVICES steps of the learner's ``step`` from the empty state,
    step ``s`` handed the block the schedule says the device holds then (:func:`held_block`)."""
    def run(q, k, v):
        out = jnp.zeros(q.shape, jnp.float32)
        m = jnp.full((q.shape[0], 1), -jnp.inf, jnp.float32)
        l_sum = jnp.zeros((q.shape[0], 1), jnp.float32)
        for s in range(RING_DEVICES):
            out, m, l_sum, k, v = step(q, k, v, out, m, l_sum, held_block(s))
        return out
    return run


def _shard_map():
    if hasattr(jax, "shard_map"):
        return jax.shard_map
    from jax.experimental.shard_map import shard_map  # JAX 0.7.2

    return shard_map


def _ring_on(mesh, step):
    from jax.sharding import PartitionSpec as P

    def local(q, k, v):  # each device's block arrives as [1, RING_BLOCK, HEAD_DIM]
        return _ring(step)(q[0], k[0], v[0])[None]

    spec = P(RING_AXIS)
    return _shard_map()(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)


def ring_runs_on() -> str:
    """Where the ring's interpret-mode check runs: ``shard_map`` on RING_DEVICES CPU devices if this
    process has them, else ``vmap`` with the same axis name (the same ``ppermute`` semantics)."""
    if len(jax.devices()) >= RING_DEVICES:
        return f"shard_map over {RING_DEVICES} {jax.devices()[0].platform} devices"
    return (f"vmap(axis_name={RING_AXIS!r}) on one device: this process has {len(jax.devices())} "
            f"device(s), fewer than {RING_DEVICES}")


def _build_ring(step, *, interpret):
    if interpret is not False:
        if len(jax.devices()) >= RING_DEVICES:
            mesh = jax.sharding.Mesh(np.array(jax.devices()[:RING_DEVICES]), (RING_AXIS,))
            return jax.jit(_ring_on(mesh, step))
        return jax.jit(jax.vmap(_ring(step), axis_name=RING_AXIS))

    def compile_on_slice(q, k, v):
        # check() compiles for one device of its chip; a ring needs four. So this function, traced
        # inside that compile (whose chips.target names the chip), compiles the ring for a
        # compile-only 2x2 slice of the same chip (four chips) -- the compiler's errors propagate --
        # and hands the one-device compile its input unchanged.
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from tpuattn import chips
        from tpuattn.measure import aot

        chip = chips.target_chip() or chips.get("v5e")
        devices = aot._topology(chip.topology).devices[:RING_DEVICES]
        mesh = jax.sharding.Mesh(np.array(devices), (RING_AXIS,))
        placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P(RING_AXIS)))
                  for a in (q, k, v)]
        jax.jit(_ring_on(mesh, step)).lower(*placed).compile()
        return q
    return compile_on_slice


def _ring_inputs():
    rng = _rng(13)
    return tuple(_normal(rng, (RING_DEVICES, RING_BLOCK, HEAD_DIM)) for _ in range(3))


def _ring64(q, k, v):
    q, k, v = _f64(q, k, v)
    n, rows, d = q.shape
    q, k, v = (a.reshape(n * rows, d) for a in (q, k, v))
    return (_probabilities64(q, k, causal_visible(n * rows)) @ v).reshape(n, rows, d)


RING = register(Puzzle(
    "13. one ring step (ppermute), causal", _build_ring, _ring_inputs, _ring64, rtol=1e-4, atol=1e-5))


# ---------------------------------------------------------------------------------------------------
# Find the bug C: causal dK/dV, the index map of the query-side blocks. grid (kv block j, query block
# i); K/V block j is seen only by query blocks i >= j (blocks of BLOCK_KV = BLOCK_Q here: square).

CAUSAL_BLOCK = BLOCK_Q
CAUSAL_GRID = (SEQ // CAUSAL_BLOCK, SEQ // CAUSAL_BLOCK)


def _causal_dkv_body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_acc, dv_acc):
    j, i = pl.program_id(0), pl.program_id(1)

    @pl.when(i == 0)
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    @pl.when(i >= j)  # query block i sees K/V block j
    def _step():
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        s = _qk(q, k) * SCALE
        rows = i * CAUSAL_BLOCK + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
        cols = j * CAUSAL_BLOCK + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        p = jnp.where(cols <= rows, jnp.exp(s - lse_ref[...]), 0.0)
        dp = _qk(do, v)
        ds = p * (dp - delta_ref[...])
        dv_acc[...] += _tn(p, do)
        dk_acc[...] += _tn(ds, q) * SCALE

    @pl.when(i == pl.num_programs(1) - 1)
    def _write():
        dk_ref[...] = dk_acc[...]
        dv_ref[...] = dv_acc[...]


def _build_causal_dkv(q_index_map, *, interpret):
    return _dkv_call(_causal_dkv_body, CAUSAL_GRID, CAUSAL_BLOCK, CAUSAL_BLOCK, q_index_map,
                     interpret=interpret)


def _causal_dkv_audit(q_index_map):
    got = fetches(q_index_map, CAUSAL_GRID)
    want = fetches(lambda j, i: (max(i, j), 0), CAUSAL_GRID)
    if got == want:
        return None
    for (j, i), block in got:
        if block[0] < j:
            return (f"at grid step (j={j}, i={i}) the index map fetches query block {block[0]}, which "
                    f"K/V block {j} never sees ({len(got)} fetches of each query-side array; "
                    f"{len(want)} are needed)")
    return f"the index map starts {len(got)} fetches of each query-side array; {len(want)} are needed"


CAUSAL_DKV = register(Puzzle(
    "C. find the bug: fetching hidden blocks", _build_causal_dkv,
    lambda: _backward_inputs(14, causal_visible(SEQ)),
    lambda q, k, v, do, lse, delta: _gradients64(q, k, v, do, causal_visible(SEQ))[1:],
    rtol=1e-4, atol=1e-5, kind="bug", audit=_causal_dkv_audit, outputs=("dK", "dV")))


# ---------------------------------------------------------------------------------------------------
# Find the bug D: a bfloat16 accumulator. out = x @ y over a reduction of BF16_REDUCE, in blocks of
# BF16_BLOCK; x, y bfloat16 and the output bfloat16; a float32 scratch accumulator is provided.

BF16_GRID = (BF16_REDUCE // BF16_BLOCK,)


def _build_bf16(body, *, interpret):
    def fn(x, y):
        return pallas_call(
            body, out_shape=jax.ShapeDtypeStruct((BF16_ROWS, BF16_COLS), jnp.bfloat16), grid=BF16_GRID,
            in_specs=[pl.BlockSpec((BF16_ROWS, BF16_BLOCK), lambda k: (0, k)),
                      pl.BlockSpec((BF16_BLOCK, BF16_COLS), lambda k: (k, 0))],
            out_specs=pl.BlockSpec((BF16_ROWS, BF16_COLS), lambda k: (0, 0)),
            scratch_shapes=[pltpu.VMEM((BF16_ROWS, BF16_COLS), jnp.float32)],
            compiler_params=_params("arbitrary"), interpret=interpret, in_names=("x", "y"),
            out_names=("out",))(x, y)
    return fn


def _bf16_inputs():
    rng = _rng(15)
    # Non-negative entries: the sums grow to about 1000, where bfloat16's spacing is 4 to 8.
    x = rng.uniform(0.0, 1.0, (BF16_ROWS, BF16_REDUCE))
    y = rng.uniform(0.0, 1.0, (BF16_REDUCE, BF16_COLS))
    return np.asarray(jnp.asarray(x, jnp.bfloat16)), np.asarray(jnp.asarray(y, jnp.bfloat16))


# The output is bfloat16 (8 significant bits): rounding it once is off by at most half its spacing,
# at most 2**-8 = 0.39% relative; the tolerance is twice that. Rounding the running sum at each of the
# 32 steps is off by more.
BF16_ACC = register(Puzzle(
    "D. find the bug: a bfloat16 accumulator", _build_bf16, _bf16_inputs,
    lambda x, y: np.asarray(x, np.float64) @ np.asarray(y, np.float64), rtol=2.0 ** -7, atol=0.0,
    kind="bug"))


# ---------------------------------------------------------------------------------------------------
# Find the bug E: the tile rule. delta = rowsum(dO * O) (the backward's first pass), o and do
# [DELTA_SEQ, HEAD_DIM] float32, delta [DELTA_SEQ, 1]. The learner gives the input BlockSpec; the
# grid (row blocks, column blocks) follows from its block shape, and the body sums over column blocks.

def _delta_body(o_ref, do_ref, delta_ref):
    @pl.when(pl.program_id(1) == 0)
    def _init():
        delta_ref[...] = jnp.zeros(delta_ref.shape, jnp.float32)

    delta_ref[...] += (o_ref[...] * do_ref[...]).sum(axis=1, keepdims=True)


def _build_delta(block_spec, *, interpret):
    def fn(o, do):
        spec = block_spec()
        rows, cols = spec.block_shape
        grid = (o.shape[0] // rows, o.shape[1] // cols)
        out_spec = pl.BlockSpec((rows, 1), lambda i, d: (i, 0))
        return pallas_call(
            _delta_body, out_shape=jax.ShapeDtypeStruct((o.shape[0], 1), jnp.float32), grid=grid,
            in_specs=[spec, spec], out_specs=out_spec, compiler_params=_params("parallel", "arbitrary"),
            interpret=interpret, in_names=("o", "do"), out_names=("delta",))(o, do)
    return fn


def _delta_inputs():
    rng = _rng(16)
    return _normal(rng, (DELTA_SEQ, HEAD_DIM)), _normal(rng, (DELTA_SEQ, HEAD_DIM))


TILE_RULE = register(Puzzle(
    "E. find the bug: the tile rule", _build_delta, _delta_inputs,
    lambda o, do: (np.asarray(o, np.float64) * np.asarray(do, np.float64)).sum(axis=1, keepdims=True),
    rtol=1e-5, atol=1e-5, kind="bug"))

PUZZLES = (DQ, DKV, MASKED, DECODE, RING, CAUSAL_DKV, BF16_ACC, TILE_RULE)

__all__ = ["PUZZLES", "block_partial", "causal_visible", "decode_tables", "fetches", "held_block",
           "needed_pages", "ring_runs_on", "window_visible"] + [
    "BF16_ACC", "CAUSAL_DKV", "DECODE", "DKV", "DQ", "MASKED", "RING", "TILE_RULE"]
