"""The finished lesson kernel as an implementation of the contract: ``impl="lesson"``.

Notebook 03 ends its forward with the scheduled kernel (:func:`tpuattn.lesson.steps.scheduled_kernel`):
a causal or windowed GQA flash forward that walks, per query block, only the kv blocks a table in
SMEM names. This module finishes it for the contract, and gives it a backward:

* **what the steps left out**: lengths that are not a multiple of the blocks (padded; the padded keys
  masked), a window on both sides, segment ids (masked inside the tiles the positions make visible),
  and rows that see no key at all (masked logits are ``-inf``, the running max guarded, such a row
  returns zeros); the forward also writes each row's statistics, the running max ``m`` and sum ``l``,
  kept apart so that logits near 1e3 lose nothing in ``m + log l``, and its output in float32;
* **the backward** (FlashAttention-2, Dao 2023, arXiv:2307.08691): ``delta = rowsum(dO * O)`` from the
  forward's float32 ``O`` (kept as a residual: from ``O`` rounded to bfloat16, ``dP - delta`` would not
  cancel on nearly one-hot rows), then
  two kernels that recompute each visible tile's ``P = exp(S - m - log l)`` -- a **dQ kernel** over
  the forward's schedule (``dQ += dS K``) and a **dK/dV kernel** over the transposed schedule, kv
  blocks outside and the query heads of a GQA group and their visible q blocks inside
  (``dV += P^T dO``, ``dK += dS^T Q``) -- joined to the forward by ``jax.custom_vjp``.

Clear, not tuned: heads-first copies ``[batch, heads, seq, head_dim]``, statistics and segment ids as
``[..., 1]`` columns (key ids as a ``[1, ...]`` row), one query head per grid step, every tile read
for its positions whatever the segment ids say. It refuses a softcap (its ``supports`` says so) and
second derivatives. Offered by name, never chosen by ``impl="auto"``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpuattn._checks import round_up
from tpuattn.lesson.steps import NT, to_bhtd
from tpuattn.numerics import first_order_only, matmul_precision
from tpuattn.options import Blocks, LessonOptions, resolve_interpret
from tpuattn.pallas.compat import out_struct
from tpuattn.registry import register
from tpuattn.sharding import mark_varying, varying_axes
from tpuattn.supports import low_precision_matmul_refused

OPTIONS = LessonOptions  # blocks= (forward tiles only), interpret=; old block_q=, block_kv=
MAX_BLOCK = 128  # the default block: 128 rows (or the length rounded up to 8, if shorter)
TN = (((0,), (0,)), ((), ()))  # dot_general dims: contract the first dim of both -> a.T @ b
SECOND_DERIVATIVE = ("impl='lesson' has no second derivatives: its backward kernels define only a "
                     "first-order VJP. Use impl='reference', 'blockwise' or 'xla' for grad-of-grad.")


@dataclasses.dataclass(frozen=True)
class Problem:
    """What the kernels need to know about one call (static, hashable)."""

    q_len: int  # the real lengths; the arrays are padded to multiples of the blocks
    kv_len: int
    offset: int  # key position of query 0 (bottom-right alignment: kv_len - q_len)
    left: int | None  # a query at position p sees keys p - left ... p + right (None: unbounded)
    right: int | None
    scale: float
    group: int  # query heads per kv head
    block_q: int
    block_kv: int
    interpret: Any


# ----------------------------------------------------------------------------- the schedule
def visible_tiles(problem: Problem) -> np.ndarray:
    """``visible[i, j]``: does some real query of block ``i`` see some real key of block ``j``?"""
    p = problem
    rows = np.arange(round_up(p.q_len, p.block_q))
    pos = rows + p.offset
    lo = np.zeros_like(pos) if p.left is None else np.maximum(pos - p.left, 0)  # first visible key
    hi = np.full_like(pos, p.kv_len - 1) if p.right is None else np.minimum(pos + p.right, p.kv_len - 1)
    hi = np.where(rows < p.q_len, hi, -1)  # padded rows see nothing
    first_key = np.arange(0, round_up(p.kv_len, p.block_kv), p.block_kv)
    last_key = first_key + p.block_kv - 1
    row_sees_block = (np.maximum(lo[:, None], first_key) <= np.minimum(hi[:, None], last_key))
    return row_sees_block.reshape(-1, p.block_q, len(first_key)).any(axis=1)


def schedule(visible: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Step 5b's tables from ``visible [rows, cols]``: ``index [rows, steps]`` (each row's visible columns,
    then its last one repeated -- no fetch) and ``count [rows]``. A row that sees nothing computes
    nothing (count 0) and names column 0."""
    count = visible.sum(axis=1).astype(np.int32)
    steps = max(1, int(count.max()))
    index = np.zeros((visible.shape[0], steps), np.int32)
    for i, row in enumerate(visible):
        cols = np.flatnonzero(row)
        if len(cols):
            index[i] = np.concatenate([cols, np.full(steps - len(cols), cols[-1])])
    return index, count


