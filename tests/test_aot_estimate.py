"""The compiled static estimate (:mod:`tpuattn.measure.estimate`): libtpu's final bundles counted as often as
they run, on kernels whose counts are known by construction (compiled for v5e in a child process, not run).
Needs libtpu (the test command's compile stages)."""

from __future__ import annotations

import re

import pytest
from helpers import require_tpu_compiler

from tpuattn import chips, errors
from tpuattn.measure import estimate, static

require_tpu_compiler()

# One 128 x 128 bf16 block of Q times one of K transposed per grid step, over a grid of `steps` steps,
# the product written only on the steps `when` selects (every step: `True`).
MATMUL_LOOP = """
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
def loop_kernel(q_ref, k_ref, o_ref):
    j = pl.program_id(0)
    o_ref[...] = jnp.zeros_like(o_ref)
    @pl.when({when})
    def _():
        o_ref[...] = jax.lax.dot_general(q_ref[...], k_ref[...], (((1,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32)
def FN(q, k):
    spec = lambda index: pl.BlockSpec((128, 128), index)
    return pl.pallas_call(loop_kernel, grid=({steps},),
                          in_specs=[spec(lambda j: (0, 0)), spec(lambda j: (j, 0))],
                          out_specs=spec(lambda j: (0, j)),
                          out_shape=jax.ShapeDtypeStruct((128, 128 * {steps}), jnp.float32))(q, k)
ARGS = [jax.ShapeDtypeStruct((128, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((128 * {steps}, 128), jnp.bfloat16)]
"""


def _loop_bundles(path) -> int:
    # Independent count: the bundle lines (an address, then ':') from the loop body's first (``LB:``)
    # through the branch back to it (the first branch after the loop's exit test) and the bundles issued
    # in that branch's delay: those with an instruction inside the loop ('>') and the empty ones after
    # them ('{}', printed without the loop's marks).
    lines = [line for line in path.read_text().splitlines()
             if re.match(r"^\s*(0x[0-9a-f]+|\d+)\s+\w*:", line)]
    start = next(i for i, line in enumerate(lines) if " LB:" in line)
    exit_test = next(i for i, line in enumerate(lines) if "loop exit test" in line)
    stop = next(i for i in range(exit_test, len(lines)) if "sbr.rel" in lines[i]) + 1
    while re.search(r":\s*>", lines[stop]) or re.search(r"\{\s*\}", lines[stop]):
        stop += 1
    return stop - start


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """``kernel(steps, when)`` -> (dump folder, bundles file, estimate with every step computing), each
    program compiled once for the module."""
    made = {}

    def make(steps, when="True"):
        if (steps, when) not in made:
            out = static.dump(MATMUL_LOOP.format(steps=steps, when=when), "v5e",
                              tmp_path_factory.mktemp(f"loop{steps}"))
            path = static.bundle_file(out, "loop_kernel")
            made[steps, when] = out, path, estimate.estimate_bundles(path, "v5e", estimate.Weights(),
                                                                     name="loop_kernel")
        return made[steps, when]
    return make


def test_the_estimate_scales_with_the_grid(kernel):
    # The grid is one loop: its trips are the grid's steps plus the pipeline's warm-up and drain, and each
    # trip costs the loop's bundles, so 16 steps cost 12 trips of loop bundles more than 4 steps.
    (_, path4, four), (_, path16, sixteen) = kernel(4), kernel(16)
    assert four.trips == (4 + 2,) and sixteen.trips == (16 + 2,)
    per_trip = _loop_bundles(path16)
    assert per_trip == _loop_bundles(path4)  # the same step, compiled twice
    assert sixteen.cycles - four.cycles == pytest.approx(12 * per_trip)
    assert four.label == estimate.LABEL == "compiled (static estimate, not run)"
    # The MXU bound is a true lower bound: one 128 x 128 x 128 matmul per step at the chip's peak.
    peak = chips.get("v5e").per_device()["bf16_flops"]
    assert sixteen.seconds >= 16 * 2 * 128**3 / peak


def test_a_branch_is_weighed_by_how_often_the_grid_takes_it(kernel):
    # The product runs on one step in 4: a region holding every vmatmul of the kernel, weighed by that share.
    _, path, every = kernel(16, "j % 4 == 0")
    (compute,) = [r for r in every.regions if r.kind == "compute"]
    assert compute.vmatmul == static.read_bundles(path)["vmatmul"] == 8
    quarter = estimate.estimate_bundles(path, "v5e", estimate.Weights(compute=0.25))
    skipped = (compute.stop - compute.start) * every.trips[0]
    assert every.cycles - quarter.cycles == pytest.approx(0.75 * skipped)
    # The regions the weights leave alone (the pipeline's) do not change.
    assert [r.kind for r in quarter.regions] == [r.kind for r in every.regions]


