"""The puzzle harness: a :class:`Puzzle` record, a registry, and :func:`check`.

A puzzle asks the learner for one piece of a Pallas TPU kernel (a kernel body, its BlockSpecs or its
index maps). ``build(answer, interpret=...)`` wraps that answer in a ``pallas_call`` and returns a
function of the puzzle's arrays; :func:`check` runs it in interpret mode on CPU against a float64
NumPy oracle, then compiles it for a TPU chip with the real TPU compiler (compile-only, nothing runs on
a TPU), and prints one line: ``PASS ...``, the first mismatch, or the compiler's message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
from collections.abc import Callable

import numpy as np

KINDS = ("write", "bug")


@dataclasses.dataclass(frozen=True)
class Puzzle:
    """One puzzle.

    ``build(answer, *, interpret)`` -> ``fn(*arrays)``: the learner's answer inside ``pallas_call``;
    ``interpret`` is passed to ``pallas_call`` as is (``True``, ``False`` to compile, or a
    ``pltpu.InterpretParams``). ``inputs()`` -> a tuple of small seeded NumPy arrays; ``oracle(*inputs)``
    -> the float64 answer (an array or a tuple of arrays), written apart from ``tpuattn``;
    ``compile_inputs()`` -> arrays or ``ShapeDtypeStruct`` s for the chip compile if ``inputs()`` is not
    tile-legal; ``kind`` is ``"write"`` or ``"bug"`` (the stub is a broken kernel to fix);
    ``detect_races`` runs the interpreter's race detector (slow: keep such a puzzle's shapes small);
    ``audit(answer)`` -> ``None`` or a sentence: a rule the output values cannot show (e.g. which blocks
    an index map fetches), checked after the values match.
    """

    name: str
    build: Callable
    inputs: Callable
    oracle: Callable
    rtol: float
    atol: float
    compile_inputs: Callable | None = None
    kind: str = "write"
    detect_races: bool = False
    audit: Callable | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {self.kind!r}")
        if not (self.rtol >= 0 and self.atol >= 0):
            raise ValueError(f"rtol, atol: expected non-negative tolerances, "
                             f"got {self.rtol!r}, {self.atol!r}")


REGISTRY: dict[str, Puzzle] = {}

# Every check's verdict, in order: (puzzle name, True / False / None, the line it printed). Tests read it.
RESULTS: list[tuple[str, bool | None, str]] = []


def register(puzzle: Puzzle) -> Puzzle:
    """Add ``puzzle`` to :data:`REGISTRY` under its name (a second puzzle of the same name is refused)."""
    if not isinstance(puzzle, Puzzle):
        raise TypeError(f"puzzle: expected a Puzzle, got {type(puzzle).__name__}")
    known = REGISTRY.get(puzzle.name)
    if known is not None and known is not puzzle:
        raise ValueError(f"puzzle: a different puzzle named {puzzle.name!r} is already registered")
    REGISTRY[puzzle.name] = puzzle
    return puzzle


def get(name: str | Puzzle) -> Puzzle:
    """The registered puzzle called ``name`` (a :class:`Puzzle` is returned as is)."""
    if isinstance(name, Puzzle):
        return name
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"puzzle: expected one of {sorted(REGISTRY)}, got {name!r}") from None


def _as_tuple(value) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _trim(error: BaseException, limit: int = 400) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = " ".join(lines[:3]) if lines else ""
    return f"{type(error).__name__}: {text}"[:limit]


def compare(got, expected, rtol: float, atol: float) -> str | None:
    """``None`` if ``got`` matches ``expected`` within ``|got - expected| <= atol + rtol * |expected|``
    everywhere, else a sentence naming the first mismatch (output, index, got, expected)."""
    got, expected = _as_tuple(got), _as_tuple(expected)
    if len(got) != len(expected):
        return f"expected {len(expected)} output(s), got {len(got)}"
    for n, (g, e) in enumerate(zip(got, expected, strict=True)):
        g = np.asarray(g, dtype=np.float64)
        e = np.asarray(e, dtype=np.float64)
        which = f"output {n} " if len(expected) > 1 else ""
        if g.shape != e.shape:
            return f"{which}shape: expected {e.shape}, got {g.shape}"
        bad = ~np.isclose(g, e, rtol=rtol, atol=atol)
        if bad.any():
            index = tuple(int(i) for i in np.argwhere(bad)[0])
            return (f"{which}mismatch at index {index}: got {g[index]:.6g}, expected {e[index]:.6g} "
                    f"({int(bad.sum())} of {bad.size} elements off; rtol={rtol:g}, atol={atol:g})")
    return None


_ACCESS = re.compile(r"^\s*(read|write) of .* \S+:(\d+):\d+ \(([^)]*)\)\s*$")


def race_summary(report: str) -> str:
    """``": a write (kernel line 9) and a read (kernel line 10) of one buffer"``: the first race of the
    detector's printed report, by access kind, function and line (the file, a notebook cell's
    temporary name, is left out); empty if the report cannot be read."""
    accesses = []
    for line in report.splitlines():
        match = _ACCESS.match(line)
        if match:
            kind, number, function = match.groups()
            accesses.append(f"a {kind} ({function} line {number})")
        if len(accesses) == 2:
            return f": {accesses[0]} and {accesses[1]} of one buffer"
    return ""


def interpret_mode(puzzle: Puzzle):
    """What ``pallas_call(interpret=...)`` gets for the CPU run: ``True``, or the TPU simulator with its
    race detector for a puzzle that asks for it."""
    if not puzzle.detect_races:
        return True
    from jax.experimental.pallas import tpu as pltpu

    if not hasattr(pltpu, "InterpretParams"):
        return None
    return pltpu.InterpretParams(detect_races=True)


def _run(puzzle: Puzzle, answer) -> tuple[bool | None, str]:
    import jax

    from tpuattn.pallas import compat

    mode = interpret_mode(puzzle)
    if mode is None:
        return None, "cannot be checked here: this JAX has no pltpu.InterpretParams (its race detector)"
    inputs = tuple(puzzle.inputs())
    expected = puzzle.oracle(*inputs)
    report = io.StringIO()
    try:
        fn = puzzle.build(answer, interpret=mode)
        if puzzle.detect_races:
            compat.reset_races()
        # The race detector prints its report (with the kernel's file names): kept, and summarised.
        with contextlib.redirect_stdout(report) if puzzle.detect_races else contextlib.nullcontext():
            got = jax.block_until_ready(fn(*inputs))
    except NotImplementedError:
        return False, "not written yet"
    except Exception as error:  # noqa: BLE001 - the learner's code may raise anything: report it
        return False, f"error in interpret mode: {_trim(error)}"
    if puzzle.detect_races and compat.races_found():
        return False, ("race detected by the interpreter's race detector "
                       f"(pltpu.InterpretParams(detect_races=True)){race_summary(report.getvalue())}")
    mismatch = compare(got, expected, puzzle.rtol, puzzle.atol)
    if mismatch is not None:
        return False, mismatch
    if puzzle.audit is not None:
        try:
            finding = puzzle.audit(answer)
        except Exception as error:  # noqa: BLE001 - the audit calls the learner's code outside a kernel
            return False, f"the values match, but auditing the answer failed: {_trim(error)}"
        if finding is not None:
            return False, f"the values match, but {finding}"
    return True, ""


def _compile(puzzle: Puzzle, answer, chip: str) -> tuple[bool | None, str]:
    from tpuattn.measure import aot

    if not aot.tpu_available():
        return None, f"not compiled for {chip}: libtpu is not installed"
    args = tuple(puzzle.compile_inputs() if puzzle.compile_inputs is not None else puzzle.inputs())
    try:
        aot.compile_for(chip, puzzle.build(answer, interpret=False), args)
    except Exception as error:  # noqa: BLE001 - Mosaic and XLA raise several types by version
        # Is it the answer, or this installation? A compiler that refuses a one-tile copy kernel
        # cannot judge any answer: say so instead of failing a right one.
        problem = aot.compiler_problem(chip)
        if problem is not None:
            return None, (f"not compiled for {chip}: this installation's TPU compiler cannot be used "
                          f"here ({problem})")
        return False, f"the {chip} compiler refused it: {aot.first_error_line(error)}"
    return True, f"compiled for {chip}"


def check(puzzle: str | Puzzle, answer, *, chip: str = "v5e") -> bool | None:
    """Run ``answer`` in interpret mode against the oracle, then compile it for ``chip``.

    Prints exactly one line -- ``PASS ...``, ``not written yet``, the first mismatch (index, got,
    expected), a race report, or the compiler's message (trimmed) -- and returns True only on a pass;
    ``None`` (also printed, with the reason) when this installation cannot check it.
    """
    puzzle = get(puzzle)
    verdict, message = _run(puzzle, answer)
    if verdict:
        verdict, compiled = _compile(puzzle, answer, chip)
        if verdict:
            message = f"PASS {puzzle.name}: matches the float64 oracle (interpret mode), {compiled}"
        elif verdict is None:
            message = f"PASS {puzzle.name} in interpret mode; {compiled}"
            verdict = True
        else:
            message = f"FAIL {puzzle.name}: right in interpret mode, but {compiled}"
    elif verdict is None:
        message = f"{puzzle.name}: {message}"
    else:
        prefix = "" if message == "not written yet" else "FAIL "
        message = f"{prefix}{puzzle.name}: {message}"
    print(message)
    RESULTS.append((puzzle.name, verdict, message))
    return verdict


def draw_grid(ax, n_rows: int, n_cols: int, *, labels=None, colours=None, title: str = "",
              xlabel: str = "", ylabel: str = "", default_colour: str = "#ffffff") -> None:
    """Draw an ``n_rows x n_cols`` grid of blocks on ``ax`` (row 0 at the top): ``labels[(r, c)]`` is a
    block's text, ``colours[(r, c)]`` its fill. The puzzles' pictures of the blocks a kernel touches."""
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Rectangle

    labels, colours = labels or {}, colours or {}
    for r in range(n_rows):
        for c in range(n_cols):
            fill = colours.get((r, c), default_colour)
            ax.add_patch(Rectangle((c, r), 1, 1, facecolor=fill, edgecolor="#333333", linewidth=1))
            if (r, c) in labels:
                red, green, blue = to_rgb(fill)
                dark = 0.299 * red + 0.587 * green + 0.114 * blue < 0.5  # white text on a dark fill
                ax.text(c + 0.5, r + 0.5, str(labels[(r, c)]), ha="center", va="center", fontsize=8,
                        color="white" if dark else "black")
    ax.set_xlim(0, n_cols)
    ax.set_ylim(n_rows, 0)
    ax.set_aspect("equal")
    ax.set_xticks([c + 0.5 for c in range(n_cols)], [str(c) for c in range(n_cols)])
    ax.set_yticks([r + 0.5 for r in range(n_rows)], [str(r) for r in range(n_rows)])
    ax.tick_params(length=0, labelsize=8)
    ax.grid(False)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
