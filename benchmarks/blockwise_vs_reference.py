"""Benchmark: blockwise against the materialised baselines, side by side as ratios, in one run.

Not a test. Built on :mod:`tpuattn.measure` (every row is a :func:`tpuattn.measure.bench.run` row),
it prints on this machine:

* peak memory of ``reference`` and ``blockwise``, forward and forward+backward (batch 1, 4 heads,
  head_dim 64, float32), lengths 1024..16384: a child process's peak resident set on CPU, XLA's
  memory plan on an accelerator; a reference run the model says would not fit in free memory is
  skipped and said so;
* wall time of the forward pass (median of repeats, compile excluded) of ``blockwise``,
  ``reference`` and ``xla`` (``jax.nn.dot_product_attention``), causal and not, lengths 1024..8192;

then one verdict per target the project sets for blockwise (no slower than the faster baseline
from 4096 tokens; at most a quarter of the reference's memory at 16384 tokens, growing linearly),
and the rows as CSV and JSON in ``--out``.

    python benchmarks/blockwise_vs_reference.py            # the full run (tens of minutes on 2 cores)
    python benchmarks/blockwise_vs_reference.py --quick    # small lengths: a smoke run
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from tpuattn.measure import bench, runtime
from tpuattn.model import roofline

CANDIDATE, BASELINE, NATIVE = "blockwise", "reference", "xla"
HEADS, HEAD_DIM = 4, 64
TIME_TARGET_FROM = 4096  # blockwise no slower than min(reference, xla) from this length
MEMORY_TARGET_AT, MEMORY_TARGET_RATIO = 16384, 0.25
LINEAR_EXPONENT = 1.25  # the largest growth exponent that still counts as linear


def _mem_available_bytes() -> float:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024.0
    except OSError:
        pass
    return math.inf


def _fits(shape: bench.Shape, mode: str) -> tuple[bool, str]:
    """Whether the baseline's modelled peak (its score buffers) fits in the free memory."""
    spec = roofline.problem(shape.seq_len, heads=shape.heads, head_dim=shape.head_dim, dtype=shape.dtype)
    need, free = roofline.cost(BASELINE, spec, mode).peak_hbm_bytes, _mem_available_bytes()
    return need <= 0.6 * free, f"skipped: needs ~{need / 2**30:.1f} GiB (modelled), {free / 2**30:.1f} free"


def _fmt(value, spec: str) -> str:
    width = int(spec.split(".")[0])
    return f"{value:{spec}}" if value is not None and math.isfinite(value) else f"{'n/a':>{width}}"


def run_memory(lengths, options) -> bench.BenchResults:
    label = runtime.info().label()
    print(f"\n== Peak memory (MiB), {label}, measured ==")
    print(f"   call = what the call added on top of runtime and inputs; batch 1, {HEADS} heads, "
          f"head_dim {HEAD_DIM}, float32, not causal")
    header = (f"{'seq':>6} {'mode':>8} | {'ref call':>9} {'bw call':>9} {'bw/ref':>7} | "
              f"{'ref peak':>9} {'bw peak':>9}")
    print(header)
    print("-" * len(header))
    results = None
    for seq_len in lengths:
        shape = bench.Shape(seq_len=seq_len, heads=HEADS, head_dim=HEAD_DIM)
        for mode in bench.MODES:
            fits, why_not = _fits(shape, mode)
            impls = [BASELINE, CANDIDATE] if fits else [CANDIDATE]
            part = bench.run(impls, [shape], [mode], memory=True, timing=False, options=options,
                             progress=False)
            results = part if results is None else results + part
            rows = {row["impl"]: row for row in part.rows}
            ref, bw = rows.get(BASELINE, {}), rows[CANDIDATE]
            ref_call, bw_call = ref.get("call_mib"), bw.get("call_mib")
            ratio = bw_call / ref_call if ref_call and bw_call is not None else None
            print(f"{seq_len:>6} {mode:>8} | {_fmt(ref_call, '9.0f')} {_fmt(bw_call, '9.0f')} "
                  f"{_fmt(ratio, '7.3f')} | {_fmt(ref.get('peak_mib'), '9.0f')} "
                  f"{_fmt(bw.get('peak_mib'), '9.0f')}", flush=True)
            if not fits:
                print(f"{'':>17}{BASELINE}: {why_not}")
            for row in part.rows:
                if row["status"] != "ok" or row["peak_mib"] is None:
                    print(f"{'':>17}{row['impl']}: {row['status']} {row['error'] or row['memory_method']}")
    return results


