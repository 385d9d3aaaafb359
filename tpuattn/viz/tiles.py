"""Figures for notebook 02: which tiles the blockwise schedule runs, and memory against length."""

from __future__ import annotations

import numpy as np

from tpuattn.spec import EMPTY, FULL, PARTIAL

# EMPTY (skipped), PARTIAL (masked), FULL (no mask arithmetic).
BLOCK_COLOURS = {EMPTY: "#f2f2f2", PARTIAL: "#f4a259", FULL: "#3d7ea6"}


def draw_block_map(ax, block_map, *, title: str = "", block_q: int | None = None,
                   block_kv: int | None = None) -> None:
    """Draw an ``[nq, nk]`` EMPTY/PARTIAL/FULL map as coloured tiles with a legend and counts."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    block_map = np.asarray(block_map)
    nq, nk = block_map.shape
    cmap = ListedColormap([BLOCK_COLOURS[EMPTY], BLOCK_COLOURS[PARTIAL], BLOCK_COLOURS[FULL]])
    ax.imshow(block_map, cmap=cmap, vmin=-0.5, vmax=2.5, interpolation="nearest")
    ax.set_xticks(np.arange(-0.5, nk, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, nq, 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=1)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel(f"key block{'' if block_kv is None else f' ({block_kv} keys)'}")
    ax.set_ylabel(f"query block{'' if block_q is None else f' ({block_q} rows)'}")
    counts = {name: int((block_map == code).sum()) for name, code in
              (("skipped", EMPTY), ("masked", PARTIAL), ("full", FULL))}
    ax.set_title(f"{title}\nrun {counts['masked'] + counts['full']} of {block_map.size} tiles "
                 f"({counts['skipped']} skipped)")
    ax.legend(handles=[Patch(color=BLOCK_COLOURS[FULL], label="FULL: no mask"),
                      Patch(color=BLOCK_COLOURS[PARTIAL], label="PARTIAL: masked"),
                      Patch(color=BLOCK_COLOURS[EMPTY], label="EMPTY: skipped")],
              loc="upper right", fontsize=7, framealpha=0.9)


def plot_memory(ax, results, *, label: str) -> None:
    """Plot call memory (MiB) against length: ``results[(impl, mode)] = [(seq_len, mib), ...]``.

    A dotted line through the smallest reference point shows quadratic growth, a dashed one
    through the smallest blockwise point linear growth, for comparison.
    """
    styles = {"reference": "o-", "blockwise": "s-"}
    for (impl, mode), points in sorted(results.items()):
        points = [(n, mib) for n, mib in points if np.isfinite(mib)]
        if not points:
            continue
        lengths, mib = zip(*points, strict=True)
        ax.plot(lengths, mib, styles.get(impl, "x-"), label=f"{impl}, {mode}",
                alpha=1.0 if mode == "fwd" else 0.6)
    for impl, power, style in (("reference", 2, ":"), ("blockwise", 1, "--")):
        points = [p for (name, _), pts in results.items() if name == impl for p in pts if np.isfinite(p[1])]
        if points:
            n0, m0 = min(points)
            xs = np.array(sorted({n for n, _ in points}), float)
            ax.plot(xs, m0 * (xs / n0) ** power, style, color="grey", linewidth=1,
                    label=f"~ length^{power} (from {impl} at {n0})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (batch 1, 4 heads, head_dim 64, float32)")
    ax.set_ylabel("memory the call added (MiB, child max RSS)")
    ax.set_title(f"Peak memory against length\n({label}, measured)")
    ax.legend(fontsize=7)
