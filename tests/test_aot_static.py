"""What the compiler made, read statically (:mod:`tpuattn.measure.static`): libtpu's final VLIW bundles and
Mosaic dumps of Pallas kernels compiled for v5e in a child process (compiled, not run). Needs libtpu
(the test command's compile stages)."""

from __future__ import annotations

import pytest
from helpers import require_tpu_compiler

from tpuattn import chips
from tpuattn.measure import static

require_tpu_compiler()

# One 128x128 bf16 block of Q times one of K transposed, per grid step of a 4x4 grid.
SCORES = """
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
def scores_kernel(q_ref, k_ref, o_ref):
    o_ref[...] = jax.lax.dot_general(q_ref[...], k_ref[...], (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)
def FN(q, k):
    spec = lambda index: pl.BlockSpec((128, 128), index)
    return pl.pallas_call(scores_kernel, grid=(4, 4),
                          in_specs=[spec(lambda i, j: (i, 0)), spec(lambda i, j: (j, 0))],
                          out_specs=spec(lambda i, j: (i, j)),
                          out_shape=jax.ShapeDtypeStruct((512, 512), jnp.float32))(q, k)
ARGS = [jax.ShapeDtypeStruct((512, 128), jnp.{dtype})] * 2
"""


def _oracle_vmatmuls(m, k, n, itemsize, mxu=128):
    # Independent count: FLOPs of the matmul over the FLOPs one vmatmul does (one 32-bit vector
    # register of LHS rows, 8 sublanes, times an mxu x mxu weight tile), for sizes that divide evenly.
    rows = 8 * 4 // itemsize
    return (2 * m * k * n) // (2 * rows * mxu * mxu)


@pytest.mark.parametrize("dtype, itemsize", [("bfloat16", 2), ("float32", 4)])
def test_lesson_kernel_bundles(dtype, itemsize, tmp_path):
    rows = static.report(SCORES.format(dtype=dtype), "v5e", out_dir=tmp_path)
    assert [row.name for row in rows] == ["scores_kernel"]
    (row,) = rows
    assert row.matmuls == ((128, 128, 128, "bf16" if dtype == "bfloat16" else "f32"),)
    assert row.ideal_vmatmul == _oracle_vmatmuls(128, 128, 128, itemsize)
    assert row.loop_depth == 1 and 0 < row.loop_bundles < row.bundles
    if dtype == "bfloat16":
        assert row.vmatmul == row.ideal_vmatmul == 8
    else:  # float32 at default precision: at least one pass per register, more if split into bf16 passes
        assert row.vmatmul >= row.ideal_vmatmul == 16
    assert static.mosaic_file(tmp_path, "scores_kernel", "post-finalize-llo").exists()


# exp2 over float32 blocks of 512 x 512, one per step of a 4-step grid: the roofline's exp rate.
EXPS = """
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
def exp_kernel(x_ref, o_ref):
    o_ref[...] = jnp.exp2(x_ref[...])
def FN(x):
    spec = pl.BlockSpec((512, 512), lambda i: (i, 0))
    return pl.pallas_call(exp_kernel, grid=(4,), in_specs=[spec], out_specs=spec,
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
ARGS = [jax.ShapeDtypeStruct((2048, 512), jnp.float32)]
"""


@pytest.mark.parametrize("chip", ["v4", "v5e", "v5p", "v6e"])
def test_the_exp_rate_is_what_the_compiler_schedules(chip, tmp_path):
    # tpuattn.chips.EUP: one float32 vector register (8 x 128 values) per EUP push, at most one push
    # per bundle. A 512 x 512 block is 512 * 512 / 1024 = 256 registers: 256 pushes, in no fewer bundles.
    (row,) = static.report(EXPS, chip, out_dir=tmp_path)
    assert row.eup == 512 * 512 // chips.EUP_VREG_ELEMENTS == 256, (chip, row.eup)
    assert row.eup_per_bundle == chips.EUP_PUSHES_PER_CYCLE == 1, (chip, row.eup_per_bundle)
    assert row.loop_bundles >= row.eup


def test_package_kernels():
    rows = {row.name: row for row in static.package_report("v5e", seq_len=4096, heads=1)}
    assert sorted(rows) == ["tpuattn_flash_dkv", "tpuattn_flash_dq", "tpuattn_flash_forward",
                            "tpuattn_flash_row_sums"]
    # Matmuls per tile of the kernels' code (masked and unmasked branches each hold them): forward
    # QK^T and PV; row sums QK^T and dO V^T; dQ adds dS K; dK/dV recomputes S and dP, adds P^T dO, dS^T Q.
    assert {name: len(row.matmuls) for name, row in rows.items()} == {
        "tpuattn_flash_forward": 4, "tpuattn_flash_row_sums": 4, "tpuattn_flash_dq": 6,
        "tpuattn_flash_dkv": 8}
    for row in rows.values():
        assert row.vmatmul >= row.ideal_vmatmul > 0
        assert row.label == "compiled (static)"


def test_one_transcendental_per_score_and_a_softcap_adds_its_tanh():
    # Each kernel computes one (block_q x block_kv) float32 score tile per branch (masked and not, both
    # counted), 8 x 128 scores a vector register; its first matmul is that tile's Q K^T.
    plain = {row.name: row for row in static.package_report("v5e", seq_len=4096, heads=1)}
    capped = {row.name: row for row in static.package_report("v5e", seq_len=4096, heads=1, softcap=30.0)}
    assert sorted(plain) == sorted(capped)
    for name, row in plain.items():
        m_rows, _, n_cols, _ = row.matmuls[0]
        score_vregs = 2 * m_rows * n_cols // (8 * 128)
        # one exp2 per score, plus per-row work (the rescale, log, reciprocal) far below one per score
        assert score_vregs <= row.eup < 2 * score_vregs, (name, row.eup, score_vregs)
        assert capped[name].eup - row.eup == score_vregs, (name, capped[name].eup, row.eup)
        assert capped[name].valu > row.valu > score_vregs
    assert static.LABEL in static.table(list(plain.values()))


def test_bad_input_is_named(tmp_path):
    with pytest.raises(ValueError, match="code: expected Python source defining FN and ARGS"):
        static.dump("x = 1", "v5e", tmp_path)
    with pytest.raises(ValueError, match="chip: expected one of"):
        static.ideal_vmatmul([(8, 128, 128, "f32")], "v9")
    with pytest.raises(ValueError, match="mode: expected 'fwd' or 'fwd\\+bwd'"):
        static.package_code("bwd")


def test_compile_failure_is_reported(tmp_path):
    broken = SCORES.format(dtype="bfloat16").replace("(128, 128)", "(100, 128)")
    with pytest.raises(static.DumpFailed, match="child compile for v5e failed"):
        static.dump(broken, "v5e", tmp_path)
