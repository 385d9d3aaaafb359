"""Online softmax in pure JAX: blockwise attention with linear memory.

The score matrix is never built. Keys and values are visited block by block while
each query row keeps three running quantities in float32: the largest logit seen so
far ``m``, the sum of exponentials relative to it ``l`` and the weighted sum of values
``acc``. When a new block raises the maximum, the old ``l`` and ``acc`` are rescaled by
``exp(m_old - m_new)`` (the online-softmax recurrence, derived in notebook 02). At the
end ``out = acc / l`` and the log-sum-exp ``m + log(l)`` is all the backward pass needs.

How the work is laid out (the static schedule)
----------------------------------------------
The mask's positions are known at trace time, so :func:`schedule` classifies every
``(query block, key block)`` tile with :meth:`MaskSpec.block_map` and builds a list of
steps. A step is one key/value block ``t`` and the contiguous run ``[lo, hi)`` of query
blocks that see it (for causal and window masks the query blocks that see block ``t``
form one band). Each step is ONE batched matmul over all its query rows, so the
independent query blocks run in parallel (what ``jax.vmap`` over query blocks produces,
without the reshape); only the loop over key blocks is sequential. Steps are emitted in
key-block order: a run of steps that differ only by their key block (every block of a
non-causal mask) becomes one ``lax.fori_loop``, the others (one per key block of a causal
band, whose row range shrinks) are unrolled when traced. Hence:

* EMPTY tiles are never computed: they are in no step (``visited_tiles``);
* steps whose tiles are all FULL skip the mask arithmetic; the others apply the mask
  (a diagonal, an edge of a window, key padding, or any tile when segment ids are given);
* every step runs inside a ``lax.cond``: with segment ids (data) its predicate is "does
  any row of the step see any key of the block", a real skip at run time; without, the
  cond keeps XLA from fusing element-wise work across unrolled steps, which would keep
  every step's tile alive at once (see ``_step_predicate``);
* any lengths work: q, k, v are padded to whole blocks and padded keys are masked.

The cost of one step is ``rows x block_kv`` floats of scores, so with a fixed
``block_kv`` memory grows linearly with the sequence; unrolled steps cost compile time
(one per key block for a causal mask: 32 at 16384 tokens with the default 512).

The backward pass is a ``jax.custom_vjp`` that saves only q, k, v, the output and the
log-sum-exp (kept as the pair ``(m, log l)``; memory linear in the sequence length) and
walks the same schedule again, recomputing each tile (FlashAttention-2):
a first pass ``delta = rowsum(P * dP)`` (see ``_delta``); per tile ``p = exp(s - lse)``; ``dV += p^T dO``;
``dP = dO V^T``; ``dS = p * (dP - delta)``; through the softcap ``dS *= 1 - tanh^2``;
``dQ += dS K * scale``; ``dK += dS^T Q * scale``.

GQA reads each key/value head once: queries are viewed as
``[batch, kv_heads, group, q_len, head_dim]`` and the group is a free matmul dimension.

Two small teaching functions, :func:`fori_loop_attention` (query blocks one after the
other in a ``lax.fori_loop``) and :func:`vmap_attention` (the same block function under
``jax.vmap``), show why the independent query blocks must be expressed as such.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tpuattn import softmax
from tpuattn._checks import positive_int
from tpuattn.numerics import matmul, pad_to_multiple
from tpuattn.options import BlockwiseOptions
from tpuattn.registry import PartialOps, register
from tpuattn.sharding import mark_varying, varying_axes
from tpuattn.spec import EMPTY, FULL, MaskSpec

OPTIONS = BlockwiseOptions  # blocks= (forward tiles; the backward walks them), old block_q=, block_kv=

# Default block size (see default_blocks).
DEFAULT_BLOCK = 512


def default_blocks(q_len: int, kv_len: int) -> tuple[int, int]:
    """The default ``(block_q, block_kv)``.

    Rule: 512 for both, clipped to the lengths. Fixed (not growing with the length) so
    that the memory of one step, ``q_rows x block_kv`` floats, grows linearly with the
    sequence; square so that a causal diagonal tile is half visible. Smaller blocks pay
    per-step overhead and compile time (a causal schedule unrolls one step per key block),
    larger ones cache misses and memory (``benchmarks/blockwise_vs_reference.py`` measures).
    """
    return min(DEFAULT_BLOCK, q_len), min(DEFAULT_BLOCK, kv_len)


# ----------------------------------------------------------------------------- schedule
@dataclasses.dataclass(frozen=True)
class Step:
    """Key block ``kv_block`` against the query blocks ``[q_lo, q_hi)`` (one batched matmul)."""

    kv_block: int
    q_lo: int
    q_hi: int
    masked: bool  # False only when every tile of the step is FULL: no mask arithmetic


def schedule(mask: MaskSpec, block_q: int, block_kv: int) -> tuple[Step, ...]:
    """The static list of steps that covers every tile the mask does not hide.

    For each key block ``t`` the query blocks that see it are grouped into contiguous
    runs (one run for causal and window masks: a band); a run is one step, masked when
    any of its tiles is PARTIAL. EMPTY tiles appear in no step. (Splitting a run into its
    FULL and PARTIAL parts would save the mask arithmetic on the FULL part but doubles
    the number of steps; on CPU the mask is a compare and a select fused into the
    exponential, so one step per key block measured faster, compile time included.)
    """
    bmap = mask.block_map(block_q, block_kv)
    steps = []
    for t in range(bmap.shape[1]):
        col = bmap[:, t]
        i = 0
        while i < len(col):
            if col[i] == EMPTY:
                i += 1
                continue
            j = i
            while j < len(col) and col[j] != EMPTY:
                j += 1
            steps.append(Step(kv_block=t, q_lo=i, q_hi=j, masked=bool(np.any(col[i:j] != FULL))))
            i = j
    return tuple(steps)


def visited_tiles(steps) -> int:
    """How many ``(query block, key block)`` tiles a schedule computes."""
    return sum(s.q_hi - s.q_lo for s in steps)


def step_groups(steps) -> list[tuple[Step, int]]:
    """Runs of steps that differ only by consecutive key blocks: ``(first step, count)``.

    Such a run (every key block of a non-causal mask, for example) executes as one
    ``lax.fori_loop``, so the traced program and the compile time stay small; a run of
    one is a single step. Each step of a run is still exactly a scheduled step.
    """
    groups: list[tuple[Step, int]] = []
    for step in steps:
        if groups:
            first, count = groups[-1]
            if ((first.q_lo, first.q_hi, first.masked) == (step.q_lo, step.q_hi, step.masked)
                    and step.kv_block == first.kv_block + count):
                groups[-1] = (first, count + 1)
                continue
        groups.append((step, 1))
    return groups


# ----------------------------------------------------------------------------- the kernel
@dataclasses.dataclass(frozen=True)
class _Config:
    mask: MaskSpec
    scale: float
    softcap: float | None
    block_q: int
    block_kv: int
    steps: tuple[Step, ...]


def _run_schedule(cfg: _Config, body, carry):
    """Apply ``body(carry, step, t)`` for every scheduled step; ``t`` is the key block (int or traced)."""
    for first, count in step_groups(cfg.steps):
        if count == 1:
            carry = body(carry, first, first.kv_block)
        else:
            carry = lax.fori_loop(first.kv_block, first.kv_block + count,
                                  lambda t, c, first=first: body(c, first, t), carry)
    return carry


def _logits(cfg, q_rows, k_blk):
    """Scaled logits ``[b, h, g, rows, keys]`` in float32, and tanh(s/c) when softcapped."""
    s = matmul("bhgqd,bhkd->bhgqk", q_rows, k_blk) * cfg.scale
    if cfg.softcap is None:
        return s, None
    t = jnp.tanh(s / cfg.softcap)
    return cfg.softcap * t, t


def _step_mask(cfg, step, t, segs):
    """Visibility of the step's tile ``[b or 1, 1, 1, rows, keys]`` (positions, padding, segments)."""
    r0, r1 = step.q_lo * cfg.block_q, step.q_hi * cfg.block_q
    c0 = t * cfg.block_kv
    rows = lax.broadcasted_iota(jnp.int32, (r1 - r0, cfg.block_kv), 0) + r0
    cols = lax.broadcasted_iota(jnp.int32, (r1 - r0, cfg.block_kv), 1) + c0
    if segs is None:
        return cfg.mask.visible(rows, cols, xp=jnp)[None, None, None]
    q_seg, kv_seg = segs
    kv_seg_blk = lax.dynamic_slice_in_dim(kv_seg, c0, cfg.block_kv, axis=1)
    keep = cfg.mask.visible(rows[None], cols[None], q_seg[:, r0:r1, None], kv_seg_blk[:, None, :], xp=jnp)
    return keep[:, None, None]