def tile_mask(p: Problem, q_block, kv_block, shape, q_seg_ref, kv_seg_ref):
    """Which (query, key) pairs of the tile of q block ``q_block`` and kv block ``kv_block`` count."""
    rows = q_block * p.block_q + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    cols = kv_block * p.block_kv + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    keep = jnp.logical_and(rows < p.q_len, cols < p.kv_len)  # padding sees nothing
    keep = jnp.logical_and(keep, q_seg_ref[...] == kv_seg_ref[...])  # [block_q, 1] == [1, block_kv]
    if p.right is not None:
        keep = jnp.logical_and(keep, cols <= rows + p.offset + p.right)
    if p.left is not None:
        keep = jnp.logical_and(keep, cols >= rows + p.offset - p.left)
    return keep


def scores(q_ref, k_ref, p: Problem):
    """``scale * q k^T`` of the tile, in float32."""
    return jax.lax.dot_general(q_ref[...], k_ref[...], NT, precision=matmul_precision(q_ref.dtype),
                               preferred_element_type=jnp.float32) * p.scale


def safe_max(m):
    """A running max of ``-inf`` (its row has seen no key yet) read as 0: ``-inf - m`` stays ``-inf``."""
    return jnp.where(m == -jnp.inf, 0.0, m)


# ----------------------------------------------------------------------------- forward
def forward_kernel(kv_index_ref, kv_count_ref, q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref,
                   o_ref, m_ref, l_ref, m_scr, l_scr, acc_scr, *, p: Problem, steps: int):
    """Step 5b's kernel, finished: ``-inf`` masking with a guarded max, and the statistics written out."""
    qi, step = pl.program_id(2), pl.program_id(3)
    kv_block = kv_index_ref[qi * steps + step]

    @pl.when(step == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    @pl.when(step < kv_count_ref[qi])
    def _update():
        s = scores(q_ref, k_ref, p)
        s = jnp.where(tile_mask(p, qi, kv_block, s.shape, q_seg_ref, kv_seg_ref), s, -jnp.inf)
        m_prev = m_scr[...]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
        alpha = jnp.exp(m_prev - safe_max(m_next))  # 0 while the row had nothing (m_prev = -inf)
        probs = jnp.exp(s - safe_max(m_next))  # 0 where masked
        l_scr[...] = alpha * l_scr[...] + jnp.sum(probs, axis=-1, keepdims=True)
        acc_scr[...] = alpha * acc_scr[...] + jnp.dot(probs.astype(v_ref.dtype), v_ref[...],
                                                      precision=matmul_precision(v_ref.dtype),
                                                      preferred_element_type=jnp.float32)
        m_scr[...] = m_next

    @pl.when(step == steps - 1)
    def _write():
        l_sum = l_scr[...]
        o_ref[...] = (acc_scr[...] / jnp.where(l_sum == 0, 1.0, l_sum)).astype(o_ref.dtype)  # no key: 0
        m_ref[...] = m_scr[...]
        l_ref[...] = l_sum


def forward(q, k, v, q_seg, kv_seg, p: Problem):
    """q ``[b, hq, Tq, d]``, k, v ``[b, hkv, Tk, d]`` (heads first, padded), segment ids ``q_seg [b, Tq, 1]``
    and ``kv_seg [b, 1, Tk]`` -> out (float32), m, l ``[b, hq, Tq, 1]``."""
    b, hq, tq, d = q.shape
    kv_index, kv_count = schedule(visible_tiles(p))
    steps = kv_index.shape[1]
    q_spec, kv_spec, row, q_seg_spec, kv_seg_spec = block_specs(p, d, row_maps(p, steps))
    stat = out_struct((b, hq, tq, 1), jnp.float32, q)  # typed like q inside a user's shard_map
    return pl.pallas_call(
        functools.partial(forward_kernel, p=p, steps=steps),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, hq, tq // p.block_q, steps),
            in_specs=[q_spec, kv_spec, kv_spec, q_seg_spec, kv_seg_spec],
            out_specs=[q_spec, row, row],
            scratch_shapes=[pltpu.VMEM((p.block_q, 1), jnp.float32), pltpu.VMEM((p.block_q, 1), jnp.float32),
                            pltpu.VMEM((p.block_q, d), jnp.float32)]),
        out_shape=[out_struct(q.shape, jnp.float32, q), stat, stat],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=p.interpret,
        name="lesson_forward",
    )(*tables(kv_index, kv_count), q, k, v, q_seg, kv_seg)


