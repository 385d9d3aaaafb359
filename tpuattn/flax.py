"""The contract as a Flax attention function: ``nnx.MultiHeadAttention(..., attention_fn=attention_fn())``.

:func:`attention_fn` returns a callable with ``flax.nnx.dot_product_attention``'s signature that calls
:func:`tpuattn.attention`. Flax's layout is the contract's (``[batch..., seq, heads, head_dim]``, GQA
query head ``h`` reading key/value head ``h // (heads // kv_heads)``) and its default scale is the
contract's ``1 / sqrt(head_dim)``, so nothing is transposed or rescaled. What the contract cannot
express is refused with :class:`~tpuattn.errors.UnsupportedInput` naming the argument: a mask array
that is not a key mask, ``bias``, dropout, ``precision``, sown attention weights (``module``).

Flax is an optional dependency (``pip install tpuattn[flax]``): importing :mod:`tpuattn` does not
import it; importing this module without it raises :class:`ImportError`. Tested with flax 0.11.2
(Colab's) and 0.12.8.
"""

from __future__ import annotations

import math

try:
    import flax  # noqa: F401  (the extra this module belongs to; the adapter itself calls no Flax code)
except ImportError as error:  # pragma: no cover - exercised by tests/test_flax.py in a clean interpreter
    raise ImportError("tpuattn.flax needs Flax: pip install tpuattn[flax]") from error

import jax.numpy as jnp

from tpuattn.api import attention
from tpuattn.errors import UnsupportedInput

__all__ = ["attention_fn"]

_DECODE = ("nnx.MultiHeadAttention(decode=True) places the query at the cache index, the contract at the "
           "last key; use tpuattn.decode.attention for decode with a window")


def attention_fn(*, causal=False, window=None, softcap=None, sinks=None, impl="auto", **options):
    """A Flax ``attention_fn`` that computes :func:`tpuattn.attention`.

    Args:
      causal, window, softcap, impl: the contract's (``causal`` aligns bottom-right; with
        ``q_len == kv_len``, as in self-attention, that is ``nnx.make_causal_mask``).
      sinks: one logit per query head, passed as ``sinks=`` to :func:`tpuattn.attention` (only when
        not None: it needs a tpuattn whose contract takes sinks). Fixed at construction, not a
        parameter of the model.
      **options: passed to :func:`tpuattn.attention` (``scale=``, block sizes, ...).

    Returns:
      ``fn(query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None,
      dropout_rate=0.0, deterministic=False, dtype=None, precision=None, module=None,
      promote_dtype=None, is_causal=False, **extra)``, Flax's signature, where:

      * ``query``: ``[batch..., q_len, heads, head_dim]``; ``key``, ``value``: ``[batch..., kv_len,
        kv_heads, head_dim]`` (any number of batch dimensions, none included).
      * ``mask``: only a key mask, broadcastable to ``[batch..., 1, 1, kv_len]`` (padding, and the
        cache mask of ``nnx.MultiHeadAttention(decode=True)``), computed as segment ids; a query that
        sees no key returns zeros (Flax averages every value). Any other mask is refused: pass
        ``causal=`` / ``window=`` here, or call :func:`tpuattn.attention` with ``segment_ids=``.
      * ``dtype``: q, k and v are cast to it (default: their common dtype), or ``promote_dtype``,
        if given, does the promotion as in Flax; the output has that dtype.
      * ``is_causal`` (Flax 0.12): Flax's causal mask aligns top-left; honoured when
        ``q_len == kv_len`` (where the alignments agree), refused otherwise.
      * ``bias``, dropout (``dropout_rate > 0`` and not ``deterministic``), ``precision`` (the
        package picks the matmul precision from the dtype: :func:`tpuattn.numerics.matmul_precision`)
        and ``module`` (sown weights: no implementation materialises them) are refused; so is any
        other keyword unless it is None or False.
    """
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {causal!r}")
    if not isinstance(impl, str):
        raise TypeError(f"impl: expected an implementation name or 'auto', got {impl!r}")
    if "segment_ids" in options:
        raise UnsupportedInput("segment_ids: not an option of attention_fn (they change with every batch); "
                               "pass a key mask [batch, 1, 1, kv_len] as the module's mask=, or call "
                               "tpuattn.attention(..., segment_ids=) in an attention_fn of your own")
    contract = dict(options, window=window, softcap=softcap, impl=impl)
    if sinks is not None:
        contract["sinks"] = sinks

    def tpuattn_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None,
                          dropout_rate=0.0, deterministic=False, dtype=None, precision=None, module=None,
                          promote_dtype=None, is_causal=False, **extra):
        for name, value_ in extra.items():
            if value_ is not None and value_ is not False:
                raise UnsupportedInput(f"{name}: tpuattn.flax.attention_fn does not know this argument of "
                                       f"Flax's attention functions; got {value_!r} (None or False is "
                                       "ignored)")
        if bias is not None:
            raise UnsupportedInput("bias: the contract takes no additive bias; express masks with "
                                   "attention_fn(causal=, window=) or segment ids, a soft cap with softcap=")
        if not deterministic and _positive(dropout_rate):
            raise UnsupportedInput(f"dropout_rate: attention dropout is not part of the contract (got "
                                   f"{dropout_rate} with deterministic=False); build the module with "
                                   "dropout_rate=0.0 or call it with deterministic=True")
        if precision is not None:
            raise UnsupportedInput(f"precision: got {precision!r}; tpuattn picks the matmul precision from "
                                   "the dtype (float32 at full precision), so leave precision=None")
        if module is not None:
            raise UnsupportedInput("module: attention weights cannot be sown (sow_weights=True): no tpuattn "
                                   "implementation materialises them; call the module with sow_weights=False")
        if promote_dtype is not None:
            query, key, value = promote_dtype((query, key, value), dtype=dtype)
        else:
            target = dtype if dtype is not None else jnp.result_type(query, key, value)
            query, key, value = (jnp.asarray(x).astype(target) for x in (query, key, value))
        if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
            raise ValueError(f"query, key, value: expected [batch..., seq, heads, head_dim] with the same "
                             f"batch dimensions, got shapes {query.shape}, {key.shape}, {value.shape}")
        batch_shape, q_len, kv_len = query.shape[:-3], query.shape[-3], key.shape[-3]
        call = dict(contract, causal=causal)
        if is_causal and not causal:
            if q_len != kv_len:
                raise UnsupportedInput(f"is_causal: Flax's causal mask aligns top-left, the contract's "
                                       f"bottom-right; they differ when q_len != kv_len ({q_len} != "
                                       f"{kv_len}); build attention_fn(causal=True) for the bottom-right "
                                       "alignment")
            call["causal"] = True
        if mask is not None:
            call["segment_ids"] = _key_mask_segments(mask, batch_shape, q_len, kv_len, causal, window)
        flat = lambda x: x.reshape((math.prod(batch_shape), *x.shape[-3:]))
        out = attention(flat(query), flat(key), flat(value), **call)
        return out.reshape(query.shape[:-1] + out.shape[-1:])

    tpuattn_attention.__doc__ = (f"tpuattn.attention(causal={causal!r}, window={window!r}, "
                                 f"softcap={softcap!r}, impl={impl!r}) with flax.nnx.dot_product_attention's "
                                 "signature.")
    return tpuattn_attention


