"""The puzzle harness: a :class:`Puzzle` record, a registry, and :func:`check`.

A puzzle asks the learner for one piece of a Pallas TPU kernel (a kernel body, its BlockSpecs or its
index maps). ``build(answer, interpret=...)`` wraps that answer in a ``pallas_call`` and returns a
function of the puzzle's arrays; :func:`check` runs it in interpret mode on CPU against a float64
NumPy oracle, then compiles it for a TPU chip with the real TPU compiler (compile-only, nothing runs on
a TPU), and prints one line: ``PASS ...``, the first mismatch, or the compiler's message.

Interpret mode runs the grid in order on one core and clamps a block index that falls outside its
array, so some wrong answers give right values there. A puzzle's ``build`` calls :func:`pallas_call`
(``pl.pallas_call`` that tells the check its grid, BlockSpecs, operand names and dimension
semantics), and the check audits what the values cannot show: every index map evaluated over the
whole grid on the host (a block outside its array, named by operand, grid step and block; an output
block that two steps of a ``"parallel"`` axis share, or that the grid leaves and comes back to), and
the kernel run with its floating-point scratch set to NaN wherever the index of a ``"parallel"`` axis
changes, as if each index ran on a TensorCore of its own (a megacore chip splits such an axis between
its two); an answer wrong only then is run once more as written, to say which it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
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
    an index map fetches), checked after the values match (and after the harness's own audits of every
    :func:`pallas_call` the answer makes); ``outputs``: the names of the oracle's outputs, in order
    (``("dK", "dV")``), used in a mismatch's message instead of "output 0".
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
    outputs: tuple[str, ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {self.kind!r}")
        if not (isinstance(self.outputs, tuple) and all(isinstance(n, str) for n in self.outputs)):
            raise ValueError(f"outputs: expected a tuple of names, got {self.outputs!r}")
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


def compare(got, expected, rtol: float, atol: float, names: tuple[str, ...] = ()) -> str | None:
    """``None`` if ``got`` matches ``expected`` within ``|got - expected| <= atol + rtol * |expected|``
    everywhere, else a sentence naming the first mismatch (output, index, got, expected). ``names``:
    the outputs' names (``("dK", "dV")``); without them, several outputs are "output 0", "output 1"."""
    got, expected = _as_tuple(got), _as_tuple(expected)
    if len(got) != len(expected):
        return f"expected {len(expected)} output(s), got {len(got)}"
    if names and len(names) != len(expected):
        raise ValueError(f"names: expected {len(expected)} output names, got {names!r}")
    for n, (g, e) in enumerate(zip(got, expected, strict=True)):
        g = np.asarray(g, dtype=np.float64)
        e = np.asarray(e, dtype=np.float64)
        which = f"{names[n]} " if names else f"output {n} " if len(expected) > 1 else ""
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


# ---------------------------------------------------------------------------------------------------
# What a check sees of each pallas_call its answer makes, and what it audits there.

@dataclasses.dataclass(frozen=True)
class Operand:
    """One array of a :class:`Launch`: its name, shape and BlockSpec (``None`` where it has no index
    map: the whole array, or memory the kernel copies itself), and whether it is an output."""

    name: str
    shape: tuple[int, ...]
    spec: object
    output: bool


@dataclasses.dataclass(frozen=True)
class Launch:
    """One ``pallas_call`` as a check saw it run: its grid, operands, scalar-prefetch values (NumPy;
    ``None`` where they were traced), dimension semantics (one per grid axis, ``"arbitrary"`` where none
    were given), the number of scratch buffers, and the ``"parallel"`` axes at whose index changes this
    run reset the scratch."""

    grid: tuple[int, ...]
    operands: tuple[Operand, ...]
    prefetch: tuple | None
    semantics: tuple[str, ...]
    num_scratch: int
    fresh_scratch: tuple[int, ...] = ()

    @property
    def parallel_axes(self) -> tuple[int, ...]:
        """The grid axes marked ``"parallel"`` (any parallel kind) with more than one index."""
        return tuple(a for a, (n, kind) in enumerate(zip(self.grid, self.semantics, strict=True))
                     if "parallel" in kind and n > 1)


PARALLEL = "parallel"  # a run that resets scratch at each index change of every parallel axis


@dataclasses.dataclass
class _Session:
    fresh: str | int | None  # None: the kernel as written; PARALLEL: every parallel axis; an int: one
    launches: list = dataclasses.field(default_factory=list)


_SESSION: _Session | None = None


