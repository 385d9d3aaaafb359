"""The roofline model: chip numbers, hand-counted FLOPs and bytes, crossover properties."""

import math

import pytest

from tpuattn import api, bench, chips
from tpuattn.model import published, roofline
from tpuattn.model.roofline import GIB, MIB
from tpuattn.pallas import blocks
from tpuattn.spec import spec_from_shapes

# ----------------------------------------------------------------------------- chips


def test_v5e_is_one_device_of_the_chip_table():
    v5e = roofline.chip_spec("v5e")
    assert v5e.bf16_flops == 197e12
    assert v5e.hbm_bandwidth == 820e9
    assert v5e.hbm_capacity == 17.2e9  # 16 GiB, in bytes as JAX's table writes it
    assert v5e.vmem_bytes == 128 * MIB
    assert v5e.tensor_cores == 1
    assert v5e.source.startswith("tpuattn.chips")


# Per JAX device: the megacore v4 and v5p are one device per chip, v2, v3 and tpu7x two.
@pytest.mark.parametrize("name, tflops, gbps, capacity, vmem_mib, cores", [
    ("v2", 23, 358, 8e9, 16, 1),
    ("v3", 70, 412.5, 17.2e9, 16, 1),
    ("v4", 275, 1230, 34.4e9, 16, 2),
    ("v5p", 459, 2765, 103e9, 64, 2),  # HBM: Cloud's v5p page (JAX's table: 2460)
    ("v6e", 920, 1640, 34.4e9, 128, 1),
    ("tpu7x", 1155, 3700, 103e9, 64, 1),
])
def test_chip_table_per_device(name, tflops, gbps, capacity, vmem_mib, cores):
    chip = roofline.chip_spec(name)
    assert chip.bf16_flops == pytest.approx(tflops * 1e12)
    assert chip.hbm_bandwidth == pytest.approx(gbps * 1e9)
    assert chip.hbm_capacity == pytest.approx(capacity)
    assert (chip.vmem_bytes, chip.tensor_cores) == (vmem_mib * MIB, cores)


def test_hbm_capacity_is_in_bytes():
    assert roofline.chip_spec("v6e").hbm_capacity == pytest.approx(32 * GIB, rel=0.002)


@pytest.mark.skipif(not roofline.jax_has_tpu_info(), reason="this JAX has no pltpu.get_tpu_info_for_chip")
@pytest.mark.parametrize("name", chips.NAMES)
def test_jax_numbers_agree_with_the_table(name):
    jax_chip, table = roofline.chip_spec(name, source="jax"), roofline.chip_spec(name)
    assert jax_chip.source.startswith("pltpu.get_tpu_info_for_chip")
    for field in ("bf16_flops", "hbm_bandwidth", "hbm_capacity"):
        if (name, field) == ("v5p", "hbm_bandwidth"):  # the one figure the table takes from Cloud's page
            assert (jax_chip.hbm_bandwidth, table.hbm_bandwidth) == (2.46e12, 2.765e12)
            continue
        assert getattr(jax_chip, field) == pytest.approx(getattr(table, field), rel=1e-6), field
    assert (jax_chip.vmem_bytes, jax_chip.tensor_cores) == (table.vmem_bytes, table.tensor_cores)


def test_jax_source_needs_a_jax_that_has_it():
    if roofline.jax_has_tpu_info():
        assert roofline.chip_spec("v5e", source="jax").bf16_flops == 197e12
    else:
        with pytest.raises(ValueError, match="source: 'jax' needs pltpu.get_tpu_info_for_chip"):
            roofline.chip_spec("v5e", source="jax")


def test_device_kinds_and_bad_names():
    assert roofline.chip_spec("TPU v5 lite") == roofline.chip_spec("v5e")
    assert roofline.chip_spec("TPU v6 lite") == roofline.chip_spec("v6e")
    assert roofline.chip_spec(chips.from_device_kind("TPU v4")).name == "v4"
    with pytest.raises(ValueError, match="expected a chip name"):
        roofline.chip_spec("v9z")
    with pytest.raises(ValueError, match="source: expected"):
        roofline.chip_spec("v5e", source="guess")


def test_f32_is_modelled_as_six_bf16_passes():
    v5e = roofline.chip_spec("v5e")
    assert v5e.peak_flops("float32") == v5e.bf16_flops / 6
    assert v5e.peak_flops("bfloat16") == v5e.bf16_flops
    assert v5e.ridge_point("bfloat16") == pytest.approx(197e12 / 820e9)


# ----------------------------------------------------------------------------- counts