def _step_predicate(keep, segs, row_values):
    """Whether a step must run. Every step is a ``lax.cond`` on this.

    With segment ids the answer is data: does any row of the step see any key of the block?
    Without, every scheduled step is needed, and the cond is there for memory: XLA fuses
    element-wise chains across unrolled steps (e.g. the running sum of all steps into one
    loop reading every step's probabilities), which keeps every tile alive at once
    (quadratic memory). A conditional's branch cannot be fused with its neighbours, so the
    tiles of one step die before the next step starts. The predicate must not be
    constant-foldable (XLA inlines constant conds), yet true for every input: "some row value
    is NaN, or not all of them are" reads the data and holds even for NaN (a NaN in the
    inputs must reach the output and the gradients, never be skipped into zeros).
    """
    if keep is not None and segs is not None:
        return jnp.any(keep)
    nan = jnp.isnan(row_values)
    return jnp.logical_or(jnp.any(nan), jnp.logical_not(jnp.all(nan)))


def _mm(dtype):
    """Operands of the second matmul of a tile: probabilities in the input dtype (as flash kernels do)."""
    return (lambda x: x) if jnp.dtype(dtype) == jnp.float32 else (lambda x: x.astype(dtype))


def _like_inputs(state, *inputs):
    """Fresh loop state (or a skipped step's zeros) typed like the inputs inside a ``shard_map``:
    varying over the same mesh axes, or the loop and its conds see two different types."""
    axes = varying_axes(*inputs)
    return jax.tree_util.tree_map(lambda x: mark_varying(x, axes), state)


