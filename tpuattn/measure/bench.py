"""Benchmarks of attention implementations: timing, TFLOP/s and memory, with their provenance.

A benchmark is a sweep: every implementation x shape x mode (``"fwd"`` or ``"fwd+bwd"``).
Each row is timed with :func:`tpuattn.measure.timing.time_jitted` (compile timed on its own, warm-up,
the median and spread of repeats, every call synchronised with ``block_until_ready``),
converted to TFLOP/s with the standard count (:mod:`tpuattn.measure.flops`) and, on request,
given a peak memory (:mod:`tpuattn.measure.memory`'s child process on CPU; XLA's memory analysis of
the compiled call on an accelerator). A failure (out of memory, an unsupported input, an
implementation missing here) becomes a row with a ``status``, never a crash. Results go to
CSV and JSON together with the environment (JAX version, backend, device kind) so that runs
from different machines can be compared.

**Interpret mode is never kernel speed.** Pallas TPU kernels (registered with
``interpreted_off_tpu=True``) run in interpret mode off a TPU: they are timed (the number says how
long the lesson takes to run) but the row's ``timing_kind`` is
``"measured (interpret mode — not kernel speed)"`` and its ``tflops`` is left empty. See
:func:`runs_interpreted`.

From Python::

    from tpuattn import bench
    results = bench.run(["reference", "blockwise"], bench.sweep([512, 1024], causal=(False, True)),
                        modes=("fwd", "fwd+bwd"))
    results.save("out/bench")          # out/bench/bench.csv, out/bench/bench.json
    print(results.table())

From a shell (``--help`` lists every flag; ``--figures`` draws with :mod:`tpuattn.viz.timings`)::

    python -m tpuattn.bench --impls reference,blockwise --seq-lens 1024,2048 --modes fwd,fwd+bwd \\
        --causal both --out out/bench --memory --figures
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from tpuattn._checks import positive_int
from tpuattn.errors import UnavailableImplementation, UnsupportedInput
from tpuattn.measure.flops import MODES, attention_flops, check_mode
from tpuattn.measure.workload import Shape, function, inputs

__all__ = ["COLUMNS", "MODES", "STATUSES", "TIMING_COMPILED", "TIMING_INTERPRET", "BenchResults", "Shape",
           "attention_flops", "classify_error", "environment", "main", "parser", "progress_bar", "run",
           "run_one", "runs_interpreted", "sweep", "timing_kind"]

TIMING_COMPILED = "measured (compiled)"
TIMING_INTERPRET = "measured (interpret mode — not kernel speed)"

STATUSES = ("ok", "unsupported", "unavailable", "oom", "error")

# Column order of the CSV (the JSON rows carry the same keys).
COLUMNS = (
    "impl", "mode", "batch", "heads", "kv_heads", "seq_len", "kv_len", "head_dim", "dtype", "causal",
    "status", "error", "timing_kind", "device_label",
    "compile_s", "median_s", "min_s", "max_s", "spread", "repeats",
    "flops", "tflops",
    "memory_method", "peak_mib", "call_mib",
    "backend", "device_kind", "jax_version",
)


# ----------------------------------------------------------------------------- labels
def runs_interpreted(impl: str, backend: str | None = None, options: dict | None = None) -> bool:
    """Whether ``impl`` runs in Pallas interpret mode on ``backend`` (default: this machine's).

    True for a Pallas TPU kernel (its record's ``interpreted_off_tpu``) on any backend but
    ``"tpu"``, and for any implementation given a truthy ``interpret`` option.
    """
    from tpuattn import api

    if options and options.get("interpret"):
        return True
    if backend is None:
        import jax

        backend = jax.default_backend()
    return api.get_implementation(impl).interpreted_off_tpu and backend != "tpu"


def timing_kind(impl: str, backend: str | None = None, options: dict | None = None) -> str:
    """:data:`TIMING_INTERPRET` for interpreted kernels, else :data:`TIMING_COMPILED`."""
    return TIMING_INTERPRET if runs_interpreted(impl, backend, options) else TIMING_COMPILED


def environment(argv: Sequence[str] | None = None) -> dict:
    """Where a run happened: JAX and jaxlib versions, backend, device kind and count, time."""
    import numpy as np

    import tpuattn
    from tpuattn.measure import runtime as platform

    info = platform.info()
    env = dataclasses.asdict(info)
    env.update(numpy_version=np.__version__, tpuattn_version=tpuattn.__version__,
               label=info.label(), pallas_mode=info.pallas_mode,
               timestamp_utc=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
    if argv is not None:
        env["argv"] = list(argv)
    return env


# ----------------------------------------------------------------------------- shapes
def sweep(seq_lens: Iterable[int], *, batch: int = 1, heads: int = 4, kv_heads: int | None = None,
          head_dim: int = 64, dtypes: Iterable[str] = ("float32",),
          causal: Iterable[bool] = (False,)) -> list[Shape]:
    """A :class:`~tpuattn.measure.workload.Shape` for every combination of sequence length, dtype and
    causal flag (self-attention: kv_len = seq_len)."""
    seq_lens, dtypes, causal = list(seq_lens), list(dtypes), list(causal)
    for name, values in (("seq_lens", seq_lens), ("dtypes", dtypes), ("causal", causal)):
        if not values:
            raise ValueError(f"{name}: expected at least one value, got none")
    return [Shape(seq_len=n, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dt,
                  causal=c) for dt in dtypes for c in causal for n in seq_lens]


# ----------------------------------------------------------------------------- results
@dataclasses.dataclass
class BenchResults:
    """Rows (dicts with :data:`COLUMNS`) and the environment they were measured in."""

    rows: list[dict]
    environment: dict

    def __add__(self, other: BenchResults) -> BenchResults:
        return BenchResults(self.rows + other.rows, self.environment)

    def select(self, **where) -> list[dict]:
        """Rows whose columns equal the given values, e.g. ``select(impl="reference", mode="fwd")``."""
        return [row for row in self.rows if all(row.get(k) == v for k, v in where.items())]

    def to_csv(self, path) -> Path:
        """One row per measurement; environment columns repeat on every row so CSVs concatenate."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
            writer.writeheader()
            for row in self.rows:
                writer.writerow({k: _csv_value(row.get(k)) for k in COLUMNS})
        return path

    def to_json(self, path) -> Path:
        """``{"environment": {...}, "columns": [...], "rows": [...]}`` (NaN written as null)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"environment": self.environment, "columns": list(COLUMNS),
                "rows": [{k: _json_value(row.get(k)) for k in COLUMNS} for row in self.rows]}
        path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        return path

    @classmethod
    def from_json(cls, path) -> BenchResults:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return cls(rows=data["rows"], environment=data["environment"])

    def save(self, out_dir, stem: str = "bench") -> tuple[Path, Path]:
        """Write ``<out_dir>/<stem>.csv`` and ``<out_dir>/<stem>.json``; return both paths."""
        out_dir = Path(out_dir)
        return self.to_csv(out_dir / f"{stem}.csv"), self.to_json(out_dir / f"{stem}.json")

    def table(self) -> str:
        """A plain-text summary, one line per row."""
        head = (f"{'impl':<10} {'mode':<7} {'seq':>6} {'causal':<6} {'dtype':<8} {'status':<11} "
                f"{'compile s':>9} {'median ms':>10} {'spread':>7} {'TFLOP/s':>8} {'call MiB':>9}  timing")
        lines = [head, "-" * len(head)]
        for r in self.rows:
            lines.append(
                f"{r['impl']:<10} {r['mode']:<7} {r['seq_len']:>6} {str(r['causal']):<6} {r['dtype']:<8} "
                f"{r['status']:<11} {_fmt(r.get('compile_s'), '9.2f')} "
                f"{_fmt(_ms(r.get('median_s')), '10.2f')} "
                f"{_fmt(_pct(r.get('spread')), '6.0f')}% {_fmt(r.get('tflops'), '8.3f')} "
                f"{_fmt(_call_mib(r), '9.0f')}  "
                + (r["timing_kind"] if r["status"] == "ok" else r.get("error", ""))
            )
        env = self.environment
        lines.append(f"environment: JAX {env.get('jax_version')}, backend {env.get('backend')}, "
                     f"device {env.get('device_kind')}")
        return "\n".join(lines)


def _call_mib(row: dict):
    """Memory the call itself needed: RSS growth on CPU; XLA's plan (temporaries + outputs) elsewhere."""
    return row.get("call_mib") if row.get("call_mib") is not None else row.get("peak_mib")


def _csv_value(value):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return value


def _json_value(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _fmt(value, spec: str) -> str:
    width = int(spec.split(".")[0])
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-".rjust(width)
    return format(value, spec)


def _ms(seconds):
    return None if seconds is None else seconds * 1e3


def _pct(fraction):
    return None if fraction is None else fraction * 100


# ----------------------------------------------------------------------------- running
def classify_error(exc: BaseException) -> str:
    """The row status for an exception a benchmark row raised, by its type: ``"unsupported"``
    (:class:`~tpuattn.errors.UnsupportedInput`, ``NotImplementedError``), ``"unavailable"``
    (:class:`~tpuattn.errors.UnavailableImplementation`), ``"oom"`` (``MemoryError``, or XLA's
    ``RESOURCE_EXHAUSTED``, which only its message tells apart) or ``"error"``."""
    if isinstance(exc, UnsupportedInput | NotImplementedError):
        return "unsupported"
    if isinstance(exc, UnavailableImplementation):
        return "unavailable"
    message = str(exc)
    if isinstance(exc, MemoryError) or "RESOURCE_EXHAUSTED" in message or "out of memory" in message.lower():
        return "oom"
    return "error"


def _short_error(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    return text[:300]


class _TextProgress:
    """A minimal progress bar on stderr for when tqdm is not installed."""

    def __init__(self, total: int):
        self.total, self.done = total, 0

    def set_description(self, text: str) -> None:
        print(f"[{self.done + 1}/{self.total}] {text}", file=sys.stderr, flush=True)

    def update(self, n: int = 1) -> None:
        self.done += n

    def close(self) -> None:
        print(f"[{self.done}/{self.total}] done", file=sys.stderr, flush=True)


class _NoProgress:
    def set_description(self, text: str) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, enabled: bool = True):
    """tqdm when it is installed (the ``notebooks`` extra), else a one-line-per-step text bar."""
    if not enabled:
        return _NoProgress()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _TextProgress(total)
    return tqdm(total=total, unit="run", file=sys.stderr)


def _device_memory_mib(fn, args) -> float:
    """XLA's plan for the compiled call: temporaries + outputs (accelerators; RSS says nothing there)."""
    import jax

    analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
    if analysis is None:
        return float("nan")
    return (analysis.temp_size_in_bytes + analysis.output_size_in_bytes) / 2**20


def _row_base(impl: str, shape: Shape, mode: str, env: dict, options: dict) -> dict:
    interpreted = runs_interpreted(impl, env["backend"], options)
    from tpuattn.measure import runtime as platform

    label = platform.info().label(interpret=interpreted)
    return {
        "impl": impl, "mode": mode, "batch": shape.batch, "heads": shape.heads, "kv_heads": shape.kv_heads,
        "seq_len": shape.seq_len, "kv_len": shape.kv_len, "head_dim": shape.head_dim, "dtype": shape.dtype,
        "causal": shape.causal, "status": "ok", "error": "",
        "timing_kind": TIMING_INTERPRET if interpreted else TIMING_COMPILED, "device_label": label,
        "compile_s": None, "median_s": None, "min_s": None, "max_s": None, "spread": None, "repeats": None,
        "flops": shape.flops(mode), "tflops": None, "memory_method": "", "peak_mib": None, "call_mib": None,
        "backend": env["backend"], "device_kind": env["device_kind"], "jax_version": env["jax_version"],
    }


def run_one(impl: str, shape: Shape, mode: str, *, arrays=None, env: dict | None = None,
            options: dict | None = None, warmup: int = 1, repeats: int = 5, min_time_s: float = 0.0,
            memory: bool = False, timing: bool = True, seed: int = 0) -> dict:
    """One benchmark row (see :data:`COLUMNS`); failures are recorded in ``status``/``error``.

    ``arrays``: ``(q, k, v)`` of ``shape`` to reuse (default: :func:`~tpuattn.measure.workload.inputs`).
    """
    from tpuattn import api
    from tpuattn.measure.timing import time_jitted

    options = dict(options or {})
    env = env or environment()
    row = _row_base(impl, shape, mode, env, options)
    implementation = api.get_implementation(impl)
    if not implementation.available():
        row.update(status="unavailable", error=f"not available on backend {env['backend']!r}")
        return row
    reason = implementation.supports(shape.spec(), env["backend"])
    if reason is not None:
        row.update(status="unsupported", error=reason)
        return row
    try:
        q, k, v = arrays if arrays is not None else inputs(shape, seed)
        fn = function(impl, shape, mode, options)
        if timing:
            t = time_jitted(fn, q, k, v, warmup=warmup, repeats=repeats, min_total_s=min_time_s)
            row.update(compile_s=t.compile_s, median_s=t.median_s, min_s=t.min_s, max_s=t.max_s,
                       spread=t.spread, repeats=t.repeats)
            if row["timing_kind"] == TIMING_COMPILED and t.median_s > 0:
                row["tflops"] = row["flops"] / t.median_s / 1e12
        if memory and env["backend"] != "cpu":
            row.update(memory_method="XLA memory_analysis (temp + output)",
                       peak_mib=_device_memory_mib(fn, (q, k, v)))
    except Exception as exc:  # noqa: BLE001 - the bench's contract: any failure of a row is a row, not a crash
        row.update(status=classify_error(exc), error=_short_error(exc))
        return row
    if memory and env["backend"] == "cpu":
        _child_memory(row, impl, shape, mode, options)
    return row


def _child_memory(row: dict, impl: str, shape: Shape, mode: str, options: dict) -> None:
    try:
        json.dumps(options)
    except TypeError:
        row["memory_method"] = "not measured (options are not JSON)"
        return
    from tpuattn.measure.memory import measure_shape

    peak = measure_shape(impl, shape, mode, options)
    row["memory_method"] = "child process peak RSS"
    if peak.ok:
        row.update(peak_mib=peak.peak_mib, call_mib=peak.call_mib)
    else:
        row["memory_method"] += f" failed: {peak.error[:200]}"
        if row["status"] == "ok" and classify_error(RuntimeError(peak.error)) == "oom":
            row["status"] = "oom"


def _check_impls(impls) -> list[str]:
    from tpuattn import api

    known = api.known_implementations()
    if impls is None or impls == "all":
        return list(api.implementations())
    if isinstance(impls, str):
        impls = [impls]
    impls = list(impls)
    if not impls:
        raise ValueError("impls: expected at least one implementation name, got none")
    for impl in impls:
        if impl not in known:
            raise ValueError(f"impls: expected names from {sorted(known)} (or 'all'), got {impl!r}")
    return impls


def run(impls=None, shapes: Iterable[Shape] = (), modes: Iterable[str] = ("fwd",), *, warmup: int = 1,
        repeats: int = 5, min_time_s: float = 0.0, memory: bool = False, timing: bool = True,
        options: dict | None = None, progress: bool = True, seed: int = 0,
        argv: Sequence[str] | None = None) -> BenchResults:
    """Benchmark ``impls`` (names, or None/"all" = every implementation available here) on ``shapes``.

    Args:
      modes: any of ``"fwd"`` and ``"fwd+bwd"`` (the gradient of ``sum(attention(q, k, v))``
        with respect to q, k and v, which runs the forward too).
      warmup, repeats, min_time_s: as :func:`tpuattn.measure.timing.time_jitted`.
      memory: also record peak memory (a child process per row on CPU: slow).
      timing: time the calls (``False`` with ``memory=True`` measures memory only).
      options: ``{impl: {option: value}}`` passed to ``tpuattn.attention`` for that impl.
      progress: show a progress bar (tqdm if installed).
    """
    impls = _check_impls(impls)
    shapes = list(shapes)
    modes = list(modes)
    if not shapes:
        raise ValueError("shapes: expected at least one Shape (see bench.sweep), got none")
    for shape in shapes:
        if not isinstance(shape, Shape):
            raise ValueError(f"shapes: expected Shape objects (see bench.sweep), got {shape!r}")
    if not modes:
        raise ValueError(f"modes: expected at least one of {MODES}, got none")
    for mode in modes:
        check_mode(mode)
    positive_int("repeats", repeats)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup: expected a non-negative int, got {warmup!r}")
    if not timing and not memory:
        raise ValueError("timing, memory: expected at least one of them to be True, got both False")
    options = dict(options or {})
    for name, opts in options.items():
        if name not in impls:
            raise ValueError(f"options: expected keys among the benchmarked impls {impls}, got {name!r}")
        if not isinstance(opts, dict):
            raise ValueError(f"options[{name!r}]: expected a dict of options, got {opts!r}")

    env = environment(argv)
    rows = []
    bar = progress_bar(len(shapes) * len(impls) * len(modes), progress)
    try:
        for shape in shapes:
            arrays = None
            for impl in impls:
                for mode in modes:
                    bar.set_description(
                        f"{impl} {mode} seq={shape.seq_len} causal={shape.causal} {shape.dtype}")
                    if arrays is None:
                        arrays = inputs(shape, seed)
                    rows.append(run_one(impl, shape, mode, arrays=arrays, env=env, options=options.get(impl),
                                        warmup=warmup, repeats=repeats, min_time_s=min_time_s, memory=memory,
                                        timing=timing, seed=seed))
                    bar.update(1)
            del arrays
    finally:
        bar.close()
    return BenchResults(rows=rows, environment=env)


# ----------------------------------------------------------------------------- command line
def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one integer, got {text!r}")
    return values


def _str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


CAUSAL_CHOICES = {"false": (False,), "true": (True,), "both": (False, True)}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tpuattn.bench",
        description="Benchmark tpuattn implementations over a sweep; write CSV, JSON and figures.",
        epilog="Off a TPU, Pallas TPU kernels run in interpret mode: their rows are "
               "labelled 'not kernel speed' and carry no TFLOP/s.")
    p.add_argument("--impls", default="all", help="comma-separated implementation names, or 'all' (default)")
    p.add_argument("--seq-lens", type=_int_list, default=[256, 512, 1024], help="e.g. 1024,2048")
    p.add_argument("--modes", type=_str_list, default=["fwd"], help="fwd, fwd+bwd or fwd,fwd+bwd")
    p.add_argument("--causal", choices=sorted(CAUSAL_CHOICES), default="false")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtypes", type=_str_list, default=["float32"], help="e.g. float32,bfloat16")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--min-time", type=float, default=0.0, help="add repeats until this many seconds")
    p.add_argument("--options", default="", help="JSON: {impl: {option: value}}")
    p.add_argument("--memory", action="store_true", help="also measure peak memory (slow on CPU)")
    p.add_argument("--figures", action="store_true", help="also write PNG figures (needs matplotlib)")
    p.add_argument("--out", default="out/bench", help="output folder (default out/bench)")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: Sequence[str] | None = None, *,
         save_figures: Callable[[BenchResults, Path], list[Path]] | None = None) -> BenchResults:
    """The command line. ``--figures`` needs ``save_figures`` (``python -m tpuattn.bench`` passes
    :func:`tpuattn.viz.timings.save_figures`; the measuring layer does not import the figures)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    args = p.parse_args(argv)
    if args.figures and save_figures is None:
        p.error("--figures: draw with `python -m tpuattn.bench` (this entry point measures only)")
    try:
        impls = "all" if args.impls == "all" else _str_list(args.impls)
        options = json.loads(args.options) if args.options else {}
        if not isinstance(options, dict):
            raise ValueError(f"--options: expected a JSON object, got {args.options!r}")
        shapes = sweep(args.seq_lens, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
                       head_dim=args.head_dim, dtypes=args.dtypes, causal=CAUSAL_CHOICES[args.causal])
        results = run(impls, shapes, args.modes, warmup=args.warmup, repeats=args.repeats,
                      min_time_s=args.min_time, memory=args.memory, options=options,
                      progress=not args.no_progress, argv=["python", "-m", "tpuattn.bench", *argv])
    except (ValueError, json.JSONDecodeError) as exc:
        p.error(str(exc))
    csv_path, json_path = results.save(args.out)
    print(results.table())
    print(f"wrote {csv_path} and {json_path}")
    if args.figures:
        for path in save_figures(results, Path(args.out)):
            print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
