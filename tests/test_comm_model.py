"""The ring's communication model and the HLO reading of the slice report (no compiler needed)."""

from __future__ import annotations

import pytest

from tpuattn.measure.slices import collectives
from tpuattn.model import comm


def test_hiding_length_from_the_cited_figures():
    # v5e: 197 TFLOP/s bf16; 400 GB/s bidirectional ICI per chip over 4 ports -> 50 GB/s per link one
    # way. MHA bf16: c* = s * F / (2 W) = 2 * 1.97e14 / (2 * 5e10) = 3940 tokens.
    assert comm.hiding_length("v5e", heads=8) == pytest.approx(3940.0)
    # GQA 8:2 sends a quarter of the bytes for the same compute.
    assert comm.hiding_length("v5e", heads=8, kv_heads=2) == pytest.approx(985.0)
    # v5p: 459 TFLOP/s; 1200 GB/s over 6 ports -> 100 GB/s per link: c* = 2 * 4.59e14 / 2e11 = 4590.
    assert comm.hiding_length("v5p", heads=8) == pytest.approx(4590.0)


@pytest.mark.parametrize("chip", ["v5e", "v5p"])
def test_a_step_is_hidden_exactly_from_the_hiding_length(chip):
    c_star = comm.hiding_length(chip, heads=16, kv_heads=4)
    below, above = comm.ring_step(chip, int(c_star) - 1, heads=16, kv_heads=4), \
        comm.ring_step(chip, int(c_star) + 1, heads=16, kv_heads=4)
    assert not below.hidden and above.hidden
    assert above.transfer_bytes == 2 * (int(c_star) + 1) * 4 * 128 * 2


def test_chips_without_ici_figures_are_refused():
    with pytest.raises(ValueError, match=r"^chip_name: expected a chip with ICI figures"):
        comm.ring_step("v4", 1024)


HLO = """\
%region (a: f32[]) -> f32[] {
  ROOT %add = f32[] add(%a, %a)
}

ENTRY %main (p: bf16[4]) -> bf16[4] {
  %p = bf16[4]{0} parameter(0)
  %cp-start = (bf16[4]{0}, bf16[4]{0}, u32[]{:S(2)}) collective-permute-start(%p)
  %fusion.1 = bf16[4]{0} fusion(%p), kind=kLoop, calls=%region
  %cp-done = bf16[4]{0} collective-permute-done(%cp-start)
  %cp-start.1 = (bf16[4]{0}, bf16[4]{0}, u32[]{:S(2)}) collective-permute-start(%cp-done)
  %cp-done.1 = bf16[4]{0} collective-permute-done(%cp-start.1)
  %ag = bf16[8]{0} all-gather(%cp-done.1), dimensions={0}
  ROOT %r = bf16[4]{0} slice(%ag), slice={[0:4]}
}
"""


def test_collectives_are_counted_and_overlap_read_from_the_schedule():
    assert collectives(HLO) == {"collective_permutes": 2, "all_gathers": 1, "reduce_scatters": 0,
                                "async_collectives": 2, "overlapped_collectives": 1}


def test_the_ring_model_works_per_device_with_the_dtypes_peak():
    # f32: 4-byte elements and the roofline's f32 peak (bf16 / 6): c* = 4 * 1.97e14 / 6 / (2 * 5e10).
    assert comm.hiding_length("v5e", heads=8, dtype="float32") == pytest.approx(4 * 1.97e14 / 6 / 1e11)
    step = comm.ring_step("v5e", 2048, heads=8, dtype="float32")
    assert step.transfer_bytes == 2 * 2048 * 8 * 128 * 4
    assert step.compute_s == pytest.approx(4.0 * 2048 * 2048 * 8 * 128 / (1.97e14 / 6))


def test_two_devices_on_a_chip_share_its_ici_links():
    # A chip's ICI is per chip; a JAX device gets its share: all of it where the device is the chip
    # (v5e, the megacore v5p), half each where two TensorCores are two devices (as on tpu7x).
    import dataclasses

    from tpuattn import chips
    from tpuattn.model import roofline

    assert roofline.chip_spec("v5e").ici_link_bandwidth == pytest.approx(400e9 / 8)
    assert roofline.chip_spec("v5p").ici_link_bandwidth == pytest.approx(1200e9 / 12)
    two_devices = dataclasses.replace(chips.get("tpu7x"), ici_bandwidth=1200e9, ici_ports=6)
    assert two_devices.per_device()["ici_link_bandwidth"] == pytest.approx(1200e9 / 12 / 2)
    assert roofline.chip_spec(two_devices).ici_link_bandwidth == pytest.approx(1200e9 / 12 / 2)
    assert roofline.chip_spec("tpu7x").ici_link_bandwidth is None  # no figures in the table