def test_materialised_counts_by_hand():
    # B=1, H=1, T=2, D=4, f32: 4 scores; Q = K = V = O = 2*4*4 = 32 bytes.
    spec = roofline.problem(2, heads=1, head_dim=4, dtype="float32")
    fwd = roofline.cost("reference", spec, "fwd")
    assert fwd.flops == 4 * 4 * 4  # 4 FLOPs per score and head_dim element
    # inputs + output 128; scores as XLA fuses them: write S 4, read S twice 8 = 12 B/score.
    assert fwd.hbm_bytes == 128 + 12 * 4
    both = roofline.cost("xla", spec, "fwd+bwd")
    assert both.flops == 64 + 8 * 4 * 4  # + dP, dV, dQ, dK
    # backward: read Q, K, V, dO and write dQ, dK, dV = 7 x 32; write P 4, read (P, S) twice 16,
    # read S 4 = 24 B/score.
    assert both.hbm_bytes == fwd.hbm_bytes + 7 * 32 + 24 * 4
    # live at the peak: S (f32) for the reference; S and its exponentials for jax.nn's XLA path
    # in bf16, S alone in f32 (what the compiler showed); plus inputs and outputs.
    assert fwd.peak_hbm_bytes == 4 * 4 + 4 * 32
    assert roofline.cost("xla", spec, "fwd").peak_hbm_bytes == 4 * 4 + 4 * 32
    bf16 = roofline.problem(2, heads=1, head_dim=4)
    assert roofline.cost("xla", bf16, "fwd").peak_hbm_bytes == 8 * 4 + 4 * 16
    # A chip whose VMEM holds the score buffers moves no score bytes through HBM (a lower bound).
    assert roofline.cost("reference", spec, "fwd", chip=roofline.chip_spec("v5e")).hbm_bytes == 128


def test_xla_keeps_buffers_in_the_vmem_the_scoped_limit_leaves():
    # VMEM beside the kernels' scoped limit: v5e 128 - 16 MiB, v6e 128 - 32; none where a kernel gets
    # the whole VMEM (v5p).
    assert [roofline.chip_spec(c).xla_vmem_bytes for c in ("v5e", "v6e", "v5p")] == [112 * MIB, 96 * MIB, 0]
    v5e = roofline.chip_spec("v5e")
    # bf16, 8 heads, causal. At 2048 tokens S is 128 MiB (f32), P 64 MiB: S goes to HBM, P stays on
    # chip; inputs and outputs are 4 MiB each.
    spec = roofline.problem(2048, heads=8, head_dim=128, causal=True)
    both = roofline.cost("reference", spec, "fwd+bwd", chip=v5e)
    assert both.peak_hbm_bytes == 6 * 4 * MIB + 128 * MIB
    big = {(b, w) for _, b, w in both.peak_breakdown if b >= 64 * MIB}
    assert big == {(128 * MIB, "HBM"), (64 * MIB, "VMEM")}
    # Strict: a buffer larger than what the scoped limit leaves is traffic, whatever VMEM holds
    # (128 MiB on 128 MiB of VMEM went to HBM: the compiler's bytes accessed, 0.47 GB).
    fwd = roofline.cost("reference", spec, "fwd", chip=v5e)
    assert fwd.hbm_bytes == roofline.cost("reference", spec, "fwd").hbm_bytes > 0.3e9
    # 1024 tokens: S is 32 MiB and stays on chip, so no score traffic.
    short = roofline.problem(1024, heads=8, head_dim=128, causal=True)
    assert roofline.cost("reference", short, "fwd", chip=v5e).hbm_bytes == 4 * 2 * MIB
    # Without a chip nothing stays on chip.
    assert roofline.cost("reference", spec, "fwd+bwd").peak_hbm_bytes == 6 * 4 * MIB + 192 * MIB


def test_flash_peak_places_copies_in_the_results_and_the_rest_in_vmem():
    # pallas, forward, 32768 tokens on v5e (what the buffer assignment showed): Q's layout copy shares
    # the output's buffer, one 64 MiB buffer (K, V copies or O) stays in VMEM, the unread 8 MiB
    # logsumexp (8 float32 rows a head) and two 64 MiB buffers stay in HBM: 3 x 64 in, 64 out, 200 of
    # temporaries.
    spec = roofline.problem(32768, heads=8, head_dim=128, causal=True)
    c = roofline.cost("pallas", spec, "fwd", chip=roofline.chip_spec("v5e"))
    assert c.peak_hbm_bytes == (4 * 64 + 8 + 2 * 64) * MIB
    where = {what: w for what, _, w in c.peak_breakdown}
    assert where["Q in the kernel layout"] == "a result's buffer" and where["logsumexp (unread)"] == "HBM"
    assert [w for what, _, w in c.peak_breakdown if what != "arguments"].count("VMEM") == 1
    with pytest.raises(ValueError, match=r"^kind: expected one of \['copy', 'temp', 'unread'\], got 'tmp'"):
        roofline._peak(0, 0, [("x", 1, "tmp")], None)


