"""One mask model for every implementation.

Positions use bottom-right alignment: query ``i`` sits at key position
``p_i = i + (kv_len - q_len)``, so a single decoding query sees the whole cache.

* ``causal``            keeps keys ``j <= p_i``
* ``window=(l, r)``     keeps keys ``p_i - l <= j <= p_i + r`` (``None`` = unbounded side)
* segment ids           keep keys whose segment equals the query's segment
* padding               keys ``j >= kv_len`` are never visible (implementations pad internally)

All masks combine with AND.  The same :meth:`MaskSpec.visible` is used by the
reference, the blockwise loop and (on iotas) the Pallas kernel, and
:meth:`MaskSpec.block_map` classifies whole tiles so that implementations can
skip the ones that are entirely hidden.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Tile classification returned by MaskSpec.block_map.
EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """The position-only part of a mask (segments are data, see ``has_segments``)."""

    q_len: int
    kv_len: int
    causal: bool = False
    window: tuple[int | None, int | None] | None = None  # (left, right)
    has_segments: bool = False

    @property
    def offset(self) -> int:
        """Key position of query 0 minus 0: ``kv_len - q_len`` (bottom-right alignment)."""
        return self.kv_len - self.q_len

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
