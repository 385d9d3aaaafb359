"""The kernels' data layout: padding, the two ways a kernel sees ``[batch, seq, heads, head_dim]``
arrays, segment-id tiles and the in-kernel mask of one tile.

A block's last two dimensions are (sequence, lanes): the TPU's (sublane, lane) tile; per-row
statistics are the transpose, rows ``[batch, heads, 8, seq]`` (:data:`STAT_ROWS`). Padded keys are
hidden by the mask's ``kv_idx < kv_len``, padded query rows are sliced off.

:class:`Layout` picks one of two views per call:

* **columns** (``head_dim`` a multiple of 128): the contract's array reshaped to
  ``[batch, seq, heads * head_dim]``. Where the arrays come from a projection of that shape (and O goes
  into one) the reshapes cancel and nothing moves outside the kernels; arguments in the contract's
  shape are relaid out once on a TPU, which tiles an array's last two dimensions: ``(heads,
  head_dim)`` there, ``(seq, heads * head_dim)`` here (``tests/test_aot_pallas_gqa.py``). Head ``h``
  is the lane columns ``h * head_dim ...``, so a block of ``q_heads`` heads of one query block is
  ``(None, block_q, q_heads * head_dim)`` and one kv head's K/V block is ``(None, block_kv, head_dim)``:
  both obey the TPU tiling rule (the last two block dims multiples of (8, 128)). A kernel takes head
  ``h`` of a block with a lane slice at a multiple of 128 (:meth:`Layout.head`). A sequence that
  is not a multiple of its block is padded (a copy).
* **paired columns** (``head_dim`` 64 and an even number of kv heads): the same free view, two heads
  per 128-lane tile. A block of one head would be half a lane tile, so a kv block holds a *pair* of kv
  heads, ``(None, block_kv, 128)``, and a step serves the query heads of both (an even number of them,
  whole tiles). A kernel reads head ``h`` as its tile with the other head's lanes zeroed and, where
  the two sit in different halves, rolled by 64 lanes onto its kv head's half (:meth:`Layout.load`):
  contracting over all 128 lanes then sums exactly one head's products, and ``P V`` over the K/V tile
  lands the head's output on its kv head's half, from where :meth:`Layout.move` takes it home. The
  MXU pads a 64-deep contraction to its width anyway, so the pairing costs a roll and two selects per
  head and step, not a matmul.
* **heads first** (any other ``head_dim``, or 64 with an odd number of kv heads):
  ``[batch, heads, seq_padded, head_dim padded to 128]``, a transposing copy in and out. Why not
  columns there: a head of fewer than 128 lanes is part of a lane tile, and a BlockSpec that picks one
  head of ``[batch, seq, heads, head_dim]``, ``(None, block, None, head_dim)``, puts a squeezed head
  axis second-minor, which Pallas TPU refuses. The roofline counts these copies (the "wrapper" lines
  of its breakdown) and the compile stage checks that the compiler's bytes for them are at least that.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from tpuattn._checks import round_up
from tpuattn.numerics import pad_to_multiple
from tpuattn.pallas import compat

SUBLANES, LANES = 8, 128

# Per-row statistics (the forward's logsumexp terms, the backward's delta) are float32 rows
# ``[batch, heads, STAT_ROWS, seq]``: queries on lanes, one statistic per sublane (the forward:
# 0 m, 1 log l, 2 seen; delta: 0), 32 bytes a query row. A kernel that needs them as columns of its
# ``[block_q, ...]`` tiles transposes its ``(8, block_q)`` block in VMEM.
STAT_ROWS = SUBLANES

# Contract dims (..., d) of both operands: q @ k^T without materialising k^T.
NT_DIMS = (((1,), (1,)), ((), ()))


def padded_head_dim(head_dim: int) -> int:
    return round_up(head_dim, LANES)


def to_kernel_layout(x, block: int):
    """``[batch, seq, heads, d]`` -> ``[batch, heads, seq_padded, d_padded]``: the sequence padded to a
    multiple of ``block``, head_dim to a multiple of 128 lanes (zeros in the padding)."""
    return pad_to_multiple(pad_to_multiple(jnp.swapaxes(x, 1, 2), 2, block), 3, LANES)


def from_kernel_layout(x, seq_len: int, head_dim: int):
    """The inverse of :func:`to_kernel_layout`: slice off the padding, back to ``[batch, seq, heads, d]``."""
    return jnp.swapaxes(x[:, :, :seq_len, :head_dim], 1, 2)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the kernels of one call see ``[batch, seq, heads, head_dim]`` arrays (see the module's
    docstring): ``columns`` (the free view ``[batch, seq, heads * head_dim]``, ``pack`` heads to a
    128-lane tile) or heads first.

    The index maps of :mod:`tpuattn.pallas.plan` name blocks of the heads-first layout,
    ``(batch, head block, seq block, 0)``; :meth:`index_map` adapts them to this layout. With paired
    heads their "kv heads" are kv head pairs (:attr:`pack`), each with the query heads of both.
    """

    columns: bool
    head_dim: int  # one head's lanes in the kernels' arrays (padded to 128 when heads first)
    pack: int = 1  # heads per 128-lane tile: 2 for paired columns (head_dim 64)

    @classmethod
    def for_head_dim(cls, head_dim: int, num_kv_heads: int = 1) -> Layout:
        if head_dim % LANES == 0:
            return cls(columns=True, head_dim=head_dim)
        if 2 * head_dim == LANES and num_kv_heads % 2 == 0:
            return cls(columns=True, head_dim=head_dim, pack=2)
        return cls(columns=False, head_dim=padded_head_dim(head_dim))

    @classmethod
    def for_spec(cls, spec) -> Layout:
        return cls.for_head_dim(spec.head_dim, spec.num_kv_heads)

    @property
    def tile(self) -> int:
        """Lanes of the tiles a kernel computes one head with: the head's (a multiple of 128), or the
        128-lane tile of a pair of heads."""
        return self.head_dim * self.pack

    def operand(self, x, block: int):
        """A contract-layout ``[batch, seq, heads, head_dim]`` array as the kernels read it, its
        sequence padded to a multiple of ``block`` (zeros)."""
        if self.columns:
            b, t, h, d = x.shape
            return pad_to_multiple(x.reshape(b, t, h * d), 1, block)
        return to_kernel_layout(x, block)

    def result(self, x, seq_len: int, heads: int, head_dim: int):
        """A kernel's output back to ``[batch, seq_len, heads, head_dim]`` (inverse of :meth:`operand`)."""
        if self.columns:
            return x[:, :seq_len].reshape(x.shape[0], seq_len, heads, head_dim)
        return from_kernel_layout(x, seq_len, head_dim)

    def shape(self, batch: int, heads: int, seq: int) -> tuple[int, ...]:
        """The kernels' array shape for ``heads`` heads of ``seq`` (padded) rows."""
        if self.columns:
            return (batch, seq, heads * self.head_dim)
        return (batch, heads, seq, self.head_dim)

    def block(self, heads: int | None, rows: int) -> tuple:
        """A BlockSpec block of ``heads`` query heads (``None``: one kv head's K/V block, its axis
        squeezed; with paired heads, a pair's tile) of ``rows`` rows."""
        if self.columns:
            return (None, rows, heads * self.head_dim if heads else self.tile)
        return (None, heads, rows, self.head_dim)

    def index_map(self, index_map):
        """``index_map`` (returning heads-first ``(b, head block, seq block, 0)``) for this layout."""
        if not self.columns:
            return index_map

        def columns_map(*grid_and_prefetch):
            b, head_block, seq_block, _ = index_map(*grid_and_prefetch)
            return (b, seq_block, head_block)

        return columns_map

    def head(self, h) -> tuple:
        """The index of head ``h`` (a Python int or a traced int32) in a block of several heads:
        ``ref[layout.head(h)]`` is that head's ``[rows, head_dim]`` tile (with paired heads, the
        128-lane tile of its pair: :meth:`load` takes the head out of it)."""
        if not self.columns:
            return (h,)
        tile = h // self.pack if isinstance(h, int) else jax.lax.div(h, jnp.asarray(self.pack, h.dtype))
        start = tile * self.tile if isinstance(h, int) else pl.multiple_of(tile * self.tile, LANES)
        return (slice(None), pl.ds(start, self.tile))

    def half(self, h):
        """Which half of its pair's tile head ``h`` of a block is in (0 without pairs)."""
        if self.pack == 1:
            return 0
        return h % self.pack if isinstance(h, int) else jax.lax.rem(h, jnp.asarray(self.pack, h.dtype))

    def move(self, x, src, dst):
        """``x`` ``[rows, tile]``: the lanes of half ``src`` moved to half ``dst``, every other lane zero
        (pairs of heads; ``x`` itself otherwise). ``src``/``dst`` may be traced: the choice is two
        selects against the lane's half, never a branch."""
        if self.pack == 1:
            return x
        lane = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
        half = jax.lax.div(lane, jnp.int32(self.head_dim))  # truncating: floor division lowers via sign
        # A roll by 64 lanes swaps the halves; in half dst it holds what the other half held.
        swapped = compat.roll_lanes(x, self.head_dim)
        return jnp.where(half == dst, jnp.where(half == src, x, swapped), jnp.zeros_like(x))

    def store(self, ref, q_heads: int, value) -> None:
        """Write ``value(h)``, head ``h``'s ``[rows, tile]`` result on its own half (:meth:`move`; zero
        elsewhere), for the ``q_heads`` heads of a block ``ref``: a pair's two results summed into
        their tile."""
        for h in range(0, q_heads, self.pack):
            tile = value(h)
            for j in range(1, self.pack):
                tile = tile + value(h + j)
            ref[self.head(h)] = tile.astype(ref.dtype)

    def load(self, ref, h, at=0):
        """Head ``h`` of a block ``ref`` of several heads as a ``[rows, tile]`` value: its own tile, or,
        with paired heads, its lanes alone (the rest zero) moved onto half ``at`` (its kv head's),
        ready to contract with a kv pair's whole tile."""
        x = ref[self.head(h)]
        return self.move(x, self.half(h), at)