def test_transcendentals_are_counted_and_timed_at_the_derived_rate():
    spec = roofline.problem(1024, heads=2, head_dim=128, causal=True)
    fwd = roofline.cost("pallas", spec, "fwd", q_block=128, kv_block=128)
    visited, _ = roofline.visited_tiles(spec, 128, 128)
    assert fwd.transcendentals == 2 * visited * 128 * 128  # one exp per computed score
    # the backward recomputes P in the row-sum pass, the dK/dV and the dQ kernels (splash: two)
    both = {impl: roofline.cost(impl, spec, "fwd+bwd", q_block=128, kv_block=128).transcendentals
            for impl in ("pallas", "splash")}
    assert both == {"pallas": 4 * fwd.transcendentals, "splash": 3 * fwd.transcendentals}
    assert roofline.cost("reference", spec, "fwd+bwd").transcendentals == 2 * 1024 * 1024  # every score once
    # a softcap adds its tanh beside every exp, in every pass and every schedule
    capped = roofline.problem(1024, heads=2, head_dim=128, causal=True, softcap=30.0)
    for impl in ("pallas", "splash", "blockwise", "reference"):
        for mode in ("fwd", "fwd+bwd"):
            plain = roofline.cost(impl, spec, mode, q_block=128, kv_block=128).transcendentals
            capped_count = roofline.cost(impl, capped, mode, q_block=128, kv_block=128).transcendentals
            assert capped_count == 2 * plain > 0
    # the rate: one float32 vector register (8 x 128) per cycle, at the clock v5e's peak implies with
    # its 4 MXUs of 128 x 128 (197 TFLOP/s / (2 * 4 * 128^2) = 1.503 GHz)
    p = roofline.predict("pallas", spec, "v5e", "fwd")
    rate = 197e12 / (2 * 4 * 128 * 128) * 8 * 128
    assert p.chip.transcendentals_per_second == pytest.approx(rate, rel=1e-9)
    assert p.vector_s == pytest.approx(p.cost.transcendentals / rate)
    assert p.as_dict()["vector_s"] == p.vector_s
    assert p.time_s == max(p.compute_s, p.memory_s, p.vector_s)
    # per device: the megacore v5p's device is the chip (two TensorCores at 4 MXUs, 459 TFLOP/s); a v3
    # device one TensorCore (2 MXUs, half of 140 TFLOP/s)
    assert roofline.chip_spec("v5p").transcendentals_per_second == pytest.approx(
        2 * (459e12 / 2) / (2 * 4 * 128 * 128) * 1024, rel=1e-9)
    assert roofline.chip_spec("v3").transcendentals_per_second == pytest.approx(
        (140e12 / 2) / (2 * 2 * 128 * 128) * 1024, rel=1e-9)
    # with a faster vector unit than matmul unit the exps bind; without a rate they are left out
    import dataclasses

    fast = dataclasses.replace(p.chip, transcendentals_per_second=p.cost.transcendentals / 1.0)
    q = roofline.Prediction(cost=p.cost, chip=fast, compute_s=p.compute_s, memory_s=p.memory_s)
    assert q.vector_s == pytest.approx(1.0) and q.time_s == q.vector_s and q.bound == "vector"
    none = dataclasses.replace(p.chip, transcendentals_per_second=None)
    r = roofline.Prediction(cost=p.cost, chip=none, compute_s=p.compute_s, memory_s=p.memory_s)
    assert r.vector_s is None and r.time_s == max(p.compute_s, p.memory_s)


@pytest.mark.skipif(not roofline.jax_has_tpu_info(), reason="pltpu.get_tpu_info_for_chip needs JAX >= 0.8.1")
@pytest.mark.parametrize("chip", chips.NAMES)
def test_the_exp_rate_from_jax_tpu_info_matches_the_table(chip):
    # the same derivation from JAX's own per-TensorCore record (num_mxus, mxu_column_size, lanes,
    # sublanes) as from the table's per-chip figures
    table, jax_spec = roofline.chip_spec(chip), roofline.chip_spec(chip, source="jax")
    assert jax_spec.transcendentals_per_second == pytest.approx(table.transcendentals_per_second, rel=0.01)


def test_the_exps_bind_only_where_the_matmuls_are_thin():
    # FlashAttention-3's argument on a TPU: per score, fwd does 4 * head_dim FLOPs on the MXU and one
    # exp on the EUP. The exps stay under the matmuls at head_dim 128 on every chip in the table
    # (bf16, causal, 8192 tokens), and come within 2x of them at head_dim 64 somewhere.
    closest = []
    for chip in chips.NAMES:
        for head_dim in (64, 128):
            spec = roofline.problem(8192, heads=8, head_dim=head_dim, dtype="bfloat16", causal=True)
            p = roofline.predict("splash", spec, chip, "fwd")
            assert p.vector_s > 0 and p.vector_s == pytest.approx(p.cost.transcendentals
                                                                  / p.chip.transcendentals_per_second)
            if head_dim == 128:
                assert p.vector_s < p.compute_s, (chip, p.vector_s, p.compute_s)
            else:
                closest.append(p.compute_s / p.vector_s)
    assert min(closest) <= 2.0, closest


