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

**Defaults come from the compiler.** ``compiled_blocks.json`` records which (block_q, block_kv) the
real TPU compiler accepts for each chip, kernel, head_dim and dtype at Mosaic's default scoped VMEM
limit (``python -m tpuattn.aot --blocks``; compiled, not run); ``compiled_blocks_paired.json`` the same
for head_dim 64's paired heads (``--head-dims 64``), whose steps hold two heads. For a chip in that
table the default is the largest accepted pair up to 512 -- or 1024 where the chip's ridge point (peak
FLOP/s over HBM bandwidth) exceeds 512 FLOP/byte, since the forward's arithmetic intensity is about
``block_q`` FLOP/byte in bf16. Elsewhere (no TPU: interpret mode; head_dim above 256) the VMEM model
below picks.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

from tpuattn import chips
from tpuattn._checks import is_int, positive_int, round_up
from tpuattn.options import Blocks, scoped_vmem_limit
from tpuattn.pallas.layout import LANES, STAT_ROWS, SUBLANES, Layout, padded_head_dim


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


def as_block_sizes(value, head_dim: int, dtype, pack: int = 1, chip=None,
                   seq_len: int | None = None) -> BlockSizes:
    """Normalise the ``blocks`` option: None (defaults), a :class:`tpuattn.options.Blocks` (a size left
    None takes its default), an int, a BlockSizes or ForwardBlocks.
    ``pack``: query heads of a kv head pair's tile a step serves at least (2 with paired heads),
    ``chip``, ``seq_len``: as in :func:`default_block_sizes`."""
    if value is None:
        return default_block_sizes(head_dim, dtype, chip=chip, pack=pack, seq_len=seq_len)
    if isinstance(value, Blocks):
        given = value.set()
        if len(given) < 4:
            defaults = default_block_sizes(head_dim, dtype, chip=chip, pack=pack, seq_len=seq_len)
            given = dict(block_q=defaults.forward.block_q, block_kv=defaults.forward.block_kv,
                         backward_block_q=defaults.backward.block_q,
                         backward_block_kv=defaults.backward.block_kv) | given
        return BlockSizes(ForwardBlocks(given["block_q"], given["block_kv"]),
                          BackwardBlocks(given["backward_block_q"], given["backward_block_kv"]))
    if isinstance(value, BlockSizes):
        return value
    if isinstance(value, ForwardBlocks):
        defaults = default_block_sizes(head_dim, dtype, chip=chip, pack=pack, seq_len=seq_len)
        return BlockSizes(value, defaults.backward)
    if is_int(value):
        return BlockSizes.uniform(_check("block_sizes", value, LANES))
    raise ValueError(
        f"block_sizes: expected None, an int (multiple of {LANES}), a BlockSizes or a ForwardBlocks, "
        f"got {value!r}"
    )


def blocks_for_spec(value, spec, chip=None) -> BlockSizes:
    """:func:`as_block_sizes` for a problem: its head_dim and dtype, and its layout's ``pack`` (paired
    heads at head_dim 64 have blocks of their own in the compiler's table: a step holds two heads)."""
    return as_block_sizes(value, spec.head_dim, spec.dtype, Layout.for_spec(spec).pack, chip,
                          max(spec.q_len, spec.kv_len))


# --------------------------------------------------------------------------- defaults
CANDIDATES = (512, 256, 128)


def forward_vmem_bytes(block_q: int, block_kv: int, head_dim: int, itemsize: int, q_heads: int = 1) -> int:
    """VMEM one forward grid step holds (head_dim already padded to 128), the step serving ``q_heads``
    query heads of one GQA group (:func:`fit_q_heads`) against one K/V block.

    inputs, double-buffered by the pipeline:   2 * (q_heads * block_q + 2 * block_kv) * head_dim * itemsize
    output, double-buffered:                   2 * q_heads * block_q * head_dim * itemsize
    float32 scratch (accumulator, m, l):       4 * q_heads * block_q * (head_dim + 2 * 128)
    float32 temporaries (s, p, mask):          3 * 4 * block_q * block_kv   (one head at a time)
    """
    inputs = 2 * (q_heads * block_q + 2 * block_kv) * head_dim * itemsize
    output = 2 * q_heads * block_q * head_dim * itemsize
    scratch = 4 * q_heads * block_q * (head_dim + 2 * LANES)
    temps = 3 * 4 * block_q * block_kv
    return inputs + output + scratch + temps


