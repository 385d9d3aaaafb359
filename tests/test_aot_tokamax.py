"""impl="tokamax" through the real TPU compiler (compiled, not run): tokamax's TPU kernel ("mosaic")
compiles whatever the adapter lets through and refuses the rest by name, on every chip the compiler
knows; and what its backward holds in HBM (one float32 dQ partial per K/V block, summed outside the
kernel: quadratic in the sequence length), the fact notebook 04 shows beside splash and the Pallas
kernel."""

from __future__ import annotations

import pytest
from helpers import require_tpu_compiler

import tpuattn
from tpuattn import chips
from tpuattn.measure import aot

require_tpu_compiler()
if "tokamax" not in tpuattn.implementations():
    pytest.skip(f"tokamax is unavailable here: {tpuattn.api.REGISTRY.unavailable_reason('tokamax')}",
                allow_module_level=True)

from test_aot import EVERY_CHIP, MODES, OPTIONS, _check  # noqa: E402

# tests/test_aot.py's problems: every chip's, and the options on v5e.
PROBLEMS = [(chip, "every-chip", EVERY_CHIP) for chip in chips.NAMES] + [
    ("v5e", name, problem) for name, problem in OPTIONS.items()]
# A length every chip's kernel takes (a multiple of its 128-row blocks), causal bf16 GQA.
ALIGNED = aot.Problem(seq_len=256, heads=4, kv_heads=2, head_dim=128, dtype="bfloat16")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chip, name, problem", PROBLEMS + [(c, "aligned", ALIGNED) for c in chips.NAMES],
                         ids=lambda x: x if isinstance(x, str) else None)
def test_compiles_or_refuses_by_name(chip, name, problem, mode):
    if not aot.chip_known(chip):
        pytest.skip(f"the installed TPU compiler ({aot.versions_text()}) does not know {chip}")
    row = aot.compile_row(chip, "tokamax", mode, problem)
    _check(row)
    if chip in ("v5e", "v6e") and name in ("aligned", "bf16-segments-softcap", "bf16-d64-mqa"):
        assert row["status"] == "ok", f"{chip} {name} {mode}: {row['error']}"
        assert row["custom_calls"] >= (1 if mode == "fwd" else 2), "no Mosaic kernel in the program"
    if row["status"] == "unsupported":
        assert "tokamax" in row["error"]


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_the_backward_holds_a_dq_partial_per_kv_block(chip):
    """Forward: only inputs and output. Backward: temporaries that grow with T^2 (16x from T=2048 to
    8192), at least the f32 [T/128, heads, T, head_dim] dQ partials."""
    temps = {}
    for n in (2048, 8192):
        problem = aot.Problem(seq_len=n, heads=8, head_dim=128, dtype="bfloat16")
        fwd = aot.compile_row(chip, "tokamax", "fwd", problem)
        assert fwd["status"] == "ok" and fwd["peak_hbm_bytes"] <= 1.05 * (fwd["argument_bytes"] +
                                                                            fwd["output_bytes"])
        bwd = aot.compile_row(chip, "tokamax", "fwd+bwd", problem)
        assert bwd["status"] == "ok", bwd["error"]
        temps[n] = bwd["temp_bytes"]
        assert temps[n] >= (n // 128) * 8 * n * 128 * 4
    assert 14 <= temps[8192] / temps[2048] <= 18


def test_the_committed_tokamax_report_reproduces(capsys):
    # python -m tpuattn.aot --reproduce tpuattn/measure/compiled_tokamax.json --limit 4: notebook 04's
    # tokamax table, compiled again, gives the recorded rows.
    from tpuattn.measure import reports

    recorded = aot.committed_report(aot.TOKAMAX_REPORT)["libtpu_version"]
    if aot._versions()[1] != recorded:
        pytest.skip(f"compiled facts recorded with libtpu {recorded}")
    with pytest.raises(SystemExit) as done:
        reports.main(["--reproduce", str(aot.TOKAMAX_REPORT), "--limit", "4"])
    printed = capsys.readouterr().out
    assert done.value.code == 0, printed
    assert printed.count(": same") == 4 and printed.strip().endswith("no difference"), printed
