"""What one decode call is: :class:`DecodeSpec` and :func:`make_decode_spec`, which validates the arrays once.

A decode step attends ``q`` (``[batch, q_len, heads, head_dim]``, ``q_len`` small: 1 for plain decode,
more for speculative decoding or chunked prefill) to a KV cache holding ``lengths[b]`` valid positions
per sequence. The queries are the *last* ``q_len`` of those positions: query ``t`` sits at key position
``lengths[b] - q_len + t`` and sees keys ``j <= that position`` (bottom-right causal, as in
:func:`tpuattn.attention`), within ``window`` when given; positions ``j >= lengths[b]`` never contribute.

When ``lengths[b] < q_len`` the first ``q_len - lengths[b]`` query rows sit at negative positions and
see no key: they return zeros (as every row of a sequence of length 0 does); the others see the keys up
to their own position. This is the contract's "a query that sees no key returns zeros", applied per row.

Two cache layouts:

* contiguous: ``k_cache, v_cache`` ``[batch, max_len, kv_heads, head_dim]``; capacity ``max_len``;
* paged: ``k_cache, v_cache`` ``[num_pages, page_size, kv_heads, head_dim]`` with ``page_table``
  ``[batch, pages_per_sequence]`` (int32): position ``j`` of sequence ``b`` is row ``j % page_size`` of
  page ``page_table[b, j // page_size]``; capacity ``pages_per_sequence * page_size``. Entries past a
  sequence's last used page (``ceil(lengths[b] / page_size)``) are never read and may hold anything
  (``-1`` for example).

Two forms of the queries:

* dense: ``q [batch, q_len, heads, head_dim]``, every sequence ``q_len`` new queries;
* ragged (``cu_q_lens`` given, the form of JAX's ``ragged_paged_attention`` and of engines' mixed
  batches): ``q [total_tokens, heads, head_dim]``, the new tokens of every sequence one after the other;
  sequence ``i``'s are rows ``cu_q_lens[i] .. cu_q_lens[i + 1] - 1`` (``cu_q_lens`` int ``[batch + 1]``,
  starting at 0, non-decreasing, at most ``total_tokens``; a query length of 0 is allowed). They are the
  last ``q_len[i] = cu_q_lens[i + 1] - cu_q_lens[i]`` positions of its ``lengths[i]``, bottom-right
  causal as in the dense form. ``num_seqs`` (an int or an int array of one element, default ``batch``)
  says how many sequences are live: the others have no queries (their ``cu_q_lens`` entries are not
  read). Rows of ``q`` past ``cu_q_lens[num_seqs]`` are padding: they return zeros.

Caches of ``float32``, ``bfloat16``, ``float16`` (q's dtype), or quantized (:data:`QUANTIZED_DTYPES`:
``int8``, ``float8_e4m3fn``) with ``k_scale`` and ``v_scale`` (float ``[]`` per tensor or
``[kv_heads]`` per kv head): the key or value a cache entry stands for is ``entry * scale`` of its kv
head (:mod:`tpuattn.decode.quant` writes them). Scales may also be given with a float cache (then they
multiply it the same way).

Checks on values (``lengths`` in ``[0, capacity]``, used page ids in ``[0, num_pages)``, ``cu_q_lens``
starting at 0, non-decreasing and at most ``total_tokens``, ``num_seqs`` in ``[0, batch]``, scales
finite and ``>= 0``) run when the arrays are concrete. Under ``jax.jit`` they are tracers and cannot be
checked: a length past the capacity is clamped to it, and an out-of-range page id is clamped into
``[0, num_pages)`` (so no read leaves the cache, but the result is then meaningless); ``cu_q_lens`` is
clipped into ``[0, total_tokens]`` and made non-decreasing, ``num_seqs`` clipped into ``[0, batch]``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import numpy as np

from tpuattn._checks import round_up
from tpuattn.errors import TpuattnError
from tpuattn.spec import SUPPORTED_DTYPES, AttentionSpec, fits_int32, spec_from_shapes

# Quantized cache dtypes: K and V entries stand for ``entry * scale`` of their kv head.
QUANTIZED_DTYPES = ("int8", "float8_e4m3fn")


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """Static facts of one decode call (hashable: it is a static argument of the kernels).

    ``attention`` is the :class:`~tpuattn.spec.AttentionSpec` of the same problem with ``kv_len`` =
    the cache capacity and ``causal=True`` (its scale, softcap, dtype and normalised window are the
    ones every implementation reads). ``page_size`` is None for a contiguous cache.
    """

    attention: AttentionSpec
    page_size: int | None = None
    num_pages: int | None = None
    pages_per_sequence: int | None = None
    ragged: bool = False  # q is [total_tokens, heads, d] with cu_q_lens (attention.q_len = total_tokens)
    cache_dtype: str | None = None  # K/V's dtype when it differs from q's (int8, float8_e4m3fn)
    scales: str | None = None  # None, "tensor" or "head": how k_scale and v_scale are given

    @property
    def paged(self) -> bool:
        return self.page_size is not None

    @property
    def quantized(self) -> bool:
        """K and V are int8 or float8_e4m3fn entries, ``entry * scale`` (:data:`QUANTIZED_DTYPES`)."""
        return self.cache_dtype in QUANTIZED_DTYPES

    @property
    def kv_dtype(self):
        """The dtype K and V are stored in (q's dtype unless quantized)."""
        import jax.numpy as jnp

        return jnp.dtype(self.cache_dtype or self.attention.dtype)

    @property
    def num_tokens(self) -> int:
        """Query rows of the call: ``batch * q_len`` (dense) or ``total_tokens`` (ragged)."""
        return self.q_len if self.ragged else self.batch * self.q_len

    @property
    def batch(self) -> int:
        return self.attention.batch

    @property
    def q_len(self) -> int:
        return self.attention.q_len

    @property
    def capacity(self) -> int:
        """The most positions a sequence can hold (``max_len``, or ``pages_per_sequence * page_size``)."""
        return self.attention.kv_len

    @property
    def num_q_heads(self) -> int:
        return self.attention.num_q_heads

    @property
    def num_kv_heads(self) -> int:
        return self.attention.num_kv_heads

    @property
    def group_size(self) -> int:
        return self.attention.num_q_heads // self.attention.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.attention.head_dim

    @property
    def dtype(self):
        return self.attention.dtype

    @property
    def scale(self) -> float:
        return self.attention.scale

    @property
    def softcap(self) -> float | None:
        return self.attention.softcap

    @property
    def left(self) -> int | None:
        """How many keys before its own position a query sees (None: all). With decode's causal mask
        the window's right side never widens what a query sees, so only the left side matters."""
        window = self.attention.window
        return None if window is None else window[0]

    @property
    def windowed(self) -> bool:
        return self.left is not None and self.left < self.capacity


def decode_spec_from_shapes(*, batch: int, q_len: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                            capacity: int | None = None, page_size: int | None = None,
                            num_pages: int | None = None, pages_per_sequence: int | None = None,
                            dtype="bfloat16", scale=None, window=None, softcap=None, ragged: bool = False,
                            cache_dtype=None, scales: str | None = None) -> DecodeSpec:
    """A :class:`DecodeSpec` from sizes alone (for the roofline and schedules); paged when ``page_size``.

    ``ragged``: ``q_len`` is the total number of new tokens of the ``batch`` sequences; ``cache_dtype``:
    K and V's dtype when it differs from ``dtype`` (a :data:`QUANTIZED_DTYPES` one needs ``scales``,
    ``"tensor"`` or ``"head"``)."""
    if page_size is not None:
        capacity = page_size * pages_per_sequence
    attn = spec_from_shapes(q_len, capacity, batch=batch, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                            head_dim=head_dim, dtype=dtype, causal=True, window=window, softcap=softcap,
                            scale=scale)
    cache_dtype = _cache_dtype(cache_dtype, attn.dtype, "cache_dtype")
    if scales not in (None, "tensor", "head"):
        raise TpuattnError(f"scales: expected None, 'tensor' or 'head', got {scales!r}")
    if cache_dtype in QUANTIZED_DTYPES and scales is None:
        raise TpuattnError(f"scales: expected 'tensor' or 'head' for a {cache_dtype} cache, got None")
    return DecodeSpec(attn, page_size, num_pages, pages_per_sequence, bool(ragged), cache_dtype, scales)


def _cache_dtype(cache_dtype, dtype, name: str) -> str | None:
    """``cache_dtype`` normalised: None when it is ``dtype``, else a name in :data:`QUANTIZED_DTYPES`."""
    import jax.numpy as jnp

    if cache_dtype is None or jnp.dtype(cache_dtype) == jnp.dtype(dtype):
        return None
    if jnp.dtype(cache_dtype).name not in QUANTIZED_DTYPES:
        raise TypeError(f"{name}: expected q's dtype ({jnp.dtype(dtype)}) or a quantized dtype in "
                        f"{list(QUANTIZED_DTYPES)}, got {jnp.dtype(cache_dtype)}")
    return jnp.dtype(cache_dtype).name


def _shape_of(name: str, x) -> tuple[int, ...]:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
    return tuple(x.shape)


def _concrete(x) -> np.ndarray | None:
    """``x`` as a NumPy array when its values are known now (not a tracer under jit), else None."""
    if isinstance(x, jax.core.Tracer):
        return None
    try:
        return np.asarray(x)
    except Exception:  # noqa: BLE001 - anything that has no concrete value
        return None


def _clip_int32(x, high: int):
    """``x`` clipped into ``[0, high]`` as int32, with no value wrapping on the way: a narrow dtype
    is widened before the clip (``jnp.clip`` of int8 ids to 1000 would wrap the bound), a wide or
    unsigned one is clipped in its own dtype, which holds ``high``, before the cast."""
    import jax.numpy as jnp

    x = jnp.asarray(x)
    if fits_int32(x.dtype):
        return jnp.clip(x.astype(jnp.int32), 0, high)
    return jnp.clip(x, 0, high).astype(jnp.int32)


class DecodeInputs(NamedTuple):
    """A validated decode call (:func:`validate`): the arrays as the implementations take them.

    ``lengths`` and ``page_table`` are int32 (``page_table`` None for a contiguous cache);
    ``cu_q_lens`` int32 ``[batch + 1]`` (ragged only, else None): non-decreasing from 0, with the
    sequences at or past ``num_seqs`` given no queries, so an implementation may ignore ``num_seqs``
    (int32 ``[1]``, ragged only); ``k_scale``, ``v_scale``: float32 ``[kv_heads]`` or None.
    """

    q: Any
    k_cache: Any
    v_cache: Any
    lengths: Any
    page_table: Any
    cu_q_lens: Any
    num_seqs: Any
    k_scale: Any
    v_scale: Any
    spec: DecodeSpec


def make_decode_spec(q, k_cache, v_cache, lengths, page_table=None, *, cu_q_lens=None, num_seqs=None,
                     k_scale=None, v_scale=None, scale=None, window=None, softcap=None):
    """Validate a decode call's inputs; return ``(q, k_cache, v_cache, lengths, page_table, spec)``
    (:func:`validate` returns the ragged and quantized arguments too)."""
    inputs = validate(q, k_cache, v_cache, lengths, page_table, cu_q_lens=cu_q_lens, num_seqs=num_seqs,
                      k_scale=k_scale, v_scale=v_scale, scale=scale, window=window, softcap=softcap)
    return inputs.q, inputs.k_cache, inputs.v_cache, inputs.lengths, inputs.page_table, inputs.spec


def validate(q, k_cache, v_cache, lengths, page_table=None, *, cu_q_lens=None, num_seqs=None,
             k_scale=None, v_scale=None, scale=None, window=None, softcap=None) -> DecodeInputs:
    """Validate a decode call's inputs (the module docstring's rules) into :class:`DecodeInputs`.

    Raises ``ValueError`` (:class:`~tpuattn.errors.TpuattnError` for the ragged and quantized
    arguments) / ``TypeError`` naming the argument, what was expected and what was given.
    """
    import jax.numpy as jnp

    ragged = cu_q_lens is not None
    q_shape = _shape_of("q", q)
    k_shape, v_shape = _shape_of("k_cache", k_cache), _shape_of("v_cache", v_cache)
    l_shape = _shape_of("lengths", lengths)
    if ragged and len(q_shape) != 3:
        raise ValueError(f"q: expected rank 3 [total_tokens, heads, head_dim] with cu_q_lens (ragged), "
                         f"got shape {q_shape}")
    if not ragged and len(q_shape) != 4:
        extra = " (a rank-3 ragged q needs cu_q_lens)" if len(q_shape) == 3 else ""
        raise ValueError(f"q: expected rank 4 [batch, q_len, heads, head_dim]{extra}, got shape {q_shape}")
    if not ragged and num_seqs is not None:
        raise TpuattnError(f"num_seqs: counts the live sequences of a ragged batch; expected None without "
                           f"cu_q_lens, got {num_seqs!r}")
    paged = page_table is not None
    layout = "[num_pages, page_size, kv_heads, head_dim]" if paged else "[batch, max_len, kv_heads, head_dim]"
    for name, shape in (("k_cache", k_shape), ("v_cache", v_shape)):
        if len(shape) != 4:
            raise ValueError(f"{name}: expected rank 4 {layout}, got shape {shape}")
    if k_shape != v_shape:
        raise ValueError(f"k_cache and v_cache: expected the same shape, got k_cache {k_shape} and "
                         f"v_cache {v_shape}")
    if ragged:
        q_len, num_q_heads, head_dim = q_shape  # q_len: the total number of new tokens
        if len(l_shape) != 1:
            raise ValueError(f"lengths: expected shape (batch,) (one per sequence), got {l_shape}")
        batch = l_shape[0]
        if batch < 1:
            raise ValueError(f"lengths: expected at least one sequence, got shape {l_shape}")
    else:
        batch, q_len, num_q_heads, head_dim = q_shape
    lead, rows, num_kv_heads, kd = k_shape
    if min(q_shape) < 1:
        raise ValueError(f"q: expected non-empty dimensions, got shape {q_shape}")
    if min(k_shape) < 1:
        raise ValueError(f"k_cache: expected non-empty dimensions, got shape {k_shape}")
    if kd != head_dim:
        raise ValueError(f"k_cache: expected head_dim {head_dim} (q's head_dim), got {kd}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q: expected a number of heads divisible by k_cache's {num_kv_heads} heads (GQA), "
                         f"got {num_q_heads}")
    kv_dtypes = {jnp.dtype(x.dtype) for x in (k_cache, v_cache)}
    if len(kv_dtypes) == 1 and next(iter(kv_dtypes)).name in QUANTIZED_DTYPES:  # a quantized cache
        dtype = jnp.dtype(q.dtype)
        if dtype.name not in SUPPORTED_DTYPES:
            raise TypeError(f"q: expected a dtype in {list(SUPPORTED_DTYPES)} over a {k_cache.dtype} cache, "
                            f"got {dtype}")
    else:
        dtypes = kv_dtypes | {jnp.dtype(q.dtype)}
        if len(dtypes) != 1:
            raise TypeError(f"q, k_cache, v_cache: expected one dtype (or k_cache and v_cache both of a "
                            f"quantized dtype in {list(QUANTIZED_DTYPES)}), got q {q.dtype}, k_cache "
                            f"{k_cache.dtype}, v_cache {v_cache.dtype}")
        dtype = dtypes.pop()
        if dtype.name not in SUPPORTED_DTYPES:
            raise TypeError(f"q, k_cache, v_cache: expected a dtype in {list(SUPPORTED_DTYPES)}, got {dtype}")
    cache_dtype = _cache_dtype(k_cache.dtype, dtype, "k_cache")

    if paged:
        t_shape = _shape_of("page_table", page_table)
        if len(t_shape) != 2 or t_shape[0] != batch or t_shape[1] < 1:
            raise ValueError(f"page_table: expected shape [batch={batch}, pages_per_sequence >= 1], "
                             f"got {t_shape}")
        if not np.issubdtype(np.dtype(page_table.dtype), np.integer):
            raise TypeError(f"page_table: expected an integer dtype (int32), got {page_table.dtype}")
        num_pages, page_size, pages_per_sequence = lead, rows, t_shape[1]
        capacity = page_size * pages_per_sequence
    else:
        if lead != batch:
            what = "lengths' batch" if ragged else "q's batch"
            raise ValueError(f"k_cache: expected batch {batch} ({what}), got {lead}")
        num_pages = page_size = pages_per_sequence = None
        capacity = rows
    if l_shape != (batch,):
        raise ValueError(f"lengths: expected shape ({batch},) (one per sequence), got {l_shape}")
    if not np.issubdtype(np.dtype(lengths.dtype), np.integer):
        raise TypeError(f"lengths: expected an integer dtype (int32), got {lengths.dtype}")

    known = _concrete(lengths)
    if known is not None and known.size and (known.min() < 0 or known.max() > capacity):
        bad = int(known.min()) if known.min() < 0 else int(known.max())
        raise ValueError(f"lengths: expected values in [0, {capacity}] (the cache capacity), got {bad}")
    if paged:
        table = _concrete(page_table)
        # Only the pages a sequence uses are read, and which those are depends on its length: with
        # lengths traced under jit no entry is known to be in use (unused entries may hold anything,
        # -1 by convention), so the page ids are clamped, not checked. Lengths are in range here, so
        # they fit int64 whatever their dtype (uint8 or uint32 lengths would wrap in -(-n // size)).
        if table is not None and known is not None:
            pages_used = -(-known.astype(np.int64)[:, None] // page_size)
            used = np.arange(pages_per_sequence)[None, :] < pages_used
            bad = used & ((table < 0) | (table >= num_pages))
            if bad.any():
                b, i = (int(x) for x in np.argwhere(bad)[0])
                raise ValueError(f"page_table: expected page ids in [0, {num_pages}) for the pages in use, "
                                 f"got {int(table[b, i])} at [{b}, {i}]")
        page_table = _clip_int32(page_table, num_pages - 1)
    lengths = _clip_int32(lengths, capacity)
    if ragged:
        cu_q_lens, num_seqs = _ragged(cu_q_lens, num_seqs, batch, q_len)
    k_scale, v_scale, scales = _scales(k_scale, v_scale, num_kv_heads, cache_dtype)

    attn = spec_from_shapes(q_len, capacity, batch=batch, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                            head_dim=head_dim, dtype=dtype, causal=True, window=window, softcap=softcap,
                            scale=scale)
    spec = DecodeSpec(attn, page_size, num_pages, pages_per_sequence, ragged, cache_dtype, scales)
    return DecodeInputs(jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache), lengths, page_table,
                        cu_q_lens, num_seqs, k_scale, v_scale, spec)


def _ragged(cu_q_lens, num_seqs, batch: int, total: int):
    """``(cu_q_lens int32 [batch + 1], num_seqs int32 [1])``, checked when concrete, else clipped; the
    sequences at or past ``num_seqs`` get no queries."""
    import jax.numpy as jnp

    c_shape = _shape_of("cu_q_lens", cu_q_lens)
    if c_shape != (batch + 1,):
        raise TpuattnError(f"cu_q_lens: expected shape ({batch + 1},) (batch + 1: one more than lengths), "
                           f"got {c_shape}")
    if not np.issubdtype(np.dtype(cu_q_lens.dtype), np.integer):
        raise TypeError(f"cu_q_lens: expected an integer dtype (int32), got {cu_q_lens.dtype}")
    if num_seqs is None:
        num_seqs = np.array([batch], np.int32)
    elif isinstance(num_seqs, int | np.integer):
        num_seqs = np.array([num_seqs], np.int64)
    n_shape = _shape_of("num_seqs", num_seqs)
    if n_shape not in ((), (1,)) or not np.issubdtype(np.dtype(num_seqs.dtype), np.integer):
        raise TpuattnError(f"num_seqs: expected an int or an integer array of one element, got shape "
                           f"{n_shape} of {num_seqs.dtype}")
    n_known = _concrete(num_seqs)
    if n_known is not None and not 0 <= int(n_known.reshape(-1)[0]) <= batch:
        raise TpuattnError(f"num_seqs: expected a value in [0, {batch}] (the batch), got "
                           f"{int(n_known.reshape(-1)[0])}")
    live = _clip_int32(jnp.reshape(num_seqs, (1,)), batch)
    known = _concrete(cu_q_lens)
    if known is not None:
        n = batch if n_known is None else int(n_known.reshape(-1)[0])
        seen = known[: n + 1].astype(np.int64)
        if seen[0] != 0:
            raise TpuattnError(f"cu_q_lens: expected 0 first (the start of sequence 0's tokens), got "
                               f"{seen[0]}")
        drops = np.flatnonzero(np.diff(seen) < 0)
        if drops.size:
            i = int(drops[0])
            raise TpuattnError(f"cu_q_lens: expected non-decreasing values (query lengths >= 0), got "
                               f"{seen[i + 1]} after {seen[i]} at [{i + 1}]")
        if seen[-1] > total:
            raise TpuattnError(f"cu_q_lens: expected values at most {total} (q's total_tokens), got "
                               f"{seen[-1]} at [{n}]")
    cu = jax.lax.cummax(_clip_int32(cu_q_lens, total), axis=0)
    cu = cu - cu[0]
    cu = jnp.where(jnp.arange(batch + 1) <= live[0], cu, cu[jnp.minimum(live[0], batch)])
    return cu, live


def _scales(k_scale, v_scale, num_kv_heads: int, cache_dtype):
    """``(k_scale, v_scale, how)``: float32 ``[kv_heads]`` (or None) and ``"tensor"``/``"head"``/None."""
    import jax.numpy as jnp

    if (k_scale is None) != (v_scale is None):
        given = "k_scale" if v_scale is None else "v_scale"
        raise TpuattnError(f"k_scale and v_scale: expected both or neither, got only {given}")
    if k_scale is None:
        if cache_dtype in QUANTIZED_DTYPES:
            raise TpuattnError(f"k_scale, v_scale: expected the scales of a {cache_dtype} cache (float32 [] "
                               f"per tensor or [{num_kv_heads}] per kv head), got None")
        return None, None, None
    out, hows = [], set()
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(x, int | float | np.number):
            x = np.asarray(x, np.float32)
        shape = _shape_of(name, x)
        if shape not in ((), (1,), (num_kv_heads,)):
            raise TpuattnError(f"{name}: expected shape () per tensor or ({num_kv_heads},) per kv head, "
                               f"got {shape}")
        if not np.issubdtype(np.dtype(x.dtype), np.floating) and np.dtype(x.dtype).name != "bfloat16":
            raise TypeError(f"{name}: expected a float dtype (float32), got {x.dtype}")
        known = _concrete(x)
        if known is not None:
            bad = ~(np.isfinite(known.astype(np.float64)) & (known.astype(np.float64) >= 0))
            if bad.any():
                value = known.reshape(-1)[np.argmax(bad.reshape(-1))]
                raise TpuattnError(f"{name}: expected finite values >= 0, got {value}")
        hows.add("head" if shape == (num_kv_heads,) and num_kv_heads > 1 else "tensor")
        out.append(jnp.broadcast_to(jnp.asarray(x, jnp.float32).reshape(-1), (num_kv_heads,)))
    return out[0], out[1], "head" if "head" in hows else "tensor"


def padded_rows(rows: int, dtype) -> int:
    """Query rows of one kv head's block (group heads x q_len) padded to a sublane tile."""
    import jax.numpy as jnp

    return round_up(rows, 8 * max(1, 4 // jnp.dtype(dtype).itemsize))
