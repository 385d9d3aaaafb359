"""Figures for :mod:`tpuattn.measure.bench` results and :mod:`tpuattn.model.roofline` models.

Every title says where its numbers come from: ``"<device>, measured"`` (from the results'
environment, so a JSON from another machine is labelled with that machine) or ``"modelled"``.
Rows measured in Pallas interpret mode are never drawn on the same axes as compiled rows: time
plots take either kind (``interpret=``), ``figure(results, "time")`` gives them their own row of
panels, and TFLOP/s plots leave them out: they are not kernel speed. Each implementation has its colour
(:func:`tpuattn.viz.style.impl_colour`); causal rows use triangles. Needs matplotlib, imported
only when drawing (the bench's command line imports this module).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tpuattn.measure.bench import TIMING_INTERPRET, BenchResults
from tpuattn.measure.flops import MODES


def measured_label(results: BenchResults) -> str:
    env = results.environment
    return f"{env.get('label') or env.get('device_kind', '?')}, measured (JAX {env.get('jax_version', '?')})"


def _has_interpreted(results: BenchResults) -> bool:
    return any(r["timing_kind"] == TIMING_INTERPRET for r in results.rows)


def _series(results: BenchResults, mode: str, value: str, *, interpreted: bool = False):
    """{(impl, causal, dtype, interpreted): (seq_lens, values)} for ok rows with a value, of one timing
    kind only: compiled rows, or (``interpreted=True``) interpret-mode rows."""
    groups: dict[tuple, list[tuple[int, float]]] = {}
    for row in results.rows:
        if row["mode"] != mode or row["status"] != "ok" or row.get(value) in (None, ""):
            continue
        if (row["timing_kind"] == TIMING_INTERPRET) != interpreted:
            continue
        val = float(row[value])
        if not np.isfinite(val):
            continue
        key = (row["impl"], bool(row["causal"]), row["dtype"], interpreted)
        groups.setdefault(key, []).append((int(row["seq_len"]), val))
    return {k: tuple(zip(*sorted(v), strict=True)) for k, v in sorted(groups.items())}


def _name(key) -> str:
    impl, causal, dtype, interpreted = key
    return f"{impl}{' causal' if causal else ''} {dtype}{' (interpret)' if interpreted else ''}"


def _plain_log_ticks(axis) -> None:
    from matplotlib.ticker import FormatStrFormatter

    axis.set_major_formatter(FormatStrFormatter("%g"))
    axis.set_minor_formatter(FormatStrFormatter("%g"))


def _draw(ax, series, *, scale: float = 1.0) -> None:
    from tpuattn.viz.style import impl_colour

    for key, (xs, ys) in series.items():
        ax.plot(xs, np.asarray(ys) * scale, marker="^" if key[1] else "o", linestyle="--" if key[3] else "-",
                color=impl_colour(key[0]), label=_name(key))
    ax.set_xscale("log", base=2)
    ticks = sorted({x for xs, _ in series.values() for x in xs})
    if ticks:
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
    ax.set_xlabel("sequence length")
    if series:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no rows", ha="center", va="center", transform=ax.transAxes)


def plot_time(results: BenchResults, ax, mode: str = "fwd", *, interpret: bool = False) -> None:
    """Median time per call against sequence length: compiled rows, or (``interpret=True``) only the
    interpret-mode rows, dashed, on their own axes and labelled as not kernel speed."""
    _draw(ax, _series(results, mode, "median_s", interpreted=interpret), scale=1e3)
    ax.set_yscale("log")
    _plain_log_ticks(ax.yaxis)
    if interpret:
        ax.set_ylabel("median time per call (ms), interpret mode")
        ax.set_title(f"{mode}: Pallas in interpret mode, NOT kernel speed\n({measured_label(results)})",
                     fontsize="small")
    else:
        ax.set_ylabel("median time per call (ms)")
        ax.set_title(f"{mode}: time vs sequence length, compiled\n({measured_label(results)})")


def plot_tflops(results: BenchResults, ax, mode: str = "fwd") -> None:
    """TFLOP/s (standard count) against sequence length; interpret-mode rows are left out."""
    _draw(ax, _series(results, mode, "tflops"))
    ax.set_ylabel("TFLOP/s (standard count)")
    ax.set_title(f"{mode}: TFLOP/s vs sequence length\n({measured_label(results)}; interpret rows omitted)")


def plot_memory(results: BenchResults, ax, mode: str = "fwd", value: str | None = None) -> None:
    """Memory (MiB) against sequence length: ``call_mib`` (what the call added) when measured, else
    ``peak_mib``; or the column named by ``value``."""
    if value is None:
        value = "call_mib" if any(r.get("call_mib") not in (None, "") for r in results.rows) else "peak_mib"
    _draw(ax, _series(results, mode, value))
    ax.set_yscale("log")
    _plain_log_ticks(ax.yaxis)
    methods = sorted({r["memory_method"] for r in results.rows if r.get("memory_method")})
    ax.set_ylabel(f"{value.replace('_mib', '')} memory (MiB)")
    ax.set_title(f"{mode}: memory vs sequence length\n({measured_label(results)}; {', '.join(methods)})",
                 fontsize="small")


def _modes(results: BenchResults) -> list[str]:
    return [m for m in MODES if any(r["mode"] == m for r in results.rows)]


def figure(results: BenchResults, kind: str):
    """A figure with one panel per mode; ``kind`` is ``"time"``, ``"tflops"`` or ``"memory"``.

    For ``"time"``, interpret-mode rows (if any) get a second row of panels of their own."""
    from matplotlib.figure import Figure

    draw = {"time": plot_time, "tflops": plot_tflops, "memory": plot_memory}[kind]
    modes = _modes(results) or ["fwd"]
    interpret_row = kind == "time" and _has_interpreted(results)
    rows = 2 if interpret_row else 1
    fig = Figure(figsize=(6 * len(modes), 4.2 * rows), layout="constrained")
    axes = fig.subplots(rows, len(modes), squeeze=False)
    for col, mode in enumerate(modes):
        draw(results, axes[0, col], mode)
        if interpret_row:
            plot_time(results, axes[1, col], mode, interpret=True)
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
    return fig


def save_figures(results: BenchResults, out_dir, prefix: str = "bench") -> list[Path]:
    """Write ``<prefix>_time.png``, ``<prefix>_tflops.png`` and (if measured) ``<prefix>_memory.png``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kinds = ["time", "tflops"]
    if any(r.get("peak_mib") not in (None, "") for r in results.rows):
        kinds.append("memory")
    paths = []
    for kind in kinds:
        path = out_dir / f"{prefix}_{kind}.png"
        figure(results, kind).savefig(path, dpi=110, metadata={"Software": None})
        paths.append(path)
    return paths


