"""Pallas TPU flash attention, forward and backward, behind the contract as ``impl="pallas"``.

Use it through the contract::

    tpuattn.attention(q, k, v, causal=True, impl="pallas",
                      blocks=Blocks(block_q=256, block_kv=512),  # optional
                      interpret=None,                            # optional
                      backward="exact")                          # optional

Options (the record :class:`tpuattn.options.PallasOptions`, validated before anything is traced):
  backward: ``"exact"`` (default; ``None`` means it) computes the backward's per-row ``delta`` as
    ``rowsum(P * dP)`` in a pass of its own (9 matmuls per visible tile in all); ``"fast"`` as
    ``rowsum(dO * O)`` from the forward's float32 output, outside the kernels (7 matmuls). See
    ``backward.py`` for the accuracy each buys. Blocks of a larger problem (ring, sinks) always use
    the exact row sums.
  blocks: ``None`` (defaults from the chip, :func:`default_block_sizes`), a
    :class:`tpuattn.options.Blocks` (the forward's ``block_q`` a multiple of 8 and ``block_kv`` of
    128, the backward's ``backward_block_q`` and ``backward_block_kv`` multiples of 128; a size left
    ``None`` takes its default) or an int (a multiple of 128, every extent). Blocks are clamped to
    the padded sequence. The old spellings are read into it: ``block_q=`` / ``block_kv=`` as the
    forward's, ``block_sizes=`` (an int, a :class:`BlockSizes` or a :class:`ForwardBlocks`) as the
    same sizes.
  interpret: ``None`` compiles on a TPU and uses Pallas interpret mode elsewhere; ``True`` /
    ``False`` force it; ``"simulate"`` runs the TPU simulator with race detection (read the
    verdict with :func:`races_found`); a ``pltpu.InterpretParams`` is used as given.

Public names (the submodules hold the rest):
  * :class:`BlockSizes`, :class:`ForwardBlocks`, :class:`BackwardBlocks`, :func:`default_block_sizes`,
    :func:`forward_vmem_bytes`, :func:`backward_vmem_bytes` -- block sizes and the one VMEM model
    (``blocks.dq_vmem_bytes`` and ``blocks.fit_q_heads`` size the head blocks);
  * :func:`flash_forward` (out and logsumexp terms), :func:`flash_backward` (dq, dk, dv);
  * :func:`resolve_interpret`, :func:`races_found`, :func:`reset_races`.

Design in one paragraph each:
  * Layout (``layout.py``): the kernels read the contract's ``[batch, seq, heads, head_dim]`` as the
    free view ``[batch, seq, heads * head_dim]``, a head per 128-lane column block (head_dim a
    multiple of 128) or two heads to a block (head_dim 64 on an even number of kv heads: a K/V
    block is a kv head pair's tile, and each query head's lanes are rolled onto its kv head's
    half); any other head_dim is transposed to ``[batch, heads, seq, head_dim]`` and padded to 128
    lanes outside the kernels. Sequences are padded to the block multiples; padded keys are
    hidden by the mask's ``kv_idx < kv_len``.
  * Skipping: a per-outer-block schedule (``plan.py``) is scalar-prefetched; index maps
    read it so a step past a block's count names the block already resident (no DMA) and
    ``pl.when`` skips its compute; the grid's reduction axis is as long as the longest list.
    Segment ids add a run-time per-tile [min, max] overlap test computed in JAX.
  * GQA/MQA: the forward and dQ grids run over head blocks, the query heads of one GQA group (a
    divisor of it where the chip's VMEM asks), looped inside a grid step against one K/V block:
    K/V are fetched once per group and a 16/2-head problem takes the grid steps of a 2/2 one. The
    dK/dV grid runs over kv heads, a step looping over a head block of the group's query heads (the
    head blocks an ``arbitrary`` axis), so dK/dV are summed in VMEM; K/V are never repeated.
  * Backward: FlashAttention-2 as three passes (row sums of P * dP, dQ, dK/dV), with the
    logsumexp saved as (max, log sum) for precision; see ``backward.py`` for why delta is the row
    sum of P * dP by default (``backward="fast"`` drops that pass).

Files: ``compat.py`` (JAX 0.7.2 vs 0.10.2 only), ``blocks.py`` (sizes, VMEM model, defaults),
``layout.py`` (padding, kernel layout, tile masks), ``plan.py`` (schedule tables, index maps, the
step guard, counts), ``forward.py``, ``backward.py``, ``vjp.py`` (custom VJP and options).
"""

from tpuattn.pallas.backward import backward as flash_backward
from tpuattn.pallas.blocks import (
    BackwardBlocks,
    BlockSizes,
    ForwardBlocks,
    backward_vmem_bytes,
    blocks_for_spec,
    default_block_sizes,
    forward_vmem_bytes,
)
from tpuattn.pallas.compat import races_found, reset_races
from tpuattn.pallas.forward import forward as flash_forward
from tpuattn.pallas.layout import STAT_ROWS
from tpuattn.pallas.vjp import OPTIONS, PARTIAL, pallas_attention, resolve_interpret
from tpuattn.registry import ScheduleModel, register
from tpuattn.supports import low_precision_matmul_refused

__all__ = [
    "BackwardBlocks",
    "BlockSizes",
    "ForwardBlocks",
    "backward_vmem_bytes",
    "default_block_sizes",
    "flash_backward",
    "flash_forward",
    "forward_vmem_bytes",
    "races_found",
    "reset_races",
    "resolve_interpret",
]


def _default_forward_blocks(spec, chip=None) -> tuple[int, int]:
    forward = blocks_for_spec(None, spec, chip).forward
    return forward.block_q, forward.block_kv


def _supports(spec, backend=None):
    return low_precision_matmul_refused(spec, backend, "pallas")


register(
    "pallas",
    pallas_attention,
    supports=_supports,
    description="Pallas TPU flash attention (compiled on TPU, interpret mode elsewhere), custom VJP",
    interpreted_off_tpu=True,
    schedule="flash (row-sum pass)",
    default_blocks=_default_forward_blocks,
    options=OPTIONS,
    partial=PARTIAL,
    # The local kernel of tpuattn.parallel with impl="auto" on a TPU (compiled there, interpreted elsewhere).
    partial_rank=lambda spec, backend: 0.0 if backend == "tpu" else None,
    # logsumexp and delta are float32 rows [batch, heads, 8, seq] (32 bytes a query row), read by
    # every pass as saved. head_dim is padded to 128 where it is not a multiple of it, except 64 with
    # paired kv heads (two heads to a lane tile). Q, K, V, O (dO, dQ, dK, dV) in the contract's
    # [batch, seq, heads, head_dim] are relaid out once each around the kernels: to and from the
    # heads-first copy, or, for the kernels' view [batch, seq, heads * head_dim] (head_dim a multiple
    # of 128, or paired 64), between the TPU's tiling of (heads, head_dim) and that of the view (none
    # when the arrays come from and go to projections of that shape: tests/test_aot_pallas_gqa.py).
    # The forward and dQ grids step over GQA groups: K/V read once per kv head.
    model=ScheduleModel(lse_row_bytes=4 * STAT_ROWS, delta_row_bytes=4 * STAT_ROWS, pads_head_dim=True,
                        pairs_heads=True, kernel_layout_copies=True, lse_copies_in_backward=0,
                        kv_once_per_group=True),
)
