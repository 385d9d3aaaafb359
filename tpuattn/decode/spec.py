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

Checks on values (``lengths`` in ``[0, capacity]``, used page ids in ``[0, num_pages)``) run when the
arrays are concrete. Under ``jax.jit`` they are tracers and cannot be checked: a length past the capacity
is clamped to it, and an out-of-range page id is clamped into ``[0, num_pages)`` (so no read leaves the
cache, but the result is then meaningless).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from tpuattn._checks import round_up
from tpuattn.spec import SUPPORTED_DTYPES, AttentionSpec, fits_int32, spec_from_shapes


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

    @property
    def paged(self) -> bool:
        return self.page_size is not None

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
                            dtype="bfloat16", scale=None, window=None, softcap=None) -> DecodeSpec:
    """A :class:`DecodeSpec` from sizes alone (for the roofline and schedules); paged when ``page_size``."""
    if page_size is not None:
        capacity = page_size * pages_per_sequence
    attn = spec_from_shapes(q_len, capacity, batch=batch, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                            head_dim=head_dim, dtype=dtype, causal=True, window=window, softcap=softcap,
                            scale=scale)
    return DecodeSpec(attn, page_size, num_pages, pages_per_sequence)


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


def make_decode_spec(q, k_cache, v_cache, lengths, page_table=None, *, scale=None, window=None,
                     softcap=None):
    """Validate a decode call's inputs; return ``(q, k_cache, v_cache, lengths, page_table, spec)``.

    ``lengths`` and ``page_table`` come back as int32 arrays (``page_table`` None for a contiguous
    cache). Raises ``ValueError`` / ``TypeError`` naming the argument, what was expected and what was
    given.
    """
    import jax.numpy as jnp

    q_shape = _shape_of("q", q)
    k_shape, v_shape = _shape_of("k_cache", k_cache), _shape_of("v_cache", v_cache)
    l_shape = _shape_of("lengths", lengths)
    if len(q_shape) != 4:
        raise ValueError(f"q: expected rank 4 [batch, q_len, heads, head_dim], got shape {q_shape}")
    paged = page_table is not None
    layout = "[num_pages, page_size, kv_heads, head_dim]" if paged else "[batch, max_len, kv_heads, head_dim]"
    for name, shape in (("k_cache", k_shape), ("v_cache", v_shape)):
        if len(shape) != 4:
            raise ValueError(f"{name}: expected rank 4 {layout}, got shape {shape}")
    if k_shape != v_shape:
        raise ValueError(f"k_cache and v_cache: expected the same shape, got k_cache {k_shape} and "
                         f"v_cache {v_shape}")
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
    dtypes = {jnp.dtype(x.dtype) for x in (q, k_cache, v_cache)}
    if len(dtypes) != 1:
        raise TypeError(f"q, k_cache, v_cache: expected one dtype, got q {q.dtype}, k_cache {k_cache.dtype}, "
                        f"v_cache {v_cache.dtype}")
    dtype = dtypes.pop()
    if dtype.name not in SUPPORTED_DTYPES:
        raise TypeError(f"q, k_cache, v_cache: expected a dtype in {list(SUPPORTED_DTYPES)}, got {dtype}")

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
            raise ValueError(f"k_cache: expected batch {batch} (q's batch), got {lead}")
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

    attn = spec_from_shapes(q_len, capacity, batch=batch, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                            head_dim=head_dim, dtype=dtype, causal=True, window=window, softcap=softcap,
                            scale=scale)
    spec = DecodeSpec(attn, page_size, num_pages, pages_per_sequence)
    return jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache), lengths, page_table, spec


def padded_rows(rows: int, dtype) -> int:
    """Query rows of one kv head's block (group heads x q_len) padded to a sublane tile."""
    import jax.numpy as jnp

    return round_up(rows, 8 * max(1, 4 // jnp.dtype(dtype).itemsize))