def row_maps(p: Problem, steps: int):
    """Index maps of the grid ``(batch, q head, q block, step)`` that walks each q block's visible kv
    blocks (the forward's and dQ's): Q-like blocks, K/V blocks, query and key segment ids."""
    def q_map(bi, hi, qi, step, index_ref, count_ref):
        return (bi, hi, qi, 0)

    def kv_map(bi, hi, qi, step, index_ref, count_ref):
        return (bi, jax.lax.div(hi, jnp.int32(p.group)), index_ref[qi * steps + step], 0)

    def q_seg_map(bi, hi, qi, step, index_ref, count_ref):
        return (bi, qi, 0)

    def kv_seg_map(bi, hi, qi, step, index_ref, count_ref):
        return (bi, 0, index_ref[qi * steps + step])

    return q_map, kv_map, q_seg_map, kv_seg_map


def column_maps(p: Problem, steps: int):
    """Index maps of the grid ``(batch, kv head, kv block, query head of the group, step)`` that walks
    each kv block's visible q blocks (dK/dV's), in the order of :func:`row_maps`."""
    def q_map(bi, hk, kj, g, step, index_ref, count_ref):
        return (bi, hk * p.group + g, index_ref[kj * steps + step], 0)

    def kv_map(bi, hk, kj, g, step, index_ref, count_ref):
        return (bi, hk, kj, 0)  # ignores g and step: the K/V block and dK/dV stay resident

    def q_seg_map(bi, hk, kj, g, step, index_ref, count_ref):
        return (bi, index_ref[kj * steps + step], 0)

    def kv_seg_map(bi, hk, kj, g, step, index_ref, count_ref):
        return (bi, 0, kj)

    return q_map, kv_map, q_seg_map, kv_seg_map


def block_specs(p: Problem, d: int, maps):
    """BlockSpecs (Q-like ``[block_q, d]``, K/V-like ``[block_kv, d]``, a per-row float ``[block_q, 1]``,
    query ids ``[block_q, 1]``, key ids ``[1, block_kv]``) for ``maps`` (:func:`row_maps` or
    :func:`column_maps`)."""
    q_map, kv_map, q_seg_map, kv_seg_map = maps
    squeeze = pl.squeezed
    return (pl.BlockSpec((squeeze, squeeze, p.block_q, d), q_map),
            pl.BlockSpec((squeeze, squeeze, p.block_kv, d), kv_map),
            pl.BlockSpec((squeeze, squeeze, p.block_q, 1), q_map),
            pl.BlockSpec((squeeze, p.block_q, 1), q_seg_map),
            pl.BlockSpec((squeeze, 1, p.block_kv), kv_seg_map))

def tables(index, count):
    """The schedule's tables as the call's scalar-prefetch operands: constants, the same on every device
    of a user's shard_map (JAX's interpreter reads them at grid indices that vary over no mesh axis)."""
    return jnp.asarray(index.reshape(-1)), jnp.asarray(count)


# ----------------------------------------------------------------------------- backward
def recompute(q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, do_ref, m_ref, l_ref, delta_ref, p: Problem,
              q_block, kv_block):
    """One visible tile's ``P = exp(S - m - log l)`` and ``dS = P * (dP - delta)``, ``dP = dO V^T``."""
    s = scores(q_ref, k_ref, p)
    l_sum = l_ref[...]
    log_l = jnp.log(jnp.where(l_sum == 0, 1.0, l_sum))
    keep = tile_mask(p, q_block, kv_block, s.shape, q_seg_ref, kv_seg_ref)
    probs = jnp.where(keep, jnp.exp(s - safe_max(m_ref[...]) - log_l), 0.0)
    dp = jax.lax.dot_general(do_ref[...], v_ref[...], NT, precision=matmul_precision(v_ref.dtype),
                             preferred_element_type=jnp.float32)
    return probs, probs * (dp - delta_ref[...])