def test_the_whole_program_adds_its_computations(kernel):
    out, _, one = kernel(16)
    program = estimate.estimate_dump(out, "v5e", {"loop_kernel": estimate.Weights()})
    names = [c.name for c in program.computations]
    assert "loop_kernel" in names and names[-1] == "program"
    assert program.seconds == pytest.approx(sum(c.seconds for c in program.computations))
    assert [c for c in program.computations if c.name == "loop_kernel"][0].cycles == one.cycles
    assert program.label == estimate.LABEL


def test_tile_weights_follow_the_tile_codes():
    # 4 x 4 tiles of a causal square: 10 visited of 16, the 4 on the diagonal partial; one write-out per row.
    assert estimate.tile_weights(2048, 512, True) == estimate.Weights(compute=10 / 16, partial=4 / 16,
                                                                      edge=1 / 4)
    assert estimate.tile_weights(2048, 512, False) == estimate.Weights(compute=1.0, partial=0.0, edge=1 / 4)


def test_clocks_are_published_or_derived():
    # v4's published clock (1050 MHz) and the one its peak implies agree; v5e has none published.
    hz, source = chips.estimate_clock("v4")
    assert hz == 1.05e9 and "ISCA 2023" in source
    assert chips.get("v4").clock_hz == pytest.approx(hz, rel=0.01)
    assert chips.estimate_clock("v5e")[1].startswith("derived")


def test_bad_weights_are_named():
    with pytest.raises(errors.TpuattnError, match="compute: expected a share between 0 and 1, got 1.5"):
        estimate.Weights(compute=1.5)


# A grid whose size the program passes in (tokamax's kernels step over the visited tiles only): the loop's
# branch back tests its index against a scalar the bundles compute from the call's operand 0, here
# 2 + (136 << 3) = 1090 trips, the shape of the tokamax forward's v5e bundles (operand 0 is the HLO's
# constant 136, its visited tiles per head).
DYNAMIC_GRID = """\
     0   :  { %s4030_s0 = inlined_call_operand.<no memory space> [shape: s32[], index: 0, kind: input] }
   0x1   :  { %4043 = sst [smem:[#allocation14_spill]] %s4030_s0 }
   0x2   :  { %s4041_s12 = sshll.u32 %s4030_s0, 3 }
   0x3   :  { %s2937_s14 = sadd.s32 2, %s4041_s12 }
   0x4   :  { %s2948_s18 = smov 0 }
   0x5 LB: > { %s2851_s18 = sphi %s2948_s18, %s48_s18 } /* Start region 91 */
   0x6   : > { %p1_p1 = scmp.eq.s32.totalorder %s2851_s18, 0 }
   0x7   : > { %2 = sbr.rel (%p1_p1) target = $region5 }
   0x8   : > { %v1_v1 = vmatmul.f32 %v0_v0 }
   0x9   : > { %v2_v2 = vmatmul.f32 %v1_v1 }
   0xa PF: > { %s48_s18 = sadd.s32 1, %s2851_s18 } /* Start region 5 */
   0xb   : > { %p47_p2 = scmp.ge.s32.totalorder %s48_s18, %s2937_s14 }
   0xc   :  { %50 = sbr.rel (!%p47_p2) target = $region91 }
   0xd   :  {}
"""


def test_a_grid_sized_by_an_operand_takes_its_trips_from_it(tmp_path):
    path = tmp_path / "dynamic-01-final_bundles.txt"
    path.write_text(DYNAMIC_GRID)
    bundles = estimate.read(path)
    ((start, stop, depth, trips),) = estimate.loops(bundles, (136, None))
    assert (depth, trips) == (1, 2 + 136 * 8) and stop - start == 7
    with pytest.raises(ValueError, match="no exit test with a constant trip count"):
        estimate.loops(bundles, (None,))  # the operand is not a constant of the program
    one = estimate.estimate_bundles(path, "v5e", estimate.Weights(), operands=(136,))
    assert one.trips == (1090,)
    # The two vmatmul bundles the branch skips run on the computing steps' share. A kernel's shares on
    # either grid: this grid's size is an operand, so it takes the visited tiles' (every step computes).
    (compute,) = one.regions
    assert (compute.kind, compute.vmatmul, compute.stop - compute.start) == ("compute", 2, 2)
    half = estimate.estimate_bundles(path, "v5e", estimate.Weights(compute=0.5), operands=(136,))
    assert one.cycles - half.cycles == pytest.approx(0.5 * 2 * 1090)
    shares = estimate.GridShares(full=estimate.Weights(compute=0.5), visited=estimate.Weights())
    assert estimate.estimate_bundles(path, "v5e", shares, operands=(136,)).cycles == one.cycles


