"""Every implementation through the real TPU compiler, for every chip (compiled, not run).

Needs libtpu (``pip install "jax[tpu]==<version>"``); the test command's ``compile`` stage runs this
file in ``.venv`` (which has libtpu) with ``TPUATTN_REQUIRE_TPU_COMPILER=1``, where a missing libtpu fails
instead of skipping. An implementation must compile whatever it claims to support: a row may be
``unsupported`` (a clear refusal), never ``compile_error``.
"""

from __future__ import annotations

import pytest
from helpers import require_tpu_compiler

from tpuattn import chips
from tpuattn.measure import aot
from tpuattn.model import roofline

require_tpu_compiler()

IMPLS = ("reference", "xla", "blockwise", "pallas", "splash")
# The model, the block table and the compile report are held to the compiler they were made with
# (JAX 0.10.2's libtpu); on JAX 0.7.2 with its own libtpu the stage checks that everything compiles.
PINNED_LIBTPU = aot.committed_report()["libtpu_version"]
pinned_compiler = pytest.mark.skipif(aot._versions()[1] != PINNED_LIBTPU,
                                     reason=f"compiled facts recorded with libtpu {PINNED_LIBTPU}")
MODES = ("fwd", "fwd+bwd")

# One configuration on every chip (bf16, causal, GQA, a length that is not a block multiple) ...
EVERY_CHIP = aot.Problem(seq_len=200, heads=4, kv_heads=2, head_dim=128, dtype="bfloat16")
# ... and the contract's options on every chip too (each has its own scoped-VMEM limit and bf16 support).
OPTIONS = {
    "f32-window": aot.Problem(seq_len=256, heads=2, head_dim=128, dtype="float32", causal=False,
                              window=(64, 16)),
    "bf16-segments-softcap": aot.Problem(seq_len=256, heads=2, head_dim=128, softcap=30.0, segments=True),
    "bf16-d64-mqa": aot.Problem(seq_len=384, heads=4, kv_heads=1, head_dim=64),
    "bf16-d256": aot.Problem(seq_len=256, heads=2, head_dim=256),
    "f32-d256-qlen<kvlen": aot.Problem(seq_len=128, kv_len=300, heads=2, head_dim=256, dtype="float32"),
}


def _check(row):
    where = f"{row['chip']} {row['impl']} {row['mode']}"
    assert row["status"] in ("ok", "unsupported"), f"{where}: {row['error']}"
    if row["status"] == "ok":
        assert row["label"] == aot.LABEL and row["peak_hbm_bytes"] > 0 and row["compile_s"] > 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("chip", chips.NAMES)
def test_every_implementation_compiles_for_every_chip(chip, impl, mode):
    if not aot.chip_known(chip):
        assert aot._versions()[1] != PINNED_LIBTPU, f"the pinned compiler must know {chip}"
        pytest.skip(f"the installed TPU compiler ({aot.versions_text()}) does not know {chip}")
    row = aot.compile_row(chip, impl, mode, EVERY_CHIP)
    _check(row)
    if impl in ("reference", "xla", "blockwise"):  # plain XLA: every chip takes it
        assert row["status"] == "ok", row["error"]
    if impl in ("pallas", "splash") and not chips.get(chip).bf16_matmul:
        # Colab's legacy TPU v2-8: Mosaic has no bf16 matmul there. Refused, in words.
        assert row["status"] == "unsupported" and "cast q, k, v to float32" in row["error"]


@pytest.mark.parametrize("name", sorted(OPTIONS))
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("chip", chips.NAMES)
def test_contract_options_compile(chip, impl, name):
    if not aot.chip_known(chip):
        pytest.skip(f"the installed TPU compiler ({aot.versions_text()}) does not know {chip}")
    _check(aot.compile_row(chip, impl, "fwd+bwd", OPTIONS[name]))


def test_float32_serves_the_kernels_on_v2():
    for impl in ("pallas", "splash"):
        row = aot.compile_row("v2", impl, "fwd", aot.Problem(seq_len=256, heads=2, dtype="float32"))
        assert row["status"] == "ok", row["error"]
        assert row["custom_calls"] >= 1  # a Mosaic kernel, not interpret mode


# ---------------------------------------------------------------------------- the model held to the compiler
# Shapes whose buffers are too large for the compiler to keep in VMEM (on v5e it kept a 64 MiB score
# buffer on chip): there the live set is all in HBM, as the model counts it. These lie off the grid of
# tests/test_aot_model_grid.py (v5e and v6e, bf16, 8 heads of 128, causal, 2048 to 32768 tokens),
# which holds every implementation there.
PEAK_CASES = [
    ("v4", "xla", aot.Problem(seq_len=8192, heads=8, dtype="float32")),
    ("v5e", "pallas", aot.Problem(seq_len=131072, heads=8)),
    ("v5e", "splash", aot.Problem(seq_len=65536, heads=8)),  # splash inspects its 512-blocks on the host
    ("v6e", "pallas", aot.Problem(seq_len=65536, batch=2, heads=8, head_dim=64)),
]


