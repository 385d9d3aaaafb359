"""Figures of a block schedule's tiles, and of measured memory against sequence length."""

from __future__ import annotations

import numpy as np

from tpuattn.spec import EMPTY, FULL, PARTIAL
from tpuattn.viz.style import TILE_COLOURS, TILE_LABELS, impl_colour

TILE_CODES = (EMPTY, PARTIAL, FULL)  # the block map's values, in colour-map order


def draw_block_map(ax, block_map, *, title: str = "", block_q: int | None = None,
                   block_kv: int | None = None) -> None:
    """Draw an ``[nq, nk]`` map of tile codes (:meth:`MaskSpec.block_map`) with a legend and counts."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    block_map = np.asarray(block_map)
    nq, nk = block_map.shape
    cmap = ListedColormap([TILE_COLOURS[code] for code in TILE_CODES])
    ax.imshow(block_map, cmap=cmap, vmin=-0.5, vmax=len(TILE_CODES) - 0.5, interpolation="nearest")
    ax.set_xticks(np.arange(-0.5, nk, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, nq, 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=1)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel(f"key block{'' if block_kv is None else f' ({block_kv} keys)'}")
    ax.set_ylabel(f"query block{'' if block_q is None else f' ({block_q} rows)'}")
    skipped = int((block_map == EMPTY).sum())
    ax.set_title(f"{title}\nrun {block_map.size - skipped} of {block_map.size} tiles ({skipped} skipped)")
    legend = [Patch(color=TILE_COLOURS[code], label=TILE_LABELS[code]) for code in reversed(TILE_CODES)]
    ax.legend(handles=legend, loc="upper right", fontsize=7, framealpha=0.9)


def plot_memory(ax, results, *, label: str, guides=(), xlabel: str = "sequence length") -> None:
    """Plot call memory (MiB) against length: ``results[(impl, mode)] = [(seq_len, mib), ...]``.

    ``guides``: ``(impl, power)`` pairs; each draws a grey line ``~ length^power`` through
    ``impl``'s smallest point, to compare growth (quadratic, linear) by eye.
    """
    for (impl, mode), points in sorted(results.items()):
        points = [(n, mib) for n, mib in points if np.isfinite(mib)]
        if not points:
            continue
        lengths, mib = zip(*points, strict=True)
        ax.plot(lengths, mib, "o-" if mode == "fwd" else "s--", color=impl_colour(impl),
                label=f"{impl}, {mode}")
    for (impl, power), style in zip(guides, (":", "--", "-."), strict=False):
        points = [p for (name, _), pts in results.items() if name == impl for p in pts if np.isfinite(p[1])]
        if points:
            n0, m0 = min(points)
            xs = np.array(sorted({n for n, _ in points}), float)
            ax.plot(xs, m0 * (xs / n0) ** power, style, color="grey", linewidth=1,
                    label=f"~ length^{power} (from {impl} at {n0})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("memory the call added (MiB, child max RSS)")
    ax.set_title(f"Peak memory against length\n({label}, measured)")
    ax.legend(fontsize=7)
