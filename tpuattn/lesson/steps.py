"""Notebook 03's kernels, one step at a time: each a Pallas kernel body and the ``pallas_call`` that runs it.

These are teaching code, written to be read in the order of the notebook's steps (it prints each one's
source with :func:`tpuattn.lesson.show`): clear before fast. Arrays are the contract's
``[batch, seq, heads, head_dim]``; lengths are multiples of the blocks. ``interpret=None`` runs a
kernel compiled on a TPU and in Pallas interpret mode anywhere else (the package's rule,
:func:`tpuattn.options.resolve_interpret`); ``True`` or ``False`` is handed to ``pallas_call`` as it
is (``False`` off a TPU is what lowering or compiling for a TPU asks for).

Step 1, one block: :func:`one_block_kernel`, :func:`one_block_attention`. Step 2, the grid:
:func:`to_bhtd`, :func:`grid_attention`. Step 3, the online softmax over kv blocks:
:func:`online_softmax_update`, :func:`flash_kernel`, :func:`flash_call`, :func:`flash_attention`.
Step 4, a causal mask and skipped blocks: :func:`causal_kernel`, :func:`causal_kv_map`,
:func:`causal_attention`. Step 5, GQA: :func:`gqa_attention`. Step 5b, the schedule as data:
:func:`block_tables`, :func:`scheduled_kernel`, :func:`scheduled_attention`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpuattn.errors import UnsupportedInput
from tpuattn.numerics import matmul_precision
from tpuattn.options import resolve_interpret

BLOCK_Q = 128  # query rows per block (a multiple of 8)
BLOCK_KV = 128  # keys per block (a multiple of 8; 128 fills the score tile's lanes)


def _interpret(interpret):
    """None -> the package's rule (compiled on a TPU, interpret mode elsewhere); a bool as given."""
    return resolve_interpret(None, "lesson") if interpret is None else interpret


NT = (((1,), (1,)), ((), ()))  # dot_general dims: contract the last dim of both -> q @ k.T, no transpose


def one_block_kernel(q_ref, k_ref, v_ref, o_ref, *, scale):
    q, k, v = q_ref[...], k_ref[...], v_ref[...]  # load the tiles from VMEM
    precision = matmul_precision(q.dtype)  # full float32 passes for float32 inputs (see tpuattn.numerics)
    s = jax.lax.dot_general(q, k, NT, precision=precision, preferred_element_type=jnp.float32) * scale
    m = jnp.max(s, axis=-1, keepdims=True)  # subtract the row max: exp never overflows
    p = jnp.exp(s - m)
    l_sum = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.dot(p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32) / l_sum
    o_ref[...] = o.astype(o_ref.dtype)  # store the tile back


@functools.partial(jax.jit, static_argnames=("interpret",))  # trace and compile once per shape
def one_block_attention(q, k, v, *, interpret=None):
    """q, k, v: [T, D] -- one head, one tile."""
    kernel = functools.partial(one_block_kernel, scale=q.shape[-1] ** -0.5)
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
                          interpret=_interpret(interpret))(q, k, v)


def to_bhtd(x):
    """[batch, seq, heads, head_dim] <-> [batch, heads, seq, head_dim]."""
    return jnp.swapaxes(x, 1, 2)


