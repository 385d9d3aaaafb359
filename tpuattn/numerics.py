"""The arithmetic every implementation shares: the one matmul and its precision, the logit soft-cap,
padding to a tile multiple, the guard for kernels that differentiate only once, and the boolean mask
(with zeros for rows that see no key) of the adapters to ``jax.nn``-style APIs."""

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


LOG2_E = 1.4426950408889634  # log2(e): exp(x) = 2 ** (x * LOG2_E)


def logits(s, scale: float, softcap: float | None):
    """The Pallas kernels' logits from the raw products ``s = q.k``: ``s`` itself without a softcap
    (the kernels fold ``scale`` into their exp2), else the capped ``softcap * tanh(s * (scale / softcap))``,
    one multiply where ``apply_softcap(s * scale)`` makes two (and a divide). The backward kernels'
    ``_softcap_grad`` evaluates the same expression, so forward and backward compute the same floats."""
    return s if softcap is None else softcap * jnp.tanh(s * (scale / softcap))


def apply_softcap(s, softcap):
    """``softcap * tanh(s / softcap)``, or ``s`` unchanged when softcap is None."""
    return s if softcap is None else softcap * jnp.tanh(s / softcap)


def pad_to_multiple(x, axis: int, multiple: int, value=0):
    """Pad ``x`` along ``axis`` at the end, with ``value``, to a multiple of ``multiple``."""
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


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


def x64(enabled: bool):
    """A context with 64-bit mode on or off: ``jax.enable_x64`` (JAX 0.8+) or 0.7's
    ``jax.experimental.enable_x64`` / ``disable_x64``. JAX's own kernels that fail to trace under
    x64 (splash; ``paged_attention``, which divides an int32 length by an int64) run with it off:
    the adapters hand them int32 ids and float arrays, which 64-bit mode does not change."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(enabled)
    from jax.experimental import disable_x64, enable_x64

    return enable_x64() if enabled else disable_x64()


def boolean_mask(segment_ids, spec):
    """The contract's mask (bottom-right, with segment ids) as one boolean ``[batch or 1, 1, q_len,
    kv_len]`` array: what ``jax.nn.dot_product_attention``-style APIs take as ``mask=`` (``xla``,
    ``tokamax``), whose own causal and window flags align top-left."""
    keep = spec.mask.dense(*(segment_ids or (None, None)), xp=jnp)  # [q, kv] or [batch, q, kv]
    return keep[None, None] if segment_ids is None else keep[:, None]


def zero_rows_without_keys(out, keep):
    """``out [batch, q_len, heads, d]`` with zeros in the rows :func:`boolean_mask` ``keep`` gives no
    key: such APIs fill masked logits with a large *finite* number, so a row that sees nothing gets
    the mean of ``v``, and the contract says zeros. Selecting zeros also zeroes the cotangent flowing
    into that row, so its gradients are exactly zero."""
    any_key = jnp.moveaxis(jnp.any(keep, axis=-1), 1, 2)[..., None]  # [batch or 1, q_len, 1, 1]
    return jnp.where(any_key, out, jnp.zeros((), out.dtype))