def _kv_block(cfg, x, t):
    return lax.dynamic_slice_in_dim(x, t * cfg.block_kv, cfg.block_kv, axis=2)


def _forward(cfg: _Config, qt, kt, vt, segs):
    """Online softmax over the schedule.

    Returns ``out`` float32 ``[b, h, g, Tq, d]`` and the log-sum-exp as a pair ``(m, log l)``
    of float32 ``[b, h, g, Tq]`` (``lse = m + log l``).
    """
    b, h, g, tq, d = qt.shape
    cast = _mm(vt.dtype)

    def body(carry, step, t):
        m, denom, acc = carry
        r0, r1 = step.q_lo * cfg.block_q, step.q_hi * cfg.block_q
        q_rows = lax.slice_in_dim(qt, r0, r1, axis=3)
        k_blk, v_blk = _kv_block(cfg, kt, t), _kv_block(cfg, vt, t)
        state = (lax.slice_in_dim(m, r0, r1, axis=3), lax.slice_in_dim(denom, r0, r1, axis=3),
                 lax.slice_in_dim(acc, r0, r1, axis=3))
        keep = _step_mask(cfg, step, t, segs) if step.masked else None

        def update(state):
            m_old, l_old, acc_old = state
            s, _ = _logits(cfg, q_rows, k_blk)
            if keep is not None:
                s = jnp.where(keep, s, -jnp.inf)
            m_new = jnp.maximum(m_old, jnp.max(s, axis=-1))
            # A row that has seen nothing yet keeps m = -inf; shift by 0 so exp gives 0, not NaN.
            m_safe = m_new if keep is None else jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m_old - m_safe)
            l_new = alpha * l_old + jnp.sum(p, axis=-1)
            pv = matmul("bhgqk,bhkd->bhgqd", cast(p), v_blk)
            return m_new, l_new, alpha[..., None] * acc_old + pv

        state = lax.cond(_step_predicate(keep, segs, state[1]), update, lambda st: st, state)
        return (lax.dynamic_update_slice_in_dim(m, state[0], r0, axis=3),
                lax.dynamic_update_slice_in_dim(denom, state[1], r0, axis=3),
                lax.dynamic_update_slice_in_dim(acc, state[2], r0, axis=3))

    init = (jnp.full((b, h, g, tq), -jnp.inf, jnp.float32), jnp.zeros((b, h, g, tq), jnp.float32),
            jnp.zeros((b, h, g, tq, d), jnp.float32))
    m, denom, acc = _run_schedule(cfg, body, _like_inputs(init, qt, kt, vt))
    seen = denom > 0
    out = acc / jnp.where(seen, denom, 1.0)[..., None]
    # The log-sum-exp is kept as the pair (m, log l): the backward computes
    # exp((s - m) - log l), which stays exact for logits of magnitude 1e3 where
    # s - (m + log l) would lose the low bits of log l. Rows that see nothing:
    # m = -inf, log l = 0 (the convention of tpuattn.softmax.Partial).
    m = jnp.where(seen, m, -jnp.inf)
    log_denom = jnp.log(jnp.where(seen, denom, 1.0))
    return out, (m, log_denom)


