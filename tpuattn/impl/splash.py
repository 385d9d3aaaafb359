"""``impl="splash"``: JAX's splash-attention Pallas kernel for TPUs behind the contract.

``jax.experimental.pallas.ops.tpu.splash_attention``, forward and its custom backward, run in
interpret mode off a TPU. What the adapter translates:

* layout: ``[batch, seq, heads, head_dim]`` to splash's ``[heads, seq, head_dim]``, vmapped over batch;
* scale: splash takes none, so ``q`` is multiplied by ``scale``;
* causal, window: ``CausalMask`` / ``LocalMask`` with ``offset = kv_len - q_len`` (bottom-right);
* segment ids: ``SegmentIds``; softcap: ``attn_logits_soft_cap``;
* GQA / MQA: the MHA kernel with fewer kv heads, or the MQA kernel;
* lengths: padded to the block size; padded keys get a segment id no query has;
* rows that see no key: a "sink" logit of -1e30 with value 0, so they return 0 and gradients stay
  finite.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from tpuattn._checks import round_up
from tpuattn.numerics import first_order_only, x64
from tpuattn.options import SplashOptions, resolve_interpret
from tpuattn.registry import ScheduleModel, register
from tpuattn.sharding import mark_varying, varying_axes, vma_checks_off
from tpuattn.supports import long_enough_for_flash, low_precision_matmul_refused

# ---------------------------------------------------------------------------- impl="splash"
SPLASH_OPTIONS = SplashOptions  # blocks= (forward and backward tiles), interpret=; old block_q=, block_kv=
# 512 x 512 tiles: big enough to keep the MXU busy on a TPU and to make few interpret steps on
# CPU; capped at the (128-rounded) sequence length so short inputs are not padded far.
DEFAULT_SPLASH_BLOCK = 512
# Splash tiles are multiples of the 128 TPU lanes (its segment-id and mask code tiles by 128).
SPLASH_LANES = 128
# A query with no visible key must return 0. Splash's "attention sink" is one extra logit per
# head, with value 0, that enters every row's softmax; at -1e30 it is exp(-1e30 - m) = 0 next
# to any real logit m, but it keeps the denominator at 1 (not 0) for a row whose real keys are
# all masked (splash fills those with -0.7 * float32 max, below the sink).
_EMPTY_ROW_SINK = -1e30


def _splash_module():
    from jax.experimental.pallas.ops.tpu import splash_attention

    return splash_attention


@functools.lru_cache(maxsize=64)
def _splash_kernel(q_len_padded, kv_len_padded, num_q_heads, mqa, positional, block_q, block_kv, softcap,
                   interpret, backward_block_q=None, backward_block_kv=None):
    """Build (and cache: it inspects every tile on the host) a splash kernel for one problem."""
    sa = _splash_module()
    shape = (q_len_padded, kv_len_padded)
    kind, window, offset = positional
    if kind == "full":
        head_mask = sa.FullMask(shape)
    elif kind == "causal":
        head_mask = sa.CausalMask(shape, offset=offset)
    else:
        head_mask = sa.LocalMask(shape, window_size=window, offset=offset)
    bq, bkv = backward_block_q or block_q, backward_block_kv or block_kv
    blocks = sa.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv,
                           block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkv,
                           block_q_dq=bq, block_kv_dq=bkv)
    make = sa.make_splash_mqa if mqa else sa.make_splash_mha
    # The kernel holds the tile tables as arrays. Build them as concrete arrays whatever trace is
    # current, or the cached kernel would carry that trace's tracers into every later call.
    with _outside_any_trace():
        return make(sa.MultiHeadMask([head_mask] * num_q_heads), block_sizes=blocks, head_shards=1,
                    q_seq_shards=1, attn_logits_soft_cap=softcap, interpret=interpret)


def _outside_any_trace():
    """A context in which JAX operations run eagerly on concrete values, whatever trace is current.

    ``jax.ensure_compile_time_eval`` is not enough: it folds constants under ``jit``, but inside an
    eager ``shard_map`` (no jit) the operations still go to the shard_map's trace, and a kernel cached
    there kept its tracers (every later call of that shape failed with ``UnexpectedTracerError``, or
    JAX 0.7's ``NotImplementedError('must override', ShardMapTracer)``). JAX's evaluation context
    (``jax._src.core.eval_context``, in 0.7 and 0.10 alike) leaves every trace.
    """
    from jax._src import core

    return core.eval_context()


def _positional(spec) -> tuple[str, tuple | None, int]:
    """The contract's positions as a splash mask: ("full"|"causal"|"local", window, offset)."""
    mask = spec.mask
    if mask.left_reach is None and mask.right_reach is None:
        return "full", None, 0
    if mask.left_reach is None and mask.right_reach == 0:
        return "causal", None, mask.offset
    # LocalMask keeps offset+i-left <= j <= offset+i+right: the contract's window with
    # causal folded into the right side (right_reach = min(0, right) when causal).
    return "local", (mask.left_reach, mask.right_reach), mask.offset


def _padding_segment(q_seg):
    """A segment id, per batch row, that no query has: marks padded keys invisible.

    ``min - 1``, or ``max + 1`` when the minimum is the smallest int32. (Only ids that contain
    both the smallest and the largest int32 in one row could collide.)
    """
    lo = jnp.min(q_seg, axis=1, keepdims=True)
    hi = jnp.max(q_seg, axis=1, keepdims=True)
    return jnp.where(lo > jnp.iinfo(jnp.int32).min, lo - 1, hi + 1)


def splash_attention(q, k, v, segment_ids, spec, *, sinks=None, **options):
    """JAX's splash-attention kernel (forward and its custom backward) behind the contract.

    ``sinks`` (float32 ``[num_q_heads]``, :mod:`tpuattn.sinks`) go to the kernel's own sinks, which
    JAX's splash differentiates: its backward returns their gradient in q's dtype, returned here in
    float32, the sinks' dtype. For bf16 inputs that gradient is the kernel's sum of bf16 products
    ``p_sink * o * dO``: within about 1e-4 of the sum of the terms' magnitudes, and the terms cancel,
    so the gradient itself can be off by a few per cent (measured: 128 tokens, up to 5%); the
    implementations with partial results (``pallas``, ``blockwise``) sum it in float32."""
    chosen = SplashOptions.parse(options)
    interpret = resolve_interpret(chosen.interpret, "splash")
    sa = _splash_module()

    b, q_len, kv_len = spec.batch, spec.q_len, spec.kv_len
    block_q, block_kv, backward_q, backward_kv = _blocks(chosen.blocks, q_len, kv_len)
    # Padded to both passes' blocks (multiples of 128: the larger where one divides the other).
    q_pad = round_up(q_len, math.lcm(block_q, backward_q))
    kv_pad = round_up(kv_len, math.lcm(block_kv, backward_kv))

    # Splash does not scale: fold the scale into q (in float32, then back to q's dtype).
    q = (q.astype(jnp.float32) * spec.scale).astype(q.dtype)
    # [batch, seq, heads, dim] -> [batch, heads, seq, dim], padded along seq with zeros.
    q = jnp.pad(jnp.swapaxes(q, 1, 2), ((0, 0), (0, 0), (0, q_pad - q_len), (0, 0)))
    k = jnp.pad(jnp.swapaxes(k, 1, 2), ((0, 0), (0, 0), (0, kv_pad - kv_len), (0, 0)))
    v = jnp.pad(jnp.swapaxes(v, 1, 2), ((0, 0), (0, 0), (0, kv_pad - kv_len), (0, 0)))
    mqa = spec.num_kv_heads == 1
    if mqa:  # the MQA kernel takes one [seq, dim] key/value shared by every query head
        k, v = k[:, 0], v[:, 0]

    # Padded keys must stay invisible. Real queries never reach them when the mask bounds the
    # right side at the diagonal (causal); otherwise mark them with a segment id no query has.
    # Padded queries are sliced off; their zero cotangent keeps them out of the gradients.
    keys_padded = kv_pad > kv_len and not (spec.mask.right_reach is not None and spec.mask.right_reach <= 0)
    if segment_ids is not None or keys_padded:
        if segment_ids is None:
            q_seg = jnp.zeros((b, q_len), jnp.int32)
            kv_seg = jnp.zeros((b, kv_len), jnp.int32)
        else:
            q_seg, kv_seg = segment_ids
        q_seg = jnp.pad(q_seg, ((0, 0), (0, q_pad - q_len)), mode="edge")
        kv_seg = jnp.concatenate(
            [kv_seg, jnp.broadcast_to(_padding_segment(q_seg), (b, kv_pad - kv_len))], axis=1)
        segments = sa.SegmentIds(q=q_seg, kv=kv_seg)
    else:
        segments = None

    kernel = _splash_kernel(q_pad, kv_pad, spec.num_q_heads, mqa, _positional(spec), block_q, block_kv,
                            spec.softcap, interpret, backward_q, backward_kv)
    # Always pass a sink: besides the contract's empty rows, padded query rows may see nothing,
    # and without it their NaN output (0/0) would leak into dk and dv through the backward pass. The
    # caller's sinks take its place (a sink of -inf, "none", stays at the harmless -1e30).
    floor = jnp.full((spec.num_q_heads,), _EMPTY_ROW_SINK, jnp.float32)
    sinks = floor if sinks is None else jnp.maximum(jnp.asarray(sinks, jnp.float32), floor)
    # Inside a user's shard_map, replicated sinks typed varying like q, k, v: the transpose of that
    # cast sums the sinks' per-device gradients over the devices (without it, one device's share).
    axes = varying_axes(q, k, v)
    sinks = mark_varying(sinks, axes)

    def batched(q, k, v, segments, sinks):
        one_batch = lambda q, k, v, segments: kernel(q, k, v, segment_ids=segments, sinks=sinks)
        return jax.vmap(one_batch)(q, k, v, segments)  # [batch, heads, q_pad, dim]

    out = _guarded(batched, axes)(q, k, v, segments, sinks)
    return jnp.swapaxes(out[:, :, :q_len], 1, 2).astype(spec.dtype)


SECOND_DERIVATIVE = ("impl='splash' has no second derivatives: JAX's splash kernel defines only a "
                     "first-order backward. Use impl='reference', 'blockwise' or 'xla' for grad-of-grad "
                     "(e.g. Hessian-vector products).")


def _guarded(fn, axes: tuple[str, ...]):
    """``fn(q, k, v, segments, sinks)`` differentiable once, traced without 64-bit types, both passes.

    Splash's index maps mix int32 grid indices with Python ints, which become int64 under
    ``jax_enable_x64`` and fail inside JAX's kernel; nothing here needs 64 bits, so both passes are
    traced with it off. Inside a user's ``shard_map`` (default checks) splash's ``pallas_call`` gives
    its outputs no varying mesh axes, so the kernel is always traced with the checks off (a no-op
    outside a shard_map) and its outputs marked as varying like the inputs (the sinks, typed varying
    like q by the caller, get this device's share of their gradient, which the caller's cast sums).
    ``axes`` are those the caller's q, k, v vary over, read once before any of this (with the checks
    off, JAX types the results of operations, cotangents among them, as varying over none).
    Differentiating the backward (a second derivative) raises a clear error instead of splash's bare
    ``NotImplementedError``.
    """

    def run(q, k, v, segments, sinks):
        with x64(False), vma_checks_off():
            q, k, v, sinks = _invariant(axes, q, k, v, sinks)
            out = fn(q, k, v, segments, sinks)
        return mark_varying(out, axes)

    @jax.custom_vjp
    def call(q, k, v, segments, sinks):
        return run(q, k, v, segments, sinks)

    def call_fwd(q, k, v, segments, sinks):
        with x64(False), vma_checks_off():
            q, k, v, sinks = _invariant(axes, q, k, v, sinks)
            out, vjp = _first_order_vjp(fn, q, k, v, segments, sinks)
        return mark_varying(out, axes), vjp

    def call_bwd(vjp, d_out):
        with x64(False), vma_checks_off():
            dq, dk, dv, d_sinks = _first_order(vjp, *_invariant(axes, d_out))
        # d_sinks: this device's share, typed like the sinks (varying like q, k, v: see splash_attention).
        d_sinks = d_sinks.astype(jnp.float32)  # the kernel's is in q's dtype (splash_attention)
        return (*(mark_varying(g, axes) for g in (dq, dk, dv)), None, mark_varying(d_sinks, axes))

    call.defvjp(call_fwd, call_bwd)
    return call


def _invariant(axes, *arrays):
    """Inside :func:`vma_checks_off`, an operation types its result as varying over no mesh axis:
    the types splash's kernel (traced with the checks off) expects for its inputs and cotangents."""
    return tuple(x + jnp.zeros((), x.dtype) for x in arrays) if axes else arrays


def _unchecked(fn):
    """``fn`` run with 64-bit types and shard_map's checks off, set again inside: an eager ``shard_map``
    (no jit) runs the body of a custom JVP or VJP (:func:`first_order_only`'s, splash's own) with
    its checks on again, where splash's ``pallas_call`` raised "`manual_axis_type` on
    `jax.ShapeDtypeStruct` must not be None" (JAX 0.7: "`vma` ...")."""

    def unchecked(*args):
        with x64(False), vma_checks_off():
            return fn(*args)

    return unchecked


def _first_order_vjp(fn, q, k, v, segments, sinks):
    def vjp(q, k, v, segments, sinks):
        return jax.vjp(_unchecked(lambda q, k, v, sinks: fn(q, k, v, segments, sinks)), q, k, v, sinks)

    return first_order_only(_unchecked(vjp), SECOND_DERIVATIVE)(q, k, v, segments, sinks)


def _first_order(vjp, d_out):
    return first_order_only(_unchecked(lambda vjp, d_out: vjp(d_out)), SECOND_DERIVATIVE)(vjp, d_out)


def splash_supports(spec, backend: str | None = None) -> str | None:
    if jnp.dtype(spec.dtype) == jnp.float16:
        return ("float16: splash is a TPU kernel and TPUs compute in bfloat16/float32; "
                "cast to bfloat16 (or use impl='xla')")
    return low_precision_matmul_refused(spec, backend, "splash")


def _splash_available() -> bool:
    try:
        _splash_module()
    except ImportError:
        return False
    return True


def _blocks(blocks, q_len: int, kv_len: int) -> tuple[int, int, int, int]:
    """The forward's and the backward's ``(block_q, block_kv)`` a call runs: the given
    :class:`~tpuattn.options.Blocks` (the backward's default: the forward's), else 512, each capped at
    its 128-rounded length."""
    given = {} if blocks is None else blocks.set()
    block_q = min(given.get("block_q", DEFAULT_SPLASH_BLOCK), round_up(q_len, SPLASH_LANES))
    block_kv = min(given.get("block_kv", DEFAULT_SPLASH_BLOCK), round_up(kv_len, SPLASH_LANES))
    backward_q = min(given.get("backward_block_q", block_q), round_up(q_len, SPLASH_LANES))
    backward_kv = min(given.get("backward_block_kv", block_kv), round_up(kv_len, SPLASH_LANES))
    return block_q, block_kv, backward_q, backward_kv


def default_blocks(spec, chip=None) -> tuple[int, int]:
    """The tiles ``impl="splash"`` runs by default: 512, capped at the 128-rounded lengths."""
    return (min(DEFAULT_SPLASH_BLOCK, round_up(spec.q_len, SPLASH_LANES)),
            min(DEFAULT_SPLASH_BLOCK, round_up(spec.kv_len, SPLASH_LANES)))


def scale_rounds_logits(spec) -> bool:
    """True when folding ``scale`` into bf16/f16 ``q`` loses accuracy that matters.

    Splash takes no scale, so the adapter multiplies ``q`` by it in float32 and rounds back to the
    input dtype: exact for a power of two, otherwise a relative error of 2**-9 (bf16) on every logit.
    Measured here (CPU, interpret mode, causal, 256 tokens, bf16, max error against the float64
    oracle): with the default ``1/sqrt(head_dim)`` (head_dim 64, 80, 96, 128: logits of order 1) splash
    is as accurate as ``xla`` (0.6-0.9x its error); with ``scale=2.5`` (logits of order 20) it is 8.4x
    less accurate. Running splash on float32 inputs removes the loss (1.3e-5) at float32 MXU speed.
    The ``auto`` rule therefore passes over splash for low-precision inputs with a scale above 1 that
    is not a power of two (an explicit, unusual scale), and keeps it for the default.
    """
    if jnp.dtype(spec.dtype) == jnp.float32:
        return False
    mantissa, _ = math.frexp(spec.scale)
    return mantissa != 0.5 and spec.scale > 1.0


def splash_auto_rank(spec, backend: str) -> float | None:
    """A TPU kernel: the automatic choice on TPU for sequences that fill its tiles, never elsewhere
    (and, for an explicit large scale in bf16, behind ``xla``: see :func:`scale_rounds_logits`).

    Evidence, compiled (``tpuattn.measure.aot.committed_report()``, bf16, causal, 8 heads x 128,
    forward + backward, one device): splash compiles on every chip from v4 to tpu7x and needs a
    fraction of ``xla``'s HBM (v5e at 8192 tokens: 97 MiB against 4256 MiB), and at 32768 tokens
    ``xla`` runs out of HBM on v4, v5e and v6e while splash needs under 1 GiB. On v2/v3 it refuses
    bf16 (``supports``), so ``auto`` falls back to ``xla`` there. Modelled (notebook 05; bf16, causal,
    8 heads x 128, forward): the flash schedule at its 512 x 512 tiles is memory bound up to 2048
    tokens on v4 and v5e and compute bound from 4096 (v5p, at its 2765 GB/s, from 2048); on v6e,
    whose ridge point is above 512 FLOP/byte, it stays memory bound at 512 x 512. The choice rests
    on memory (above), not speed.

    Accuracy the rank cannot see: on one-hot rows at huge logits (near 1e4 in float32, where a logit's
    ulp is ~1e-3) splash's backward takes delta = rowsum(dO * O) from its rounded output, so dS is ~1e-3
    where the truth is 0 and dK multiplies it by the large q: measured (CPU, 128 tokens, error over
    max|dV|, ``tests/test_splash_one_hot.py``) 7.1e-4 in dK on JAX 0.10.2, 1.9e-3 in dV on 0.7.2,
    against 1e-4 for the materialised reference and under 1e-5 for every implementation at logits near
    20. ``auto`` sees shapes, not values, and the package's own flash kernel recomputes the logits in
    its backward and is less exact at such logits (dK 0.69 of max|dV|, interpret mode, JAX 0.10.2),
    so the rank stays; exact gradients there need
    ``impl="reference"`` or a ``softcap`` that bounds the logits.
    """
    if backend != "tpu":
        return None
    if scale_rounds_logits(spec):
        return 1.5
    return 0.0 if long_enough_for_flash(spec) else 1.0


register("splash", splash_attention, supports=splash_supports, available=_splash_available, takes_sinks=True,
         auto_rank=splash_auto_rank, interpreted_off_tpu=True, schedule="flash",
         default_blocks=default_blocks, options=SPLASH_OPTIONS,
         # The adapter transposes Q, K, V to [batch, heads, seq, head_dim] (and O back); for the
         # backward the forward kernel writes its float32 logsumexp 128 lanes wide ([heads, q_len,
         # NUM_LANES], splash_attention_kernel.py; the residual is lane 0 of it, one float32 a row,
         # what the backward reads), and without residuals none; delta is one float32 per row.
         model=ScheduleModel(lse_row_bytes=4, lse_written_row_bytes=512, delta_row_bytes=4,
                             kernel_layout_copies=True, forward_saves_lse=False),
         description="JAX's splash-attention Pallas kernel (TPU; interpret mode elsewhere)")