def _positive(rate) -> bool:
    try:
        return float(rate) > 0.0
    except TypeError as error:  # a traced rate: its value is unknown when the call is traced
        raise UnsupportedInput(f"dropout_rate: expected a Python number, got {rate!r}") from error


def _key_mask_segments(mask, batch_shape, q_len, kv_len, causal, window):
    """A key mask ``[batch..., 1, 1, kv_len]`` as segment ids ``(q: ones, kv: 1 kept / 0 masked)``."""
    mask = jnp.asarray(mask)
    shape = (1,) * max(0, 3 - mask.ndim) + mask.shape
    if shape[-3:-1] != (1, 1) or shape[-1] not in (1, kv_len):
        hint = ("attention_fn(causal=True) already applies the causal mask (nnx.make_causal_mask's), so "
                "call the module without mask=" if causal else
                "pass causal= / window= to attention_fn, or segment_ids= to tpuattn.attention")
        raise UnsupportedInput(f"mask: only a key mask broadcastable to [batch..., 1, 1, kv_len={kv_len}] is "
                               f"computed (as segment ids); got shape {mask.shape}; {hint}")
    if window is not None and q_len != kv_len:
        raise UnsupportedInput(f"mask: a key mask with window= and q_len != kv_len ({q_len} != {kv_len}) "
                               f"is ambiguous: {_DECODE}")
    try:
        keys = jnp.broadcast_to(mask.reshape(shape[:-3] + shape[-1:]), (*batch_shape, kv_len))
    except ValueError as error:
        raise UnsupportedInput(f"mask: shape {mask.shape} does not broadcast to the batch "
                               f"{tuple(batch_shape)} and kv_len {kv_len}") from error
    batch = math.prod(batch_shape)
    kv_segments = (keys.reshape(batch, kv_len) != 0).astype(jnp.int32)
    return jnp.ones((batch, q_len), jnp.int32), kv_segments