def plot_roofline(ax, chip, predictions=(), *, dtype="bfloat16", measured=()) -> None:
    """The roofline of ``chip`` (log-log) with modelled points and, optionally, measured ones.

    ``predictions``: :class:`tpuattn.model.roofline.Prediction` objects, drawn at their arithmetic
    intensity and attainable FLOP/s (executed FLOPs / predicted time): on the line by construction,
    so they show a schedule's *position*, not how well it runs. ``measured``: tuples
    ``(label, intensity, flops_per_s)`` or ``(label, intensity, flops_per_s, impl)`` from real runs on
    this chip (drawn as stars, in ``impl``'s colour when given): how far below the line they sit is the
    information a roofline gives.
    """
    from tpuattn.model import roofline
    from tpuattn.viz.style import ROOF_COLOUR, impl_colour

    chip = chip if isinstance(chip, roofline.ChipSpec) else roofline.chip_spec(chip)
    predictions = list(predictions)
    intensities = np.logspace(0, 4, 200)
    ax.loglog(intensities, roofline.roofline_curve(chip, intensities, dtype) / 1e12, color=ROOF_COLOUR,
              lw=1.5)
    ridge = chip.ridge_point(dtype)
    ax.axvline(ridge, color="k", lw=0.5, ls=":")
    ax.text(ridge, chip.peak_flops(dtype) / 1e12 * 1.15, f"ridge {ridge:.0f} FLOP/B", fontsize="x-small",
            ha="center")
    markers = dict(zip(roofline.SCHEDULES, "sod^", strict=True))
    for i, pred in enumerate(predictions):
        attained = pred.cost.flops / pred.time_s / 1e12
        # Implementations with the same schedule land on the same point: draw later ones smaller.
        same = sum(np.isclose(p.cost.intensity, pred.cost.intensity) for p in predictions[:i])
        ax.scatter(pred.cost.intensity, attained, marker=markers.get(pred.cost.schedule, "o"),
                   zorder=3 + same, s=70 / (1 + 2 * same), color=impl_colour(pred.cost.impl),
                   label=f"{pred.cost.impl} {pred.cost.mode} ({pred.bound})")
    for label, intensity, flops, *impl in measured:
        colour = {"color": impl_colour(impl[0])} if impl else {}
        ax.scatter(intensity, flops / 1e12, marker="*", s=110, zorder=4, edgecolors="k", linewidths=0.4,
                   label=f"{label} (measured)", **colour)
        # The gap to the roof at the same intensity: what the run left on the table.
        roof = roofline.roofline_curve(chip, [intensity], dtype)[0] / 1e12
        ax.vlines(intensity, flops / 1e12, roof, colors=colour.get("color", "grey"), linestyles=":", lw=1)
    ax.set_xlabel("arithmetic intensity (FLOP / HBM byte)")
    ax.set_ylabel(f"attainable TFLOP/s ({dtype})")
    kinds = "modelled roofline" + (", measured runs" if measured else "")
    ax.set_title(f"TPU {chip.name} roofline, one device ({kinds}; {chip.source})", fontsize="small")
    if predictions or measured:
        ax.legend(fontsize="x-small")
