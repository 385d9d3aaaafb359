"""Numerics shared by the implementations: the one matmul, the logit soft-cap, padding."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpuattn import chips


def matmul_precision(dtype):
    """Full float32 matmuls for float32 inputs (TPUs default to bf16 passes); native otherwise."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def matmul(subscripts: str, a, b):
    """``einsum(subscripts, a, b)`` accumulated in float32: the one matmul the implementations use.

    float32 operands run at full precision (TPUs default to bf16 passes). bf16/f16 operands are
    multiplied as they are on a TPU's MXU (exact products, float32 sums); on a CPU they are
    widened to float32 first, which computes the same thing, because XLA:CPU in JAX 0.7.2 has no
    kernel for some batched bf16 x bf16 -> f32 dots ("Unsupported element type for DotThunk").
    """
    a, b = jnp.asarray(a), jnp.asarray(b)
    if chips.target_backend() == "cpu" and (a.dtype != jnp.float32 or b.dtype != jnp.float32):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.einsum(subscripts, a, b, precision=matmul_precision(jnp.promote_types(a.dtype, b.dtype)),
                      preferred_element_type=jnp.float32)


def apply_softcap(s, softcap):
    """``softcap * tanh(s / softcap)``, or ``s`` unchanged when softcap is None."""
    return s if softcap is None else softcap * jnp.tanh(s / softcap)


def long_enough_for_flash(spec) -> bool:
    """At least one 128-row query tile and 512 keys: below that a flash kernel pads most of its tile."""
    return spec.q_len >= 128 and spec.kv_len >= 512


def pad_to_multiple(x, axis: int, multiple: int, value=0):
    """Pad ``x`` along ``axis`` at the end, with ``value``, to a multiple of ``multiple``."""
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


# ---------------------------------------------------------------------------- inside shard_map
def varying_axes(*arrays) -> tuple[str, ...]:
    """The mesh axes any of ``arrays`` varies over inside a ``shard_map`` (empty outside one).

    JAX 0.10 reads them from ``typeof(x).manual_axis_type.varying``, JAX 0.7 from ``typeof(x).vma``.
    """
    axes = set()
    for x in arrays:
        aval = jax.typeof(x)
        manual = getattr(aval, "manual_axis_type", None)
        axes |= set(manual.varying if manual is not None else getattr(aval, "vma", ()) or ())
    return tuple(sorted(axes))


def mark_varying(x, axes: tuple[str, ...]):
    """``x`` typed as varying over ``axes`` (``lax.pcast(..., to="varying")`` or 0.7's ``lax.pvary``)."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)


def vma_checks_off():
    """A context in which shard_map's varying-axes checks are off (for kernels we do not own whose
    ``pallas_call`` gives no varying axes for its outputs; :func:`mark_varying` restores them)."""
    from jax._src import config

    return config._check_vma(False)


# ---------------------------------------------------------------------------- first order only
def first_order_only(fn, message: str):
    """``fn`` unchanged, except that differentiating it raises ``NotImplementedError(message)``.

    For the forward and backward of a kernel that defines only a first-order VJP: a second
    derivative differentiates both (the forward that saved the residuals and the backward), and
    without this JAX raises a bare ``NotImplementedError`` from deep inside ``pallas_call``.
    """
    guarded = jax.custom_jvp(fn)

    def refuse(primals, tangents):
        raise NotImplementedError(message)

    guarded.defjvp(refuse)
    return guarded


def low_precision_matmul_refused(spec, backend: str | None, impl: str) -> str | None:
    """Why a Pallas TPU kernel cannot take ``spec`` on the target chip, or None.

    Mosaic on TPU v2 and v3 (Colab's legacy "TPU v2-8") has no bf16/f16 matmul operands
    ("E2001: CompileTimeMosaicUnsupportedRhsType ... vector<128x128xbf16>"); float32 inputs compile.
    """
    chip = chips.target_chip()
    if (backend or chips.target_backend()) != "tpu" or chip is None or chip.bf16_matmul:
        return None
    if jnp.dtype(spec.dtype) == jnp.float32:
        return None
    return (f"{spec.dtype} on TPU {chip.name}: Mosaic there has no {spec.dtype} matmul operands (the kernel "
            f"would not compile); cast q, k, v to float32 for impl='{impl}', or use impl='xla'")
