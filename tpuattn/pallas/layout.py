"""The kernels' data layout: padding, the ``[batch, heads, seq, head_dim]`` layout, segment-id tiles
and the in-kernel mask of one tile.

A block's last two dimensions are (sequence, head_dim): the TPU's (sublane, lane) tile. head_dim
is padded to a multiple of 128 lanes and the sequences to their block multiples; padded keys are
hidden by the mask's ``kv_idx < kv_len``, padded query rows are sliced off.

Why the kernels do not read the contract's ``[batch, seq, heads, head_dim]`` directly: a BlockSpec
that picks one head there, ``(None, block, None, head_dim)``, puts a squeezed head axis second-minor,
and Pallas TPU refuses it (the last two block dims must be multiples of (8, 128) or the full dims).
A block holding every head, ``(None, block, heads, head_dim)``, does compile for v5e (checked with the
TPU compiler), at the price of a kernel that loops over heads in VMEM with VMEM growing with the head
count -- not done. The copies in and out of this layout are therefore part of the Pallas path's cost:
the roofline counts them (the "wrapper" lines of its breakdown) and the compile stage checks that the
compiler's bytes for them are at least that.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpuattn._checks import round_up
from tpuattn.numerics import pad_to_multiple

SUBLANES, LANES = 8, 128

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