def _tile_probabilities(cfg, q_rows, k_blk, m_rows, log_denom_rows, keep):
    """The forward's probabilities of one tile, recomputed from the saved (max, log sum)."""
    s, tanh_s = _logits(cfg, q_rows, k_blk)
    # A row that saw nothing (m = -inf) is shifted by +inf instead, so that exp(s - shift) = 0
    # (not exp(+inf), which a padded query row in an unmasked step would turn into NaN gradients).
    shift = jnp.where(m_rows == -jnp.inf, jnp.inf, m_rows)
    p = jnp.exp((s - shift[..., None]) - log_denom_rows[..., None])
    if keep is not None:
        p = jnp.where(keep, p, 0.0)
    return p, tanh_s


def _rows(x, step, cfg):
    return lax.slice_in_dim(x, step.q_lo * cfg.block_q, step.q_hi * cfg.block_q, axis=3)


def _delta(cfg: _Config, qt, kt, vt, segs, lse, d_out_in):
    """delta = rowsum(P * dP) ``[b, h, g, Tq]``, accumulated over the schedule (a first pass).

    In exact arithmetic it equals rowsum(dO * O), which is cheaper; but O is rounded (to bf16 for
    bf16 inputs, and by float32 for logits of 1e3), and dS = P * (dP - delta) then stops cancelling
    for nearly one-hot rows (gradients 70-200x worse than autodiff of the reference in bf16).
    Summing the very P * dP that the second pass computes makes dS cancel exactly. Cost: two
    matmuls per tile (QK^T and dO V^T) on top of the backward's five.
    """
    row_max, log_denom = lse

    def body(delta, step, t):
        q_rows, do_rows = _rows(qt, step, cfg), _rows(d_out_in, step, cfg)
        m_rows, log_denom_rows = _rows(row_max, step, cfg), _rows(log_denom, step, cfg)
        k_blk, v_blk = _kv_block(cfg, kt, t), _kv_block(cfg, vt, t)
        keep = _step_mask(cfg, step, t, segs) if step.masked else None

        def tile():
            p, _ = _tile_probabilities(cfg, q_rows, k_blk, m_rows, log_denom_rows, keep)
            dp = matmul("bhgqd,bhkd->bhgqk", do_rows, v_blk)
            return jnp.sum(p * dp, axis=-1)

        skipped = lambda: _like_inputs(jnp.zeros(m_rows.shape, jnp.float32), qt, kt, vt)
        part = lax.cond(_step_predicate(keep, segs, m_rows), tile, skipped)
        r0 = step.q_lo * cfg.block_q
        return lax.dynamic_update_slice_in_dim(delta, _rows(delta, step, cfg) + part, r0, axis=3)

    return _run_schedule(cfg, body, _like_inputs(jnp.zeros(row_max.shape, jnp.float32), qt, kt, vt))


