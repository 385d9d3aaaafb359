"""The problem description: one mask model and one validated spec for every implementation.

Positions use bottom-right alignment: query ``i`` sits at key position
``p_i = i + (kv_len - q_len)``, so a single decoding query sees the whole cache.

* ``causal``            keeps keys ``j <= p_i``
* ``window=(l, r)``     keeps keys ``p_i - l <= j <= p_i + r`` (``None`` = unbounded side; an int
                        ``w`` means ``(w, w)``; an extent past the sequence is the same as unbounded)
* segment ids           keep keys whose segment equals the query's segment
* padding               keys ``j >= kv_len`` are never visible (implementations pad internally)

All masks combine with AND. :meth:`MaskSpec.visible` is the one element-level rule (used by the
reference, the blockwise loop, the native adapters and, on iotas, the Pallas kernels);
:meth:`MaskSpec.row_bounds` gives each row's visible interval and :meth:`MaskSpec.block_map`
classifies whole tiles as EMPTY, PARTIAL or FULL (the tile codes every schedule, count and figure
uses) so that implementations can skip the hidden ones.

:func:`make_spec` validates the contract's arrays once; :func:`spec_from_shapes` builds the same
:class:`AttentionSpec` from sizes alone (for models, counts and figures). Nothing else builds one.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from tpuattn._checks import is_int, positive_int

# Tile codes, returned by MaskSpec.block_map and used by every schedule, count and figure:
# EMPTY tiles are hidden entirely (skipped), PARTIAL ones need the mask applied, FULL ones do not.
EMPTY, PARTIAL, FULL = 0, 1, 2
TILE_NAMES = {EMPTY: "empty (skipped)", PARTIAL: "partial (masked)", FULL: "full"}


def normalise_window(window, q_len: int, kv_len: int) -> tuple[int | None, int | None] | None:
    """The contract's ``window`` as ``(left, right)`` with each side an int or None.

    An int ``w`` means ``(w, w)``. An extent that reaches past every key is the same as
    unbounded, so it is clipped to ``q_len + kv_len``: the mask then never overflows int32,
    whatever the caller passed (``2**40`` included).
    """
    if window is None:
        return None
    if is_int(window):
        window = (window, window)
    if not isinstance(window, tuple | list) or len(window) != 2:
        raise ValueError(f"window: expected an int or a pair (left, right) of ints or None, got {window!r}")
    out = []
    for side, w in zip(("left", "right"), window, strict=True):
        if w is None:
            out.append(None)
            continue
        if not is_int(w):
            raise ValueError(f"window: expected the {side} extent to be an int or None, got {w!r}")
        if w < 0:
            raise ValueError(f"window: expected a non-negative {side} extent, got {int(w)}")
        out.append(min(int(w), q_len + kv_len))
    return (out[0], out[1])


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """The position-only part of a mask (segments are data, see ``has_segments``)."""

    q_len: int
    kv_len: int
    causal: bool = False
    window: tuple[int | None, int | None] | None = None  # (left, right)
    has_segments: bool = False
    # Where this block sits in a larger problem: its query 0 is ``shift`` positions further right
    # (relative to its keys) than bottom-right alignment of the block alone would put it. 0 for
    # every call of the contract; the sharded and ring attention of :mod:`tpuattn.parallel` attend
    # one chunk of queries to one chunk of keys and set it (see :func:`block_spec`).
    shift: int = 0

    def __post_init__(self):
        # A window side wider than the problem is unbounded: clipped to the block's extent, which
        # for a block of a larger problem includes its shift.
        window = normalise_window(self.window, self.q_len + abs(self.shift), self.kv_len)
        object.__setattr__(self, "window", window)

    @property
    def offset(self) -> int:
        """Key position of query 0: ``kv_len - q_len`` (bottom-right alignment), plus ``shift``."""
        return self.kv_len - self.q_len + self.shift

    @property
    def is_trivial(self) -> bool:
        """True when no key is ever hidden (apart from padding)."""
        return not self.causal and self.window is None and not self.has_segments

    @property
    def right_reach(self) -> int | None:
        """Largest ``j - p_i`` a query may see (None = unbounded)."""
        bounds = []
        if self.causal:
            bounds.append(0)
        if self.window is not None and self.window[1] is not None:
            bounds.append(self.window[1])
        return min(bounds) if bounds else None

    @property
    def left_reach(self) -> int | None:
        """Largest ``p_i - j`` a query may see (None = unbounded)."""
        if self.window is not None and self.window[0] is not None:
            return self.window[0]
        return None

    # ------------------------------------------------------------------ element level
    def visible(self, q_idx, kv_idx, q_segment_ids=None, kv_segment_ids=None, xp=None):
        """Boolean visibility of key ``kv_idx`` to query ``q_idx`` (broadcasting).

        ``q_idx``/``kv_idx`` are integer arrays of query rows and key columns
        (padded indices allowed); ``xp`` is ``numpy`` or ``jax.numpy`` (inferred).
        Segment ids, when given, must broadcast against the index arrays.
        """
        if xp is None:
            numpy_inputs = all(isinstance(x, np.ndarray | int) for x in (q_idx, kv_idx))
            xp = np if numpy_inputs else _jnp()
        pos = q_idx + self.offset
        keep = kv_idx < self.kv_len
        if self.right_reach is not None:
            keep = xp.logical_and(keep, kv_idx <= pos + self.right_reach)
        if self.left_reach is not None:
            keep = xp.logical_and(keep, kv_idx >= pos - self.left_reach)
        if q_segment_ids is not None:
            keep = xp.logical_and(keep, q_segment_ids == kv_segment_ids)
        return keep

    def row_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """Half-open visible key interval ``[lo, hi)`` of every query row (positions only)."""
        pos = np.arange(self.q_len, dtype=np.int64) + self.offset
        lo = np.zeros(self.q_len, np.int64)
        hi = np.full(self.q_len, self.kv_len, np.int64)
        if self.left_reach is not None:
            lo = np.maximum(lo, pos - self.left_reach)
        if self.right_reach is not None:
            hi = np.minimum(hi, pos + self.right_reach + 1)
        return lo, np.maximum(lo, hi)

    def dense(self, q_segment_ids=None, kv_segment_ids=None, xp=np):
        """The element mask ``[q_len, kv_len]`` (``[batch, q_len, kv_len]`` with segment ids)."""
        rows = xp.arange(self.q_len)[:, None]
        cols = xp.arange(self.kv_len)[None, :]
        if q_segment_ids is None:
            return self.visible(rows, cols, xp=xp)
        return self.visible(rows[None], cols[None], q_segment_ids[:, :, None], kv_segment_ids[:, None, :],
                            xp=xp)

    def rows_can_be_empty(self) -> bool:
        """True when some query may see no key (by positions, or possibly through segment ids)."""
        lo, hi = self.row_bounds()
        return self.has_segments or bool(np.any(lo >= hi))

    # ------------------------------------------------------------------ block level
    def kv_span(self, q_start: int, q_stop: int) -> tuple[int, int]:
        """Half-open key range ``[lo, hi)`` that queries ``[q_start, q_stop)`` can see.

        Ignores segments. The range is clipped to ``[0, kv_len)`` and may be empty.
        """
        lo, hi = 0, self.kv_len
        if self.left_reach is not None:
            lo = max(lo, q_start + self.offset - self.left_reach)
        if self.right_reach is not None:
            hi = min(hi, q_stop - 1 + self.offset + self.right_reach + 1)
        return lo, max(lo, hi)

    def block_map(self, q_block: int, kv_block: int, q_len_padded: int | None = None,
                  kv_len_padded: int | None = None) -> np.ndarray:
        """Classify each ``(q_block, kv_block)`` tile as EMPTY, PARTIAL or FULL.

        Position-only: with segment ids a FULL tile is reported PARTIAL (segment
        visibility is data and must be checked at run time). Tiles that contain
        key padding are at most PARTIAL. Returns an ``int8`` array
        ``[num_q_blocks, num_kv_blocks]``.
        """
        q_pad = q_len_padded or -(-self.q_len // q_block) * q_block
        kv_pad = kv_len_padded or -(-self.kv_len // kv_block) * kv_block
        nq, nk = q_pad // q_block, kv_pad // kv_block
        out = np.empty((nq, nk), np.int8)
        for i in range(nq):
            rows = np.arange(i * q_block, (i + 1) * q_block)
            rows = rows[rows < max(self.q_len, 1)]
            for j in range(nk):
                k0, k1 = j * kv_block, (j + 1) * kv_block
                if rows.size == 0:
                    out[i, j] = EMPTY
                    continue
                # Visible keys of a row form an interval; tile is empty if no
                # row's interval meets [k0, k1), full if every row covers it.
                lo_first, hi_first = self._row_interval(rows[0])
                lo_last, hi_last = self._row_interval(rows[-1])
                # Intervals move monotonically with the row, so the union over
                # rows is [min lo, max hi) and the intersection [max lo, min hi).
                u_lo, u_hi = min(lo_first, lo_last), max(hi_first, hi_last)
                i_lo, i_hi = max(lo_first, lo_last), min(hi_first, hi_last)
                any_vis = u_lo < u_hi and max(u_lo, k0) < min(u_hi, k1)
                all_vis = i_lo <= k0 and k1 <= i_hi
                if not any_vis:
                    out[i, j] = EMPTY
                elif all_vis and not self.has_segments:
                    out[i, j] = FULL
                else:
                    out[i, j] = PARTIAL
        return out

    def _row_interval(self, row: int) -> tuple[int, int]:
        """Half-open interval of keys visible to query ``row`` (positions only)."""
        return self.kv_span(int(row), int(row) + 1)


def _jnp():
    import jax.numpy as jnp

    return jnp


# ---------------------------------------------------------------------------- the attention spec
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """An already-validated description of one attention problem.

    Shapes follow ``[batch, seq, heads, head_dim]`` everywhere.
    """

    batch: int
    q_len: int
    kv_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: Any
    scale: float
    softcap: float | None
    mask: MaskSpec

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (1 = MHA, num_q_heads = MQA)."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def causal(self) -> bool:
        return self.mask.causal

    @property
    def window(self):
        return self.mask.window

    @property
    def has_segments(self) -> bool:
        return self.mask.has_segments


def _positive_number(name: str, value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ValueError(f"{name}: expected a positive Python number or None, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: expected a positive finite number, got {value!r}")
    return value


def spec_from_shapes(q_len: int, kv_len: int | None = None, *, batch: int = 1, num_q_heads: int = 1,
                     num_kv_heads: int | None = None, head_dim: int = 128, dtype="float32",
                     causal: bool = False, window=None, softcap: float | None = None,
                     scale: float | None = None, has_segments: bool = False) -> AttentionSpec:
    """An :class:`AttentionSpec` from sizes alone (no arrays): the one place a spec is built.

    ``window`` as in :func:`tpuattn.attention` (an int ``w`` means ``(w, w)``); ``scale``
    defaults to ``1 / sqrt(head_dim)``; ``num_kv_heads`` to ``num_q_heads``.
    """
    import jax.numpy as jnp

    kv_len = q_len if kv_len is None else kv_len
    num_kv_heads = num_q_heads if num_kv_heads is None else num_kv_heads
    sizes = {name: positive_int(name, value) for name, value in (
        ("q_len", q_len), ("kv_len", kv_len), ("batch", batch), ("num_q_heads", num_q_heads),
        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim))}
    if sizes["num_q_heads"] % sizes["num_kv_heads"]:
        raise ValueError(f"num_q_heads: expected a multiple of num_kv_heads={sizes['num_kv_heads']} (GQA), "
                         f"got {sizes['num_q_heads']}")
    dtype = jnp.dtype(dtype)
    if dtype.name not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype: expected one of {list(SUPPORTED_DTYPES)}, got {dtype}")
    if not isinstance(causal, bool | np.bool_):
        raise ValueError(f"causal: expected a bool, got {causal!r}")
    scale = _positive_number("scale", scale)
    mask = MaskSpec(q_len=sizes["q_len"], kv_len=sizes["kv_len"], causal=bool(causal), window=window,
                    has_segments=bool(has_segments))
    return AttentionSpec(batch=sizes["batch"], q_len=sizes["q_len"], kv_len=sizes["kv_len"],
                         num_q_heads=sizes["num_q_heads"], num_kv_heads=sizes["num_kv_heads"],
                         head_dim=sizes["head_dim"], dtype=dtype,
                         scale=1.0 / math.sqrt(sizes["head_dim"]) if scale is None else scale,
                         softcap=_positive_number("softcap", softcap), mask=mask)


def block_spec(spec: AttentionSpec, *, q_start: int, q_len: int, kv_start: int, kv_len: int,
               batch: int | None = None, num_q_heads: int | None = None,
               num_kv_heads: int | None = None) -> AttentionSpec:
    """The spec of one block of ``spec``'s problem: queries ``[q_start, q_start + q_len)`` against
    keys ``[kv_start, kv_start + kv_len)``, with the masks of the whole problem.

    The block keeps bottom-right alignment of the whole: its query ``i`` sits at key position
    ``q_start + i + spec.kv_len - spec.q_len`` of the whole, i.e. at ``i + kv_len - q_len + shift``
    of the block. ``batch`` and the head counts default to the whole's (a shard of them may be
    given). Used by :mod:`tpuattn.parallel` for the chunk pairs of a sharded sequence.
    """
    shift = (q_start - kv_start) + (spec.kv_len - spec.q_len) - (kv_len - q_len)
    mask = MaskSpec(q_len=positive_int("q_len", q_len), kv_len=positive_int("kv_len", kv_len),
                    causal=spec.mask.causal, window=spec.mask.window, has_segments=spec.mask.has_segments,
                    shift=int(shift))
    return dataclasses.replace(
        spec, q_len=q_len, kv_len=kv_len, mask=mask,
        batch=spec.batch if batch is None else batch,
        num_q_heads=spec.num_q_heads if num_q_heads is None else num_q_heads,
        num_kv_heads=spec.num_kv_heads if num_kv_heads is None else num_kv_heads)


# ---------------------------------------------------------------------------- validating arrays
def _shape_of(name: str, x) -> tuple[int, ...]:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
    return tuple(x.shape)


def fits_int32(dtype) -> bool:
    info = np.iinfo(dtype)
    return info.min >= np.iinfo(np.int32).min and info.max <= np.iinfo(np.int32).max


def dense_segment_ids(q_seg, kv_seg):
    """Segment ids as int32 that compare equal exactly when the originals' integer *values* do.

    Ids whose dtypes both fit int32 (int8/16/32, uint8/16) are cast. Otherwise (uint32, int64,
    uint64, or two different widths) a plain cast would make different values collide (int64 0
    and 2**32 both become 0; int32 -1 and uint32 4294967295 share their bits), so each batch row's
    ids are replaced by their rank among the row's distinct values: an int32 that keeps every
    equality and no other.
    """
    import jax.numpy as jnp

    q_dtype, kv_dtype = np.dtype(q_seg.dtype), np.dtype(kv_seg.dtype)
    if fits_int32(q_dtype) and fits_int32(kv_dtype):
        return jnp.asarray(q_seg, jnp.int32), jnp.asarray(kv_seg, jnp.int32)
    xp = np if isinstance(q_seg, np.ndarray) and isinstance(kv_seg, np.ndarray) else jnp
    q_len = q_seg.shape[1]
    import jax

    keys = _value_keys(q_dtype, kv_dtype, wide=xp is np or jax.config.jax_enable_x64)
    both = [xp.concatenate([key(xp.asarray(q_seg)), key(xp.asarray(kv_seg))], axis=1) for key in keys]
    # Rank by the keys, the first most significant: stable sorts from the least significant key.
    order = None
    for key in reversed(both):
        keyed = key if order is None else xp.take_along_axis(key, order, axis=1)
        step = xp.argsort(keyed, axis=1, stable=True)
        order = step if order is None else xp.take_along_axis(order, step, axis=1)
    changes = None
    for key in both:
        ordered = xp.take_along_axis(key, order, axis=1)
        differs = ordered[:, 1:] != ordered[:, :-1]
        changes = differs if changes is None else xp.logical_or(changes, differs)
    starts = xp.concatenate([xp.zeros_like(changes[:, :1]), changes], axis=1)
    ranks_sorted = xp.cumsum(starts.astype(np.int32), axis=1, dtype=np.int32)
    inverse = xp.argsort(order, axis=1)
    ranks = xp.take_along_axis(ranks_sorted, inverse, axis=1)
    return jnp.asarray(ranks[:, :q_len], jnp.int32), jnp.asarray(ranks[:, q_len:], jnp.int32)


def _value_keys(a, b, wide: bool) -> tuple:
    """Functions of an id array whose results, taken together, are equal exactly when the values are.

    One cast to the common integer dtype when NumPy's promotion gives one (it holds both ranges);
    for uint64 beside a signed dtype (no integer dtype holds both) two keys: "is non-negative",
    then the value's bits as an unsigned integer (a negative id never equals an unsigned one). JAX
    arrays without ``jax_enable_x64`` are at most 32 bits wide, so there the bits are a uint32."""
    common = np.promote_types(a, b)
    if np.issubdtype(common, np.integer) and (wide or common.itemsize <= 4):
        return (lambda x: x.astype(common),)
    bits = np.uint64 if wide else np.uint32
    return (lambda x: (x >= 0).astype(np.int32), lambda x: x.astype(bits))


def _normalise_segments(segment_ids, batch: int, q_len: int, kv_len: int):
    if segment_ids is None:
        return None
    if isinstance(segment_ids, tuple | list):
        if len(segment_ids) != 2:
            raise ValueError(
                "segment_ids: expected an array [batch, seq] or a pair (q_segment_ids, kv_segment_ids), "
                f"got a sequence of length {len(segment_ids)}"
            )
        q_seg, kv_seg = segment_ids
    else:
        if q_len != kv_len:
            raise ValueError(
                "segment_ids: a single array needs q_len == kv_len; pass (q_segment_ids, kv_segment_ids) "
                f"for q_len={q_len}, kv_len={kv_len}"
            )
        q_seg = kv_seg = segment_ids
    for name, seg, length in (("q_segment_ids", q_seg, q_len), ("kv_segment_ids", kv_seg, kv_len)):
        shape = _shape_of(f"segment_ids ({name})", seg)
        if not np.issubdtype(np.dtype(seg.dtype), np.integer):
            raise ValueError(f"segment_ids ({name}): expected an integer dtype, got {seg.dtype}")
        if shape != (batch, length):
            raise ValueError(f"segment_ids ({name}): expected shape {(batch, length)}, got {shape}")
    return dense_segment_ids(q_seg, kv_seg)


def make_spec(q, k, v, *, causal=False, scale=None, segment_ids=None, window=None, softcap=None):
    """Validate the contract's inputs; return ``(q, k, v, segment_ids, spec)`` normalised.

    ``segment_ids`` comes back as ``None`` or a pair ``(q_segment_ids [batch, q_len],
    kv_segment_ids [batch, kv_len])`` of int32 arrays.
    """
    import jax.numpy as jnp

    q_shape, k_shape, v_shape = _shape_of("q", q), _shape_of("k", k), _shape_of("v", v)
    for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(shape) != 4:
            raise ValueError(f"{name}: expected rank 4 [batch, seq, heads, head_dim], got shape {shape}")
    if k_shape != v_shape:
        raise ValueError(f"k and v: expected the same shape, got k {k_shape} and v {v_shape}")
    batch, q_len, num_q_heads, head_dim = q_shape
    kb, kv_len, num_kv_heads, kd = k_shape
    if kb != batch:
        raise ValueError(f"k: expected batch {batch} (q's batch), got {kb}")
    if kd != head_dim:
        raise ValueError(f"k: expected head_dim {head_dim} (q's head_dim), got {kd}")
    for name, n in (("q", q_len), ("k", kv_len)):
        if n < 1:
            raise ValueError(f"{name}: expected a sequence length of at least 1, got {n}")
    if min(batch, num_q_heads, num_kv_heads, head_dim) < 1:
        raise ValueError(f"q, k: expected non-empty batch, heads and head_dim, got q {q_shape}, k {k_shape}")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"q: expected a number of heads divisible by k's {num_kv_heads} heads (GQA), got {num_q_heads}"
        )
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) != 1:
        raise TypeError(f"q, k, v: expected one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    dtype = dtypes.pop()
    if dtype.name not in SUPPORTED_DTYPES:
        raise TypeError(f"q, k, v: expected a dtype in {list(SUPPORTED_DTYPES)}, got {dtype}")
    segments = _normalise_segments(segment_ids, batch, q_len, kv_len)
    spec = spec_from_shapes(q_len, kv_len, batch=batch, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                            head_dim=head_dim, dtype=dtype, causal=causal, window=window, softcap=softcap,
                            scale=scale, has_segments=segments is not None)
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), segments, spec


def normalise_sinks(sinks, num_q_heads: int):
    """The contract's ``sinks`` (one logit per query head, :mod:`tpuattn.sinks`) as a float32 array
    ``[num_q_heads]``, or ``None``. Any floating dtype; ``-inf`` turns a head's sink off."""
    if sinks is None:
        return None
    import jax.numpy as jnp

    shape = _shape_of("sinks", sinks)
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise TypeError(f"sinks: expected a floating dtype (one logit per query head), got {sinks.dtype}")
    if shape != (num_q_heads,):
        raise ValueError(f"sinks: expected shape ({num_q_heads},) (one logit per query head), got {shape}")
    return jnp.asarray(sinks, jnp.float32)

