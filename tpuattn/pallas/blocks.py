"""Block sizes per pass: small frozen dataclasses, validated, with defaults from the chip.

A TPU vector register holds 8 sublanes x 128 lanes of 32-bit values. Every block below
puts one of its sequence extents on the lane axis somewhere in a kernel:

* forward and dQ: the scores ``s = q k^T`` are ``[block_q, block_kv]``, so ``block_kv``
  lies on lanes -> a multiple of 128; ``block_q`` lies on sublanes -> a multiple of 8;
* dK/dV: that kernel works on the transposed scores ``s^T = k q^T`` (``[block_kv, block_q]``)
  so that the saved logsumexp broadcasts as a row -> ``block_q`` a multiple of 128 and
  ``block_kv`` a multiple of 8 -- and the dQ pass shares the backward padding, so both
  backward passes use multiples of 128 for both extents.

Blocks larger than the (padded) sequence are clamped to it, so a 7-token problem uses an
8 x 128 forward tile, not 512 x 512.
"""

from __future__ import annotations

import dataclasses

from tpuattn import chips
from tpuattn._checks import is_int, positive_int, round_up
from tpuattn.pallas.layout import LANES, SUBLANES, padded_head_dim


def _check(name: str, value, multiple_of: int) -> int:
    value = positive_int(name, value)
    if value % multiple_of:
        raise ValueError(f"{name}: expected a multiple of {multiple_of} (the TPU tile is {SUBLANES} sublanes "
                         f"x {LANES} lanes), got {value}")
    return value


@dataclasses.dataclass(frozen=True)
class ForwardBlocks:
    """Forward tile: ``block_q`` rows (multiple of 8) x ``block_kv`` keys (multiple of 128)."""

    block_q: int = 128
    block_kv: int = 128

    def __post_init__(self):
        object.__setattr__(self, "block_q", _check("block_sizes.forward.block_q", self.block_q, SUBLANES))
        object.__setattr__(self, "block_kv", _check("block_sizes.forward.block_kv", self.block_kv, LANES))

    def clamp(self, q_len: int, kv_len: int) -> ForwardBlocks:
        """Blocks no larger than the sequences rounded up to the tile."""
        return ForwardBlocks(min(self.block_q, round_up(q_len, SUBLANES)),
                             min(self.block_kv, round_up(kv_len, LANES)))


