"""A small decoder-only transformer in Flax NNX whose attention is :func:`tpuattn.attention`.

Byte-level tokens (a vocabulary of 256), pre-norm blocks (RMSNorm, attention, RMSNorm, a SwiGLU MLP),
rotary position embeddings (RoPE) and grouped-query attention (``heads`` query heads sharing
``kv_heads`` key/value heads). The implementation of attention is one argument, ``impl``: the same
weights give the same logits whichever implementation computes them (within float32 rounding).

Three ways through the same weights:

* ``model(tokens)``: logits for every position (training, and recomputing a sequence from scratch);
* ``model.prefill(tokens)``: the same, plus each layer's keys and values (after RoPE), which a server
  writes into its KV cache;
* ``model.decode_step(tokens, positions, cache, page_table)``: one new token per sequence against a
  paged KV cache through :func:`tpuattn.decode.attention` (see :mod:`tpuattn.lm.serve`).

Shapes are written ``[batch, seq, heads, head_dim]``, the contract's order.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from tpuattn._checks import positive_int
from tpuattn.api import attention
from tpuattn.decode import attention as decode_attention

__all__ = ["VOCAB", "Config", "PagedCache", "Transformer", "rope"]

VOCAB = 256  # bytes
# Flax 0.12 wants a list of submodules wrapped (nnx.List); 0.11 (Colab's) takes a plain list.
_Modules = getattr(nnx, "List", list)


@dataclasses.dataclass(frozen=True)
class Config:
    """The model's sizes. ``head_dim = d_model // heads``; it must be even (RoPE rotates pairs)."""

    d_model: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    mlp_dim: int = 128
    rope_base: float = 10_000.0
    dtype: str = "float32"  # computation (activations, attention, KV cache); parameters stay float32

    def __post_init__(self):
        for name in ("d_model", "layers", "heads", "kv_heads", "mlp_dim"):
            positive_int(f"Config.{name}", getattr(self, name))
        if self.d_model % self.heads:
            raise ValueError(f"Config.heads: expected a divisor of d_model={self.d_model}, got {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"Config.kv_heads: expected a divisor of heads={self.heads} (grouped-query "
                             f"attention), got {self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"Config.heads: head_dim = d_model // heads must be even for RoPE, got "
                             f"{self.d_model} // {self.heads} = {self.head_dim}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"Config.dtype: expected 'float32' or 'bfloat16', got {self.dtype!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


def rope(x, positions, base: float):
    """Rotary position embedding: rotate pairs ``(x[i], x[i + D/2])`` of ``x [batch, seq, heads, D]`` by
    the angle ``position * base ** (-i / (D/2))`` (``positions``: int ``[batch, seq]``). The dot product
    of a rotated query and a rotated key then depends only on the distance between their positions."""
    half = x.shape[-1] // 2
    frequencies = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[..., None].astype(jnp.float32) * frequencies  # [batch, seq, D/2]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedCache:
    """Every layer's keys and values in pages: ``k``, ``v`` ``[layers, num_pages, page_size, kv_heads,
    head_dim]``. Which pages hold which sequence is the server's page table, not the cache's."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def empty(cls, config: Config, num_pages: int, page_size: int) -> PagedCache:
        shape = (config.layers, num_pages, page_size, config.kv_heads, config.head_dim)
        return cls(jnp.zeros(shape, config.dtype), jnp.zeros(shape, config.dtype))

    @property
    def page_size(self) -> int:
        return self.k.shape[2]


class Attention(nnx.Module):
    """Grouped-query self-attention: ``heads`` query heads, ``kv_heads`` key/value heads, RoPE."""

    def __init__(self, config: Config, *, rngs: nnx.Rngs):
        c = config
        linear = lambda n_in, n_out: nnx.Linear(n_in, n_out, use_bias=False, dtype=c.dtype, rngs=rngs)
        self.config = c
        self.query = linear(c.d_model, c.heads * c.head_dim)
        self.key = linear(c.d_model, c.kv_heads * c.head_dim)
        self.value = linear(c.d_model, c.kv_heads * c.head_dim)
        self.out = linear(c.heads * c.head_dim, c.d_model)

    def project(self, x, positions):
        """``x [batch, seq, d_model]`` -> q ``[batch, seq, heads, D]``, k and v ``[batch, seq, kv_heads,
        D]``, q and k rotated to their positions."""
        c, (batch, seq, _) = self.config, x.shape
        q = self.query(x).reshape(batch, seq, c.heads, c.head_dim)
        k = self.key(x).reshape(batch, seq, c.kv_heads, c.head_dim)
        v = self.value(x).reshape(batch, seq, c.kv_heads, c.head_dim)
        return rope(q, positions, c.rope_base), rope(k, positions, c.rope_base), v

    def __call__(self, x, positions, impl: str):
        """Causal self-attention over the whole sequence; also returns ``(k, v)`` for a KV cache."""
        q, k, v = self.project(x, positions)
        o = attention(q, k, v, causal=True, impl=impl)  # the one argument that picks the implementation
        return self.out(o.reshape(*x.shape[:2], -1)), (k, v)

    def decode(self, x, positions, k_pages, v_pages, page_table, impl: str):
        """One new token per sequence: ``x [batch, d_model]`` at ``positions [batch]``. Its key and value
        are written into the pages (row ``position % page_size`` of page ``page_table[b, position //
        page_size]``), then its query attends to the ``position + 1`` keys of its sequence."""
        q, k, v = self.project(x[:, None], positions[:, None])
        page_size, rows = k_pages.shape[1], jnp.arange(x.shape[0])
        page, row = page_table[rows, positions // page_size], positions % page_size
        k_pages = k_pages.at[page, row].set(k[:, 0])
        v_pages = v_pages.at[page, row].set(v[:, 0])
        o = decode_attention(q, k_pages, v_pages, positions + 1, page_table=page_table, impl=impl)
        return self.out(o.reshape(x.shape[0], -1)), k_pages, v_pages


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: Config, *, rngs: nnx.Rngs):
        linear = lambda n_in, n_out: nnx.Linear(n_in, n_out, use_bias=False, dtype=config.dtype, rngs=rngs)
        self.gate = linear(config.d_model, config.mlp_dim)
        self.up = linear(config.d_model, config.mlp_dim)
        self.down = linear(config.mlp_dim, config.d_model)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    """Pre-norm residual block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: Config, *, rngs: nnx.Rngs):
        self.attention_norm = nnx.RMSNorm(config.d_model, dtype=config.dtype, rngs=rngs)
        self.attention = Attention(config, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(config.d_model, dtype=config.dtype, rngs=rngs)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x, positions, impl):
        a, kv = self.attention(self.attention_norm(x), positions, impl)
        x = x + a
        return x + self.mlp(self.mlp_norm(x)), kv

    def decode(self, x, positions, k_pages, v_pages, page_table, impl):
        a, k_pages, v_pages = self.attention.decode(self.attention_norm(x), positions, k_pages, v_pages,
                                                    page_table, impl)
        x = x + a
        return x + self.mlp(self.mlp_norm(x)), k_pages, v_pages


class Transformer(nnx.Module):
    """Byte-level decoder-only transformer; the output projection is the embedding's transpose (tied).

    Args:
      config: the sizes (:class:`Config`).
      rngs: ``nnx.Rngs`` for the initial weights (the same seed gives the same weights).
      impl: the :func:`tpuattn.attention` implementation for whole sequences (``"auto"``, ``"reference"``,
        ``"xla"``, ``"blockwise"``, ``"pallas"``, ...); each call may override it.
      decode_impl: the :func:`tpuattn.decode.attention` implementation for :meth:`decode_step`.
    """

    def __init__(self, config: Config, *, rngs: nnx.Rngs, impl: str = "auto", decode_impl: str = "auto"):
        if not isinstance(config, Config):
            raise TypeError(f"config: expected a tpuattn.lm.Config, got {type(config).__name__}")
        for name, value in (("impl", impl), ("decode_impl", decode_impl)):
            if not isinstance(value, str):
                raise TypeError(f"{name}: expected an implementation name or 'auto', got {value!r}")
        self.config, self.impl, self.decode_impl = config, impl, decode_impl
        self.embed = nnx.Embed(VOCAB, config.d_model, dtype=config.dtype, rngs=rngs)
        self.blocks = _Modules([Block(config, rngs=rngs) for _ in range(config.layers)])
        self.final_norm = nnx.RMSNorm(config.d_model, dtype=config.dtype, rngs=rngs)

    def _tokens(self, tokens, ndim: int, name: str = "tokens"):
        tokens = jnp.asarray(tokens)
        if tokens.ndim != ndim or not jnp.issubdtype(tokens.dtype, jnp.integer):
            expected = "[batch, seq]" if ndim == 2 else "[batch]"
            raise ValueError(f"{name}: expected integer byte ids {expected}, got {tokens.dtype} "
                             f"{tokens.shape}")
        return tokens

    def _logits(self, x):
        return self.embed.attend(self.final_norm(x)).astype(jnp.float32)

    def prefill(self, tokens, *, impl: str | None = None):
        """``tokens [batch, seq]`` -> (logits ``[batch, seq, 256]`` float32, ``[(k, v)]`` per layer, each
        ``[batch, seq, kv_heads, head_dim]``: what a KV cache holds for these positions)."""
        tokens = self._tokens(tokens, 2)
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = self.embed(tokens).astype(self.config.dtype)
        kvs = []
        for block in self.blocks:
            x, kv = block(x, positions, impl or self.impl)
            kvs.append(kv)
        return self._logits(x), kvs

    def __call__(self, tokens, *, impl: str | None = None):
        """``tokens [batch, seq]`` -> logits ``[batch, seq, 256]`` (float32): position ``t`` predicts
        token ``t + 1``."""
        return self.prefill(tokens, impl=impl)[0]

    def decode_step(self, tokens, positions, cache: PagedCache, page_table, *, impl: str | None = None):
        """One decode step for a batch of sequences.

        Args:
          tokens: int ``[batch]``: each sequence's newest token, not yet in the cache.
          positions: int ``[batch]``: its position (the sequence's length before this step).
          cache: the :class:`PagedCache`; this token's key and value are written into it.
          page_table: int32 ``[batch, pages_per_sequence]``: the pages of each sequence, in order.

        Returns:
          (logits ``[batch, 256]`` for the next token, the updated cache).
        """
        tokens = self._tokens(tokens, 1)
        positions = self._tokens(positions, 1, "positions")
        x = self.embed(tokens).astype(self.config.dtype)
        ks, vs = [], []
        for layer, block in enumerate(self.blocks):
            x, k_pages, v_pages = block.decode(x, positions, cache.k[layer], cache.v[layer], page_table,
                                               impl or self.decode_impl)
            ks.append(k_pages)
            vs.append(v_pages)
        return self._logits(x), PagedCache(jnp.stack(ks), jnp.stack(vs))