def run_timing(lengths, repeats, options) -> bench.BenchResults:
    label = runtime.info().label()
    print(f"\n== Wall time of the forward pass (median of {repeats}, seconds), {label}, measured ==")
    print(f"   {NATIVE} = jax.nn.dot_product_attention; ratio = {CANDIDATE} / min({BASELINE}, {NATIVE})")
    header = (f"{'seq':>6} {'causal':>6} | {CANDIDATE:>9} {BASELINE:>9} {NATIVE:>9} | {'ratio':>6} "
              f"| {'bw compile':>10}")
    print(header)
    print("-" * len(header))
    results = bench.run([CANDIDATE, BASELINE, NATIVE], bench.sweep(lengths, heads=HEADS, head_dim=HEAD_DIM,
                                                                   causal=(False, True)),
                        repeats=repeats, options=options, progress=False)
    for seq_len in lengths:
        for causal in (False, True):
            rows = {row["impl"]: row for row in results.select(seq_len=seq_len, causal=causal)}
            median = {impl: rows[impl]["median_s"] for impl in rows}
            others = [median[i] for i in (BASELINE, NATIVE) if median.get(i) is not None]
            ratio = median[CANDIDATE] / min(others) if others and median.get(CANDIDATE) is not None else None
            print(f"{seq_len:>6} {causal!s:>6} | {_fmt(median.get(CANDIDATE), '9.3f')} "
                  f"{_fmt(median.get(BASELINE), '9.3f')} {_fmt(median.get(NATIVE), '9.3f')} | "
                  f"{_fmt(ratio, '6.2f')} | {_fmt(rows[CANDIDATE]['compile_s'], '9.1f')}s", flush=True)
    for row in results.rows:
        if row["status"] != "ok":
            print(f"   {row['impl']} seq {row['seq_len']} causal={row['causal']}: "
                  f"{row['status']} {row['error']}")
    return results


def verdicts(memory: bench.BenchResults | None, timing: bench.BenchResults | None) -> None:
    print(f"\n== Verdicts (the project's targets for {CANDIDATE}), {runtime.info().label()}, measured ==")
    if timing is not None:
        median = {(r["seq_len"], r["causal"], r["impl"]): r["median_s"] for r in timing.select(status="ok")}
        worst = []
        for (seq_len, causal, impl), t in median.items():
            others = [median.get((seq_len, causal, i)) for i in (BASELINE, NATIVE)]
            if impl == CANDIDATE and seq_len >= TIME_TARGET_FROM and all(o is not None for o in others):
                worst.append((t / min(others), seq_len, causal))
        if worst:
            ratio, seq_len, causal = max(worst)
            print(f"[{'PASS' if ratio <= 1.0 else 'MISS'}] time: {CANDIDATE} no slower than "
                  f"min({BASELINE}, {NATIVE}) from {TIME_TARGET_FROM} up; worst ratio {ratio:.2f} "
                  f"at seq {seq_len} causal={causal}")
        else:
            print(f"[n/a ] time: no length >= {TIME_TARGET_FROM} timed (use the full run)")
    if memory is None:
        return
    call = {(r["seq_len"], r["mode"], r["impl"]): r["call_mib"] for r in memory.select(status="ok")
            if r["call_mib"] is not None}
    for mode in bench.MODES:
        both = sorted(s for (s, m, i) in call if m == mode and i == CANDIDATE and (s, m, BASELINE) in call)
        if both:
            top = both[-1]
            ratio = call[top, mode, CANDIDATE] / call[top, mode, BASELINE]
            # The target is stated at MEMORY_TARGET_AT tokens; below it the verdict is only partial.
            status = "PASS" if ratio <= MEMORY_TARGET_RATIO else "MISS"
            status = status if top >= MEMORY_TARGET_AT else "PART"
            note = "" if top >= MEMORY_TARGET_AT else f" ({BASELINE} measured only up to {top})"
            print(f"[{status}] memory {mode}: {CANDIDATE}/{BASELINE} at {top} = {ratio:.3f} "
                  f"(target <= {MEMORY_TARGET_RATIO}){note}")
        lengths = sorted(s for (s, m, i) in call if m == mode and i == CANDIDATE)
        if len(lengths) >= 2:
            a, b = lengths[-2], lengths[-1]
            growth = call[b, mode, CANDIDATE] / max(call[a, mode, CANDIDATE], 1e-9)
            exponent = math.log(growth) / math.log(b / a) if growth > 0 else float("nan")
            status = "PASS" if exponent <= LINEAR_EXPONENT else "MISS"
            print(f"[{status}] memory {mode}: {CANDIDATE} grows as length^{exponent:.2f} from {a} to {b} "
                  f"(x{growth:.2f} for x{b / a:.0f} length; linear = 1)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small lengths and few repeats (smoke run)")
    parser.add_argument("--mem-lengths", type=int, nargs="*", default=None)
    parser.add_argument("--time-lengths", type=int, nargs="*", default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--block-q", type=int, default=None, help=f"{CANDIDATE}'s block_q (default: its own)")
    parser.add_argument("--block-kv", type=int, default=None,
                        help=f"{CANDIDATE}'s block_kv (default: its own)")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--out", default="out/blockwise_vs_reference")
    args = parser.parse_args(argv)
    mem_lengths = args.mem_lengths or ([1024, 2048, 4096] if args.quick else [1024, 2048, 4096, 8192, 16384])
    time_lengths = args.time_lengths or ([1024, 2048] if args.quick else [1024, 2048, 4096, 8192])
    repeats = args.repeats or (3 if args.quick else 5)
    blocks = {key: val for key, val in (("block_q", args.block_q), ("block_kv", args.block_kv)) if val}
    options = {CANDIDATE: blocks} if blocks else None
    print(runtime.info().summary())
    print(f"numbers below are measured on this machine ({runtime.info().label()}); {CANDIDATE} options: "
          f"{blocks or 'defaults'}")
    memory = None if args.skip_memory else run_memory(mem_lengths, options)
    timing = None if args.skip_timing else run_timing(time_lengths, repeats, options)
    verdicts(memory, timing)
    out = Path(args.out)
    for stem, results in (("memory", memory), ("timing", timing)):
        if results is not None:
            csv_path, json_path = results.save(out, stem)
            print(f"wrote {csv_path} and {json_path}")


if __name__ == "__main__":
    main()
