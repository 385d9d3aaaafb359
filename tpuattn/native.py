"""The attention the platform maintains, behind the same contract.

Two implementations:

* ``xla``: :func:`jax.nn.dot_product_attention`. It materialises the scores
  like ``reference`` but is maintained by JAX; on a GPU it can dispatch to
  cuDNN's fused kernel (``implementation="cudnn"``).
* ``splash``: JAX's splash-attention Pallas kernel for TPUs
  (``jax.experimental.pallas.ops.tpu.splash_attention``), forward and
  backward, run in interpret mode off-TPU.

Neither speaks the contract natively; this module translates:

==================  ==========================================  ===========================================
contract            ``xla`` (jax.nn.dot_product_attention)       ``splash``
==================  ==========================================  ===========================================
layout              ``[batch, seq, heads, head_dim]`` (same)     ``[heads, seq, head_dim]``, vmap over batch
scale               ``scale=``                                   none: ``q`` is multiplied by ``scale``
causal, window      ``is_causal`` aligns top-left, so any        ``CausalMask``/``LocalMask`` with
                    mask but square causal becomes a boolean     ``offset = kv_len - q_len`` (bottom-right)
                    ``mask`` built from :class:`MaskSpec`
segment ids         AND-ed into the boolean ``mask``             ``SegmentIds``
softcap             not supported: refused                       ``attn_logits_soft_cap``
GQA / MQA           native (grouped heads)                       MHA kernel with fewer kv heads / MQA kernel
lengths             any                                          padded to the block size; padded keys get a
                                                                 segment id no query has
rows seeing no key  jax.nn returns the mean of ``v`` (masked     a "sink" logit of -1e30 and value 0: rows
                    logits are finite); output zeroed here       with no key return 0, gradients stay finite
float32 matmuls     run under ``default_matmul_precision``       kernel's own precision (full on CPU)
                    ``"highest"`` (TPU defaults to bf16 passes)
==================  ==========================================  ===========================================
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tpuattn import api
from tpuattn._common import check_block, check_options

# ---------------------------------------------------------------------------- shared helpers


def _row_bounds(spec) -> tuple[np.ndarray, np.ndarray]:
    """Half-open visible key interval ``[lo, hi)`` of every query row (positions only)."""
    mask = spec.mask
    pos = np.arange(spec.q_len) + mask.offset
    lo = np.zeros(spec.q_len, np.int64)
    hi = np.full(spec.q_len, spec.kv_len, np.int64)
    if mask.left_reach is not None:
        lo = np.maximum(lo, pos - mask.left_reach)
    if mask.right_reach is not None:
        hi = np.minimum(hi, pos + mask.right_reach + 1)
    return lo, hi


def rows_can_be_empty(spec) -> bool:
    """True when some query may see no key (decided by positions, or possible with segments)."""
    lo, hi = _row_bounds(spec)
    return spec.has_segments or bool(np.any(lo >= hi))


# ---------------------------------------------------------------------------- impl="xla"
# Options: ``implementation`` is passed to jax.nn.dot_product_attention (None = cuDNN on a GPU
# when the case allows it, XLA otherwise).
XLA_OPTIONS = ("implementation",)


def _cudnn_compatible(spec) -> bool:
    """Cases cuDNN's fused kernel takes through jax.nn without an explicit mask."""
    if jnp.dtype(spec.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return False
    if spec.has_segments or spec.head_dim > 128 or spec.head_dim % 8:
        return False
    mask = spec.mask
    if mask.is_trivial:
        return True
    # cuDNN's causal mask is top-left, which equals bottom-right only when q_len == kv_len;
    # its sliding window is left-only and needs causal.
    if not mask.causal or mask.offset != 0:
        return False
    return mask.window is None or mask.right_reach == 0


def _xla_mask(segment_ids, spec):
    """Boolean ``[batch or 1, 1, q_len, kv_len]`` from the contract's mask (bottom-right)."""
    rows = jnp.arange(spec.q_len)[:, None]
    cols = jnp.arange(spec.kv_len)[None, :]
    if segment_ids is None:
        return spec.mask.visible(rows, cols, xp=jnp)[None, None]
    q_seg, kv_seg = segment_ids
    keep = spec.mask.visible(rows[None], cols[None], q_seg[:, :, None], kv_seg[:, None, :], xp=jnp)
    return keep[:, None]


def xla_attention(q, k, v, segment_ids, spec, **options):
    """``jax.nn.dot_product_attention`` with the contract's masks translated."""
    check_options("xla", options, XLA_OPTIONS)
    implementation = options.get("implementation")
    if implementation not in (None, "xla", "cudnn"):
        raise ValueError(f"implementation: expected None, 'xla' or 'cudnn', got {implementation!r}")
    if implementation == "cudnn" and not _cudnn_compatible(spec):
        raise ValueError("implementation: 'cudnn' needs bfloat16/float16, head_dim <= 128 (multiple of 8), "
                         "no segment ids and at most a square causal mask with a left window")
    if implementation is None:
        implementation = "cudnn" if jax.default_backend() == "gpu" and _cudnn_compatible(spec) else "xla"

    mask = spec.mask
    kwargs = {}
    if implementation == "cudnn" or (mask.causal and mask.offset == 0 and mask.window is None
                                     and not spec.has_segments):
        # Square causal (and, for cuDNN, a left window): jax.nn's own flags mean the same thing.
        kwargs["is_causal"] = mask.causal
        if mask.window is not None and mask.left_reach is not None:
            kwargs["local_window_size"] = (mask.left_reach, 0)
        keep = None
    elif not mask.is_trivial:
        # jax.nn aligns is_causal and local_window_size top-left; the contract aligns
        # bottom-right. An explicit boolean mask says exactly what we mean.
        keep = _xla_mask(segment_ids, spec)
        kwargs["mask"] = keep
    else:
        keep = None

    # float32 inputs: full-precision matmuls (TPUs default to bfloat16 passes, GPUs to TF32).
    # The context is read when the einsums are traced, so it also fixes the backward pass.
    precision = "highest" if jnp.dtype(spec.dtype) == jnp.float32 else None
    with jax.default_matmul_precision(precision):
        out = jax.nn.dot_product_attention(q, k, v, scale=spec.scale, implementation=implementation, **kwargs)

    if keep is not None and rows_can_be_empty(spec):
        # jax.nn fills masked logits with a large *finite* negative number, so a row that sees no
        # key gets a uniform softmax: the mean of v. The contract says zeros. Selecting zeros
        # also zeroes the cotangent flowing into that row, so its gradients are exactly zero.
        any_key = jnp.any(keep, axis=-1)  # [batch or 1, 1, q_len]
        any_key = jnp.moveaxis(any_key, 1, 2)[..., None]  # [batch or 1, q_len, 1, 1]
        out = jnp.where(any_key, out, jnp.zeros((), out.dtype))
    return out.astype(q.dtype)


def xla_supports(spec) -> str | None:
    if spec.softcap is not None:
        return ("softcap: jax.nn.dot_product_attention has no logit soft-capping (checked in JAX 0.7.2 "
                "and 0.10.2); use impl='splash' on TPU or 'reference'/'blockwise'")
    if jnp.dtype(spec.dtype) == jnp.float16 and jax.default_backend() == "cpu":
        return ("float16 on CPU: jax.nn.dot_product_attention does not compile under jit there (XLA: "
                "precision 'F16_F16_F32' is not supported by dot_general on CPU); use bfloat16 or float32")
    return None


api.register("xla", xla_attention, supports=xla_supports,
             description="jax.nn.dot_product_attention (XLA; cuDNN on a GPU when the case allows)")


# ---------------------------------------------------------------------------- impl="splash"
SPLASH_OPTIONS = ("block_q", "block_kv", "interpret")
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


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _splash_module():
    from jax.experimental.pallas.ops.tpu import splash_attention

    return splash_attention


@functools.lru_cache(maxsize=64)
def _splash_kernel(q_len_padded, kv_len_padded, num_q_heads, mqa, positional, block_q, block_kv, softcap,
                   interpret):
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
    blocks = sa.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv,
                           block_q_dkv=block_q, block_kv_dkv=block_kv, block_kv_dkv_compute=block_kv,
                           block_q_dq=block_q, block_kv_dq=block_kv)
    make = sa.make_splash_mqa if mqa else sa.make_splash_mha
    # The kernel holds the tile tables as arrays. Build them as constants even when called while
    # tracing (under jit), or the cached kernel would carry that trace's tracers into the next one.
    with jax.ensure_compile_time_eval():
        return make(sa.MultiHeadMask([head_mask] * num_q_heads), block_sizes=blocks, head_shards=1,
                    q_seq_shards=1, attn_logits_soft_cap=softcap, interpret=interpret)


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


