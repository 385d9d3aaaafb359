"""Forward puzzles, in order of difficulty: from a copy to a flash-attention forward with a causal
schedule, a scalar-prefetch table and GQA, plus two find-the-bug kernels.

Each puzzle's ``build`` holds everything but the learner's answer (the grid, the other BlockSpecs, the
scratch buffers); its ``oracle`` is float64 NumPy written from the formula, apart from ``tpuattn``.
Shapes are small (interpret mode runs on CPU) and tile-legal, so the same kernels compile for v5e.
Importing this module registers the puzzles in :data:`tpuattn.puzzles.core.REGISTRY`.
Every ``pallas_call`` goes through :func:`tpuattn.puzzles.core.pallas_call` with its operands' names,
so the check walks its index maps over the whole grid and checks its ``"parallel"`` axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpuattn.puzzles.core import Puzzle, pallas_call, register

# ---------------------------------------------------------------------------------------------------
# Shapes (small for interpret mode; every block is a multiple of the (8, 128) float32 tile, or of
# bfloat16's (16, 128), or the array's whole dimension).

COPY_SHAPE, COPY_BLOCK = (16, 256), (8, 128)
ADD_SHAPE, ADD_BLOCK = (16, 512), (8, 128)
MATMUL_M, MATMUL_K, MATMUL_N = 32, 256, 256
MATMUL_BLOCKS = (16, 128, 128)  # (bm, bk, bn): bfloat16 inputs, so bm is a multiple of 16
SOFTMAX_SHAPE, SOFTMAX_BLOCK_ROWS = (16, 256), 8
HEAD_DIM = 128
FLASH_Q, FLASH_KV, FLASH_BLOCK_Q, FLASH_BLOCK_KV = 32, 256, 16, 128
CAUSAL_SEQ, CAUSAL_BLOCK = 256, 64
WINDOW = 128  # puzzle 7: a key is visible if  row - WINDOW < col <= row
GQA_HEADS, GQA_KV_HEADS, GQA_Q, GQA_KV, GQA_BLOCK_Q = 4, 2, 16, 128, 8
RACE_ROWS = 8  # the race puzzle copies two chunks of (RACE_ROWS, 128)


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _normal(rng, shape, dtype=np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def _bf16(rng, shape) -> np.ndarray:
    return np.asarray(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16))


def _params(*semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics)


# ---------------------------------------------------------------------------------------------------
# float64 oracles, from the formulas.

def _softmax64(s: np.ndarray) -> np.ndarray:
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    return p / p.sum(axis=-1, keepdims=True)


def _attention64(q, k, v, visible=None, sink=None) -> np.ndarray:
    """softmax(q kᵀ / sqrt(d)) v over the visible keys; with ``sink`` (a logit), one more term
    ``exp(sink)`` in every row's denominator that adds no value (an attention sink)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    s = q @ k.T / np.sqrt(q.shape[-1])
    if visible is not None:
        s = np.where(visible, s, -np.inf)
    if sink is None:
        return _softmax64(s) @ v
    top = np.maximum(s.max(axis=-1, keepdims=True), sink)
    p = np.exp(s - top)
    return (p @ v) / (p.sum(axis=-1, keepdims=True) + np.exp(sink - top))


def causal_visible(seq: int) -> np.ndarray:
    """``[seq, seq]`` bool: query ``r`` sees key ``c`` iff ``c <= r``."""
    r = np.arange(seq)[:, None]
    return np.arange(seq)[None, :] <= r


def window_visible(seq: int, window: int = WINDOW) -> np.ndarray:
    """``[seq, seq]`` bool: query ``r`` sees key ``c`` iff ``r - window < c <= r``."""
    r, c = np.arange(seq)[:, None], np.arange(seq)[None, :]
    return (c <= r) & (c > r - window)


# ---------------------------------------------------------------------------------------------------
# 1. copy: the kernel body.