def test_flash_counts_by_hand():
    # T=256, D=128, bf16, 128 x 128 blocks: 2 x 2 tiles; a Q/K/V block is 128*128*2 = 32 KiB.
    spec = roofline.problem(256, heads=1, head_dim=128, dtype="bfloat16")
    tile = 128 * 128 * 2
    full = roofline.cost("pallas", spec, "fwd", q_block=128, kv_block=128)
    assert full.flops == 4 * 256 * 256 * 128 == full.standard_flops
    # Q once per q block (2), K and V per visited tile (4), O once per q block (2), the logsumexp
    # 8 sublanes of f32 per row (256 rows), and the wrapper's relayouts into the kernels' view (Q, K, V:
    # read + write 3 x 2 blocks each) and out of it (O).
    copies = 2 * (3 * 2 * tile) + 2 * (2 * tile)
    assert full.hbm_bytes == 2 * tile + 4 * 2 * tile + 2 * tile + 256 * 32 + copies
    # splash's forward without residuals writes no logsumexp; for a gradient it saves 128 lanes a row.
    splash = roofline.cost("splash", spec, "fwd", q_block=128, kv_block=128)
    assert full.hbm_bytes - splash.hbm_bytes == 256 * 32
    assert ("write logsumexp", 256 * 512) in roofline.cost("splash", spec, "fwd+bwd", q_block=128,
                                                           kv_block=128).breakdown
    causal_spec = roofline.problem(256, heads=1, head_dim=128, causal=True)
    assert roofline.visited_tiles(causal_spec, 128, 128) == (3, 4)
    causal = roofline.cost("pallas", causal_spec, "fwd", q_block=128, kv_block=128)
    assert causal.flops == 3 * 4 * 128**3  # the diagonal tiles are computed whole
    assert causal.standard_flops == 0.5 * full.flops
    assert causal.hbm_bytes == full.hbm_bytes - 2 * tile  # one tile of K and V skipped
    assert causal.visited_fraction == 0.75


def test_problem_is_built_by_spec_from_shapes():
    assert roofline.problem(4096, window=128) == roofline.problem(4096, window=(128, 128))
    spec = roofline.problem(512, batch=2, heads=8, kv_heads=2, head_dim=64, dtype="float32", causal=True,
                            kv_len=1024)
    assert spec == spec_from_shapes(512, 1024, batch=2, num_q_heads=8, num_kv_heads=2, head_dim=64,
                                    dtype="float32", causal=True)


def test_schedules_and_blocks_come_from_the_registry():
    models = roofline.models()
    for name, schedule in models.items():
        assert schedule == api.get_implementation(name).schedule
        assert schedule in roofline.SCHEDULES
    spec = roofline.problem(8192, head_dim=128, dtype="bfloat16", causal=True)
    v5e = roofline.chip_spec("v5e")
    for name, schedule in models.items():
        if schedule != "materialised":
            record = api.get_implementation(name)
            expected = tuple(record.default_blocks(spec, "v5e"))
            assert roofline.default_blocks(name, spec, v5e) == expected


def test_default_blocks_follow_each_chip():
    spec = roofline.problem(8192, head_dim=128, dtype="bfloat16", causal=True)
    # The splash kernel runs 512 x 512 tiles by default (capped at the 128-rounded lengths).
    assert roofline.default_blocks("splash", spec, roofline.chip_spec("v5e")) == (512, 512)
    assert roofline.default_blocks("splash", roofline.problem(200), roofline.chip_spec("v5e")) == (256, 256)
    # The Pallas kernel takes its defaults from the compiler's table for the chip: 512 x 512 where
    # the ridge point is below 512 FLOP/byte, 1024 x 1024 on v6e (all compile there); for a problem's
    # length, from the tuned table where it has the chip (python -m tpuattn.aot --tune), as the model does.
    for chip, expected in (("v5e", 512), ("v4", 512), ("v5p", 512), ("tpu7x", 512), ("v6e", 1024)):
        tuned = blocks.default_block_sizes(128, "bfloat16", chip=chip, seq_len=8192).forward
        assert roofline.default_blocks("pallas", spec, roofline.chip_spec(chip)) == (tuned.block_q,
                                                                                    tuned.block_kv), chip
        forward = blocks.default_block_sizes(128, "bfloat16", chip=chip).forward
        assert (forward.block_q, forward.block_kv) == (expected, expected)
    v5e = roofline.chip_spec("v5e")
    assert roofline.cost("splash", spec, chip=v5e) == roofline.cost("splash", spec, q_block=512, kv_block=512,
                                                                     chip=v5e)


