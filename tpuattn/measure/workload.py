"""What a measurement runs: one problem shape, its inputs, and the call timed in each mode.

The bench (:mod:`tpuattn.measure.bench`) and the peak-memory child process
(:mod:`tpuattn.measure.memory`) both measure exactly this, so a time and a memory figure in the
same row describe the same call.
"""

from __future__ import annotations

import dataclasses

from tpuattn._checks import one_of, positive_int
from tpuattn.measure.flops import attention_flops, check_mode
from tpuattn.spec import SUPPORTED_DTYPES, AttentionSpec, spec_from_shapes


@dataclasses.dataclass(frozen=True)
class Shape:
    """One problem: q ``[batch, seq_len, heads, head_dim]``, k/v ``[batch, kv_len, kv_heads, head_dim]``."""

    seq_len: int
    batch: int = 1
    heads: int = 4
    kv_heads: int | None = None  # None: = heads
    head_dim: int = 64
    dtype: str = "float32"
    causal: bool = False
    kv_len: int | None = None  # None: = seq_len

    def __post_init__(self):
        for name in ("seq_len", "batch", "heads", "head_dim"):
            positive_int(name, getattr(self, name))
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.kv_len is None:
            object.__setattr__(self, "kv_len", self.seq_len)
        positive_int("kv_heads", self.kv_heads)
        positive_int("kv_len", self.kv_len)
        if self.heads % self.kv_heads:
            raise ValueError(f"heads: expected a multiple of kv_heads={self.kv_heads}, got {self.heads}")
        one_of("dtype", self.dtype, SUPPORTED_DTYPES)
        if not isinstance(self.causal, bool):
            raise ValueError(f"causal: expected a bool, got {self.causal!r}")

    def flops(self, mode: str) -> float:
        """The standard count (:func:`tpuattn.measure.flops.attention_flops`) for ``mode``."""
        return attention_flops(batch=self.batch, heads=self.heads, q_len=self.seq_len, kv_len=self.kv_len,
                               head_dim=self.head_dim, causal=self.causal, mode=mode)

    def spec(self) -> AttentionSpec:
        """The :class:`~tpuattn.spec.AttentionSpec` an implementation receives for this shape."""
        return spec_from_shapes(self.seq_len, self.kv_len, batch=self.batch, num_q_heads=self.heads,
                                num_kv_heads=self.kv_heads, head_dim=self.head_dim, dtype=self.dtype,
                                causal=self.causal)


def inputs(shape: Shape, seed: int = 0):
    """Normal q, k, v of ``shape`` (drawn in float32, then cast: the same values in every dtype)."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(keys[0], (shape.batch, shape.seq_len, shape.heads, shape.head_dim), jnp.float32)
    kv_shape = (shape.batch, shape.kv_len, shape.kv_heads, shape.head_dim)
    k = jax.random.normal(keys[1], kv_shape, jnp.float32)
    v = jax.random.normal(keys[2], kv_shape, jnp.float32)
    return jax.block_until_ready(tuple(x.astype(shape.dtype) for x in (q, k, v)))


def function(impl: str, shape: Shape, mode: str, options: dict | None = None):
    """``f(q, k, v)`` to time: the forward, or for ``"fwd+bwd"`` the gradient of ``sum(attention)``
    with respect to q, k and v (which runs the forward too)."""
    import jax
    import jax.numpy as jnp

    import tpuattn

    check_mode(mode)
    options = dict(options or {})

    def forward(q, k, v):
        return tpuattn.attention(q, k, v, causal=shape.causal, impl=impl, **options)

    if mode == "fwd":
        return forward
    return jax.grad(lambda q, k, v: jnp.sum(forward(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))
