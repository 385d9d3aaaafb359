"""``impl="xla"``: :func:`jax.nn.dot_product_attention` behind the contract.

It materialises the scores like ``reference`` but is maintained by JAX; on a GPU it can dispatch
to cuDNN's fused kernel (``implementation="cudnn"``). What the adapter translates:

* scale: passed as ``scale=``;
* causal, window: ``is_causal`` and ``local_window_size`` align top-left, so any mask but square
  causal becomes a boolean ``mask`` built from the contract's :class:`~tpuattn.spec.MaskSpec`;
* segment ids: AND-ed into that boolean mask;
* softcap: not supported (refused: ``jax.nn`` has no soft-capping);
* rows that see no key: ``jax.nn`` fills masked logits with a large finite number and returns the
  mean of ``v``; the adapter zeroes them (the contract says zeros);
* float32: matmuls run under ``default_matmul_precision("highest")`` (TPUs default to bf16 passes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpuattn.numerics import boolean_mask, zero_rows_without_keys
from tpuattn.options import XlaOptions
from tpuattn.registry import ScheduleModel, register
from tpuattn.supports import long_enough_for_flash


# ---------------------------------------------------------------------------- impl="xla"
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


def xla_attention(q, k, v, segment_ids, spec, **options):
    """``jax.nn.dot_product_attention`` with the contract's masks translated."""
    implementation = XlaOptions.parse(options).implementation
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
        keep = boolean_mask(segment_ids, spec)
        kwargs["mask"] = keep
    else:
        keep = None

    # float32 inputs: full-precision matmuls (TPUs default to bfloat16 passes, GPUs to TF32).
    # The context is read when the einsums are traced, so it also fixes the backward pass.
    precision = "highest" if jnp.dtype(spec.dtype) == jnp.float32 else None
    with jax.default_matmul_precision(precision):
        out = jax.nn.dot_product_attention(q, k, v, scale=spec.scale, implementation=implementation, **kwargs)

    if keep is not None and spec.mask.rows_can_be_empty():
        out = zero_rows_without_keys(out, keep)  # jax.nn returns the mean of v there
    return out.astype(q.dtype)


def xla_supports(spec, backend: str | None = None) -> str | None:
    if spec.softcap is not None:
        return ("softcap: jax.nn.dot_product_attention has no logit soft-capping (checked in JAX 0.7.2 "
                "and 0.10.2); use impl='splash' on TPU or 'reference'/'blockwise'")
    if jnp.dtype(spec.dtype) == jnp.float16 and (backend or jax.default_backend()) == "cpu":
        return ("float16 on CPU: jax.nn.dot_product_attention does not compile under jit there (XLA: "
                "precision 'F16_F16_F32' is not supported by dot_general on CPU); use bfloat16 or float32")
    return None


def xla_auto_rank(spec, backend: str) -> float:
    """The platform's maintained attention is the default, except where memory or a kernel wins.

    On CPU it gives way to ``blockwise`` once its float32 score matrix passes 1 GiB (memory, not
    speed, decides there: ``benchmarks/`` and notebook 04 measure both); on TPU to ``splash`` for
    sequences long enough to fill its tiles (the roofline's flash bound is far below the
    materialised one there; notebook 05 measures it on a TPU runtime).
    """
    if backend == "cpu":
        return 0.0 if 4 * spec.batch * spec.num_q_heads * spec.q_len * spec.kv_len <= 1024**3 else 1.0
    if backend == "tpu":
        return 1.0 if long_enough_for_flash(spec) else 0.0
    return 0.0


# What XLA:TPU keeps live (its compiled memory analysis, v5e, JAX 0.10.2): with bf16 inputs two f32
# [B, H, T, T] buffers (the scores and their exponentials), with f32 one; the backward adds ~4 bytes.
# v4 and v5p keep the same; v6e does not, and not monotonically in the length, so there the model
# can be 2.2x low (the sweep: tests/test_aot_model_grid.py's known gaps, benchmarks/peak_hbm_grid.py).
LIVE_SCORES = {"fwd": lambda p: 8 if p < 4 else 4, "fwd+bwd": lambda p: 8}

register("xla", xla_attention, supports=xla_supports, auto_rank=xla_auto_rank, schedule="materialised",
         options=XlaOptions, model=ScheduleModel(live_scores=LIVE_SCORES),
         description="jax.nn.dot_product_attention (XLA; cuDNN on a GPU when the case allows)")
