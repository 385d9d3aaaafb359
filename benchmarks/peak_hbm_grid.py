"""Modelled peak HBM against the TPU compiler's, on a whole grid (compiled, not run).

Not a test (``tests/test_aot_model_grid.py`` holds the same grid to 10%). For every chip,
implementation, mode and sequence length it prints the roofline's peak HBM
(``tpuattn.model.roofline.cost(...).peak_hbm_bytes``), the compiler's (``memory_analysis``: arguments
+ outputs + temporaries, :func:`tpuattn.measure.aot.compile_row`) and their ratio, plus the compiled
bytes accessed beside the modelled HBM traffic, and the compiled temporaries per score element
(``temp B/score``: ``temp_bytes / (batch x heads x T x T)``, what a materialised schedule keeps live
per score: 8 where two float32 [B, H, T, T] buffers are)::

    python benchmarks/peak_hbm_grid.py                       # v5e and v6e, the whole grid (~5 min)
    python benchmarks/peak_hbm_grid.py --chips v5e --seq-lens 2048
    python benchmarks/peak_hbm_grid.py --chips v4,v5e,v5p,v6e --impls xla --modes fwd \
        --seq-lens 2048,3072,4096,6144,8192                  # XLA's live scores per chip and length

The grid: bf16, batch 1, 8 heads of 128, causal; T in 2048, 8192, 32768; reference, xla, pallas,
splash; fwd and fwd+bwd. Needs libtpu (the compile-only TPU devices).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tpuattn.measure import aot  # noqa: E402
from tpuattn.model import roofline  # noqa: E402

CHIPS = ("v5e", "v6e")
IMPLS = ("reference", "xla", "pallas", "splash")
MODES = ("fwd", "fwd+bwd")
SEQ_LENS = (2048, 8192, 32768)
MIB = 2**20


def grid_problem(seq_len: int) -> aot.Problem:
    return aot.Problem(seq_len=seq_len, batch=1, heads=8, head_dim=128, dtype="bfloat16", causal=True)


def modelled(chip: str, impl: str, mode: str, problem: aot.Problem) -> roofline.Cost:
    spec = roofline.problem(problem.seq_len, batch=problem.batch, heads=problem.heads,
                            head_dim=problem.head_dim, dtype=problem.dtype, causal=problem.causal)
    return roofline.cost(impl, spec, mode, chip=roofline.chip_spec(chip))


def row(chip: str, impl: str, mode: str, seq_len: int) -> dict:
    """One cell: the compiled row with the model's ``modelled_peak`` and ``modelled_bytes`` added."""
    problem = grid_problem(seq_len)
    compiled = aot.compile_row(chip, impl, mode, problem)
    cost = modelled(chip, impl, mode, problem)
    return dict(compiled, modelled_peak=cost.peak_hbm_bytes, modelled_bytes=cost.hbm_bytes)


def line(r: dict) -> str:
    head = f"{r['chip']:<4} {r['impl']:<9} {r['mode']:<7} {r['seq_len']:>6}"
    if r["status"] != "ok":
        return f"{head} {r['modelled_peak'] / MIB:9.0f} {'-':>9} {'-':>6}  {r['status']}: {r['error'][:80]}"
    ratio = r["modelled_peak"] / r["peak_hbm_bytes"]
    flag = "" if abs(ratio - 1) <= 0.10 else "  off"
    per_score = r["temp_bytes"] / (r["batch"] * r["heads"] * r["seq_len"] * r["seq_len"])
    return (f"{head} {r['modelled_peak'] / MIB:9.0f} {r['peak_hbm_bytes'] / MIB:9.0f} {ratio:6.2f} "
            f"{r['modelled_bytes'] / 1e9:8.3f} {r['bytes_accessed'] / 1e9:8.3f} {per_score:12.2f} "
            f"{r['compile_s']:6.1f}{flag}")


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chips", default=",".join(CHIPS))
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--seq-lens", default=",".join(map(str, SEQ_LENS)))
    args = parser.parse_args(argv)
    if not aot.tpu_available():
        parser.error("libtpu is not installed (the compile-only TPU devices come with it)")
    split = lambda text: [x for x in text.split(",") if x]
    print(f"peak HBM, modelled against compiled ({aot.versions_text()}); bf16, B=1, 8 heads x 128, causal")
    print(f"{'chip':<4} {'impl':<9} {'mode':<7} {'T':>6} {'model MiB':>9} {'comp MiB':>9} {'ratio':>6} "
          f"{'model GB':>8} {'comp GB':>8} {'temp B/score':>12} {'comp s':>6}")
    rows, start = [], time.perf_counter()
    for chip in split(args.chips):
        for seq_len in map(int, split(args.seq_lens)):
            for impl in split(args.impls):
                for mode in split(args.modes):
                    rows.append(row(chip, impl, mode, seq_len))
                    print(line(rows[-1]), flush=True)
    ok = [r for r in rows if r["status"] == "ok"]
    within = sum(abs(r["modelled_peak"] / r["peak_hbm_bytes"] - 1) <= 0.10 for r in ok)
    worst = max(ok, key=lambda r: abs(r["modelled_peak"] / r["peak_hbm_bytes"] - 1), default=None)
    print(f"{within} of {len(ok)} compiled cells within 10% ({len(rows) - len(ok)} did not compile); "
          + (f"worst {worst['chip']} {worst['impl']} {worst['mode']} T={worst['seq_len']}: "
             f"{worst['modelled_peak'] / worst['peak_hbm_bytes']:.2f}x; " if worst else "")
          + f"{time.perf_counter() - start:.0f} s")
    return rows


if __name__ == "__main__":
    main()
