"""Plotting helpers shared by the notebooks: one style, labelled titles, one place figures go.

Every figure says which backend produced its numbers and whether they were measured or modelled::

    fig, ax = plt.subplots()
    ...
    ax.set_title(style.labelled("Peak memory vs sequence length", measured=True))
    style.save_figure(fig, "01_memory")          # -> out/figures/01_memory.png

Figures go to ``$TPUATTN_FIGURES_DIR`` when set, else to ``../out/figures`` when running from
``notebooks/``, else to ``./out/figures``: in a checkout that is the ignored ``out/`` folder, so
running the notebooks leaves the working tree clean. The committed ``figures/`` (the book's static
fallback for widgets) are written only when asked: ``python3 ci/notebooks.py --update`` (or
``--figures``) points ``TPUATTN_FIGURES_DIR`` at them; the test command points it at a temporary
folder. Needs matplotlib (the ``notebooks`` extra).
"""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib as mpl
import matplotlib.pyplot as plt
import numpy as np

from tpuattn.spec import EMPTY, FULL, PARTIAL

STYLE = {
    "figure.dpi": 100,
    "savefig.dpi": 120,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.titlesize": "medium",
    "font.size": 10,
    "legend.frameon": False,
}


# One colour per tile code in every figure (block maps, grid walks, schedules).
TILE_COLOURS = {EMPTY: "#eeeeee", PARTIAL: "#f4a259", FULL: "#3d7ab8"}
TILE_LABELS = {EMPTY: "empty: skipped", PARTIAL: "partial: masked", FULL: "full: no mask"}
# What a grid step does with the K/V block it names (the Pallas grid walk).
STEP_COLOURS = {"fetch": "#6a4c93", "resident": "#8cc084", "idle": "#ffffff", "fetch_idle": "#d9534f"}


# One colour per implementation in every figure (matplotlib's first five, in the built-in order of
# tpuattn.api.IMPLEMENTATION_MODULES). Implementations added later (notebooks 06, 07, your own) get one
# of EXTRA_IMPL_COLOURS chosen from their name, so a name has the same colour in every notebook; add an
# entry here to pin one.
IMPL_COLOURS = {
    "reference": "#1f77b4",
    "xla": "#ff7f0e",
    "blockwise": "#2ca02c",
    "pallas": "#d62728",
    "splash": "#9467bd",
}
EXTRA_IMPL_COLOURS = ("#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")
# Colours that mean something other than an implementation: the roofline itself, "does not fit".
ROOF_COLOUR = "#000000"
MISSING_COLOUR = "#000000"


def impl_colour(impl: str) -> str:
    """The colour of implementation ``impl`` in every figure (:data:`IMPL_COLOURS`).

    A name not in the table gets one of :data:`EXTRA_IMPL_COLOURS` from a hash of its name (CRC-32,
    the same in every process), never one of the built-in implementations' colours.
    """
    if impl in IMPL_COLOURS:
        return IMPL_COLOURS[impl]
    import zlib

    return EXTRA_IMPL_COLOURS[zlib.crc32(impl.encode()) % len(EXTRA_IMPL_COLOURS)]


def use_style() -> None:
    """Apply the project's matplotlib style (call once per notebook)."""
    mpl.rcParams.update(STYLE)


def figures_dir() -> Path:
    """Where :func:`save_figure` writes (see the module docstring); created if missing."""
    if os.environ.get("TPUATTN_FIGURES_DIR"):
        path = Path(os.environ["TPUATTN_FIGURES_DIR"])
    elif Path.cwd().name == "notebooks":
        path = Path.cwd().parent / "out" / "figures"
    else:
        path = Path.cwd() / "out" / "figures"
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_figure(fig, name: str) -> Path:
    """Save ``fig`` as ``<figures_dir>/<name>.png`` (``name`` like ``"01_memory"``); return the path."""
    if not name.endswith(".png"):
        name += ".png"
    path = figures_dir() / name
    # No "Software" metadata: the PNG bytes then depend only on the drawing, not the matplotlib version.
    fig.savefig(path, bbox_inches="tight", metadata={"Software": None})
    return path


def backend_label(*, measured: bool, interpret: bool = False) -> str:
    """``"cpu, measured"``, ``"TPU v5 lite, measured"``, ``"cpu (interpret), measured"``, ``"modelled"``."""
    if not measured:
        return "modelled"
    from tpuattn.measure import runtime as platform

    return f"{platform.info().label(interpret=interpret)}, measured"


def labelled(title: str, *, measured: bool, interpret: bool = False, chip: str | None = None) -> str:
    """A title with its provenance: ``"<title>\\n(<backend>, measured)"`` or ``"(modelled for <chip>)"``."""
    if measured:
        return f"{title}\n({backend_label(measured=True, interpret=interpret)})"
    return f"{title}\n(modelled{' for ' + chip if chip else ''})"


def show_mask(ax, visible, *, title: str = "", xlabel: str = "key j", ylabel: str = "query i") -> None:
    """Draw a boolean ``[q_len, kv_len]`` visibility matrix: dark = visible, light = hidden."""
    visible = np.asarray(visible, bool)
    ax.imshow(visible, cmap="Blues", vmin=-0.3, vmax=1.0, interpolation="nearest", aspect="equal")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(False)
    q_len, kv_len = visible.shape
    ax.set_xticks(range(0, kv_len, max(1, kv_len // 4)))
    ax.set_yticks(range(0, q_len, max(1, q_len // 4)))
    if title:
        ax.set_title(title)


def close(fig) -> None:
    """Close a figure after it has been shown/saved (keeps long notebooks' memory flat)."""
    plt.close(fig)
