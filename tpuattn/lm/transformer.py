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
  paged KV cache through :func:`tpuattn.decode.attention` (see :mod:`tpuattn.lm.serve`);
* ``model.mixed_step(tokens, positions, seq, cu_q_lens, lengths, cache, page_table)``: a ragged batch,
  chunks of prompts beside single decoded tokens, in one call: every token's key and value written into
  the pages (quantized for an int8 or float8 cache), then every token's query against its sequence's
  keys through :func:`tpuattn.decode.attention` with ``cu_q_lens`` (continuous batching with chunked
  prefill, as TPU inference engines step).

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
from tpuattn.decode import write as write_pages

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
    k_scale: jax.Array | None = None  # a quantized cache's float32 scales, [layers, kv_heads]
    v_scale: jax.Array | None = None

    @classmethod
    def empty(cls, config: Config, num_pages: int, page_size: int, *, dtype=None, k_scale=None,
              v_scale=None) -> PagedCache:
        """Zeros of the model's dtype, or of a quantized ``dtype`` (``"int8"``, ``"float8_e4m3fn"``) with
        its fixed scales ``k_scale``, ``v_scale`` (float32 ``[layers, kv_heads]``, e.g. from
        :func:`tpuattn.lm.serve.calibrate`): entry ``e`` of layer ``l``, kv head ``h`` holds ``e *
        k_scale[l, h]``."""
        shape = (config.layers, num_pages, page_size, config.kv_heads, config.head_dim)
        dtype = config.dtype if dtype is None else jnp.dtype(dtype).name
        quantized = dtype in ("int8", "float8_e4m3fn")
        if quantized != (k_scale is not None and v_scale is not None):
            raise ValueError(f"k_scale, v_scale: expected both for an int8 or float8_e4m3fn cache and "
                             f"neither for {config.dtype}, got a {dtype} cache with k_scale "
                             f"{'set' if k_scale is not None else 'None'}, v_scale "
                             f"{'set' if v_scale is not None else 'None'}")
        scales = {}
        if quantized:
            for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
                x = jnp.asarray(x, jnp.float32)
                if x.shape != (config.layers, config.kv_heads):
                    raise ValueError(f"{name}: expected float32 [layers, kv_heads] = "
                                     f"[{config.layers}, {config.kv_heads}], got shape {x.shape}")
                scales[name] = x
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), **scales)

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    def scales(self, layer: int) -> dict:
        """The keyword arguments of :func:`tpuattn.decode.attention` for ``layer``'s pages."""
        if self.k_scale is None:
            return {}
        return dict(k_scale=self.k_scale[layer], v_scale=self.v_scale[layer])


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

    def mixed(self, x, positions, seq, cu_q_lens, lengths, k_pages, v_pages, page_table, impl: str,
              scales: dict):
        """A ragged batch of new tokens, ``x [tokens, d_model]``: token ``t`` of sequence ``seq[t]`` at
        ``positions[t]`` (``-1``: padding, never written). Every key and value is written into the pages
        first (quantized with the cache's scales), then each query attends to its sequence's keys up to
        its own position (``cu_q_lens``, ``lengths``: the decode contract's ragged form)."""
        q, k, v = self.project(x[None], jnp.maximum(positions, 0)[None])
        scale_of = lambda name: None if not scales else scales[name]
        k_pages = write_pages(k_pages, k[0], page_table, positions, seq=seq, scale=scale_of("k_scale"))
        v_pages = write_pages(v_pages, v[0], page_table, positions, seq=seq, scale=scale_of("v_scale"))
        o = decode_attention(q[0], k_pages, v_pages, lengths, page_table=page_table, cu_q_lens=cu_q_lens,
                             impl=impl, **scales)
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

    def mixed(self, x, *args):
        a, k_pages, v_pages = self.attention.mixed(self.attention_norm(x), *args)
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

    def mixed_step(self, tokens, positions, seq, cu_q_lens, lengths, cache: PagedCache, page_table, *,
                   impl: str | None = None):
        """One step of a ragged batch: chunks of prompts (chunked prefill) beside single new tokens.

        Args:
          tokens: int ``[total]``: the new tokens, each sequence's one after the other, then padding.
          positions: int ``[total]``: each token's position in its sequence; ``-1`` for padding.
          seq: int ``[total]``: each token's sequence (its row of ``page_table``).
          cu_q_lens: int32 ``[batch + 1]``: sequence ``i``'s tokens are ``cu_q_lens[i] ..
            cu_q_lens[i + 1] - 1`` (0 of them for an idle slot).
          lengths: int ``[batch]``: each sequence's length after this step.
          cache: the :class:`PagedCache` (full width or quantized); the tokens' keys and values are
            written into it.
          page_table: int32 ``[batch, pages_per_sequence]``.

        Returns:
          (logits ``[total, 256]``: token ``t``'s predict the token after it, the updated cache).
        """
        tokens = self._tokens(tokens, 1)
        positions = self._tokens(positions, 1, "positions")
        x = self.embed(tokens).astype(self.config.dtype)
        ks, vs = [], []
        for layer, block in enumerate(self.blocks):
            x, k_pages, v_pages = block.mixed(x, positions, seq, cu_q_lens, lengths, cache.k[layer],
                                              cache.v[layer], page_table, impl or self.decode_impl,
                                              cache.scales(layer))
            ks.append(k_pages)
            vs.append(v_pages)
        return self._logits(x), PagedCache(jnp.stack(ks), jnp.stack(vs), cache.k_scale, cache.v_scale)
