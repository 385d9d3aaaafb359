"""The roofline model: published chip numbers, hand-counted FLOPs and bytes, crossover properties."""

import math

import pytest

from tpuattn import bench, roofline
from tpuattn.model.roofline import GIB, MIB, PUBLISHED

# ----------------------------------------------------------------------------- chips


def test_v5e_matches_published_spec():
    v5e = PUBLISHED["v5e"]
    assert v5e.bf16_flops == 197e12
    assert v5e.hbm_bandwidth == 819e9
    assert v5e.hbm_capacity == 16 * GIB
    assert v5e.vmem_bytes == 128 * MIB
    assert v5e.tensor_cores == 1


@pytest.mark.parametrize("name, tflops, gbps, capacity, vmem_mib, cores", [
    ("v4", 275, 1200, 32 * GIB, 16, 2),
    ("v5p", 459, 2765, 95e9, 64, 2),
    ("v6e", 918, 1638, 32e9, 128, 1),
])
def test_published_table(name, tflops, gbps, capacity, vmem_mib, cores):
    chip = PUBLISHED[name]
    assert (chip.bf16_flops, chip.hbm_bandwidth, chip.hbm_capacity) == (tflops * 1e12, gbps * 1e9, capacity)
    assert (chip.vmem_bytes, chip.tensor_cores) == (vmem_mib * MIB, cores)


def test_auto_source_keeps_v5e_on_spec():
    chip = roofline.chip_spec("v5e")
    assert chip.bf16_flops == pytest.approx(197e12, rel=1e-3)
    assert chip.hbm_bandwidth == pytest.approx(819e9, rel=0.01)
    expected = "pltpu.get_tpu_info_for_chip" if roofline.jax_has_tpu_info() else "Google Cloud"
    assert chip.source.startswith(expected)


@pytest.mark.skipif(not roofline.jax_has_tpu_info(), reason="this JAX has no pltpu.get_tpu_info_for_chip")
@pytest.mark.parametrize("name", roofline.CHIPS)
def test_jax_numbers_agree_with_the_published_table(name):
    jax_chip, table = roofline.chip_spec(name, source="jax"), PUBLISHED[name]
    assert jax_chip.bf16_flops == pytest.approx(table.bf16_flops, rel=0.01)
    assert jax_chip.vmem_bytes == table.vmem_bytes
    assert jax_chip.tensor_cores == table.tensor_cores
    # JAX and the Cloud pages disagree by up to 11% on bandwidth (v5p: 2.46 vs 2.765 TB/s) and
    # 8% on capacity (v5p: 103 vs 95 GB); the model reports which one it used (ChipSpec.source).
    assert jax_chip.hbm_bandwidth == pytest.approx(table.hbm_bandwidth, rel=0.12)
    assert jax_chip.hbm_capacity == pytest.approx(table.hbm_capacity, rel=0.09)


def test_device_kinds_and_bad_names():
    assert roofline.chip_spec("TPU v5 lite", source="published") is PUBLISHED["v5e"]
    assert roofline.chip_spec("TPU v6 lite", source="published") is PUBLISHED["v6e"]
    assert roofline.chip_for_device_kind("TPU v4") == "v4"
    assert roofline.chip_for_device_kind("cpu") is None
    with pytest.raises(ValueError, match="name: expected a chip name"):
        roofline.chip_spec("v9z")
    with pytest.raises(ValueError, match="source: expected"):
        roofline.chip_spec("v5e", source="guess")


def test_f32_is_modelled_as_six_bf16_passes():
    v5e = PUBLISHED["v5e"]
    assert v5e.peak_flops("float32") == v5e.bf16_flops / 6
    assert v5e.peak_flops("bfloat16") == v5e.bf16_flops
    assert v5e.ridge_point("bfloat16") == pytest.approx(197e12 / 819e9)


# ----------------------------------------------------------------------------- counts


def test_materialised_counts_by_hand():
    # B=1, H=1, T=2, D=4, f32: 4 scores; Q = K = V = O = 2*4*4 = 32 bytes.
    spec = roofline.problem(2, heads=1, head_dim=4, dtype="float32")
    fwd = roofline.cost("reference", spec, "fwd")
    assert fwd.flops == 4 * 4 * 4  # 4 FLOPs per score and head_dim element
    # inputs + output 128; scores: write S 4, read S 3 x 4, write P 4, read P 4 = 24 B/score.
    assert fwd.hbm_bytes == 128 + 24 * 4
    both = roofline.cost("xla", spec, "fwd+bwd")
    assert both.flops == 64 + 8 * 4 * 4  # + dP, dV, dQ, dK
    # backward: read Q, K, V, dO and write dQ, dK, dV = 7 x 32; dP w 4, (P, dP) r 8, (P, dP) r + dS w 12,
    # P r 4, dS r twice 8 = 36 B/score.
    assert both.hbm_bytes == fwd.hbm_bytes + 7 * 32 + 36 * 4
    assert fwd.peak_hbm_bytes == (4 + 4) * 4 + 4 * 32