def _backward(cfg: _Config, qt, kt, vt, segs, lse, d_out, delta=None):
    """Recompute each scheduled tile from the log-sum-exp; returns (dq, dk, dv) in float32.

    ``delta`` (rowsum(P * dP) of the whole row) is computed here unless given (a block of a
    larger problem, :data:`PARTIAL`, gets it summed over every block of the row)."""
    row_max, log_denom = lse
    cast = _mm(qt.dtype)
    d_out_in = cast(d_out.astype(jnp.float32))
    if delta is None:
        delta = _delta(cfg, qt, kt, vt, segs, lse, d_out_in)

    def body(carry, step, t):
        dq, dk, dv = carry
        r0, r1 = step.q_lo * cfg.block_q, step.q_hi * cfg.block_q
        q_rows = lax.slice_in_dim(qt, r0, r1, axis=3)
        do_rows = lax.slice_in_dim(d_out_in, r0, r1, axis=3)
        m_rows = lax.slice_in_dim(row_max, r0, r1, axis=3)
        log_denom_rows = lax.slice_in_dim(log_denom, r0, r1, axis=3)
        delta_rows = lax.slice_in_dim(delta, r0, r1, axis=3)
        k_blk, v_blk = _kv_block(cfg, kt, t), _kv_block(cfg, vt, t)
        keep = _step_mask(cfg, step, t, segs) if step.masked else None

        def tile():
            p, tanh_s = _tile_probabilities(cfg, q_rows, k_blk, m_rows, log_denom_rows, keep)
            dv_t = matmul("bhgqk,bhgqd->bhkd", cast(p), do_rows)
            dp = matmul("bhgqd,bhkd->bhgqk", do_rows, v_blk)
            ds = p * (dp - delta_rows[..., None])
            if tanh_s is not None:
                ds = ds * (1.0 - tanh_s * tanh_s)  # through the softcap
            ds = cast(ds)
            dq_rows = matmul("bhgqk,bhkd->bhgqd", ds, k_blk) * cfg.scale
            dk_t = matmul("bhgqk,bhgqd->bhkd", ds, q_rows) * cfg.scale
            return dq_rows, dk_t, dv_t

        zeros = _like_inputs((jnp.zeros(q_rows.shape, jnp.float32), jnp.zeros(k_blk.shape, jnp.float32),
                              jnp.zeros(v_blk.shape, jnp.float32)), qt, kt, vt)
        dq_rows, dk_t, dv_t = lax.cond(_step_predicate(keep, segs, delta_rows), tile, lambda: zeros)
        c0 = t * cfg.block_kv
        dq_rows = lax.slice_in_dim(dq, r0, r1, axis=3) + dq_rows
        return (lax.dynamic_update_slice_in_dim(dq, dq_rows, r0, axis=3),
                lax.dynamic_update_slice_in_dim(dk, _kv_block(cfg, dk, t) + dk_t, c0, axis=2),
                lax.dynamic_update_slice_in_dim(dv, _kv_block(cfg, dv, t) + dv_t, c0, axis=2))

    init = (jnp.zeros(qt.shape, jnp.float32), jnp.zeros(kt.shape, jnp.float32),
            jnp.zeros(vt.shape, jnp.float32))
    return _run_schedule(cfg, body, _like_inputs(init, qt, kt, vt))


def _flash_impl(cfg, qt, kt, vt, segs):
    out, _ = _forward(cfg, qt, kt, vt, segs)
    return out.astype(qt.dtype)


def _flash_fwd(cfg, qt, kt, vt, segs):
    out, lse = _forward(cfg, qt, kt, vt, segs)
    # Residuals: inputs and two floats per query row. Nothing of size q_len * kv_len.
    return out.astype(qt.dtype), (qt, kt, vt, segs, lse)