def backward_vmem_bytes(block_q: int, block_kv: int, head_dim: int, itemsize: int, q_heads: int = 1) -> int:
    """VMEM one dK/dV grid step holds (the larger of the two backward passes at one head a step),
    serving ``q_heads`` query heads of a GQA group against one K/V block.

    In bytes::

        inputs q, dO (block_q rows per head) and k, v (block_kv rows), double-buffered:
                                               2 * 2 * (q_heads * block_q + block_kv) * head_dim * itemsize
        outputs dK, dV double-buffered:        2 * 2 * block_kv * head_dim * itemsize
        float32 scratch dK, dV:                2 * 4 * block_kv * head_dim
        float32 temporaries (s, p, dp, ds):    4 * 4 * block_q * block_kv   (one head at a time)
    """
    inputs = 4 * (q_heads * block_q + block_kv) * head_dim * itemsize
    outputs = 4 * block_kv * head_dim * itemsize
    scratch = 8 * block_kv * head_dim
    temps = 16 * block_q * block_kv
    return inputs + outputs + scratch + temps


def dq_vmem_bytes(block_q: int, block_kv: int, head_dim: int, itemsize: int, q_heads: int = 1) -> int:
    """VMEM one dQ (or row-sum) grid step holds, serving ``q_heads`` query heads against one K/V block.

    In bytes::

        inputs q, dO (per head) and k, v, double-buffered:
                                               2 * 2 * (q_heads * block_q + block_kv) * head_dim * itemsize
        float32 logsumexp and delta, 8-sublane rows, double-buffered, and delta's 128-lane scratch:
                                               2 * 2 * q_heads * block_q * 8 * 4 + q_heads * block_q * 128 * 4
        output dQ, double-buffered, and its float32 scratch:
                                               q_heads * block_q * head_dim * (2 * itemsize + 4)
        float32 temporaries (s, p, dp, ds):    4 * 4 * block_q * block_kv   (one head at a time)

    Used to choose the heads per step of the dQ grid; :func:`backward_vmem_bytes` (the dK/dV step)
    at one head a step sizes the backward blocks.
    """
    inputs = 4 * (q_heads * block_q + block_kv) * head_dim * itemsize
    rows = 16 * q_heads * block_q * STAT_ROWS + 4 * q_heads * block_q * LANES
    output = q_heads * block_q * head_dim * (2 * itemsize + 4)
    return inputs + rows + output + 16 * block_q * block_kv


# A head-block kernel asks the compiler for its modelled VMEM times this margin, and a head block is
# chosen so that this fits in three quarters of the chip's VMEM (the rest for the compiler's own use).
# 2, not the decode kernel's 1.5: compiled for v5e, the forward of a group of 8 query heads (512 x 512,
# bf16, head_dim 128) asked for 21.59 MiB against 13.5 MiB modelled (1.6x; the unrolled head loop
# keeps more than one head's temporaries live).
VMEM_MARGIN = 2.0


def fit_q_heads(group_size: int, need, chip=None, multiple_of: int = 1) -> int:
    """Query heads one forward, dQ or dK/dV grid step serves: the largest divisor of the GQA ``group_size``
    (a multiple of ``multiple_of``: whole 128-lane tiles of paired heads) whose modelled VMEM
    ``need(q_heads)`` (bytes), with :data:`VMEM_MARGIN`, fits three quarters of ``chip``'s VMEM. The
    whole group without a chip (interpret mode has no VMEM to fit). K/V blocks are then fetched once
    per head block, not once per query head."""
    if chip is None:
        return group_size
    for q_heads in range(group_size, 0, -multiple_of):
        if group_size % q_heads == 0 and need(q_heads) * VMEM_MARGIN <= chip.vmem_bytes * 3 // 4:
            return q_heads
    return multiple_of