def test_flash_counts_by_hand():
    # T=256, D=128, bf16, 128 x 128 blocks: 2 x 2 tiles; a Q/K/V block is 128*128*2 = 32 KiB.
    spec = roofline.problem(256, heads=1, head_dim=128, dtype="bfloat16")
    tile = 128 * 128 * 2
    full = roofline.cost("pallas", spec, "fwd", q_block=128, kv_block=128)
    assert full.flops == 4 * 256 * 256 * 128 == full.standard_flops
    # Q once per q block (2), K and V per visited tile (4), O and f32 logsumexp once per q block.
    assert full.hbm_bytes == 2 * tile + 4 * 2 * tile + 2 * (tile + 4 * 128)
    causal_spec = roofline.problem(256, heads=1, head_dim=128, causal=True)
    assert roofline.visited_tiles(causal_spec, 128, 128) == (3, 4)
    causal = roofline.cost("pallas", causal_spec, "fwd", q_block=128, kv_block=128)
    assert causal.flops == 3 * 4 * 128**3  # the diagonal tiles are computed whole
    assert causal.standard_flops == 0.5 * full.flops
    assert causal.hbm_bytes == full.hbm_bytes - 2 * tile  # one tile of K and V skipped
    assert causal.visited_fraction == 0.75


def test_visited_tiles_follow_block_map():
    spec = roofline.problem(1024, causal=True)
    assert roofline.visited_tiles(spec, 128, 128) == (36, 64)  # 8 * 9 / 2
    window = roofline.problem(1024, window=(128, 0))
    visited, total = roofline.visited_tiles(window, 128, 128)
    assert (visited, total) == (8 + 7, 64)  # the diagonal and the one below it


def test_standard_flops_is_the_bench_count():
    spec = roofline.problem(512, batch=2, heads=4, head_dim=64, causal=True)
    assert roofline.standard_flops(spec, "fwd+bwd") == bench.attention_flops(
        batch=2, heads=4, q_len=512, kv_len=512, head_dim=64, causal=True, mode="fwd+bwd")


# ----------------------------------------------------------------------------- predictions


@pytest.mark.parametrize("impl", sorted(roofline.MODELS))
@pytest.mark.parametrize("mode", roofline.MODES)
def test_predicted_time_grows_with_length(impl, mode):
    chip = PUBLISHED["v5e"]
    times = [roofline.predict(impl, roofline.problem(t, causal=True), chip, mode, **_blocks(impl)).time_s
             for t in (1024, 2048, 4096, 8192)]
    assert all(b > a for a, b in zip(times, times[1:], strict=False))


def _blocks(impl):
    return {} if roofline.MODELS[impl] == "materialised" else {"q_block": 512, "kv_block": 512}


def test_bounds_at_long_sequences():
    chip = PUBLISHED["v5e"]
    spec = roofline.problem(32768, causal=True, dtype="bfloat16")
    ref = roofline.predict("reference", spec, chip)
    flash = roofline.predict("pallas", spec, chip, q_block=512, kv_block=512)
    assert ref.bound == "memory" and not ref.fits_hbm
    assert flash.bound == "compute" and flash.fits_hbm and flash.fits_vmem
    assert flash.time_s < ref.time_s
    assert flash.time_s == max(flash.compute_s, flash.memory_s)
    # A 128-row query block re-reads K/V too often for v5e: intensity 2*128/2 = 128 < ridge 240.
    small = roofline.predict("splash", spec, chip, q_block=128, kv_block=128)
    assert small.bound == "memory"
    assert small.cost.intensity == pytest.approx(128, rel=0.05)


def test_materialise_crossover():
    chip = PUBLISHED["v5e"]
    kwargs = dict(batch=1, heads=8, head_dim=128, dtype="bfloat16")
    t = roofline.materialise_crossover(chip, **kwargs)

    def peak(n):
        return roofline.cost("reference", roofline.problem(n, **{k: v for k, v in kwargs.items()
                                                                  if k != "batch"}), "fwd").peak_hbm_bytes

    assert peak(t) > chip.hbm_capacity >= peak(t - 1)
    assert t == pytest.approx(math.sqrt(chip.hbm_capacity / (6 * 8)), rel=0.01)  # S f32 + P bf16 per head
    assert roofline.materialise_crossover(chip, mode="fwd+bwd", **kwargs) < t
    assert roofline.materialise_crossover(PUBLISHED["v5p"], **kwargs) > t


def test_vmem_crossover_by_hand():
    # Q, O blocks bf16 + f32 accumulator = 131072 bytes; per key: a f32 score column of 128 rows
    # (512 B) + a K and a V row (2 * 128 * 2 = 512 B).
    expected = (128 * MIB - 131072) // 1024 + 1
    assert roofline.vmem_crossover(PUBLISHED["v5e"], q_block=128, head_dim=128) == expected
    assert roofline.vmem_crossover(PUBLISHED["v4"]) < roofline.vmem_crossover(PUBLISHED["v5e"])


def test_roofline_curve():
    chip = PUBLISHED["v5e"]
    low, high = roofline.roofline_curve(chip, [1.0, 1e4])
    assert low == 819e9 and high == 197e12


def test_bad_arguments():
    spec = roofline.problem(256)
    with pytest.raises(ValueError, match="impl: expected one of"):
        roofline.cost("nope", spec)
    with pytest.raises(ValueError, match="mode: expected one of"):
        roofline.cost("reference", spec, "bwd")
    with pytest.raises(ValueError, match="q_block: expected a positive int"):
        roofline.cost("pallas", spec, q_block=0)
    with pytest.raises(ValueError, match="seq_len: expected a positive int"):
        roofline.problem(0)
    with pytest.raises(ValueError, match="heads: expected a multiple of kv_heads=3"):
        roofline.problem(128, heads=4, kv_heads=3)