def test_flash_vmem_is_the_kernels_own_accounting():
    spec = roofline.problem(4096, head_dim=64, dtype="bfloat16")
    fwd = roofline.cost("pallas", spec, "fwd", q_block=256, kv_block=128)
    both = roofline.cost("pallas", spec, "fwd+bwd", q_block=256, kv_block=128)
    # head_dim 64 on 8 kv heads: paired, a step holds a kv pair's two query heads in 128-lane tiles
    assert fwd.vmem_bytes == blocks.forward_vmem_bytes(256, 128, 128, 2, 2)
    assert both.vmem_bytes == max(fwd.vmem_bytes, blocks.backward_vmem_bytes(256, 128, 128, 2, 2),
                                  blocks.dq_vmem_bytes(256, 128, 128, 2, 2))
    unpaired = roofline.cost("pallas", roofline.problem(4096, head_dim=64, heads=3, kv_heads=3,
                                                        dtype="bfloat16"), "fwd", q_block=256, kv_block=128)
    assert unpaired.vmem_bytes == blocks.forward_vmem_bytes(256, 128, 128, 2)  # padded to 128 lanes


def test_pallas_reads_kv_once_per_gqa_group():
    """The Pallas forward and dQ grids step over GQA groups: 16 query heads on 2 kv heads read the K/V
    bytes of 2 on 2 (splash's model reads them once per query head)."""
    def kv_lines(impl, heads, mode="fwd+bwd"):
        spec = roofline.problem(4096, heads=heads, kv_heads=2, head_dim=128, dtype="bfloat16", causal=True)
        cost = roofline.cost(impl, spec, mode, q_block=512, kv_block=512)
        return {name: b for name, b in cost.breakdown if "read K, V (" in name}, cost

    gqa, gqa_cost = kv_lines("pallas", 16)
    mha, _ = kv_lines("pallas", 2)
    assert len(gqa) == 3 and all("of a GQA group" in name for name in gqa)  # forward, row sums, dQ
    assert list(gqa.values()) == list(mha.values())  # the bytes of 2 on 2 (whose lines say no group)
    assert not any("GQA" in name for name in mha)
    assert gqa_cost.vmem_bytes == blocks.dq_vmem_bytes(512, 512, 128, 2, 8)
    splash16, _ = kv_lines("splash", 16, "fwd")
    splash2, _ = kv_lines("splash", 2, "fwd")
    assert sum(splash16.values()) == 8 * sum(splash2.values())


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


@pytest.mark.parametrize("impl", sorted(roofline.models()))
@pytest.mark.parametrize("mode", roofline.MODES)
def test_predicted_time_grows_with_length(impl, mode):
    chip = roofline.chip_spec("v5e")
    times = [roofline.predict(impl, roofline.problem(t, causal=True), chip, mode, **_blocks(impl)).time_s
             for t in (1024, 2048, 4096, 8192)]
    assert all(b > a for a, b in zip(times, times[1:], strict=False))


def _blocks(impl):
    return {} if roofline.models()[impl] == "materialised" else {"q_block": 512, "kv_block": 512}


def test_bounds_at_long_sequences():
    chip = roofline.chip_spec("v5e")
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
    chip = roofline.chip_spec("v5e")
    kwargs = dict(batch=1, heads=8, head_dim=128, dtype="bfloat16")
    t = roofline.materialise_crossover(chip, **kwargs)

    def peak(n):
        return roofline.cost("reference", roofline.problem(n, **{k: v for k, v in kwargs.items()
                                                                  if k != "batch"}), "fwd").peak_hbm_bytes

    assert peak(t) > chip.hbm_capacity >= peak(t - 1)
    assert t == pytest.approx(math.sqrt(chip.hbm_capacity / (4 * 8)), rel=0.01)  # S in f32, 8 heads
    assert roofline.materialise_crossover(chip, mode="fwd+bwd", **kwargs) < t
    # jax.nn's XLA path keeps two score buffers while they fit, the leanest graph's one when short.
    xla = roofline.problem(t - 1, heads=8, head_dim=128, dtype="bfloat16")
    assert roofline.cost("xla", xla, "fwd", chip=chip).peak_hbm_bytes == peak(t - 1)
    assert roofline.cost("xla", xla, "fwd").peak_hbm_bytes > 1.9 * peak(t - 1) - 2 * 4 * 8 * 2 * (t - 1) * 128
    assert roofline.materialise_crossover("v5p", **kwargs) > t