@pinned_compiler
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chip,impl,problem", PEAK_CASES, ids=[f"{c}-{i}-{p.dtype}-T{p.seq_len}-d{p.head_dim}"
                                                               for c, i, p in PEAK_CASES])
def test_modelled_peak_hbm_is_within_ten_percent_of_the_compiler(chip, impl, problem, mode):
    row = aot.compile_row(chip, impl, mode, problem)
    _check(row)
    spec = roofline.problem(problem.seq_len, batch=problem.batch, heads=problem.heads,
                            head_dim=problem.head_dim, dtype=problem.dtype, causal=problem.causal)
    modelled = roofline.cost(impl, spec, mode, chip=roofline.chip_spec(chip)).peak_hbm_bytes
    assert modelled == pytest.approx(row["peak_hbm_bytes"], rel=0.10), (modelled, row["peak_hbm_bytes"])


@pinned_compiler
def test_materialised_attention_stops_fitting_where_the_model_says():
    # jax.nn's XLA path, bf16, 8 heads of 128 on one v5e device (16 GiB): the compiler's own
    # out-of-memory confirms the modelled length, within 5%.
    t = roofline.materialise_crossover("v5e", heads=8, head_dim=128, dtype="bfloat16")
    fits = aot.compile_row("v5e", "xla", "fwd", aot.Problem(seq_len=int(t * 0.95) // 128 * 128, heads=8))
    assert fits["status"] == "ok", fits["error"]
    too_long = aot.compile_row("v5e", "xla", "fwd", aot.Problem(seq_len=int(t * 1.05) // 128 * 128, heads=8))
    assert too_long["status"] == "out_of_memory", too_long["error"]
    assert "RESOURCE_EXHAUSTED" in too_long["error"] and aot.HBM_OOM_PATTERN.search(too_long["error"])


# ---------------------------------------------------------------------------- block sizes from the compiler
@pinned_compiler
@pytest.mark.parametrize("chip", [c for c in chips.NAMES if chips.get(c).bf16_matmul])
def test_default_blocks_compile_at_full_size(chip):
    # 1024 tokens: the defaults (512 or 1024) are not clamped, forward and both backward passes.
    from tpuattn.pallas.blocks import default_block_sizes

    sizes = default_block_sizes(128, "bfloat16", chip=chip)
    assert sizes.forward.block_q >= 512, sizes
    _check(aot.compile_row(chip, "pallas", "fwd+bwd", aot.Problem(seq_len=1024, heads=2)))


@pinned_compiler
@pytest.mark.parametrize("chip", chips.NAMES)
def test_paired_heads_default_blocks_compile_on_every_chip(chip):
    # head_dim 64, a kv head pair to a 128-lane tile: every grid step holds two heads, so the defaults
    # are the compiler's head_dim 64 rows (compiled with a pair), not head_dim 128's. float32, the
    # widest (on v3, 128's 512 x 512 backward spilled 4 MiB of registers: 19.9 MiB of 16 VMEM).
    from tpuattn.pallas.blocks import compiled_pairs, default_block_sizes

    sizes = default_block_sizes(64, "float32", chip=chip, pack=2)
    for kernel, blocks in (("forward", sizes.forward), ("backward", sizes.backward)):
        assert (blocks.block_q, blocks.block_kv) in compiled_pairs(chip, kernel, 64, "float32", pack=2), (
            chip, kernel, blocks)
    _check(aot.compile_row(chip, "pallas", "fwd+bwd", aot.Problem(seq_len=1024, heads=2, head_dim=64,
                                                                     dtype="float32")))


@pinned_compiler
@pytest.mark.parametrize("pick", ["CompileTimeScopedVmemOom", "compile permanent error", "ok"])
def test_committed_block_table_reproduces(pick):
    # A row of the committed table compiled again: the first compile error of each kind the compiler
    # gives (Mosaic's scoped-VMEM check on v5e and newer, XLA's out-of-memory on the older chips), and
    # a pair it accepted.
    from tpuattn.pallas.blocks import compiled_table

    rows = compiled_table()["rows"]
    if pick == "ok":
        row = next(r for r in rows if r["status"] == "ok" and r["block_q"] == 1024)
    else:
        row = next(r for r in rows if r["status"] == "compile_error" and pick in r["error"])
    again = aot.block_row(row["chip"], row["kernel"], row["block_q"], row["block_kv"], row["head_dim"],
                          row["dtype"])
    assert again["status"] == row["status"], (row, again["error"])
    if pick != "ok":
        assert pick in again["error"], again["error"]


@pinned_compiler
def test_committed_paired_block_table_reproduces():
    # The paired table's reason to be, compiled again: on v3, float32, head_dim 64 with a kv head pair
    # a step, head_dim 128's default backward blocks (512 x 512) overflow VMEM, and the paired default
    # compiles.
    from tpuattn.pallas.blocks import compiled_table, default_block_sizes

    rows = {(r["chip"], r["kernel"], r["dtype"], r["block_q"], r["block_kv"]): r
            for r in compiled_table(paired=True)["rows"]}
    big = default_block_sizes(128, "float32", chip="v3").backward
    row = rows["v3", "backward", "float32", big.block_q, big.block_kv]
    assert row["head_dim"] == 64 and row["status"] == "compile_error", row
    again = aot.block_row("v3", "backward", big.block_q, big.block_kv, 64, "float32")
    assert again["status"] == "compile_error" and "vmem" in again["error"], again["error"]
    paired = default_block_sizes(64, "float32", chip="v3", pack=2).backward
    assert paired.block_q * paired.block_kv < big.block_q * big.block_kv
    assert rows["v3", "backward", "float32", paired.block_q, paired.block_kv]["status"] == "ok"


@pinned_compiler
def test_committed_report_reproduces():
    # The report the notebooks show (tpuattn/measure/compiled_report.json): one row of each status,
    # compiled again with the pinned compiler, agrees to the byte.
    report = aot.committed_report()
    assert (report["jax_version"], report["libtpu_version"]) == aot._versions()
    assert {r["status"] for r in report["rows"]} <= set(aot.STATUSES) - {"compile_error"}
    for status in ("ok", "out_of_memory", "unsupported"):
        row = next(r for r in report["rows"] if r["status"] == status and r["impl"] in ("pallas", "xla"))
        problem = aot.Problem(seq_len=row["seq_len"], batch=row["batch"], heads=row["heads"],
                              head_dim=row["head_dim"], dtype=row["dtype"], causal=row["causal"])
        again = aot.compile_row(row["chip"], row["impl"], row["mode"], problem)
        assert again["status"] == status, again["error"]
        assert again["peak_hbm_bytes"] == row["peak_hbm_bytes"]


@pinned_compiler
@pytest.mark.parametrize("kind, limit", [("report", 3), ("blocks", 1)])
def test_reproduce_a_committed_report_finds_no_difference(kind, limit, capsys):
    # python -m tpuattn.aot --reproduce FILE --limit N: the recorded problems, compiled again with the
    # pinned compiler, give the recorded rows (a subset spread over the report, for time).
    from tpuattn.measure import reports
    from tpuattn.pallas import blocks

    path = {"report": aot.REPORT, "blocks": blocks.COMPILED_TABLE}[kind]
    with pytest.raises(SystemExit) as done:
        reports.main(["--reproduce", str(path), "--limit", str(limit)])
    printed = capsys.readouterr().out
    assert done.value.code == 0, printed
    assert printed.count(": same") == limit and printed.strip().endswith("no difference"), printed


@pinned_compiler
@pytest.mark.parametrize(("head_dim", "heads"), [(64, 8), (64, 3), (128, 8)])
def test_the_wrappers_layout_copies_cost_at_least_what_the_model_counts(head_dim, heads):
    # Called with contract-shaped arrays, the Pallas path relays Q, K, V out into its view and O back:
    # [batch, seq, heads * head_dim] (the TPU tiles [.., heads, head_dim] otherwise) at head_dim 128 and
    # at 64 on 8 heads (paired), the padded [batch, heads, seq, 128] copy at 64 on 3 heads (an odd
    # number cannot pair). The model counts one read and one write of each (its "wrapper" lines);
    # XLA's cost analysis of those moves alone counts at least that, so the model stays a lower bound.
    problem = aot.Problem(seq_len=4096, heads=heads, head_dim=head_dim, causal=False)
    compiled = aot.layout_copy_bytes("v5e", problem)
    spec = roofline.problem(4096, heads=heads, head_dim=head_dim, dtype="bfloat16")
    cost = roofline.cost("pallas", spec, "fwd", chip=roofline.chip_spec("v5e"))
    modelled = sum(b for what, b in cost.breakdown if what.startswith("wrapper"))
    assert modelled <= compiled <= 4 * modelled, (modelled, compiled)