def pallas_call(kernel, *, in_names: tuple[str, ...] = (), out_names: tuple[str, ...] = (), **kwargs):
    """``pl.pallas_call(kernel, **kwargs)`` for a puzzle's ``build``. Outside :func:`check` it is that
    call; inside, it also tells the check what it launched (a :class:`Launch`: grid, BlockSpecs,
    dimension semantics), so that the check can audit the index maps over the whole grid, and the check
    may run ``kernel`` with its scratch reset wherever an index of a ``"parallel"`` axis changes.
    ``in_names``, ``out_names``: the inputs' names (after any scalar-prefetch operands) and the outputs',
    for the messages ("the bias index map asks for ...")."""
    from jax.experimental import pallas as pl

    def run(*args):
        session = _SESSION
        if session is None:
            return pl.pallas_call(kernel, **kwargs)(*args)
        launch = _launch(kwargs, args, in_names, out_names)
        axes = ()
        if launch.num_scratch and session.fresh is not None:
            axes = tuple(a for a in launch.parallel_axes if session.fresh in (PARALLEL, a))
        launch = dataclasses.replace(launch, fresh_scratch=axes)
        session.launches.append(launch)
        body = _with_fresh_scratch(kernel, launch.grid, axes, launch.num_scratch) if axes else kernel
        return pl.pallas_call(body, **kwargs)(*args)
    return run


def _launch(kwargs: dict, args: tuple, in_names, out_names) -> Launch:
    grid_spec = kwargs.get("grid_spec")

    def get(name, default):
        return kwargs.get(name, default) if grid_spec is None else getattr(grid_spec, name, default)

    grid = get("grid", ()) or ()
    grid = tuple(int(n) for n in _as_tuple(grid))
    num_prefetch = int(get("num_scalar_prefetch", 0) or 0)
    scratch = get("scratch_shapes", ()) or ()
    out_shapes = _as_tuple(kwargs["out_shape"])
    inputs = args[num_prefetch:]
    in_specs = get("in_specs", None)
    in_specs = list(in_specs) if isinstance(in_specs, (list, tuple)) else [None] * len(inputs)
    out_specs = get("out_specs", None)
    out_specs = list(out_specs) if isinstance(out_specs, (list, tuple)) else [out_specs] * len(out_shapes)
    if len(in_specs) != len(inputs) or len(out_specs) != len(out_shapes):
        in_specs, out_specs = [None] * len(inputs), [None] * len(out_shapes)  # pallas_call will say
    operands = [Operand(in_names[n] if n < len(in_names) else f"input {n}", tuple(np.shape(x)),
                        _blocked(spec), False)
                for n, (x, spec) in enumerate(zip(inputs, in_specs, strict=True))]
    operands += [Operand(out_names[n] if n < len(out_names) else f"output {n}", tuple(out.shape),
                         _blocked(spec), True)
                 for n, (out, spec) in enumerate(zip(out_shapes, out_specs, strict=True))]
    try:
        prefetch = tuple(np.asarray(a) for a in args[:num_prefetch])
    except Exception:  # noqa: BLE001 - traced (a jitted build): the index maps cannot be walked here
        prefetch = None
    params = kwargs.get("compiler_params")
    semantics = getattr(params, "dimension_semantics", None)
    if semantics is None and isinstance(params, dict):
        semantics = params.get("mosaic", {}).get("dimension_semantics")
    semantics = tuple(str(s).lower() for s in semantics) if semantics else ()
    if len(semantics) != len(grid):  # none given (all "arbitrary"), or a wrong count: pallas_call says
        semantics = ("arbitrary",) * len(grid)
    return Launch(grid, tuple(operands), prefetch, semantics,
                  len(scratch) if isinstance(scratch, (list, tuple)) else 0)


def _blocked(spec):
    """``spec`` if it is a BlockSpec with a block shape and an index map, else ``None``."""
    has = getattr(spec, "block_shape", None) is not None and getattr(spec, "index_map", None) is not None
    return spec if has else None


def _with_fresh_scratch(kernel, grid: tuple[int, ...], axes: tuple[int, ...], num_scratch: int):
    """``kernel`` with its floating-point scratch set to NaN before each grid step whose index along one
    of ``axes`` differs from the previous step's: as if each index of those axes ran on a core of its
    own, whose scratch holds nothing of the others'."""
    import functools

    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    @functools.wraps(kernel)
    def body(*refs):
        index = [pl.program_id(d) for d in range(len(grid))]
        # The index along axis a changes exactly where every later axis is back at 0 (but not at the
        # very first step).
        first = functools.reduce(jnp.logical_and, [i == 0 for i in index])
        changed = functools.reduce(jnp.logical_or, [
            functools.reduce(jnp.logical_and, [index[d] == 0 for d in range(a + 1, len(grid))],
                             jnp.bool_(True)) for a in axes])

        @pl.when(jnp.logical_and(changed, jnp.logical_not(first)))
        def _reset():
            for ref in refs[len(refs) - num_scratch:]:
                if _floating(ref):
                    ref[...] = jnp.full(ref.shape, jnp.nan, ref.dtype)

        return kernel(*refs)
    return body


