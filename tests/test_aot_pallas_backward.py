"""The fast Pallas backward (``backward="fast"``) through the real TPU compiler for v5e (compiled, not
run): it compiles where the exact one does, and its program holds one kernel fewer (no row-sum pass).

Needs libtpu; the test command's ``compile`` stage runs it with ``TPUATTN_REQUIRE_TPU_COMPILER=1``.
"""

from __future__ import annotations

import pytest
from helpers import require_tpu_compiler

from tpuattn.measure import aot

require_tpu_compiler()

PROBLEMS = {
    "bf16-causal-gqa-200": aot.Problem(seq_len=200, heads=4, kv_heads=2, head_dim=128, dtype="bfloat16"),
    "bf16-segments-softcap": aot.Problem(seq_len=256, heads=2, head_dim=128, softcap=30.0, segments=True),
    "f32-window-d64": aot.Problem(seq_len=384, heads=2, head_dim=64, dtype="float32", causal=False,
                                  window=(64, 16)),
}


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_fast_backward_compiles_for_v5e_with_one_kernel_fewer(name):
    rows = {which: aot.compile_row("v5e", "pallas", "fwd+bwd", PROBLEMS[name], options={"backward": which})
            for which in ("exact", "fast")}
    for which, row in rows.items():
        assert row["status"] == "ok", f"{which}: {row['error']}"
        assert row["label"] == aot.LABEL and row["peak_hbm_bytes"] > 0
    # forward, row sums, dQ, dK/dV against forward, dQ, dK/dV.
    assert rows["fast"]["custom_calls"] == rows["exact"]["custom_calls"] - 1, rows