@dataclasses.dataclass(frozen=True)
class BackwardBlocks:
    """Backward tile (dQ and dK/dV passes): both extents multiples of 128."""

    block_q: int = 128
    block_kv: int = 128

    def __post_init__(self):
        object.__setattr__(self, "block_q", _check("block_sizes.backward.block_q", self.block_q, LANES))
        object.__setattr__(self, "block_kv", _check("block_sizes.backward.block_kv", self.block_kv, LANES))

    def clamp(self, q_len: int, kv_len: int) -> BackwardBlocks:
        return BackwardBlocks(min(self.block_q, round_up(q_len, LANES)),
                              min(self.block_kv, round_up(kv_len, LANES)))


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Block sizes of the three passes. ``BlockSizes.uniform(128)`` sets every extent."""

    forward: ForwardBlocks = ForwardBlocks()
    backward: BackwardBlocks = BackwardBlocks()

    def __post_init__(self):
        if not isinstance(self.forward, ForwardBlocks):
            raise ValueError(f"block_sizes.forward: expected a ForwardBlocks, got {self.forward!r}")
        if not isinstance(self.backward, BackwardBlocks):
            raise ValueError(f"block_sizes.backward: expected a BackwardBlocks, got {self.backward!r}")

    @classmethod
    def uniform(cls, block: int) -> BlockSizes:
        return cls(ForwardBlocks(block, block), BackwardBlocks(block, block))


def as_block_sizes(value, head_dim: int, dtype) -> BlockSizes:
    """Normalise the ``block_sizes`` option: None (defaults), an int, a BlockSizes or ForwardBlocks."""
    if value is None:
        return default_block_sizes(head_dim, dtype)
    if isinstance(value, BlockSizes):
        return value
    if isinstance(value, ForwardBlocks):
        return BlockSizes(value, default_block_sizes(head_dim, dtype).backward)
    if is_int(value):
        return BlockSizes.uniform(_check("block_sizes", value, LANES))
    raise ValueError(
        f"block_sizes: expected None, an int (multiple of {LANES}), a BlockSizes or a ForwardBlocks, "
        f"got {value!r}"
    )


# --------------------------------------------------------------------------- defaults
CANDIDATES = (512, 256, 128)


def forward_vmem_bytes(block_q: int, block_kv: int, head_dim: int, itemsize: int) -> int:
    """VMEM one forward grid step holds (head_dim already padded to 128).

    inputs, double-buffered by the pipeline:   2 * (block_q + 2 * block_kv) * head_dim * itemsize
    output, double-buffered:                   2 * block_q * head_dim * itemsize
    float32 scratch (accumulator, m, l):       4 * block_q * (head_dim + 2 * 128)
    float32 temporaries (s, p, mask):          3 * 4 * block_q * block_kv
    """
    inputs = 2 * (block_q + 2 * block_kv) * head_dim * itemsize
    output = 2 * block_q * head_dim * itemsize
    scratch = 4 * block_q * (head_dim + 2 * LANES)
    temps = 3 * 4 * block_q * block_kv
    return inputs + output + scratch + temps


def backward_vmem_bytes(block_q: int, block_kv: int, head_dim: int, itemsize: int) -> int:
    """VMEM one dK/dV grid step holds (the larger of the two backward passes).

    inputs q, dO (block_q rows) and k, v (block_kv rows), double-buffered:
                                               2 * 2 * (block_q + block_kv) * head_dim * itemsize
    outputs dK, dV double-buffered:            2 * 2 * block_kv * head_dim * itemsize
    float32 scratch dK, dV:                    2 * 4 * block_kv * head_dim
    float32 temporaries (s, p, dp, ds):        4 * 4 * block_q * block_kv
    """
    inputs = 4 * (block_q + block_kv) * head_dim * itemsize
    outputs = 4 * block_kv * head_dim * itemsize
    scratch = 8 * block_kv * head_dim
    temps = 16 * block_q * block_kv
    return inputs + outputs + scratch + temps


def vmem_budget_bytes(capacity: int) -> int:
    """The share of VMEM we plan for: an eighth of the chip's VMEM, at most 16 MiB.

    Mosaic's default scoped-VMEM limit is 16 MiB on v4/v5e (32 MiB on v6e) and the compiler
    needs room of its own, so staying well below it keeps every default compilable without
    raising ``vmem_limit_bytes``; 128 MiB chips get 16 MiB, 16 MiB chips 2 MiB.
    """
    return min(capacity // 8, 16 * 1024 * 1024)


def default_block_sizes(head_dim: int, dtype, vmem_bytes: int | None = None) -> BlockSizes:
    """The largest square-ish blocks (from 512, 256, 128) whose VMEM need fits the budget.

    Example: v5e (128 MiB VMEM -> 16 MiB budget), head_dim 128, bfloat16: the forward at
    512 x 512 needs 2*(512+1024)*128*2 + 2*512*128*2 + 4*512*(128+256) + 12*512*512
    = 0.79 + 0.26 + 0.79 + 3.15 MB ~ 5 MB, so 512 x 512; on CPU (16 MiB default -> 2 MiB
    budget) the same problem gets 256 x 256 (1.7 MB), and float32 with head_dim 256 gets 128 x 128.
    """
    import jax.numpy as jnp

    if vmem_bytes is None:
        vmem_bytes, _ = chips.vmem_bytes()
    budget = vmem_budget_bytes(vmem_bytes)
    d = padded_head_dim(head_dim)
    itemsize = jnp.dtype(dtype).itemsize

    def pick(need):
        for bq in CANDIDATES:
            for bk in CANDIDATES:
                if bk <= bq and need(bq, bk, d, itemsize) <= budget:
                    return bq, bk
        return LANES, LANES

    fq, fk = pick(forward_vmem_bytes)
    bq, bk = pick(backward_vmem_bytes)
    return BlockSizes(ForwardBlocks(fq, fk), BackwardBlocks(bq, bk))