def _flash_bwd(cfg, residuals, d_out):
    qt, kt, vt, segs, lse = residuals
    dq, dk, dv = _backward(cfg, qt, kt, vt, segs, lse, d_out)
    return dq.astype(qt.dtype), dk.astype(kt.dtype), dv.astype(vt.dtype), None


_flash = jax.custom_vjp(_flash_impl, nondiff_argnums=(0,))
_flash.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------- the contract
def resolve_blocks(spec, options) -> tuple[int, int]:
    """Validate the options (:class:`~tpuattn.options.BlockwiseOptions`) and return the
    ``(block_q, block_kv)`` actually used (clipped to lengths)."""
    blocks = BlockwiseOptions.parse(options).blocks
    default_q, default_kv = default_blocks(spec.q_len, spec.kv_len)
    block_q = default_q if blocks is None or blocks.block_q is None else blocks.block_q
    block_kv = default_kv if blocks is None or blocks.block_kv is None else blocks.block_kv
    return min(block_q, spec.q_len), min(block_kv, spec.kv_len)


def _layout(q, k, v, segment_ids, spec, options):
    """The loop's config and its layout: ``[b, hkv, g, Tq, d]`` queries (query head ``h`` reads kv
    head ``h // g``), ``[b, hkv, Tk, d]`` keys and values, each padded to whole blocks."""
    block_q, block_kv = resolve_blocks(spec, options)
    cfg = _Config(mask=spec.mask, scale=float(spec.scale), softcap=spec.softcap, block_q=block_q,
                  block_kv=block_kv, steps=schedule(spec.mask, block_q, block_kv))
    b, _, _, d = q.shape
    hkv, g = spec.num_kv_heads, spec.group_size
    qt = pad_to_multiple(q, 1, block_q).reshape(b, -1, hkv, g, d).transpose(0, 2, 3, 1, 4)
    kt = pad_to_multiple(k, 1, block_kv).transpose(0, 2, 1, 3)
    vt = pad_to_multiple(v, 1, block_kv).transpose(0, 2, 1, 3)
    segs = None
    if segment_ids is not None:
        # Padded query rows get a segment of their own; padded keys are hidden by position anyway.
        segs = (pad_to_multiple(segment_ids[0], 1, block_q, value=-1),
                pad_to_multiple(segment_ids[1], 1, block_kv, value=-2))
    return cfg, qt, kt, vt, segs


def _from_rows_layout(q, x):
    """``[b, hkv, g, Tq_padded, d]`` back to the contract's ``[b, Tq, H, d]``."""
    b, tq, hq, d = q.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(b, -1, hq, d)[:, :tq]


def blockwise_attention(q, k, v, segment_ids, spec, **options):
    """Online-softmax attention behind the contract (see the module docstring).

    Options (:class:`~tpuattn.options.BlockwiseOptions`):
      blocks: a :class:`~tpuattn.options.Blocks`: ``block_q`` query rows and ``block_kv`` keys per
        block (default: :func:`default_blocks`); the backward walks the same tiles. The old spelling
        ``block_q=``, ``block_kv=`` is read as ``blocks=Blocks(block_q=..., block_kv=...)``.

    A block larger than its sequence is clipped to the sequence length.
    """
    cfg, qt, kt, vt, segs = _layout(q, k, v, segment_ids, spec, options)
    return _from_rows_layout(q, _flash(cfg, qt, kt, vt, segs))


# ----------------------------------------------------------------------------- one block of many
def _stats_in(spec, tq_padded, m, log_l):
    """Whole-problem row stats ``[b, H, Tq]`` (``m = -inf``: sees nothing) in the loop's layout
    ``[b, hkv, g, Tq_padded]``, padded rows seeing nothing."""
    b, hq, tq = m.shape
    pad = ((0, 0), (0, 0), (0, tq_padded - tq))
    m = jnp.pad(m, pad, constant_values=-jnp.inf)
    log_l = jnp.pad(log_l, pad)
    shape = (b, spec.num_kv_heads, spec.group_size, tq_padded)
    return m.reshape(shape), log_l.reshape(shape)