def dq_kernel(kv_index_ref, kv_count_ref, q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, do_ref, m_ref, l_ref,
              delta_ref, dq_ref, dq_scr, *, p: Problem, steps: int):
    """The forward's grid and schedule: ``dQ = scale * sum over visible kv blocks of dS K``."""
    qi, step = pl.program_id(2), pl.program_id(3)

    @pl.when(step == 0)
    def _init():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

    @pl.when(step < kv_count_ref[qi])
    def _update():
        _, ds = recompute(q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, do_ref, m_ref, l_ref, delta_ref, p, qi,
                          kv_index_ref[qi * steps + step])
        dq_scr[...] += jnp.dot(ds.astype(k_ref.dtype), k_ref[...], precision=matmul_precision(k_ref.dtype),
                               preferred_element_type=jnp.float32)

    @pl.when(step == steps - 1)
    def _write():
        dq_ref[...] = (dq_scr[...] * p.scale).astype(dq_ref.dtype)


def dkv_kernel(q_index_ref, q_count_ref, q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, do_ref, m_ref, l_ref,
               delta_ref, dk_ref, dv_ref, dk_scr, dv_scr, *, p: Problem, steps: int):
    """Grid ``(batch, kv head, kv block, query head of the group, step)``: a kv block's ``dK`` and ``dV``
    summed over the group's query heads and their visible q blocks (both axes ``arbitrary``)."""
    kj, g, step = pl.program_id(2), pl.program_id(3), pl.program_id(4)

    @pl.when(jnp.logical_and(g == 0, step == 0))
    def _init():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    @pl.when(step < q_count_ref[kj])
    def _update():
        probs, ds = recompute(q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, do_ref, m_ref, l_ref, delta_ref, p,
                              q_index_ref[kj * steps + step], kj)
        dv_scr[...] += jax.lax.dot_general(probs.astype(do_ref.dtype), do_ref[...], TN,
                                           precision=matmul_precision(do_ref.dtype),
                                           preferred_element_type=jnp.float32)
        dk_scr[...] += jax.lax.dot_general(ds.astype(q_ref.dtype), q_ref[...], TN,
                                           precision=matmul_precision(q_ref.dtype),
                                           preferred_element_type=jnp.float32)

    @pl.when(jnp.logical_and(g == pl.num_programs(3) - 1, step == steps - 1))
    def _write():
        dk_ref[...] = (dk_scr[...] * p.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def backward(q, k, v, q_seg, kv_seg, out, m, l_sum, d_out, p: Problem):
    """dq, dk, dv of the heads-first padded arrays, given the forward's float32 ``out``, ``m``, ``l``."""
    b, hq, tq, d = q.shape
    _, hkv, tk, _ = k.shape
    delta = jnp.sum(d_out.astype(jnp.float32) * out, axis=-1, keepdims=True)  # rowsum(dO * O)
    d_out = d_out.astype(q.dtype)
    visible = visible_tiles(p)
    operands = (q, k, v, q_seg, kv_seg, d_out, m, l_sum, delta)

    # dQ: the forward's grid and schedule.
    kv_index, kv_count = schedule(visible)
    steps = kv_index.shape[1]
    q_spec, kv_spec, row, q_seg_spec, kv_seg_spec = block_specs(p, d, row_maps(p, steps))
    dq = pl.pallas_call(
        functools.partial(dq_kernel, p=p, steps=steps),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(b, hq, tq // p.block_q, steps),
            in_specs=[q_spec, kv_spec, kv_spec, q_seg_spec, kv_seg_spec, q_spec, row, row, row],
            out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((p.block_q, d), jnp.float32)]),
        out_shape=out_struct(q.shape, q.dtype, q),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=p.interpret,
        name="lesson_dq",
    )(*tables(kv_index, kv_count), *operands)

    # dK/dV: the transposed schedule, each kv block's visible q blocks, for every query head of its group.
    q_index, q_count = schedule(visible.T)
    steps = q_index.shape[1]
    q_spec, kv_spec, row, q_seg_spec, kv_seg_spec = block_specs(p, d, column_maps(p, steps))
    dk, dv = pl.pallas_call(
        functools.partial(dkv_kernel, p=p, steps=steps),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(b, hkv, tk // p.block_kv, p.group, steps),
            in_specs=[q_spec, kv_spec, kv_spec, q_seg_spec, kv_seg_spec, q_spec, row, row, row],
            out_specs=[kv_spec, kv_spec],
            scratch_shapes=[pltpu.VMEM((p.block_kv, d), jnp.float32),  # dK, dV accumulators
                            pltpu.VMEM((p.block_kv, d), jnp.float32)]),
        out_shape=[out_struct(k.shape, k.dtype, q), out_struct(v.shape, v.dtype, q)],
        # The group's heads and the steps both add into the same dK/dV block: both "arbitrary".
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary")),
        interpret=p.interpret,
        name="lesson_dkv",
    )(*tables(q_index, q_count), *operands)
    return dq, dk, dv


