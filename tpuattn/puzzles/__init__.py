"""Kernel puzzles: the learner writes a Pallas TPU kernel body, its BlockSpecs or its index maps, and
:func:`check` runs it against a float64 oracle in interpret mode and compiles it for a TPU chip.

``core`` is the harness; each puzzle module (``forward_puzzles``, ``backward_puzzles``, ``capstones``:
whole kernels) registers its puzzles in :data:`REGISTRY` when imported.
"""

from tpuattn.puzzles.core import REGISTRY, RESULTS, Puzzle, check, compare, draw_grid, get, register

__all__ = ["REGISTRY", "RESULTS", "Puzzle", "check", "compare", "draw_grid", "get", "register"]