def _rows_out(spec, x, tq):
    """``[b, hkv, g, Tq_padded]`` row values back to ``[b, H, Tq]``."""
    return x.reshape(x.shape[0], spec.num_q_heads, -1)[:, :, :tq]


def partial_forward(q, k, v, segment_ids, spec, **options):
    """This block's :class:`tpuattn.softmax.Partial` (see :class:`tpuattn.registry.PartialOps`)."""
    cfg, qt, kt, vt, segs = _layout(q, k, v, segment_ids, spec, options)
    out, (m, log_l) = _forward(cfg, qt, kt, vt, segs)
    tq = q.shape[1]
    return softmax.Partial(_from_rows_layout(q, out), _rows_out(spec, m, tq), _rows_out(spec, log_l, tq))


def partial_row_sums(q, k, v, segment_ids, spec, m, log_l, d_out, **options):
    """This block's share of ``rowsum(P * dP)`` under the whole problem's row stats."""
    cfg, qt, kt, vt, segs = _layout(q, k, v, segment_ids, spec, options)
    lse = _stats_in(spec, qt.shape[3], m, log_l)
    do = _layout(d_out, k, v, None, spec, options)[1]
    delta = _delta(cfg, qt, kt, vt, segs, lse, _mm(qt.dtype)(do.astype(jnp.float32)))
    return _rows_out(spec, delta, q.shape[1])


def partial_backward(q, k, v, segment_ids, spec, m, log_l, d_out, delta, **options):
    """This block's shares of ``(dq, dk, dv)`` (float32) under the whole problem's stats."""
    cfg, qt, kt, vt, segs = _layout(q, k, v, segment_ids, spec, options)
    tqp = qt.shape[3]
    lse = _stats_in(spec, tqp, m, log_l)
    do = _layout(d_out, k, v, None, spec, options)[1]
    delta = _stats_in(spec, tqp, jnp.zeros_like(delta), delta)[1]
    dq, dk, dv = _backward(cfg, qt, kt, vt, segs, lse, do, delta)
    kv_len = k.shape[1]
    return (_from_rows_layout(q, dq), dk.transpose(0, 2, 1, 3)[:, :kv_len],
            dv.transpose(0, 2, 1, 3)[:, :kv_len])


PARTIAL = PartialOps(forward=partial_forward, row_sums=partial_row_sums, backward=partial_backward)


def blockwise_auto_rank(spec, backend: str) -> float:
    """Second choice everywhere; the first on CPU once ``xla``'s score matrix passes 1 GiB
    (its memory is linear in the length: see :func:`tpuattn.impl.xla.xla_auto_rank`)."""
    if backend == "cpu" and 4 * spec.batch * spec.num_q_heads * spec.q_len * spec.kv_len > 1024**3:
        return 0.0
    return 2.0


register("blockwise", blockwise_attention, auto_rank=blockwise_auto_rank, schedule="blockwise (XLA loop)",
         partial=PARTIAL,
         # The local kernel of tpuattn.parallel with impl="auto" off a TPU (after pallas on one).
         partial_rank=lambda spec, backend: 1.0,
         default_blocks=lambda spec, chip=None: default_blocks(spec.q_len, spec.kv_len),
         options=OPTIONS,
         description="online softmax in pure JAX: static schedule over key blocks, masked blocks "
                     "skipped, recomputing custom VJP (linear memory)")


# ----------------------------------------------------------------------------- teaching versions
def _check_teaching(q, k, v, block_q, block_kv):
    if q.ndim != 4 or q.shape != k.shape or k.shape != v.shape:
        raise ValueError(f"q, k, v: expected one shape [batch, seq, heads, head_dim], got "
                         f"{q.shape}, {k.shape}, {v.shape}")
    n = q.shape[1]
    for name, block in (("block_q", block_q), ("block_kv", block_kv)):
        positive_int(name, block)
        if n % block:
            raise ValueError(f"{name}: expected a divisor of the sequence length {n}, got {block}")