def padded_segment_ids(segment_ids, block_q: int, block_kv: int):
    """``(q_segment_ids, kv_segment_ids)`` ``[batch, len]`` padded to the block multiples by repeating
    each row's last id, so the padding widens no block's [min, max] range (the schedule's overlap test);
    padded keys are hidden by ``kv_idx < kv_len`` anyway."""
    def pad(s, block):
        return jnp.pad(s, ((0, 0), (0, -s.shape[1] % block)), mode="edge")

    return pad(segment_ids[0], block_q), pad(segment_ids[1], block_kv)


def segment_layouts(segment_ids, block_q: int, block_kv: int):
    """Padded segment ids (:func:`padded_segment_ids`) as they are, as lane columns ``[b, t, 128]``
    and as sublane rows ``[b, 8, t]``.

    A kernel compares a column of query ids with a row of key ids; both are kept as
    full (8, 128)-aligned tiles so the BlockSpecs obey the TPU tiling rule.
    """
    q_seg, kv_seg = padded_segment_ids(segment_ids, block_q, block_kv)

    def column(s):
        return jnp.broadcast_to(s[:, :, None], (*s.shape, LANES))

    def row(s):
        return jnp.broadcast_to(s[:, None, :], (s.shape[0], SUBLANES, s.shape[1]))

    return {"q": q_seg, "kv": kv_seg, "q_col": column(q_seg), "q_row": row(q_seg),
            "kv_col": column(kv_seg), "kv_row": row(kv_seg)}


def tile_visibility(mask, shape, q_start, kv_start, q_seg=None, kv_seg=None, *, transposed=False):
    """Which elements of one score tile the mask keeps, from iotas inside the kernel.

    The tile is ``[block_q, block_kv]`` (queries on sublanes), or its transpose when
    ``transposed`` (keys on sublanes, as in the dK/dV kernel). ``q_seg``/``kv_seg`` are the
    tile's segment ids already laid out to broadcast against it.
    """
    q_axis, kv_axis = (1, 0) if transposed else (0, 1)
    q_idx = q_start + jax.lax.broadcasted_iota(jnp.int32, shape, q_axis)
    kv_idx = kv_start + jax.lax.broadcasted_iota(jnp.int32, shape, kv_axis)
    return mask.visible(q_idx, kv_idx, q_seg, kv_seg, xp=jnp)