def vmem_limit_bytes(need: int, q_heads: int, chip=None) -> int | None:
    """``vmem_limit_bytes`` of a head-block kernel: None (the compiler's default scoped limit) for one
    head per step, else the package's one rule (:func:`tpuattn.options.scoped_vmem_limit`) with
    :data:`VMEM_MARGIN`: None off a chip or while the margined ``need`` fits the default; else that,
    rounded up to a MiB, at most the chip's VMEM."""
    return None if q_heads == 1 else scoped_vmem_limit(need, VMEM_MARGIN, chip)


def vmem_budget_bytes(capacity: int) -> int:
    """The share of VMEM we plan for: an eighth of the chip's VMEM, at most 16 MiB.

    Mosaic's default scoped-VMEM limit is 16 MiB on v4/v5e (32 MiB on v6e) and the compiler
    needs room of its own, so staying well below it keeps every default compilable without
    raising ``vmem_limit_bytes``; 128 MiB chips get 16 MiB, 16 MiB chips 2 MiB.
    """
    return min(capacity // 8, 16 * 1024 * 1024)


COMPILED_TABLE = Path(__file__).with_name("compiled_blocks.json")
# head_dim 64 with paired heads: every step holds a kv head pair's two heads in one 128-lane tile, so its
# blocks were compiled apart (python -m tpuattn.aot --blocks --head-dims 64: a pair of heads per problem).
COMPILED_PAIRED_TABLE = Path(__file__).with_name("compiled_blocks_paired.json")


@functools.lru_cache(maxsize=2)
def compiled_table(paired: bool = False) -> dict:
    """A committed compile table: ``{"rows": [...], "jax_version": ..., "libtpu_version": ...}``; with
    ``paired``, the one of head_dim 64's paired heads."""
    return json.loads((COMPILED_PAIRED_TABLE if paired else COMPILED_TABLE).read_text())


def compiled_pairs(chip: str, kernel: str, head_dim: int, dtype, pack: int = 1) -> list[tuple[int, int]]:
    """The (block_q, block_kv) the TPU compiler accepted for ``chip``'s ``kernel`` ("forward" or
    "backward") at this head_dim and dtype: head_dim padded to 128 for one head a tile, or with
    ``pack=2`` the paired table's rows (two heads of 64 to a 128-lane tile, compiled with a kv head
    pair); empty when the table has no such rows."""
    import jax.numpy as jnp

    d, name = (head_dim if pack > 1 else padded_head_dim(head_dim)), jnp.dtype(dtype).name
    return [(r["block_q"], r["block_kv"]) for r in compiled_table(paired=pack > 1)["rows"]
            if r["chip"] == chip and r["kernel"] == kernel and r["head_dim"] == d and r["dtype"] == name
            and r["status"] == "ok"]


def target_block(chip: chips.Chip) -> int:
    """512, or 1024 where the chip's ridge point exceeds 512 FLOP/byte (v6e)."""
    device = chip.per_device()
    return 1024 if device["bf16_flops"] / device["hbm_bandwidth"] > 512 else 512


def _from_compiled(chip: chips.Chip, head_dim: int, dtype, pack: int) -> BlockSizes | None:
    limit = target_block(chip)

    def best(kernel):
        accepted = compiled_pairs(chip.name, kernel, head_dim, dtype, pack)
        pairs = [(q, k) for q, k in accepted if k <= q <= limit]
        return max(pairs, key=lambda p: (p[0] * p[1], p[0])) if pairs else None

    forward, backward = best("forward"), best("backward")
    if forward is None or backward is None:
        return None
    return BlockSizes(ForwardBlocks(*forward), BackwardBlocks(*backward))


TUNED_TABLE = Path(__file__).with_name("tuned_blocks.json")


@functools.lru_cache(maxsize=1)
def tuned_table() -> dict:
    """The blocks the compiled static estimate chose per chip and sequence length
    (``python -m tpuattn.aot --tune``: ``{"rows": [...], "command": ..., "versions": ...}``); no rows
    without the file."""
    return json.loads(TUNED_TABLE.read_text()) if TUNED_TABLE.exists() else {"rows": []}


def _from_tuned(chip: chips.Chip, head_dim: int, dtype, pack: int,
                seq_len: int | None) -> BlockSizes | None:
    """The tuned entry of this chip, head_dim and dtype whose sequence length is nearest ``seq_len`` (by
    ratio); None without a length, with paired heads or where the table has no such entry."""
    import math

    import jax.numpy as jnp

    if seq_len is None or pack > 1:
        return None
    rows = [r for r in tuned_table()["rows"] if r["chip"] == chip.name
            and r["head_dim"] == padded_head_dim(head_dim) and r["dtype"] == jnp.dtype(dtype).name]
    if not rows:
        return None
    r = min(rows, key=lambda r: abs(math.log(r["seq_len"] / max(seq_len, 1))))
    return BlockSizes(ForwardBlocks(r["block_q"], r["block_kv"]),
                      BackwardBlocks(r["backward_block_q"], r["backward_block_kv"]))


def default_block_sizes(head_dim: int, dtype, vmem_bytes: int | None = None, chip=None,
                        pack: int = 1, seq_len: int | None = None) -> BlockSizes:
    """Default blocks: from the compiler's table for the target chip (``chip``, a name or
    :class:`~tpuattn.chips.Chip`; else :func:`tpuattn.chips.target_chip`), otherwise the largest
    square-ish blocks (from 512, 256, 128) whose modelled VMEM need fits the budget.

    Example of the model: v5e (128 MiB VMEM -> 16 MiB budget), head_dim 128, bfloat16: the forward at
    512 x 512 needs 2*(512+1024)*128*2 + 2*512*128*2 + 4*512*(128+256) + 12*512*512
    = 0.79 + 0.26 + 0.79 + 3.15 MB ~ 5 MB, so 512 x 512; on CPU (16 MiB default -> 2 MiB
    budget) the same problem gets 256 x 256 (1.7 MB), and float32 with head_dim 256 gets 128 x 128.

    ``pack=2`` (paired heads, head_dim 64): a grid step holds a kv head pair's query heads, at least two,
    so a TPU's blocks come from the paired table (compiled with a pair; on v3 float32 the backward
    gets 512 x 128, where head_dim 128's 512 x 512 spills) or fit the model at two heads a
    step. Interpret mode has no VMEM to fit, and keeps one head's blocks.

    ``seq_len`` given (:func:`blocks_for_spec` passes the problem's): where ``tuned_blocks.json`` (the
    blocks the compiled static estimate chose, ``python -m tpuattn.aot --tune``) has entries for the chip,
    head_dim and dtype, the one of the nearest sequence length wins over the compiler's table.
    """
    import jax.numpy as jnp

    heads = 1
    if vmem_bytes is None:
        target = chips.get(chip) if isinstance(chip, str) else (chip or chips.target_chip())
        if target is not None:
            tuned = _from_tuned(target, head_dim, dtype, pack, seq_len)
            if tuned is not None:
                return tuned
            compiled = _from_compiled(target, head_dim, dtype, pack)
            if compiled is not None:
                return compiled
            vmem_bytes, heads = target.vmem_bytes, pack
        else:
            vmem_bytes, _ = chips.vmem_bytes()
    budget = vmem_budget_bytes(vmem_bytes)
    d = padded_head_dim(head_dim)
    itemsize = jnp.dtype(dtype).itemsize

    def pick(need):
        for bq in CANDIDATES:
            for bk in CANDIDATES:
                if bk <= bq and need(bq, bk, d, itemsize, heads) <= budget:
                    return bq, bk
        return LANES, LANES

    fq, fk = pick(forward_vmem_bytes)
    bq, bk = pick(backward_vmem_bytes)
    return BlockSizes(ForwardBlocks(fq, fk), BackwardBlocks(bq, bk))