def test_vmem_crossover_by_hand():
    # Q, O blocks bf16 + f32 accumulator = 131072 bytes; per key: a f32 score column of 128 rows
    # (512 B) + a K and a V row (2 * 128 * 2 = 512 B). The VMEM is what a kernel is given, as the
    # compiler states it: on v5e (128 MiB physical) a 16 MiB scoped limit, on v6e 32 MiB, on v5p
    # its whole 64 MiB.
    v5e = roofline.chip_spec("v5e")
    assert v5e.vmem_budget_bytes == 16 * MIB
    expected = (16 * MIB - 131072) // 1024 + 1
    assert roofline.vmem_crossover(v5e, q_block=128, head_dim=128) == expected
    assert roofline.vmem_crossover("v4") == roofline.vmem_crossover("v5e")
    assert roofline.vmem_crossover("v5e") < roofline.vmem_crossover("v6e") < roofline.vmem_crossover("v5p")


def test_roofline_curve():
    low, high = roofline.roofline_curve("v5e", [1.0, 1e4])
    assert low == 820e9 and high == 197e12


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


# ---------------------------------------------------------------------------- published measurements
# Times measured on real TPUs and published (tpuattn.model.published, with their sources). The roofline
# is a lower bound, so for the same work on the same chip it must never predict slower. No constant of
# the model was fitted to any of these.
RUN_IDS = [f"{r.chip}-{r.impl}-{r.seq_len}-{r.mode}-{r.precision}" for r in published.RUNS]


@pytest.mark.parametrize("run", published.RUNS, ids=RUN_IDS)
def test_roofline_never_predicts_slower_than_a_published_measurement(run):
    spec = roofline.problem(run.seq_len, batch=run.batch, heads=run.heads, head_dim=run.head_dim,
                            dtype=run.dtype, causal=run.causal)
    blocks_kw = {} if run.block is None else {"q_block": run.block, "kv_block": run.block}
    predicted = roofline.predict(run.impl, spec, run.chip, run.mode, precision=run.precision, **blocks_kw)
    assert predicted.time_s <= run.seconds, f"{run.source}: modelled {predicted.time_s * 1e3:.3f} ms > " \
                                            f"measured {run.seconds * 1e3:.3f} ms"
    # ... and it bounds something: at least a few percent of the measured time.
    assert predicted.time_s >= 0.02 * run.seconds, run.source


def test_the_auto_rules_compiled_evidence_holds():
    # splash_auto_rank's docstring cites the committed compile report; the report says so.
    from tpuattn.measure import aot

    rows = {(r["chip"], r["impl"], r["mode"], r["seq_len"]): r for r in aot.committed_report()["rows"]}
    assert rows["v5e", "splash", "fwd+bwd", 8192]["peak_hbm_bytes"] < rows["v5e", "xla", "fwd+bwd", 8192][
        "peak_hbm_bytes"] / 40
    for chip in ("v4", "v5e", "v6e"):
        assert rows[chip, "xla", "fwd+bwd", 32768]["status"] == "out_of_memory"
        assert rows[chip, "splash", "fwd+bwd", 32768]["peak_hbm_bytes"] < 2**30
    for chip in ("v4", "v5e", "v5p", "v6e", "tpu7x"):
        assert all(rows[chip, "splash", m, t]["status"] == "ok" for m in ("fwd", "fwd+bwd")
                   for t in (2048, 8192, 32768))
    assert rows["v2", "splash", "fwd", 2048]["status"] == "unsupported"
    assert rows["v2", "xla", "fwd", 2048]["status"] == "ok"


def test_the_splash_rule_docstring_matches_the_model():
    # splash_auto_rank's docstring states where the flash schedule turns compute bound; hold it to that.
    for chip, turns in (("v4", 4096), ("v5e", 4096), ("v5p", 2048)):
        bounds = {t: roofline.predict("splash", roofline.problem(t, heads=8, head_dim=128, dtype="bfloat16",
                                                                 causal=True), chip, "fwd").bound
                  for t in (1024, 2048, 4096)}
        assert bounds == {t: "compute" if t >= turns else "memory" for t in bounds}, chip
    assert roofline.predict("splash", roofline.problem(8192, heads=8, head_dim=128, dtype="bfloat16",
                                                       causal=True), "v6e", "fwd").bound == "memory"


# ----------------------------------------------------------------------------- one unit: the JAX device
# Hand figures per chip (tpuattn.chips, JAX's tpu_info): HBM bytes/s and bf16 FLOP/s of the whole chip.
# tpu7x's two TensorCores are two JAX devices (half each); the megacore v5p is one device (the chip).
@pytest.mark.parametrize("name, chip_gbps, chip_tflops, share", [
    ("tpu7x", 7400, 2310, 0.5), ("v2", 716, 46, 0.5), ("v5p", 2765, 459, 1.0), ("v5e", 820, 197, 1.0)])