def online_softmax_block(q_block, k, v, q_start, *, block_kv: int, causal: bool, scale: float):
    """Attention of one query block ``[batch, block_q, heads, d]`` starting at row ``q_start``.

    A ``fori_loop`` over key blocks carries the running max ``m``, sum ``l`` and
    accumulator ``acc`` (float32). Causal masking is applied per tile (q_len == kv_len).
    """
    b, bq, h, d = q_block.shape
    num_kv_blocks = k.shape[1] // block_kv
    rows = q_start + jnp.arange(bq)[:, None]

    def body(t, carry):
        m, denom, acc = carry
        k_t = lax.dynamic_slice_in_dim(k, t * block_kv, block_kv, axis=1)
        v_t = lax.dynamic_slice_in_dim(v, t * block_kv, block_kv, axis=1)
        s = matmul("bqhd,bkhd->bhqk", q_block, k_t) * scale
        if causal:
            cols = t * block_kv + jnp.arange(block_kv)[None, :]
            s = jnp.where(cols <= rows, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        acc = alpha[..., None] * acc + matmul("bhqk,bkhd->bhqd", p, v_t.astype(jnp.float32))
        return m_new, alpha * denom + p.sum(-1), acc

    init = (jnp.full((b, h, bq), -jnp.inf, jnp.float32), jnp.zeros((b, h, bq), jnp.float32),
            jnp.zeros((b, h, bq, d), jnp.float32))
    _, denom, acc = lax.fori_loop(0, num_kv_blocks, body, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.transpose(0, 2, 1, 3).astype(q_block.dtype)  # [b, bq, h, d]


def fori_loop_attention(q, k, v, *, block_q: int = 128, block_kv: int = 128, causal: bool = False,
                        scale: float | None = None):
    """Teaching version A: query blocks one after another in a sequential ``lax.fori_loop``.

    ``q, k, v``: ``[batch, seq, heads, head_dim]``, one shape, ``seq`` a multiple of both blocks.
    Each iteration computes one query block with :func:`online_softmax_block`; nothing runs
    in parallel across query blocks (on a TPU: one small tile at a time).
    """
    _check_teaching(q, k, v, block_q, block_kv)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale

    def body(i, out):
        q_i = lax.dynamic_slice_in_dim(q, i * block_q, block_q, axis=1)
        o_i = online_softmax_block(q_i, k, v, i * block_q, block_kv=block_kv, causal=causal, scale=scale)
        return lax.dynamic_update_slice_in_dim(out, o_i, i * block_q, axis=1)

    return lax.fori_loop(0, q.shape[1] // block_q, body, jnp.zeros_like(q))


def vmap_attention(q, k, v, *, block_q: int = 128, block_kv: int = 128, causal: bool = False,
                   scale: float | None = None):
    """Teaching version B: the same block function, independent query blocks under ``jax.vmap``.

    ``jax.vmap`` turns the per-block matmuls into batched matmuls over all query blocks at
    once, so each key-block step is one big operation instead of ``num_q_blocks`` small ones.
    """
    _check_teaching(q, k, v, block_q, block_kv)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    b, n, h, d = q.shape
    nq = n // block_q
    q_blocks = q.reshape(b, nq, block_q, h, d).transpose(1, 0, 2, 3, 4)  # [nq, b, bq, h, d]
    starts = jnp.arange(nq) * block_q
    block_fn = lambda q_i, start: online_softmax_block(q_i, k, v, start, block_kv=block_kv, causal=causal,
                                                       scale=scale)
    out = jax.vmap(block_fn)(q_blocks, starts)
    return out.transpose(1, 0, 2, 3, 4).reshape(b, n, h, d)


__all__ = ["blockwise_attention", "default_blocks", "schedule", "step_groups", "visited_tiles", "Step",
           "fori_loop_attention", "vmap_attention", "online_softmax_block", "resolve_blocks"]