def _floating(ref) -> bool:
    import jax.numpy as jnp

    try:
        return bool(jnp.issubdtype(ref.dtype, jnp.floating))
    except Exception:  # noqa: BLE001 - a semaphore's dtype is no NumPy dtype
        return False


def _block_counts(operand: Operand) -> tuple[int, ...] | None:
    """Blocks per dimension of ``operand`` (a squeezed dimension: its size), or ``None`` where a block
    dimension is not a block count (``pl.Element``: an offset)."""
    counts = []
    if len(operand.spec.block_shape) != len(operand.shape):
        return None
    for dim, size in zip(operand.spec.block_shape, operand.shape, strict=True):
        if dim is None or type(dim).__name__ == "Squeezed":
            counts.append(size)
        elif isinstance(dim, (int, np.integer)) or type(dim).__name__ == "Blocked":
            block = int(getattr(dim, "block_size", dim))
            counts.append(-(-size // block))
        else:
            return None
    return tuple(counts)


class _Finding(Exception):  # noqa: N818 - not an error: a sentence for the learner
    pass


def block_walk(index_map, grid: tuple[int, ...], prefetch: tuple = (), name: str = "the") \
        -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``[(step, block), ...]``: ``index_map(*step, *prefetch)`` at every step of ``grid`` in the
    pipeline's order (the last axis fastest), on the host: NumPy scalar-prefetch arrays, so that a read
    outside one raises instead of being clamped (a map the host cannot run is traced as the pipeline
    traces it)."""
    import jax

    walk = []
    for step in itertools.product(*(range(n) for n in grid)):
        try:
            block = index_map(*step, *prefetch)
        except IndexError as error:
            raise _Finding(f"the {name} index map reads outside a scalar-prefetch array at grid step "
                           f"{step} ({_trim(error)})") from None
        except Exception:  # noqa: BLE001 - e.g. Python control flow on a traced value: trace it
            block = jax.jit(index_map)(*(np.int32(i) for i in step), *prefetch)
        walk.append((step, tuple(int(b) for b in _as_tuple(block))))
    return walk


def _launch_findings(launches: list[Launch]) -> tuple[str | None, str | None]:
    """``(out of range, output blocks)``: the first block index outside its array, and the first output
    block two steps of a ``"parallel"`` axis share or the grid returns to; ``None`` where there is none."""
    out_of_range = outputs = None
    for launch in launches:
        if launch.prefetch is None:
            continue
        for operand in launch.operands:
            if operand.spec is None:
                continue
            walk = block_walk(operand.spec.index_map, launch.grid, launch.prefetch, operand.name)
            counts = _block_counts(operand)
            if out_of_range is None and counts is not None:
                for step, block in walk:
                    if len(block) == len(counts) and any(
                            not 0 <= b < n for b, n in zip(block, counts, strict=True)):
                        out_of_range = (f"the {operand.name} index map asks for block {block} at grid "
                                        f"step {step}; {operand.name} has "
                                        f"{' x '.join(str(n) for n in counts)} blocks")
                        break
            if outputs is None and operand.output:
                outputs = _output_finding(operand.name, walk, launch.parallel_axes)
    return out_of_range, outputs


def _output_finding(name: str, walk, parallel_axes) -> str | None:
    first, last, previous = {}, {}, None
    for step, block in walk:
        if block in first:
            shared = [a for a in parallel_axes if first[block][a] != step[a]]
            if shared:
                return (f"the {name} index map names block {block} at grid steps {first[block]} and "
                        f"{step}, which differ along grid axis {shared[0]}, marked \"parallel\": a "
                        "megacore chip (v4, v5p) may give those steps to its two TensorCores, which "
                        "would write that block at the same time (an axis whose steps share an output "
                        "block must be \"arbitrary\")")
            if block != previous:
                return (f"the {name} index map leaves block {block} after grid step {last[block]} and "
                        f"comes back to it at grid step {step}: a TPU writes an output block back when "
                        "the grid moves off it and never reads it back, so the return starts from "
                        "garbage and overwrites it (the steps that name one output block must be "
                        "consecutive)")
        else:
            first[block] = step
        last[block], previous = step, block
    return None


def _interpret(puzzle: Puzzle, answer, inputs: tuple, mode, fresh) -> tuple[object, _Session, str]:
    """Build ``answer`` and run it in interpret mode, recording its launches: ``(outputs, session,
    the race detector's printed report)``."""
    import jax

    from tpuattn.pallas import compat

    global _SESSION
    session, report = _Session(fresh), io.StringIO()
    outer, _SESSION = _SESSION, session
    try:
        fn = puzzle.build(answer, interpret=mode)
        if puzzle.detect_races:
            compat.reset_races()
        # The race detector prints its report (with the kernel's file names): kept, and summarised.
        with contextlib.redirect_stdout(report) if puzzle.detect_races else contextlib.nullcontext():
            got = jax.block_until_ready(fn(*inputs))
    finally:
        _SESSION = outer
    return got, session, report.getvalue()


def _carry(puzzle: Puzzle, answer, inputs, expected, mode, launches, mismatch: str) -> str:
    """The sentence for an answer right when the grid runs in order on one core and wrong when scratch
    starts afresh at each index of its parallel axes: which axis (the first that alone breaks it)."""
    axes = sorted({a for launch in launches for a in launch.fresh_scratch})
    if len(axes) > 1:
        for axis in axes:
            try:
                got, _, _ = _interpret(puzzle, answer, inputs, mode, axis)
            except Exception:  # noqa: BLE001 - it ran before: name every axis instead
                break
            found = compare(got, expected, puzzle.rtol, puzzle.atol, puzzle.outputs)
            if found is not None:
                axes, mismatch = [axis], found
                break
    where = (f"grid axis {axes[0]} to the next, and that axis is" if len(axes) == 1 else
             f"grid axes {' and '.join(str(a) for a in axes)} to the next, and those axes are")
    return ("the values match when the grid runs in order on one core, but scratch carries over from one "
            f"index of {where} marked \"parallel\": a megacore chip (v4, v5p) splits a parallel axis "
            "between its two TensorCores, each with its own scratch (with the scratch reset to NaN at "
            f"each new index: {mismatch})")


def _run(puzzle: Puzzle, answer) -> tuple[bool | None, str]:
    from tpuattn.pallas import compat

    mode = interpret_mode(puzzle)
    if mode is None:
        return None, "cannot be checked here: this JAX has no pltpu.InterpretParams (its race detector)"
    inputs = tuple(puzzle.inputs())
    expected = puzzle.oracle(*inputs)
    try:
        # Scratch reset wherever a parallel axis's index changes: a right kernel never reads it there.
        got, session, report = _interpret(puzzle, answer, inputs, mode, PARALLEL)
    except NotImplementedError:
        return False, "not written yet"
    except Exception as error:  # noqa: BLE001 - the learner's code may raise anything: report it
        return False, f"error in interpret mode: {_trim(error)}"
    if puzzle.detect_races and compat.races_found():
        return False, ("race detected by the interpreter's race detector "
                       f"(pltpu.InterpretParams(detect_races=True)){race_summary(report)}")
    mismatch = compare(got, expected, puzzle.rtol, puzzle.atol, puzzle.outputs)
    fresh_mismatch, fresh_launches = None, session.launches
    if mismatch is not None and any(launch.fresh_scratch for launch in fresh_launches):
        # Wrong only with the scratch reset? Run the kernel as written to tell.
        try:
            got, session, _ = _interpret(puzzle, answer, inputs, mode, None)
        except Exception as error:  # noqa: BLE001
            return False, f"error in interpret mode: {_trim(error)}"
        fresh_mismatch, mismatch = mismatch, compare(got, expected, puzzle.rtol, puzzle.atol,
                                                     puzzle.outputs)
    try:
        out_of_range, outputs = _launch_findings(session.launches)
    except _Finding as finding:
        out_of_range, outputs = str(finding), None
    except Exception as error:  # noqa: BLE001 - the index maps are the learner's code
        out_of_range, outputs = f"evaluating an index map over the grid failed: {_trim(error)}", None
    if out_of_range is not None:  # the cause of any wrong values: interpret mode clamped the index
        return False, out_of_range if mismatch is not None else f"the values match, but {out_of_range}"
    if mismatch is not None:
        return False, mismatch
    if outputs is not None:
        return False, f"the values match, but {outputs}"
    if fresh_mismatch is not None:
        return False, _carry(puzzle, answer, inputs, expected, mode, fresh_launches, fresh_mismatch)
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

    Prints exactly one line -- ``PASS ...``, ``not written yet``, the first mismatch (output, index,
    got, expected), a race report, a rule the values cannot show (a block index outside its array, an
    output block or scratch shared across a ``"parallel"`` axis, the puzzle's own ``audit``), or the
    compiler's message (trimmed) -- and returns True only on a pass;
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