@pytest.mark.parametrize("dtype, passes, itemsize", [("bfloat16", 1, 2), ("float32", 6, 4)])
def test_the_decode_roofline_works_per_device_with_the_dtypes_peak(name, chip_gbps, chip_tflops, share,
                                                                    dtype, passes, itemsize):
    from tpuattn.model.decode_roofline import decode_roofline

    r = decode_roofline([4096] * 8, heads=32, kv_heads=8, head_dim=128, dtype=dtype, chip=name)
    bandwidth, peak = chip_gbps * 1e9 * share, chip_tflops * 1e12 * share / passes
    cache = 8 * 4096 * 2 * 8 * 128 * itemsize
    io = 2 * 8 * 32 * 128 * itemsize + 4 * 8
    flops = 4.0 * 32 * 128 * 8 * 4096
    assert (r.cache_bytes, r.io_bytes, r.flops) == (cache, io, flops)
    assert r.memory_s == pytest.approx((cache + io) / bandwidth)
    assert r.compute_s == pytest.approx(flops / peak)
    assert r.ridge == pytest.approx(peak / bandwidth)
    assert r.crossover_q_len == pytest.approx(peak / bandwidth * itemsize / (2 * 4))
    # the same peak the attention roofline uses for the dtype (one function, not a copy)
    assert r.compute_s == pytest.approx(flops / roofline.chip_spec(name).peak_flops(dtype))


def test_the_decode_roofline_accepts_a_chip_spec():
    from tpuattn.model.decode_roofline import decode_roofline

    a = decode_roofline([1000], heads=8, kv_heads=8, head_dim=128, chip="tpu7x")
    b = decode_roofline([1000], heads=8, kv_heads=8, head_dim=128, chip=roofline.chip_spec("tpu7x"))
    assert a == b and a.chip == "tpu7x"


def test_per_device_states_each_chips_share():
    # megacore: one device spans both TensorCores (the chip); tpu7x, v2, v3: one TensorCore (half).
    for name, share in (("v4", 1.0), ("v5p", 1.0), ("v5e", 1.0), ("v6e", 1.0), ("v2", 0.5), ("v3", 0.5),
                        ("tpu7x", 0.5)):
        chip = chips.get(name)
        device = chip.per_device()
        assert device["bf16_flops"] == pytest.approx(chip.bf16_flops * share), name
        assert device["hbm_bandwidth"] == pytest.approx(chip.hbm_bandwidth * share), name
        assert device["hbm_bytes"] == pytest.approx(chip.hbm_bytes * share), name


# ----------------------------------------------------------------------------- the typed schedule model
def test_a_misspelt_schedule_model_field_is_an_error():
    from tpuattn.registry import ScheduleModel

    with pytest.raises(TypeError, match="lse_row_byte"):
        ScheduleModel(lse_row_byte=512)
    with pytest.raises(ValueError, match=r"^live_scores: expected .* got keys \['fwd\+bw'\]"):
        ScheduleModel(live_scores={"fwd+bw": lambda p: 8})
    with pytest.raises(ValueError, match=r"^lse_row_bytes: expected a positive int"):
        ScheduleModel(lse_row_bytes=0)
    assert roofline.schedule_model("pallas") == ScheduleModel(lse_row_bytes=32, delta_row_bytes=32,
                                                              pads_head_dim=True, pairs_heads=True,
                                                              kernel_layout_copies=True,
                                                              lse_copies_in_backward=0,
                                                              kv_once_per_group=True)
    with pytest.raises(ValueError, match=r"^lse_copies_in_backward: expected an int >= 0, got True"):
        ScheduleModel(lse_copies_in_backward=True)
    with pytest.raises(ValueError, match=r"^lse_written_row_bytes: expected a positive int"):
        ScheduleModel(lse_written_row_bytes=0)
    # splash's forward writes 128 lanes of logsumexp a row; its backward reads one float32
    splash = roofline.schedule_model("splash")
    assert (splash.lse_written_row_bytes, splash.lse_row_bytes, splash.forward_saves_lse) == (512, 4, False)