@functools.partial(jax.jit, static_argnames=("block_q", "interpret"))
def grid_attention(q, k, v, *, block_q=BLOCK_Q, interpret=None):
    """Grid (batch, heads, q blocks); each step: one q block against all keys."""
    b, tq, h, d = q.shape
    tk = k.shape[1]
    squeeze = pl.squeezed

    def q_map(bi, hi, qi):  # grid indices -> block indices (in units of blocks)
        return (bi, hi, qi, 0)

    def kv_map(bi, hi, qi):  # the whole sequence: block index 0 along seq
        return (bi, hi, 0, 0)

    out = pl.pallas_call(
        functools.partial(one_block_kernel, scale=d ** -0.5),  # the step-1 body, unchanged
        grid=(b, h, tq // block_q),
        in_specs=[pl.BlockSpec((squeeze, squeeze, block_q, d), q_map),
                  pl.BlockSpec((squeeze, squeeze, tk, d), kv_map),
                  pl.BlockSpec((squeeze, squeeze, tk, d), kv_map)],
        out_specs=pl.BlockSpec((squeeze, squeeze, block_q, d), q_map),
        out_shape=jax.ShapeDtypeStruct((b, h, tq, d), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=_interpret(interpret),
    )(to_bhtd(q), to_bhtd(k), to_bhtd(v))
    return to_bhtd(out)


def online_softmax_update(s, v_ref, m_scr, l_scr, acc_scr):
    """Fold one float32 score tile s [block_q, block_kv] and its V block into the running m, l, acc."""
    m_prev = m_scr[...]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)  # rescales what was accumulated under the old max
    p = jnp.exp(s - m_next)
    l_scr[...] = alpha * l_scr[...] + jnp.sum(p, axis=-1, keepdims=True)
    acc_scr[...] = alpha * acc_scr[...] + jnp.dot(p.astype(v_ref.dtype), v_ref[...],
                                                  precision=matmul_precision(v_ref.dtype),
                                                  preferred_element_type=jnp.float32)
    m_scr[...] = m_next


def flash_kernel(q_ref, k_ref, v_ref, o_ref, m_scr, l_scr, acc_scr, *, scale):
    kj = pl.program_id(3)  # the kv step (grid axis 3)

    @pl.when(kj == 0)  # a new query block: reset its running statistics
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    s = jax.lax.dot_general(q_ref[...], k_ref[...], NT, precision=matmul_precision(q_ref.dtype),
                            preferred_element_type=jnp.float32) * scale
    online_softmax_update(s, v_ref, m_scr, l_scr, acc_scr)

    @pl.when(kj == pl.num_programs(3) - 1)  # its last kv block: normalise and store
    def _write():
        o_ref[...] = (acc_scr[...] / l_scr[...]).astype(o_ref.dtype)


def flash_call(kernel, kv_map, q, k, v, *, block_q, block_kv, interpret):
    """Run ``kernel`` on the grid (batch, q heads, q blocks, kv blocks) with float32 scratch m, l, acc;
    K and V blocks follow ``kv_map``. q: [b, tq, hq, d]; k, v: [b, tk, hkv, d]; lengths multiples of
    the blocks."""
    b, tq, hq, d = q.shape
    tk = k.shape[1]
    squeeze = pl.squeezed

    def q_map(bi, hi, qi, kj):
        return (bi, hi, qi, 0)  # ignores kj: the q block stays resident across the kv steps

    out = pl.pallas_call(
        kernel,
        grid=(b, hq, tq // block_q, tk // block_kv),  # the kv axis is last ...
        in_specs=[pl.BlockSpec((squeeze, squeeze, block_q, d), q_map),
                  pl.BlockSpec((squeeze, squeeze, block_kv, d), kv_map),
                  pl.BlockSpec((squeeze, squeeze, block_kv, d), kv_map)],
        out_specs=pl.BlockSpec((squeeze, squeeze, block_q, d), q_map),
        out_shape=jax.ShapeDtypeStruct((b, hq, tq, d), q.dtype),
        scratch_shapes=[pltpu.VMEM((block_q, 1), jnp.float32),  # m: running max (float32)
                        pltpu.VMEM((block_q, 1), jnp.float32),  # l: running sum (float32)
                        pltpu.VMEM((block_q, d), jnp.float32)],  # acc: unnormalised output (float32)
        compiler_params=pltpu.CompilerParams(  # ... and "arbitrary": it carries the scratch
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=_interpret(interpret),
    )(to_bhtd(q), to_bhtd(k), to_bhtd(v))
    return to_bhtd(out)


@functools.partial(jax.jit, static_argnames=("block_q", "block_kv", "interpret"))
def flash_attention(q, k, v, *, block_q=BLOCK_Q, block_kv=BLOCK_KV, interpret=None):
    """No mask; q, k, v: [b, t, h, d] with equal head counts."""
    def kv_map(bi, hi, qi, kj):
        return (bi, hi, kj, 0)  # kv step kj holds kv block kj

    kernel = functools.partial(flash_kernel, scale=q.shape[-1] ** -0.5)
    return flash_call(kernel, kv_map, q, k, v, block_q=block_q, block_kv=block_kv, interpret=interpret)


# A finite "minus infinity": exp(MASK_VALUE - m) = 0, and never inf - inf = NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def causal_kernel(q_ref, k_ref, v_ref, o_ref, m_scr, l_scr, acc_scr, *, scale, block_q, block_kv, offset):
    qi, kj = pl.program_id(2), pl.program_id(3)

    @pl.when(kj == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    @pl.when(kj * block_kv <= qi * block_q + block_q - 1 + offset)  # new: block's first key visible?
    def _update():
        s = jax.lax.dot_general(q_ref[...], k_ref[...], NT, precision=matmul_precision(q_ref.dtype),
                                preferred_element_type=jnp.float32) * scale
        rows = qi * block_q + offset + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)  # new: positions
        cols = kj * block_kv + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        online_softmax_update(jnp.where(cols <= rows, s, MASK_VALUE), v_ref, m_scr, l_scr, acc_scr)

    @pl.when(kj == pl.num_programs(3) - 1)
    def _write():
        o_ref[...] = (acc_scr[...] / l_scr[...]).astype(o_ref.dtype)


def causal_kv_map(block_q, block_kv, offset):
    """Step 3's K/V index map, clamped to the q block's last visible kv block."""
    def kv_map(bi, hi, qi, kj):
        # jax.lax.div, not //: the indices are non-negative, so truncating division is floor
        # division, and it lowers to one scalar op on every TPU generation.
        last_visible = jax.lax.div(qi * block_q + block_q - 1 + offset, block_kv)
        return (bi, hi, jnp.minimum(kj, last_visible), 0)  # new: past it, name it again -> no fetch
    return kv_map


@functools.partial(jax.jit, static_argnames=("block_q", "block_kv", "interpret"))
def causal_attention(q, k, v, *, block_q=BLOCK_Q, block_kv=BLOCK_KV, interpret=None):
    """Step 3 under a causal mask, bottom-right aligned (kv_len >= q_len)."""
    offset = k.shape[1] - q.shape[1]  # query row i sits at key position i + offset
    kernel = functools.partial(causal_kernel, scale=q.shape[-1] ** -0.5, block_q=block_q,
                               block_kv=block_kv, offset=offset)
    return flash_call(kernel, causal_kv_map(block_q, block_kv, offset), q, k, v, block_q=block_q,
                      block_kv=block_kv, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("block_q", "block_kv", "interpret"))
def gqa_attention(q, k, v, *, block_q=BLOCK_Q, block_kv=BLOCK_KV, interpret=None):
    """Step 4 (causal) with q heads = group x kv heads: the same kernel, a new K/V index map."""
    group, offset = q.shape[2] // k.shape[2], k.shape[1] - q.shape[1]
    causal_map = causal_kv_map(block_q, block_kv, offset)

    def kv_map(bi, hi, qi, kj):
        return causal_map(bi, jax.lax.div(hi, group), qi, kj)  # new: query head hi reads kv head hi // group

    kernel = functools.partial(causal_kernel, scale=q.shape[-1] ** -0.5, block_q=block_q,
                               block_kv=block_kv, offset=offset)
    return flash_call(kernel, kv_map, q, k, v, block_q=block_q, block_kv=block_kv, interpret=interpret)


def block_tables(q_len, kv_len, block_q, block_kv, *, causal=True, left=None):
    """(kv_index [num_q_blocks, steps] int32, kv_count [num_q_blocks] int32) of a causal/window mask."""
    offset = kv_len - q_len  # bottom-right alignment: query row r sits at key position r + offset
    num_q_blocks, num_kv_blocks = q_len // block_q, kv_len // block_kv
    first_row = np.arange(num_q_blocks)[:, None] * block_q + offset  # position of each q block's row 0
    last_row = first_row + block_q - 1
    first_key = np.arange(num_kv_blocks)[None, :] * block_kv
    last_key = first_key + block_kv - 1
    visible = np.ones((num_q_blocks, num_kv_blocks), bool)  # [q block, kv block]: any pair visible?
    if causal:
        visible &= first_key <= last_row
    if left is not None:
        visible &= last_key >= first_row - left
    kv_count = visible.sum(axis=1).astype(np.int32)
    if kv_count.min() < 1:  # the finished kernel (tpuattn.lesson.flash) handles it; this step does not
        raise UnsupportedInput(f"block_tables: expected every q block to see a key, got q blocks "
                               f"{np.flatnonzero(kv_count == 0).tolist()} that see none")
    steps = int(kv_count.max())
    kv_index = np.zeros((num_q_blocks, steps), np.int32)
    for i in range(num_q_blocks):
        blocks = np.flatnonzero(visible[i])
        kv_index[i] = np.concatenate([blocks, np.full(steps - len(blocks), blocks[-1])])  # pad: the clamp
    return kv_index, kv_count


def scheduled_kernel(kv_index_ref, kv_count_ref, q_ref, k_ref, v_ref, o_ref, m_scr, l_scr, acc_scr, *,
                     scale, causal, left, block_q, block_kv, offset, steps):
    qi, step = pl.program_id(2), pl.program_id(3)
    kv_block = kv_index_ref[qi * steps + step]  # new: the kv block this step holds, read from SMEM

    @pl.when(step == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    @pl.when(step < kv_count_ref[qi])  # new: padded steps (the clamp) compute nothing
    def _update():
        s = jax.lax.dot_general(q_ref[...], k_ref[...], NT, precision=matmul_precision(q_ref.dtype),
                                preferred_element_type=jnp.float32) * scale
        rows = qi * block_q + offset + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
        cols = kv_block * block_kv + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)  # new: from the table
        keep = cols <= rows if causal else jnp.ones(s.shape, bool)
        if left is not None:
            keep = jnp.logical_and(keep, cols >= rows - left)  # new: the window's left edge
        online_softmax_update(jnp.where(keep, s, MASK_VALUE), v_ref, m_scr, l_scr, acc_scr)

    @pl.when(step == steps - 1)
    def _write():
        o_ref[...] = (acc_scr[...] / l_scr[...]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("causal", "left", "block_q", "block_kv", "interpret"))
def scheduled_attention(q, k, v, *, causal=True, left=None, block_q=BLOCK_Q, block_kv=BLOCK_KV,
                        interpret=None):
    """The lesson kernel on a block schedule: causal and/or window (left, 0), GQA; lengths multiples of
    the blocks."""
    b, tq, hq, d = q.shape
    _, tk, hkv, _ = k.shape
    group = hq // hkv
    kv_index, kv_count = block_tables(tq, tk, block_q, block_kv, causal=causal, left=left)  # NumPy, at trace
    steps = kv_index.shape[1]

    def q_map(bi, hi, qi, step, kv_index_ref, kv_count_ref):  # the prefetched refs come last
        return (bi, hi, qi, 0)

    def kv_map(bi, hi, qi, step, kv_index_ref, kv_count_ref):
        return (bi, jax.lax.div(hi, group), kv_index_ref[qi * steps + step], 0)  # GQA head; scheduled block

    squeeze = pl.squeezed
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,  # kv_index, kv_count: the call's first two operands, copied to SMEM
        grid=(b, hq, tq // block_q, steps),  # the kv axis is `steps` long, not tk // block_kv
        in_specs=[pl.BlockSpec((squeeze, squeeze, block_q, d), q_map),
                  pl.BlockSpec((squeeze, squeeze, block_kv, d), kv_map),
                  pl.BlockSpec((squeeze, squeeze, block_kv, d), kv_map)],
        out_specs=pl.BlockSpec((squeeze, squeeze, block_q, d), q_map),
        scratch_shapes=[pltpu.VMEM((block_q, 1), jnp.float32), pltpu.VMEM((block_q, 1), jnp.float32),
                        pltpu.VMEM((block_q, d), jnp.float32)],
    )
    kernel = functools.partial(scheduled_kernel, scale=d ** -0.5, causal=causal, left=left, block_q=block_q,
                               block_kv=block_kv, offset=tk - tq, steps=steps)
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((b, hq, tq, d), q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=_interpret(interpret),
    )(jnp.asarray(kv_index.reshape(-1)), jnp.asarray(kv_count), to_bhtd(q), to_bhtd(k), to_bhtd(v))
    return to_bhtd(out)
