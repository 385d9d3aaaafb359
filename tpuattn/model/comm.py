"""The ring's communication model, beside the roofline (modelled, not measured).

**Units: one JAX device**, as everywhere in :mod:`tpuattn.model` (:meth:`tpuattn.chips.Chip.per_device`):
a ring runs over JAX devices, so its compute is one device's peak FLOP/s for the dtype
(:meth:`tpuattn.model.roofline.ChipSpec.peak_flops`: bf16 peak, or the modelled f32 peak = bf16 / 6)
and its transfer one device's share of an ICI link. On v5e (one TensorCore) and the megacore v5p (one
device spans both) a device is the chip and has the chip's links; on a two-device chip (tpu7x) the two
devices are assumed to share the chip's links, half each (both send at every ring step). This table
carries ICI figures for v5e and v5p only.

At each ring step a device sends the K and V block it holds to its neighbour and computes attention
of its queries against that block. With ``c`` tokens per device (``c = T / n``), ``H`` query heads,
``Hk`` kv heads, head dim ``D`` and ``s`` bytes per element, a step that computes a full block:

* **transfer**: ``2 c Hk D s`` bytes (K and V) over one ICI link, at ``W`` bytes/s one way
  (:attr:`tpuattn.model.roofline.ChipSpec.ici_link_bandwidth`);
* **compute**: ``4 c^2 H D`` FLOPs (two matmuls) at the device's peak ``F`` FLOP/s for the dtype: a
  lower bound on its time, like the roofline's.

Compute hides the transfer when ``4 c^2 H D / F >= 2 c Hk D s / W``, i.e. from

    c* = (Hk / H) * s * F / (2 W)

tokens per device up: the block length above which the ring's communication is free, if the compiler
overlaps the two (the slice report says whether it schedules them so). Below it the ring is
bandwidth-bound on ICI. A causal diagonal block does half the work for the same transfer.
"""

from __future__ import annotations

import dataclasses

from tpuattn import chips
from tpuattn.model import roofline

LABEL = "modelled (peak FLOP/s and ICI link bandwidth; not measured)"


@dataclasses.dataclass(frozen=True)
class RingStep:
    chip: str
    tokens_per_device: int
    transfer_bytes: float
    transfer_s: float
    compute_flops: float
    compute_s: float
    hidden: bool  # compute_s >= transfer_s


def _device(chip_name: str) -> roofline.ChipSpec:
    device = roofline.chip_spec(chip_name)
    if device.ici_link_bandwidth is None:
        raise ValueError(f"chip_name: expected a chip with ICI figures in tpuattn.chips "
                         f"({[c.name for c in chips.CHIPS.values() if c.ici_bandwidth]}), got {chip_name!r}")
    return device


def ring_step(chip_name: str, tokens_per_device: int, *, heads: int = 8, kv_heads: int | None = None,
              head_dim: int = 128, dtype="bfloat16", batch: int = 1) -> RingStep:
    """One full-block ring step on one device of ``chip_name`` (see the module docstring)."""
    device = _device(chip_name)
    kv_heads = heads if kv_heads is None else kv_heads
    c = tokens_per_device
    transfer = 2.0 * batch * c * kv_heads * head_dim * roofline._itemsize(dtype)
    flops = 4.0 * batch * c * c * heads * head_dim
    transfer_s = transfer / device.ici_link_bandwidth
    compute_s = flops / device.peak_flops(dtype)
    return RingStep(device.name, c, transfer, transfer_s, flops, compute_s, compute_s >= transfer_s)


def hiding_length(chip_name: str, *, heads: int = 8, kv_heads: int | None = None, dtype="bfloat16") -> float:
    """``c*``: tokens per device from which a full block's compute hides its K/V transfer."""
    device = _device(chip_name)
    kv_heads = heads if kv_heads is None else kv_heads
    return (kv_heads / heads) * roofline._itemsize(dtype) * device.peak_flops(dtype) / (
        2.0 * device.ici_link_bandwidth)