def test_the_roofline_reads_the_record_by_attribute_and_refuses_anything_else(monkeypatch):
    import dataclasses

    real = api.get_implementation
    spec = roofline.problem(1024, heads=2)

    def patched(**changes):
        monkeypatch.setattr(roofline.api, "get_implementation",
                            lambda name: dataclasses.replace(real(name), **changes))

    patched(model={"lse_row_bytes": 4})  # the old untyped protocol: an error, not silent defaults
    with pytest.raises(TypeError, match=r"^splash: its record's model: expected a tpuattn.registry.Sched"):
        roofline.cost("splash", spec, q_block=128, kv_block=128)
    patched(schedule="flsh")
    with pytest.raises(ValueError, match=r"^splash: its record's schedule: expected one of .* got 'flsh'"):
        roofline.cost("splash", spec, q_block=128, kv_block=128)
    # A field read by attribute changes the count: 128 lanes of logsumexp per row instead of one.
    from tpuattn.registry import ScheduleModel

    monkeypatch.setattr(roofline.api, "get_implementation", real)
    base = roofline.cost("splash", spec, q_block=128, kv_block=128)
    patched(model=ScheduleModel(lse_row_bytes=4, delta_row_bytes=4, kernel_layout_copies=True,
                                forward_saves_lse=False))
    narrow = roofline.cost("splash", spec, "fwd+bwd", q_block=128, kv_block=128)
    patched(model=ScheduleModel(lse_row_bytes=512, delta_row_bytes=4, kernel_layout_copies=True,
                                forward_saves_lse=False))
    wide = roofline.cost("splash", spec, "fwd+bwd", q_block=128, kv_block=128)
    # the forward writes the logsumexp once per query row, and the backward's passes read it once
    # per q block (dQ) and per visited tile (dK/dV): batch 1 x 2 heads x (512 - 4) bytes more a row each
    visited, _ = roofline.visited_tiles(spec, 128, 128)
    assert wide.hbm_bytes - narrow.hbm_bytes == 2 * (1024 + 1024 + visited * 128) * (512 - 4)
    # and a forward-only call that saves none writes none
    patched(model=ScheduleModel(lse_row_bytes=512, delta_row_bytes=4, kernel_layout_copies=True))
    saves = roofline.cost("splash", spec, q_block=128, kv_block=128)
    assert saves.hbm_bytes - base.hbm_bytes == 1 * 2 * 1024 * 512


# ---------------------------------------------------------------------------- argument shapes
def _pallas_forward_peak_oracle(seq_len, heads, head_dim, relaid_out):
    """Peak HBM of the Pallas forward on a chip whose XLA keeps nothing in VMEM (v5p in the model),
    counted from the shapes alone: Q, K, V in and O out (bf16), the logsumexp nothing reads (8 float32
    statistics a query row), and, for contract-shaped arguments, the relaid-out K and V and the
    kernel's O (Q's relayout is dead before O is written, so it lives in O's buffer)."""
    array = seq_len * heads * head_dim * 2
    lse = seq_len * heads * 8 * 4
    return 4 * array + lse + (3 * array if relaid_out else 0)


def test_projected_arguments_have_no_relayout_and_contract_shaped_ones_do():
    spec = roofline.problem(8192, heads=8, head_dim=128, causal=True)
    contract = roofline.cost("pallas", spec, chip="v5p")
    projected = roofline.cost("pallas", spec, chip="v5p", arguments="projected")
    assert (contract.arguments, projected.arguments) == ("contract", "projected")
    assert contract.peak_hbm_bytes == _pallas_forward_peak_oracle(8192, 8, 128, relaid_out=True)
    assert projected.peak_hbm_bytes == _pallas_forward_peak_oracle(8192, 8, 128, relaid_out=False)
    # no wrapper traffic either: the compiled projected call moves nothing outside its kernels
    assert not [what for what, _ in projected.breakdown if what.startswith("wrapper")]
    assert contract.hbm_bytes - projected.hbm_bytes == 2 * 4 * 8192 * 8 * 128 * 2  # Q, K, V, O: read + write
    # the gradient: the cotangent dO is still a buffer the kernels read (in HBM on v5p), the
    # gradients go straight into the results
    grad = roofline.cost("pallas", spec, "fwd+bwd", chip="v5p", arguments="projected")
    array, row_stats = 8192 * 8 * 128 * 2, 8192 * 8 * 8 * 4
    assert grad.peak_hbm_bytes == 3 * array + 3 * array + array + 2 * row_stats  # + dO, lse, delta


def test_argument_shapes_change_nothing_where_the_kernel_layout_is_a_copy_either_way():
    # splash reads [batch, heads, seq, head_dim] and the Pallas kernel at head_dim 96 the padded
    # heads-first view: both copy projected arrays as they copy contract-shaped ones
    for impl, head_dim in (("splash", 128), ("pallas", 96)):
        spec = roofline.problem(4096, heads=8, head_dim=head_dim, causal=True)
        for mode in ("fwd", "fwd+bwd"):
            a = roofline.cost(impl, spec, mode, chip="v5e")
            b = roofline.cost(impl, spec, mode, chip="v5e", arguments="projected")
            assert (a.peak_hbm_bytes, a.hbm_bytes) == (b.peak_hbm_bytes, b.hbm_bytes), (impl, mode)
    from tpuattn.errors import TpuattnError

    expected = r"^arguments: expected one of \['contract', 'projected'\], got 'flat'"
    with pytest.raises(TpuattnError, match=expected):
        roofline.cost("pallas", roofline.problem(256), arguments="flat")