# ----------------------------------------------------------------------------- custom VJP
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def flash(q, k, v, segments, p: Problem):
    """The lesson's attention on heads-first padded arrays, differentiable by its own backward."""
    return _forward(q, k, v, segments, p)[0].astype(q.dtype)


def _forward(q, k, v, segments, p):  # a second derivative is refused by name, not by a bare pallas error
    return first_order_only(functools.partial(forward, p=p), SECOND_DERIVATIVE)(q, k, v, *segments)


def _flash_forward(q, k, v, segments, p):
    out, m, l_sum = _forward(q, k, v, segments, p)
    return out.astype(q.dtype), (q, k, v, segments, out, m, l_sum)


def _flash_backward(p, residuals, d_out):
    q, k, v, segments, out, m, l_sum = residuals
    run = first_order_only(functools.partial(backward, p=p), SECOND_DERIVATIVE)
    return (*run(q, k, v, *segments, out, m, l_sum, d_out), None)  # no cotangent for integer ids


flash.defvjp(_flash_forward, _flash_backward)


# ----------------------------------------------------------------------------- the contract
def _block(value: int | None, length: int) -> int:
    """A forward block (already checked by :class:`~tpuattn.options.LessonOptions`), or the default:
    ``MAX_BLOCK`` rows, or the length rounded up to 8 if shorter."""
    return min(MAX_BLOCK, round_up(length, 8)) if value is None else value


def resolve_options(spec, options) -> tuple[int, int, Any]:
    """``(block_q, block_kv, interpret)`` from the options, read through their record
    :class:`~tpuattn.options.LessonOptions` (``blocks=`` or the old ``block_q=`` / ``block_kv=``, each
    a multiple of 8; no backward blocks: the dQ and dK/dV kernels walk the forward's tiles), None
    being the defaults."""
    chosen = LessonOptions.parse(options)
    blocks = chosen.blocks or Blocks()
    return (_block(blocks.block_q, spec.q_len), _block(blocks.block_kv, spec.kv_len),
            resolve_interpret(chosen.interpret, "lesson"))


def lesson_attention(q, k, v, segment_ids, spec, **options):
    """The contract's entry: pad to the blocks, go heads first, run :func:`flash`, come back."""
    block_q, block_kv, interpret = resolve_options(spec, options)
    mask = spec.mask
    p = Problem(q_len=spec.q_len, kv_len=spec.kv_len, offset=mask.offset, left=mask.left_reach,
                right=mask.right_reach, scale=float(spec.scale), group=spec.group_size, block_q=block_q,
                block_kv=block_kv, interpret=interpret)

    def padded(x, block):  # [b, t, h, d] -> [b, h, t rounded up to the block, d], zeros appended
        pad = round_up(x.shape[1], block) - x.shape[1]
        return to_bhtd(jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))))

    if segment_ids is None:  # one segment: every token 0
        segment_ids = (jnp.zeros(q.shape[:2], jnp.int32), jnp.zeros(k.shape[:2], jnp.int32))
    q_seg, kv_seg = segment_ids
    q_seg = jnp.pad(q_seg, ((0, 0), (0, round_up(spec.q_len, block_q) - spec.q_len)))[:, :, None]
    kv_seg = jnp.pad(kv_seg, ((0, 0), (0, round_up(spec.kv_len, block_kv) - spec.kv_len)))[:, None, :]
    # Inside a user's shard_map every operand is typed varying over the same mesh axes as the others.
    arrays = (padded(q, block_q), padded(k, block_kv), padded(v, block_kv), q_seg, kv_seg)
    axes = varying_axes(*arrays)
    q, k, v, q_seg, kv_seg = (mark_varying(x, axes) for x in arrays)
    return to_bhtd(flash(q, k, v, (q_seg, kv_seg), p))[:, :spec.q_len]


def supports(spec, backend=None) -> str | None:
    """Why ``impl="lesson"`` cannot serve ``spec`` (a reason naming the feature), or None."""
    if spec.softcap is not None:
        return "softcap: impl='lesson' has no logit soft-cap"
    return low_precision_matmul_refused(spec, backend, "lesson")


register(
    "lesson",
    lesson_attention,
    supports=supports,
    description="notebook 03's finished kernel (scheduled Pallas flash forward, FlashAttention-2 backward "
                "in Pallas, custom VJP); teaching code, offered by name, never chosen by auto",
    interpreted_off_tpu=True,
    options=OPTIONS,
)