# An XLA copy's inner loop over a chunk: its length min(1024 - 80 i, 80) (a compare and a predicated move
# of the constant), its trips that over 32 (JAX 0.10.2's libtpu, splash's backward at 8K tokens on v5e).
CHUNK_LOOP = """\
     0   :  { %s52_s15 = smov 0 }
   0x1   :  { %s53_s18 = ssub.s32 1024, %s52_s15 }
   0x2   :  { %p54_p3 = scmp.lt.s32.totalorder (!%p2_p2), %s53_s18, 80 }
   0x3   :  { %s5293_s18 = smov (!%p54_p3, %s53_s18), 80 }
   0x4   :  { %s3292_s26 = sshrl.u32 (!%p4_p4), %s5293_s18, 5  ;;  %s3300_s29 = smov 0 }
   0x5 LB: > { %s3178_s29 = sphi %s3300_s29, %s256_s2 } /* Start region 622 */
   0x6   : > { %s256_s2 = sadd.s32 1, %s3178_s29 }
   0x7   : > { %p185_p6 = scmp.ge.s32.totalorder %s256_s2, %s3292_s26 }
   0x8   : > { %188 = sbr.rel (!%p185_p6) target = $region622 }
   0x9   :  {}
"""


def test_a_chunk_loop_takes_its_trips_from_the_clamp(tmp_path):
    path = tmp_path / "copy-01-final_bundles.txt"
    path.write_text(CHUNK_LOOP)
    assert estimate.loops(estimate.read(path)) == [(5, 10, 1, 80 >> 5)]  # the idle delay slot counted in
    # a predicated move whose predicate is not the clamp of the same scalar is not read
    path.write_text(CHUNK_LOOP.replace("%s53_s18, 80 }", "%s53_s18, 81 }"))
    with pytest.raises(ValueError, match="no exit test with a constant trip count"):
        estimate.loops(estimate.read(path))


def test_visited_grid_and_splash_weights():
    # 4 x 4 tiles of a causal square visited: 10 steps, all computing, 4 of them partial, 4 rows.
    assert estimate.visited_grid_weights(2048, 512, 512) == estimate.Weights(compute=1.0, partial=4 / 10,
                                                                            edge=4 / 10)
    # splash's body (its nested branch included) runs on every visited tile, for every kernel.
    every = estimate.splash_weights(2048, 512)
    assert every.get("splash_mha_dkv_no_residuals") == estimate.Weights(compute=10 / 16, partial=10 / 16,
                                                                         edge=1 / 4)
    assert estimate.EveryKernel(None).get("any", estimate.Weights()) == estimate.Weights()


def test_v4_compiles_for_its_megacore_device():
    # A v4 JAX device is the chip, its two TensorCores one megacore device (tpuattn.chips: megacore, a
    # device's share of the chip 1); libtpu describes that device when asked for the megacore chip
    # configuration, four devices of two cores for the 2x2x1 slice.
    from tpuattn.measure import aot

    assert chips.get("v4").megacore and chips.get("v4").per_device()["hbm_bandwidth"] == 1.23e12
    code = estimate.device_code("FN = None\nARGS = []\n", "v4")
    assert "aot.describe_topology" in code and "chip_config_name" in code
    assert code.endswith("FN = None\nARGS = []\n")
    assert estimate.device_code("FN = None", "v5p") == "FN = None"  # v5p's devices are megacore already
    name = chips.get("v4").topology
    try:
        described = aot.describe_topology(name, **estimate.TOPOLOGY_OPTIONS["v4"])
        assert len(described.devices) == 4 and described.devices[0].num_cores == 2
        assert aot.topology_device(chips.get("v4")) is described.devices[0]  # what compile_for uses
    finally:  # the rest of this process compiles for libtpu's default description, as before
        default = aot.describe_topology(name)
    assert len(default.devices) == 8


def test_each_published_run_compiles_the_program_its_source_ran():
    # axlearn's 261.7b-layer times (apple/axlearn 6789f847, tpu_attention_benchmark.py) were printed by a
    # benchmark that passes a dense [batch, heads, T, T] bias to JAX's Pallas flash_attention (ab=) and to
    # its mha_reference; marin's rows ran splash, jax-ml/jax#24633 flash_attention without a bias.
    from tpuattn.model import published, validation

    for run in published.RUNS:
        what, code, _ = validation.program(run)
        if run.source.startswith("apple/axlearn"):
            assert "bias" in what and f"({run.batch}, {run.heads}, {run.seq_len}, {run.seq_len})" in code
            assert ("ab=bias" in code) == (run.impl != "reference")
        elif run.source.startswith("marin"):
            assert "splash_attention" in code and "bias" not in code