def splash_attention(q, k, v, segment_ids, spec, **options):
    """JAX's splash-attention kernel (forward and its custom backward) behind the contract."""
    check_options("splash", options, SPLASH_OPTIONS)
    block_q = check_block("block_q", options.get("block_q", DEFAULT_SPLASH_BLOCK), multiple_of=SPLASH_LANES)
    block_kv = check_block("block_kv", options.get("block_kv", DEFAULT_SPLASH_BLOCK),
                           multiple_of=SPLASH_LANES)
    interpret = options.get("interpret", jax.default_backend() != "tpu")
    if not isinstance(interpret, bool):
        raise ValueError(f"interpret: expected a bool, got {interpret!r}")
    sa = _splash_module()

    b, q_len, kv_len = spec.batch, spec.q_len, spec.kv_len
    block_q = min(block_q, _round_up(q_len, SPLASH_LANES))
    block_kv = min(block_kv, _round_up(kv_len, SPLASH_LANES))
    q_pad, kv_pad = _round_up(q_len, block_q), _round_up(kv_len, block_kv)

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
                            spec.softcap, interpret)
    # Always pass the sink: besides the contract's empty rows, padded query rows may see nothing,
    # and without it their NaN output (0/0) would leak into dk and dv through the backward pass.
    sinks = jnp.full((spec.num_q_heads,), _EMPTY_ROW_SINK, jnp.float32)

    def one_batch(q, k, v, segments):
        return kernel(q, k, v, segment_ids=segments, sinks=sinks)

    out = jax.vmap(one_batch)(q, k, v, segments)  # [batch, heads, q_pad, dim]
    return jnp.swapaxes(out[:, :, :q_len], 1, 2).astype(spec.dtype)


def splash_supports(spec) -> str | None:
    if jnp.dtype(spec.dtype) == jnp.float16:
        return ("float16: splash is a TPU kernel and TPUs compute in bfloat16/float32; "
                "cast to bfloat16 (or use impl='xla')")
    return None


def _splash_available() -> bool:
    try:
        _splash_module()
    except ImportError:
        return False
    return True


api.register("splash", splash_attention, supports=splash_supports, available=_splash_available,
             description="JAX's splash-attention Pallas kernel (TPU; interpret mode elsewhere)")