def _build_copy(body, *, interpret):
    spec = pl.BlockSpec(COPY_BLOCK, lambda i, j: (i, j))
    grid = (COPY_SHAPE[0] // COPY_BLOCK[0], COPY_SHAPE[1] // COPY_BLOCK[1])

    def fn(x):
        return pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=grid,
                           in_specs=[spec], out_specs=spec, interpret=interpret, in_names=("x",),
                           out_names=("out",))(x)
    return fn


COPY = register(Puzzle(
    "1. copy", _build_copy, lambda: (_normal(_rng(1), COPY_SHAPE),),
    lambda x: np.asarray(x, np.float64), rtol=0.0, atol=0.0))


# ---------------------------------------------------------------------------------------------------
# 2. bias add: the BlockSpecs. out[r, c] = x[r, c] + bias[0, c] on the grid (rows / 8, cols / 128).

def _add_body(x_ref, bias_ref, o_ref):
    o_ref[...] = x_ref[...] + bias_ref[...]  # (8, 128) + (1, 128): broadcast over the rows


def _build_add(specs, *, interpret):
    grid = (ADD_SHAPE[0] // ADD_BLOCK[0], ADD_SHAPE[1] // ADD_BLOCK[1])

    def fn(x, bias):
        x_spec, bias_spec, out_spec = specs()
        return pallas_call(_add_body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=grid,
                           in_specs=[x_spec, bias_spec], out_specs=out_spec,
                           compiler_params=_params("parallel", "parallel"), interpret=interpret,
                           in_names=("x", "bias"), out_names=("out",))(x, bias)
    return fn


def _add_inputs():
    rng = _rng(2)
    return _normal(rng, ADD_SHAPE), _normal(rng, (1, ADD_SHAPE[1]))


ADD = register(Puzzle(
    "2. bias add (BlockSpecs)", _build_add, _add_inputs,
    lambda x, bias: np.asarray(x, np.float64) + np.asarray(bias, np.float64), rtol=1e-6, atol=1e-6))


# ---------------------------------------------------------------------------------------------------
# 3. matmul with a float32 accumulator over the reduction grid axis: the kernel body.

def _build_matmul(body, *, interpret):
    bm, bk, bn = MATMUL_BLOCKS
    grid = (MATMUL_M // bm, MATMUL_N // bn, MATMUL_K // bk)  # the reduction axis last: "arbitrary"

    def fn(x, y):
        return pallas_call(
            body, out_shape=jax.ShapeDtypeStruct((MATMUL_M, MATMUL_N), x.dtype), grid=grid,
            in_specs=[pl.BlockSpec((bm, bk), lambda i, j, k: (i, k)),
                      pl.BlockSpec((bk, bn), lambda i, j, k: (k, j))],
            out_specs=pl.BlockSpec((bm, bn), lambda i, j, k: (i, j)),
            scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
            compiler_params=_params("parallel", "parallel", "arbitrary"), interpret=interpret,
            in_names=("x", "y"), out_names=("out",))(x, y)
    return fn


def _matmul_inputs():
    rng = _rng(3)
    return _bf16(rng, (MATMUL_M, MATMUL_K)), _bf16(rng, (MATMUL_K, MATMUL_N))


def _matmul64(x, y):
    return np.asarray(x, np.float64) @ np.asarray(y, np.float64)


# The output is bfloat16 (relative spacing 2**-8 = 0.4%); the sums are about 16 in size.
MATMUL = register(Puzzle(
    "3. matmul, float32 accumulator", _build_matmul, _matmul_inputs, _matmul64, rtol=1e-2, atol=5e-2))


# ---------------------------------------------------------------------------------------------------
# 4. row softmax: the kernel body. Rows are scaled so that exp without the max subtracted overflows.

def _build_softmax(body, *, interpret):
    rows, cols = SOFTMAX_SHAPE
    spec = pl.BlockSpec((SOFTMAX_BLOCK_ROWS, cols), lambda i: (i, 0))

    def fn(x):
        return pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                           grid=(rows // SOFTMAX_BLOCK_ROWS,), in_specs=[spec], out_specs=spec,
                           compiler_params=_params("parallel"), interpret=interpret, in_names=("x",),
                           out_names=("out",))(x)
    return fn


SOFTMAX = register(Puzzle(
    "4. row softmax", _build_softmax, lambda: (30.0 * _normal(_rng(4), SOFTMAX_SHAPE),),
    lambda x: _softmax64(np.asarray(x, np.float64)), rtol=1e-5, atol=1e-7))


# ---------------------------------------------------------------------------------------------------
# 5. flash forward (online softmax) for one head: the kernel body.
# grid (query blocks, kv blocks); scratch: m and l (block_q, 1), acc (block_q, head_dim), float32.

SCALE = 1.0 / np.sqrt(HEAD_DIM)


def _flash_call(body, q, k, v, *, grid, q_map, kv_map, block_q, block_kv, interpret, num_prefetch=0,
                prefetch=()):
    q_spec = pl.BlockSpec((block_q, HEAD_DIM), q_map)
    kv_spec = pl.BlockSpec((block_kv, HEAD_DIM), kv_map)
    scratch = [pltpu.VMEM((block_q, 1), jnp.float32), pltpu.VMEM((block_q, 1), jnp.float32),
               pltpu.VMEM((block_q, HEAD_DIM), jnp.float32)]
    out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    params = _params("parallel", "arbitrary")
    names = {"in_names": ("q", "k", "v"), "out_names": ("out",)}
    if num_prefetch:
        grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=num_prefetch, grid=grid,
                                                 in_specs=[q_spec, kv_spec, kv_spec], out_specs=q_spec,
                                                 scratch_shapes=scratch)
        return pallas_call(body, out_shape=out_shape, grid_spec=grid_spec, compiler_params=params,
                           interpret=interpret, **names)(*prefetch, q, k, v)
    return pallas_call(body, out_shape=out_shape, grid=grid, in_specs=[q_spec, kv_spec, kv_spec],
                       out_specs=q_spec, scratch_shapes=scratch, compiler_params=params,
                       interpret=interpret, **names)(q, k, v)


def _build_flash(body, *, interpret):
    grid = (FLASH_Q // FLASH_BLOCK_Q, FLASH_KV // FLASH_BLOCK_KV)

    def fn(q, k, v):
        return _flash_call(body, q, k, v, grid=grid, q_map=lambda i, j: (i, 0), kv_map=lambda i, j: (j, 0),
                           block_q=FLASH_BLOCK_Q, block_kv=FLASH_BLOCK_KV, interpret=interpret)
    return fn


def _flash_inputs():
    rng = _rng(5)
    return (_normal(rng, (FLASH_Q, HEAD_DIM)), _normal(rng, (FLASH_KV, HEAD_DIM)),
            _normal(rng, (FLASH_KV, HEAD_DIM)))


FLASH = register(Puzzle(
    "5. flash forward (online softmax)", _build_flash, _flash_inputs, _attention64, rtol=1e-4, atol=1e-5))


# ---------------------------------------------------------------------------------------------------
# The masked flash step the harness itself uses in puzzles 6 and 7 (the learner writes its index maps).

def _empty_state(m_ref, l_ref, acc_ref):
    """The running state before any key: max -inf, sum 0, accumulator 0."""
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def _masked_step(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *, i, kv_block, first, last,
                 visible, window, init=_empty_state):
    """One online-softmax step of query block ``i`` against K/V block ``kv_block`` (both of size
    CAUSAL_BLOCK), masked causally (and to ``window`` if given); ``first``/``last``/``visible``: bools;
    ``init(m_ref, l_ref, acc_ref)`` starts the running state at the first step."""
    block = CAUSAL_BLOCK

    @pl.when(first)
    def _init():
        init(m_ref, l_ref, acc_ref)

    @pl.when(visible)
    def _step():
        s = jax.lax.dot_general(q_ref[...], k_ref[...], (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * SCALE
        rows = i * block + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
        cols = kv_block * block + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        seen = cols <= rows
        if window is not None:
            seen = seen & (cols > rows - window)
        s = jnp.where(seen, s, -jnp.inf)
        m_old = m_ref[...]
        m_new = jnp.maximum(m_old, s.max(axis=1, keepdims=True))
        # A row may see no key of this block and none before it (a window): m_new is -inf there, and
        # exp(-inf - -inf) would be NaN. Subtract 0 instead; p and alpha are then 0 as they should be.
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m_old - m_safe)
        l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
        acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p, v_ref[...], preferred_element_type=jnp.float32)
        m_ref[...] = m_new

    @pl.when(last)
    def _finish():
        o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)


def _attention_inputs(seed: int, seq: int):
    rng = _rng(seed)
    return tuple(_normal(rng, (seq, HEAD_DIM)) for _ in range(3))


def fetched_blocks(index_map, grid, *prefetch) -> list[tuple[tuple[int, int], int]]:
    """Walk ``grid`` in order (the last axis fastest) as the Pallas pipeline does, and list
    ``((i, j), block)`` for every step at which ``index_map(i, j, *prefetch)`` names a block other than
    the previous step's: the steps that start a DMA."""
    fetches, previous = [], None
    for i in range(grid[0]):
        for j in range(grid[1]):
            block = int(index_map(i, j, *prefetch)[0])
            if block != previous:
                fetches.append(((i, j), block))
            previous = block
    return fetches


def _fetch_audit(index_map, grid, expected_map, prefetch=(), visible_blocks=None) -> str | None:
    got = fetched_blocks(index_map, grid, *prefetch)
    want = fetched_blocks(expected_map, grid, *prefetch)
    if got == want:
        return None
    for (step, block) in got:
        if visible_blocks is not None and block not in visible_blocks[step[0]]:
            return (f"the K/V index map fetches K/V block {block} at grid step {step}, a block query block "
                    f"{step[0]} never sees ({len(got)} fetches in all; {len(want)} are needed)")
    wanted = dict(want)
    for (step, block) in got:
        if wanted.get(step) != block:
            return (f"at grid step {step} the K/V index map fetches K/V block {block}, a fetch that is not "
                    f"needed ({len(got)} fetches in all; {len(want)} are needed)")
    missing = next(step for step, _ in want if step not in dict(got))
    return f"at grid step {missing} the K/V index map does not fetch the block that step needs"


# 6. causal skip: the K/V index map, clamped so that a hidden block is never fetched.

CAUSAL_GRID = (CAUSAL_SEQ // CAUSAL_BLOCK, CAUSAL_SEQ // CAUSAL_BLOCK)


def _causal_body(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref):
    i, j = pl.program_id(0), pl.program_id(1)
    _masked_step(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, i=i, kv_block=j, first=j == 0,
                 last=j == pl.num_programs(1) - 1, visible=j <= i, window=None)


def _build_causal(kv_index_map, *, interpret):
    def fn(q, k, v):
        return _flash_call(_causal_body, q, k, v, grid=CAUSAL_GRID, q_map=lambda i, j: (i, 0),
                           kv_map=kv_index_map, block_q=CAUSAL_BLOCK, block_kv=CAUSAL_BLOCK,
                           interpret=interpret)
    return fn


def _causal_audit(kv_index_map):
    rows = range(CAUSAL_GRID[0])
    return _fetch_audit(kv_index_map, CAUSAL_GRID, lambda i, j: (min(i, j), 0),
                        visible_blocks={i: set(range(i + 1)) for i in rows})


CAUSAL = register(Puzzle(
    "6. causal skip, clamped index map", _build_causal, lambda: _attention_inputs(6, CAUSAL_SEQ),
    lambda q, k, v: _attention64(q, k, v, causal_visible(CAUSAL_SEQ)), rtol=1e-4, atol=1e-5,
    audit=_causal_audit))


# 6b. an attention sink: one more logit in every row's softmax, with no value. The learner writes the
# running state's start (the harness's causal kernel, with the clamped map, does the rest).

SINK = 1.5  # the sink's logit (gpt-oss learns one per head; here one constant, a Python float)


def _build_sink(init, *, interpret):
    def body(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref):
        i, j = pl.program_id(0), pl.program_id(1)
        _masked_step(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, i=i, kv_block=j, first=j == 0,
                     last=j == pl.num_programs(1) - 1, visible=j <= i, window=None, init=init)

    def fn(q, k, v):
        return _flash_call(body, q, k, v, grid=CAUSAL_GRID, q_map=lambda i, j: (i, 0),
                           kv_map=lambda i, j: (jnp.minimum(i, j), 0), block_q=CAUSAL_BLOCK,
                           block_kv=CAUSAL_BLOCK, interpret=interpret)
    return fn


SINK_PUZZLE = register(Puzzle(
    "6b. an attention sink in the running state", _build_sink, lambda: _attention_inputs(66, CAUSAL_SEQ),
    lambda q, k, v: _attention64(q, k, v, causal_visible(CAUSAL_SEQ), sink=SINK), rtol=1e-4, atol=1e-5))


# 6c. a quantized KV cache: one decode step reads int8 keys and values with a float32 scale each
# (entry e holds e * scale), handed over in SMEM by scalar prefetch. The learner writes the
# dequantization the harness's online-softmax step calls on each K/V block.

QUANT_Q, QUANT_KV, QUANT_BLOCK_KV = 8, 256, 128  # 8 query rows (a GQA group's heads) over 256 cached keys


def _quant_body(dequantize):
    def body(scales_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref):
        j = pl.program_id(0)

        @pl.when(j == 0)
        def _init():
            _empty_state(m_ref, l_ref, acc_ref)

        k = dequantize(k_ref[...], scales_ref[0])  # [block, HEAD_DIM] float32
        v = dequantize(v_ref[...], scales_ref[1])
        s = jax.lax.dot_general(q_ref[...], k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * SCALE
        m_old = m_ref[...]
        m_new = jnp.maximum(m_old, s.max(axis=1, keepdims=True))
        p = jnp.exp(s - m_new)
        alpha = jnp.exp(m_old - m_new)
        l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
        acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p, v, preferred_element_type=jnp.float32)
        m_ref[...] = m_new

        @pl.when(j == pl.num_programs(0) - 1)
        def _finish():
            o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)
    return body


def _build_quant(dequantize, *, interpret):
    q_spec = pl.BlockSpec((QUANT_Q, HEAD_DIM), lambda j, scales: (0, 0))
    kv_spec = pl.BlockSpec((QUANT_BLOCK_KV, HEAD_DIM), lambda j, scales: (j, 0))
    scratch = [pltpu.VMEM((QUANT_Q, 1), jnp.float32), pltpu.VMEM((QUANT_Q, 1), jnp.float32),
               pltpu.VMEM((QUANT_Q, HEAD_DIM), jnp.float32)]

    def fn(scales, q, k8, v8):
        grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(QUANT_KV // QUANT_BLOCK_KV,),
                                                 in_specs=[q_spec, kv_spec, kv_spec], out_specs=q_spec,
                                                 scratch_shapes=scratch)
        return pallas_call(_quant_body(dequantize), out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
                           grid_spec=grid_spec, compiler_params=_params("arbitrary"), interpret=interpret,
                           in_names=("scales", "q", "k", "v"), out_names=("out",))(scales, q, k8, v8)
    return fn


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """``(entries, scale)``: ``x`` as int8 entries ``round(x / scale)`` with ``scale = max|x| / 127``."""
    scale = np.float32(np.abs(x).max() / 127.0)
    return np.clip(np.round(x / scale), -127, 127).astype(np.int8), scale


def _quant_inputs():
    rng = _rng(63)
    q = _normal(rng, (QUANT_Q, HEAD_DIM))
    k8, k_scale = quantize_int8(_normal(rng, (QUANT_KV, HEAD_DIM)) * 3.0)
    v8, v_scale = quantize_int8(_normal(rng, (QUANT_KV, HEAD_DIM)) * 0.5)
    return np.array([k_scale, v_scale], np.float32), q, k8, v8


def _quant_oracle(scales, q, k8, v8):
    """Attention over the dequantized cache, in float64: the quantization is the cache's, not an error."""
    scales = np.asarray(scales, np.float64)
    return _attention64(q, np.asarray(k8, np.float64) * scales[0], np.asarray(v8, np.float64) * scales[1])


QUANT = register(Puzzle(
    "6c. a quantized cache: dequantize in the kernel", _build_quant, _quant_inputs, _quant_oracle,
    rtol=1e-4, atol=1e-5))


# 7. the scalar-prefetch schedule: a table of each query block's visible K/V blocks (causal + window),
# read by the index map from SMEM. grid (query blocks, the most blocks any row sees).

def window_schedule(seq: int = CAUSAL_SEQ, block: int = CAUSAL_BLOCK, window: int = WINDOW):
    """``(kv_blocks [n, width] int32, counts [n] int32)``: query block ``i`` sees K/V blocks
    ``kv_blocks[i, :counts[i]]`` in order; the rest of a row is 0 (padding, never a visible block)."""
    visible = window_visible(seq, window)
    n = seq // block
    tiles = visible.reshape(n, block, n, block).any(axis=(1, 3))
    counts = tiles.sum(axis=1).astype(np.int32)
    kv_blocks = np.zeros((n, int(counts.max())), np.int32)
    for i in range(n):
        kv_blocks[i, :counts[i]] = np.flatnonzero(tiles[i])
    return kv_blocks, counts


def _schedule_body(kv_blocks_ref, counts_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref):
    i, j = pl.program_id(0), pl.program_id(1)
    count = counts_ref[i]
    kv_block = kv_blocks_ref[i, jnp.minimum(j, count - 1)]
    _masked_step(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, i=i, kv_block=kv_block, first=j == 0,
                 last=j == pl.num_programs(1) - 1, visible=j < count, window=WINDOW)


def _build_schedule(kv_index_map, *, interpret):
    kv_blocks, counts = window_schedule()
    grid = kv_blocks.shape

    def fn(q, k, v):
        return _flash_call(_schedule_body, q, k, v, grid=grid, q_map=lambda i, j, *_: (i, 0),
                           kv_map=kv_index_map, block_q=CAUSAL_BLOCK, block_kv=CAUSAL_BLOCK,
                           interpret=interpret, num_prefetch=2,
                           prefetch=(jnp.asarray(kv_blocks), jnp.asarray(counts)))
    return fn


def _schedule_audit(kv_index_map):
    kv_blocks, counts = window_schedule()

    def expected(i, j, table, count):
        return table[i, min(j, count[i] - 1)], 0

    visible = {i: set(kv_blocks[i, :counts[i]].tolist()) for i in range(len(counts))}
    return _fetch_audit(kv_index_map, kv_blocks.shape, expected, prefetch=(kv_blocks, counts),
                        visible_blocks=visible)


SCHEDULE = register(Puzzle(
    "7. scalar-prefetch schedule", _build_schedule, lambda: _attention_inputs(7, CAUSAL_SEQ),
    lambda q, k, v: _attention64(q, k, v, window_visible(CAUSAL_SEQ)), rtol=1e-4, atol=1e-5,
    audit=_schedule_audit))


# ---------------------------------------------------------------------------------------------------
# 8. GQA folded into the rows: the BlockSpecs. q is [kv_heads, group, seq_q, head_dim] (query head
# h * group + g uses kv head h); grid (kv_heads, seq_q / block_q); one step serves a whole group.

GQA_GROUP = GQA_HEADS // GQA_KV_HEADS
GQA_GRID = (GQA_KV_HEADS, GQA_Q // GQA_BLOCK_Q)


def _gqa_body(q_ref, k_ref, v_ref, o_ref):
    group, block_q, head_dim = q_ref.shape
    q = q_ref[...].reshape(group * block_q, head_dim)  # the group's heads stacked as rows
    s = jax.lax.dot_general(q, k_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    s = s * SCALE
    p = jnp.exp(s - s.max(axis=1, keepdims=True))
    out = jnp.dot(p, v_ref[...], preferred_element_type=jnp.float32) / p.sum(axis=1, keepdims=True)
    o_ref[...] = out.reshape(group, block_q, head_dim).astype(o_ref.dtype)


def _build_gqa(specs, *, interpret):
    def fn(q, k, v):
        q_spec, kv_spec, out_spec = specs()
        folded = q.reshape(GQA_KV_HEADS, GQA_GROUP, GQA_Q, HEAD_DIM)
        out = pallas_call(_gqa_body, out_shape=jax.ShapeDtypeStruct(folded.shape, q.dtype),
                          grid=GQA_GRID, in_specs=[q_spec, kv_spec, kv_spec], out_specs=out_spec,
                          compiler_params=_params("parallel", "parallel"), interpret=interpret,
                          in_names=("q", "k", "v"), out_names=("out",))(folded, k, v)
        return out.reshape(q.shape)
    return fn


def _gqa_inputs():
    rng = _rng(8)
    return (_normal(rng, (GQA_HEADS, GQA_Q, HEAD_DIM)), _normal(rng, (GQA_KV_HEADS, GQA_KV, HEAD_DIM)),
            _normal(rng, (GQA_KV_HEADS, GQA_KV, HEAD_DIM)))


def _gqa64(q, k, v):
    return np.stack([_attention64(q[h], k[h // GQA_GROUP], v[h // GQA_GROUP]) for h in range(GQA_HEADS)])


GQA = register(Puzzle(
    "8. GQA folded into the rows (BlockSpecs)", _build_gqa, _gqa_inputs, _gqa64, rtol=1e-4, atol=1e-5))


# ---------------------------------------------------------------------------------------------------
# Find the bug A: a race. The kernel copies x [2 * RACE_ROWS, 128] from HBM by hand in two chunks
# and writes 2 * x; the interpreter's race detector checks every DMA against every read and write.

def _build_race(body, *, interpret):
    def fn(x):
        return pallas_call(
            body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],  # x stays in HBM: the kernel copies it
            out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
            scratch_shapes=[pltpu.VMEM((2, RACE_ROWS, 128), x.dtype), pltpu.SemaphoreType.DMA((2,))],
            interpret=interpret, in_names=("x",), out_names=("out",))(x)
    return fn


RACE = register(Puzzle(
    "A. find the bug: a race", _build_race, lambda: (_normal(_rng(9), (2 * RACE_ROWS, 128)),),
    lambda x: 2.0 * np.asarray(x, np.float64), rtol=0.0, atol=0.0, kind="bug", detect_races=True))

# Find the bug B: the matmul of puzzle 3, as a broken kernel body.
MATMUL_BUG = register(Puzzle(
    "B. find the bug: the accumulator", _build_matmul, _matmul_inputs, _matmul64, rtol=1e-2, atol=5e-2,
    kind="bug"))

PUZZLES = (COPY, ADD, MATMUL, SOFTMAX, FLASH, CAUSAL, SINK_PUZZLE, SCHEDULE, GQA, RACE, MATMUL_BUG)

__all__ = ["PUZZLES", "causal_visible", "fetched_blocks", "window_schedule", "window_visible"] + [
    "ADD", "CAUSAL", "COPY", "FLASH", "GQA", "MATMUL", "MATMUL_BUG", "RACE", "SCHEDULE", "SINK",
    "SINK_PUZZLE", "SOFTMAX"]
