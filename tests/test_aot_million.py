"""A million tokens through ``impl="pallas"`` on one device (compiled for v5p, not run), and through
the all-gather strategy of ``tpuattn.parallel`` on 8-device slices of v5e and v5p.

B=1, one head of 128, bf16, causal, forward and forward+backward at 1,048,576 tokens. The kernels'
position-only schedule is arithmetic on the block indices (:class:`tpuattn.pallas.plan.IntervalRule`),
not scalar-prefetch tables: tables of (queries / block) x (keys / block) entries asked for 16 MiB of
SMEM here, against v5p's 1 MiB. The peak HBM is what the call's arrays need (Q, K, V and O are 256
MiB each), so nothing of the length's square is left outside the kernels either.

Needs libtpu; the test command's ``compile`` stage runs it with ``TPUATTN_REQUIRE_TPU_COMPILER=1``.
"""

from __future__ import annotations

import pytest
from helpers import require_tpu_compiler

from tpuattn.measure import aot

require_tpu_compiler()

MILLION = 1 << 20
ARRAY = MILLION * 128 * 2  # one of Q, K, V, O, dQ, dK, dV: 256 MiB


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_a_million_tokens_compile_for_v5p(mode):
    row = aot.compile_row("v5p", "pallas", mode, aot.Problem(seq_len=MILLION, heads=1, head_dim=128,
                                                             causal=True))
    assert row["status"] == "ok", row["error"]
    # fwd: Q, K, V in, O out; fwd+bwd: Q, K, V in, dQ, dK, dV out, and no more than twice that in all.
    arrays = 4 if mode == "fwd" else 6
    assert arrays * ARRAY <= row["peak_hbm_bytes"] <= 2 * arrays * ARRAY, row["peak_hbm_bytes"]


@pytest.mark.parametrize(
    "topology, mode", [("v5e:2x4", "fwd"), ("v5p:2x2x2", "fwd"),
                       # the longest compile of the stage (~60 s): on the newest compiler only
                       pytest.param("v5p:2x2x2", "fwd+bwd", marks=pytest.mark.newest_compiler)]
)
def test_the_all_gather_strategy_compiles_at_a_million_tokens(topology, mode):
    # The sequence sharded over the slice's 8 devices, K/V gathered, each device's queries through
    # the Pallas kernel: 131,072 queries against 1,048,576 keys per device.
    from tpuattn.measure import slices

    row = slices.slice_row(topology, "allgather", mode, MILLION, heads=1, kv_heads=1, impl="pallas")
    assert row["status"] == "ok", row["error"]
    assert row["devices"] == 8
