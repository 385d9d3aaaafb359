"""A time for a compiled TPU program, read from libtpu's final VLIW bundles: **compiled (static estimate,
not run)**.

libtpu issues one VLIW bundle a cycle (:mod:`tpuattn.measure.static` reads them from its dumps). A
computation's time is then its bundles, each counted as often as it runs, at the chip's clock
(:func:`tpuattn.chips.estimate_clock`), or the bytes it moves over the HBM bandwidth where those take
longer. Per computation of the program (the top-level program's ``inlined_call`` of each fusion or
kernel):

* **loops**: a bundle inside a loop runs once per trip; the trip count is the constant of the loop's
  exit test (``scmp.ge ... N /* loop exit test */``; a Pallas grid is one loop of its steps plus the
  pipeline's warm-up and drain trips, counted as full trips) or, where the branch back tests a scalar,
  that scalar read back through the bundles to constants and the call's constant operands (tokamax's
  grid over the visited tiles) or to a chunk's clamp (an XLA copy's chunk loop: its most);
* **branches**: a ``sbr.rel`` skips the bundles up to its target region. In a Pallas kernel's grid loop
  the skipped region is weighed by how often the grid runs it (:class:`Weights`): a region that waits
  for the pipeline's DMAs on every step (``pipeline-emitter-dma-wait``), a region with ``vmatmul`` on the
  steps that compute (the visited tiles' share of the grid), of two regions nested in it the one with
  the most mask instructions (``vcmp``, ``vsel``) on the share of those that are partial (masked), its
  sibling on the rest (one region nested alone runs whenever its parent does), and any other region
  (the accumulators' set-up and write-out) once per output block. Outside Pallas kernels every branch is
  counted as taken (an upper bound on the bundles);
* **DMA**: in a Pallas grid loop the copies a step starts (``dma.hbm_to_vmem``, their constant
  block, ``window_bounds`` elements of ``element_size_in_bytes`` as the dump annotates each copy) over
  the HBM bandwidth (a copy issued on several paths of a step is counted on each: an upper bound); a
  computing step takes the
  longer of its bundles and that; an XLA fusion takes the longer of its bundles and its operands and
  results in HBM (not those placed in VMEM, ``S(1)`` in their layout) over the bandwidth (the
  roofline of its bytes);
* the bundles outside loops (prologue, epilogue) once.

Each program is compiled for the chip's JAX device (:func:`device_code`: v4's is the megacore chip, as
:mod:`tpuattn.chips` models it). The bundle reading the tuner and the side-by-side table use is here too:
:func:`split_branches`, :func:`splash_weights`, :func:`tokamax_weights`, :func:`estimate_with_counts`.

Nothing is run or timed and nothing is fitted to a measurement: the numbers are the compiler's output,
the chip's clock and its published HBM bandwidth.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tempfile
from pathlib import Path

from tpuattn import chips, errors
from tpuattn.measure import static

LABEL = "compiled (static estimate, not run)"

_LINE = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s+([A-Z]{2})?:\s*(>*)\s*\{")
# A branch names its target region: "target = $region40" (JAX 0.10.2's libtpu) or "target bundleno = 304
# (0x130), region = 40" (0.7.2's).
_BRANCH = re.compile(r"sbr\.rel \(([^)]*)\) target (?:= \$region(\d+)|bundleno = \d+ \(0x[0-9a-f]+\), "
                     r"region = (\d+))")
_EXIT = re.compile(r"scmp\.ge\.s32\.totalorder %\w+, (\d+) /\* loop exit test \*/")
# A copy the loop starts (not the bounds check's comment that repeats it), and the block it moves.
_DMA_IN = re.compile(r"(?:\{|;;)\s*%\w+ = dma\.hbm_to_vmem\b")
_WINDOW = re.compile(r"window_bounds: \(([\d, ]+)\)")
_ELEMENT = re.compile(r"element_size_in_bytes: (\d+)")
_CALL = re.compile(r"inlined_call[^/]*/\* %([\w.\-]+) = ")
_IDLE = re.compile(r"\{\s*(?:%\w+ = (?:vnop|vdelay \d+)\s*)?\}")
_DELAY = re.compile(r"= vdelay (\d+)")
_MASK_OPS = re.compile(r"= v(?:cmp|sel)[.\s]")
_SHAPE = re.compile(r"\b(pred|s4|u4|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64|f8\w*)\[([\d,]*)\]"
                    r"(\{[^}]*\})?")
_ITEMSIZE = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
             "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8}


@dataclasses.dataclass(frozen=True)
class Bundle:
    depth: int   # enclosing loops
    loop: bool   # the first bundle of a loop body (``LB:``)
    text: str    # the bundle, its continuation lines included
    cycles: int = 1  # one a cycle, or the N cycles of a ``vdelay N`` (the compiler's stall, on v2)


@dataclasses.dataclass(frozen=True)
class Region:
    """The bundles ``[start, stop)`` a branch at ``branch`` skips, and how often they run (per trip)."""

    branch: int
    start: int
    stop: int
    kind: str         # "pipeline", "compute", "partial", "unmasked", "edge" or "xla"
    vmatmul: int
    mask_ops: int
    frequency: float


@dataclasses.dataclass(frozen=True)
class Weights:
    """How often a Pallas grid runs each kind of branch, per grid step: ``compute`` (steps that compute
    / all steps), ``partial`` (steps that compute on a partial, masked tile / all steps) and ``edge``
    (set-up and write-out: once per output block, 1 / the reduction axis' steps)."""

    compute: float = 1.0
    partial: float = 0.0
    edge: float = 1.0

    def __post_init__(self):
        for name in ("compute", "partial", "edge"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
                raise errors.TpuattnError(f"{name}: expected a share between 0 and 1, got {value!r}")


@dataclasses.dataclass(frozen=True)
class GridShares:
    """A kernel's :class:`Weights` on either grid its compiler may make: ``full`` where the grid steps over
    every tile (its trip count a constant), ``visited`` where it steps over the visited tiles only (its trip
    count an operand of the call, :func:`loops`: tokamax's forward kernels)."""

    full: Weights
    visited: Weights


@dataclasses.dataclass(frozen=True)
class Computation:
    """One computation's estimate (``compiled (static estimate, not run)``)."""

    name: str
    kind: str            # "pallas", "xla" or "program" (the top-level program's own bundles)
    bundles: int         # bundles in the file
    trips: tuple         # each loop's trip count, outermost first
    cycles: float        # bundles counted as often as they run
    compute_s: float     # cycles at the clock
    dma_bytes: float     # HBM bytes its DMAs (Pallas) or its operands and results (XLA) move
    seconds: float       # the estimate
    regions: tuple = ()
    label: str = LABEL


@dataclasses.dataclass(frozen=True)
class Estimate:
    chip: str
    clock_hz: float
    clock_source: str
    computations: tuple
    seconds: float
    label: str = LABEL


def read(path: str | os.PathLike) -> list[Bundle]:
    """The bundles of a final-bundles file, in order."""
    bundles: list[list] = []
    for line in Path(path).read_text().splitlines():
        match = _LINE.match(line)
        if match:
            depth = len(match.group(3))
            if not depth and bundles and _IDLE.search(line):
                depth = bundles[-1][0]  # an idle bundle (a stall) is printed without its loop marks
            bundles.append([depth, match.group(2) == "LB", line])
        elif bundles:
            bundles[-1][2] += "\n" + line
    return [Bundle(depth, loop, text, max([1] + [int(n) for n in _DELAY.findall(text)]))
            for depth, loop, text in bundles]


def _definitions(bundles: list[Bundle]) -> dict[str, str]:
    """``SSA name -> the instruction defining it`` (libtpu's scalar names, ``%s2937_s14``, are unique)."""
    found = {}
    for bundle in bundles:
        for instruction in re.split(r"\{|;;|\}", bundle.text):
            match = re.match(r"\s*%(\w+) = (.*)", instruction)
            if match:
                found.setdefault(match.group(1), match.group(2))
    return found


def _scalar(name: str, definitions: dict, operands: tuple, spills: dict, depth: int = 0) -> int | None:
    """The value of the scalar ``name`` where the bundles fix it before the loop: a constant, a constant
    added to, shifted or multiplied into a known scalar, a spill slot's stored value, or an operand of the
    call that the program passes as a constant (``operands``, from its HLO); None otherwise."""
    text = definitions.get(name)
    if text is None or depth > 12:
        return None
    value = lambda token: (int(token) if re.fullmatch(r"-?\d+", token) else
                           _scalar(token.lstrip("%"), definitions, operands, spills, depth + 1))
    match = re.match(r"smov (-?\d+|%\w+)\b", text)
    if match:
        return value(match.group(1))
    # a predicated move of a constant over a scalar (``smov (!%p, %x), 80``, %p testing x < 80): the clamp
    # of a chunk's length to its most, an upper bound on the loop it sizes
    match = re.match(r"smov \(!%(\w+), %(\w+)\), (-?\d+)\b", text)
    if match:
        test = re.match(r"scmp\.lt\.s32\.totalorder (?:\(!?%\w+\), )?%(\w+), (-?\d+)\b",
                        definitions.get(match.group(1), ""))
        if test and test.groups() == (match.group(2), match.group(3)):
            return int(match.group(3))
    match = re.match(r"(sadd\.s32|ssub\.s32|sshll\.u32|sshrl\.u32|sand\.u32|smul\.u32|smul\.s32) "
                     r"(?:\(!?%\w+\), )?(-?\d+|%\w+), (-?\d+|%\w+)", text)
    if match:
        a, b = value(match.group(2)), value(match.group(3))
        if a is None or b is None:
            return None
        op = match.group(1)
        if op == "sshrl.u32":  # printed as (value, shift)
            return a >> b
        return {"sadd.s32": a + b, "ssub.s32": a - b, "sshll.u32": a << b, "sand.u32": a & b}.get(op, a * b)
    match = re.match(r"inlined_call_operand\.[^\[]*\[shape: s32\[\], index: (\d+)", text)
    if match:
        index = int(match.group(1))
        return operands[index] if index < len(operands) else None
    match = re.match(r"sld \[smem:\[#(\w+_spill)\]\]", text)
    if match and match.group(1) in spills:
        return value(spills[match.group(1)])
    return None


def loops(bundles: list[Bundle], operands: tuple = ()) -> list[tuple[int, int, int, int]]:
    """``(start, stop, depth, trips)`` of each loop: the bundles from its ``LB:`` on at its depth or
    deeper, the trip count the last exit test at its depth compares with: a constant (an ``scmp.ge``
    against ``N /* loop exit test */``) or, for a grid whose size the program passes in (tokamax's
    kernels step over the visited tiles only, their count a scalar operand), the scalar the loop's
    branch back tests, where the bundles compute it from constants and the call's constant
    ``operands`` (:func:`_scalar`)."""
    found = []
    definitions, spills = None, {}
    for start, stop, depth in _loop_spans(bundles):
        exits = [int(m) for b in bundles[start:stop] if b.depth == depth for m in _EXIT.findall(b.text)]
        if not exits:
            if definitions is None:
                definitions = _definitions(bundles)
                spills = {slot: stored for b in bundles
                          for slot, stored in re.findall(r"sst \[smem:\[#(\w+_spill)\]\] (%\w+)", b.text)}
            exits = _dynamic_exit(bundles, start, stop, definitions, operands, spills)
        if not exits:
            raise ValueError(f"bundles: the loop at bundle {start} has no exit test with a constant "
                             f"trip count")
        found.append((start, stop, depth, exits[-1]))
    return found


def _loop_spans(bundles: list[Bundle]) -> list[tuple[int, int, int]]:
    """``(start, stop, depth)`` of each loop: from its ``LB:`` bundle on, the bundles at its depth or
    deeper."""
    spans = []
    for start, bundle in enumerate(bundles):
        if bundle.loop:
            stop = start
            while stop < len(bundles) and bundles[stop].depth >= bundle.depth:
                stop += 1
            spans.append((start, stop, bundle.depth))
    return spans


def _dynamic_exit(bundles, start, stop, definitions, operands, spills) -> list[int]:
    """The trip count of a loop whose branch back (``sbr.rel (!%p) target = $regionN``, N the region its
    ``LB:`` bundle starts) tests ``%p = scmp.ge.s32.totalorder %i, %bound``: ``bound`` resolved."""
    head = re.findall(r"Start region (\d+)", bundles[start].text)
    found = []
    for b in bundles[start:stop + 1]:
        for predicate, newer, older in _BRANCH.findall(b.text):
            if (newer or older) not in head:
                continue
            test = definitions.get(predicate.strip().lstrip("!").lstrip("%"), "")
            match = re.match(r"scmp\.ge\.s32\.totalorder %\w+, %(\w+)", test)
            value = None if match is None else _scalar(match.group(1), definitions, operands, spills)
            if value is not None:
                found.append(value)
    return found


def _region_stop(bundles: list[Bundle], after: int, region: str) -> int | None:
    mark = re.compile(rf"(?:Start/End empty|Start) region {region}\b")
    for index in range(after + 1, len(bundles)):
        if mark.search(bundles[index].text):
            return index
    return None  # a backward branch (a loop's)


def regions(bundles: list[Bundle], weights: Weights | None) -> list[Region]:
    """The forward branches' regions, each with its frequency per trip (``weights`` None: an XLA
    computation, every region counted as run)."""
    raw = []
    for index, bundle in enumerate(bundles):
        for _predicate, newer, older in _BRANCH.findall(bundle.text):
            target = newer or older
            stop = _region_stop(bundles, index, target)
            if stop is None:
                continue
            body = "\n".join(b.text for b in bundles[index + 1:stop])
            raw.append((index, index + 1, stop, len(re.findall(r"= vmatmul[.\s]", body)),
                        len(_MASK_OPS.findall(body)), "pipeline-emitter-dma-wait" in body))
    found = []
    for branch, start, stop, vmatmul, mask_ops, waits in raw:
        if weights is None:
            kind, frequency = "xla", 1.0
        elif waits:
            kind, frequency = "pipeline", 1.0
        elif vmatmul:
            parents = [r for r in raw if r[1] <= start and stop <= r[2] and r[0] != branch and r[3]
                       and not r[5]]
            if not parents:
                kind, frequency = "compute", weights.compute
            else:
                parent = min(parents, key=lambda r: r[2] - r[1])
                siblings = [r for r in raw if parent[1] <= r[1] and r[2] <= parent[2] and r[0] != parent[0]
                            and r[3]]
                most = max(r[4] for r in siblings)
                share = weights.partial / weights.compute if weights.compute else 0.0
                if len(siblings) < 2:  # one computing region nested in another: the same steps
                    kind, frequency = "compute", 1.0
                else:
                    kind, frequency = ("partial", share) if mask_ops == most else ("unmasked", 1 - share)
        else:
            kind, frequency = "edge", weights.edge
        found.append(Region(branch, start, stop, kind, vmatmul, mask_ops, frequency))
    return found


def _frequencies(bundles: list[Bundle], found: list[Region]) -> list[float]:
    """Per bundle, the product of its regions' frequencies relative to the enclosing ones."""
    per_bundle = [1.0] * len(bundles)
    for region in found:
        for index in range(region.start, region.stop):
            per_bundle[index] *= region.frequency
    return per_bundle


def estimate_bundles(path: str | os.PathLike, chip: str, weights: Weights | None = None, *,
                     hbm_bytes: float = 0.0, name: str | None = None, operands: tuple = ()) -> Computation:
    """The estimate of one computation's final-bundles file (``weights`` given: a Pallas kernel whose grid
    runs its branches that often; None: an XLA computation that moves ``hbm_bytes``; ``operands``: the
    call's scalar operands the program passes as constants, None for the others, which a grid's size
    may be read from)."""
    clock, _ = chips.estimate_clock(chip)
    bandwidth = chips.get(chip).per_device()["hbm_bandwidth"]
    bundles = read(path)
    found_loops = loops(bundles, operands)
    weights = _grid_weights(bundles, found_loops, weights)
    found = regions(bundles, weights)
    per_bundle = _frequencies(bundles, found)
    times = [1.0] * len(bundles)
    for start, stop, _depth, trips in found_loops:
        for index in range(start, stop):
            times[index] *= trips
    cycles = sum(f * t * b.cycles for f, t, b in zip(per_bundle, times, bundles, strict=True))
    compute_s = cycles / clock
    kind = "xla" if weights is None else "pallas"
    if weights is None:
        return Computation(name or Path(path).name, kind, len(bundles), tuple(t for *_, t in found_loops),
                           cycles, compute_s, hbm_bytes, max(compute_s, hbm_bytes / bandwidth), tuple(found))
    # A Pallas grid: the outermost loop. A computing step waits for the copies it started when they
    # take longer than its bundles (the step's bundles with every compute region run once).
    dma_bytes, stall_s = 0.0, 0.0
    outer = [loop for loop in found_loops if loop[2] == 1]
    for start, stop, _depth, trips in outer:
        step_bytes = sum(_copied_bytes(b.text) for b in bundles[start:stop])
        step = [1.0] * len(bundles)
        for region in found:
            if region.kind in ("edge",) and start <= region.start < stop:
                for index in range(region.start, region.stop):
                    step[index] *= region.frequency
            if region.kind in ("partial", "unmasked") and start <= region.start < stop:
                for index in range(region.start, region.stop):
                    step[index] *= region.frequency
        step_cycles = sum(step[i] * times[i] * bundles[i].cycles / trips for i in range(start, stop))
        computing_steps = trips * weights.compute
        dma_bytes += computing_steps * step_bytes
        stall_s += computing_steps * max(0.0, step_bytes / bandwidth - step_cycles / clock)
    outside = sum(_copied_bytes(b.text) for b in bundles if b.depth == 0)
    dma_bytes += outside
    seconds = compute_s + stall_s + outside / bandwidth
    return Computation(name or Path(path).name, kind, len(bundles), tuple(t for *_, t in found_loops), cycles,
                       compute_s, dma_bytes, seconds, tuple(found))


def _grid_weights(bundles: list[Bundle], found_loops, weights):
    """``weights``, or for :class:`GridShares` the shares of the grid the compiler made: the visited tiles'
    where the grid loop's trip count is not a constant (an operand's), else every tile's."""
    if not isinstance(weights, GridShares):
        return weights
    grid = next(((s, e) for s, e, depth, _t in found_loops if depth == 1), None)
    sized = grid is not None and not any(_EXIT.search(b.text) for b in bundles[grid[0]:grid[1]]
                                         if b.depth == 1)
    return weights.visited if sized else weights.full


def _copied_bytes(text: str) -> float:
    """The bytes of each copy from HBM a bundle starts: its block's elements times their size."""
    total = 0.0
    for match in _DMA_IN.finditer(text):
        rest = text[match.end():]
        window, element = _WINDOW.search(rest), _ELEMENT.search(rest)
        if window and element:
            total += math.prod(int(n) for n in window.group(1).split(",")) * int(element.group(1))
    return total


# ---------------------------------------------------------------------------- a whole program
def _shape_bytes(text: str, *, hbm_only: bool = True) -> float:
    total = 0.0
    for dtype, dims, layout in _SHAPE.findall(text):
        if hbm_only and layout and "S(1)" in layout:
            continue
        total += math.prod(int(d) for d in dims.split(",") if d) * _ITEMSIZE.get(dtype, 1)
    return total


def _hlo_definitions(hlo: str) -> dict[str, str]:
    """``name -> the shape text`` of every instruction of the entry computation."""
    entry = hlo[hlo.find("\nENTRY"):]
    found = {}
    for match in re.finditer(r"^\s*(?:ROOT )?%([\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\((.*?)\)", entry, re.M):
        found[match.group(1)] = (match.group(2), match.group(3), match.group(4))
    return found


def _hbm_bytes(name: str, defs: dict) -> float:
    """An XLA op's operands and result in HBM, in bytes (the roofline's bytes of that op)."""
    if name not in defs:
        return 0.0
    shape, _op, operands = defs[name]
    total = _shape_bytes(shape)
    for operand in re.findall(r"%([\w.\-]+)", operands):
        if operand in defs:
            total += _shape_bytes(defs[operand][0])
    return total


def _constant_operands(name: str, defs: dict) -> tuple:
    """The scalar integer constants an HLO instruction takes, by operand position (None: not one)."""
    if name not in defs:
        return ()
    found = []
    for operand in re.findall(r"%([\w.\-]+)", defs[name][2]):
        shape, op, value = defs.get(operand, ("", "", ""))
        found.append(int(value) if op == "constant" and shape.startswith("s32[]")
                     and re.fullmatch(r"-?\d+", value) else None)
    return tuple(found)


def _program_files(out: Path) -> tuple[Path, Path]:
    """The final bundles and HLO of the dumped program ``jit_FN`` (the child's ``FN``)."""
    for hlo in sorted((out / "llo").glob("*-TLP-hlo.txt")):
        if re.match(r"HloModule jit_FN\b", hlo.read_text()):
            return hlo.with_name(hlo.name.replace("-TLP-hlo.txt", "-TLP-01-final_bundles.txt")), hlo
    raise static.DumpFailed(f"no top-level program jit_FN under {out / 'llo'}")


def _computation_file(out: Path, name: str, after: int) -> Path | None:
    files = [p for p in (out / "llo").glob(f"*-{name}-01-final_bundles.txt")
             if p.name.split("-", 1)[0].isdigit()]
    later = [p for p in files if int(p.name.split("-", 1)[0]) >= after]
    if not (later or files):
        return None
    return min(later or files, key=lambda p: int(p.name.split("-", 1)[0]))


def estimate_dump(out: str | os.PathLike, chip: str, weights: dict[str, Weights] | None = None) -> Estimate:
    """The program a dump holds (:func:`tpuattn.measure.static.dump` of code defining ``FN``), estimated:
    its own bundles and, per ``inlined_call``, the called computation's (``weights``: the Pallas
    kernels' by kernel name; a kernel not named there is weighed as if every step computed)."""
    out = Path(out)
    weights = {} if weights is None else weights
    top, hlo_path = _program_files(out)
    defs = _hlo_definitions(hlo_path.read_text())
    top_id = int(top.name.split("-", 1)[0])
    kernels = {}
    for kernel in static.kernel_names(out):
        try:
            kernels[static.bundle_file(out, kernel).name] = kernel
        except ValueError:
            continue
    clock, source = chips.estimate_clock(chip)
    bandwidth = chips.get(chip).per_device()["hbm_bandwidth"]
    bundles = read(top)
    found_loops = loops(bundles)
    computations = []
    for index, bundle in enumerate(bundles):
        for name in _CALL.findall(bundle.text):
            if name.startswith("<"):
                continue
            repeat = math.prod(t for s, e, _d, t in found_loops if s <= index < e)
            path = _computation_file(out, name, top_id)
            kernel = None if path is None else kernels.get(path.name)
            if path is None:  # an op with no bundles of its own (a copy done by DMA): at the roofline
                moved = _hbm_bytes(name, defs)
                one = Computation(name, "xla", 0, (), 0.0, 0.0, moved, moved / bandwidth)
            elif kernel is not None:
                one = estimate_bundles(path, chip, weights.get(kernel, Weights()), name=kernel,
                                       operands=_constant_operands(name, defs))
            else:
                one = estimate_bundles(path, chip, None, hbm_bytes=_hbm_bytes(name, defs), name=name)
            computations += [one] * repeat
    # The program's own bundles (its calls are one bundle each) and its copies between HBM and VMEM.
    times = [1.0] * len(bundles)
    for start, stop, _depth, trips in found_loops:
        for index in range(start, stop):
            times[index] *= trips
    own = sum(t * b.cycles for t, b in zip(times, bundles, strict=True))
    copies = sum(_shape_bytes(defs[n][0]) for n in defs if defs[n][1] == "copy-start")
    computations.append(Computation("program", "program", len(bundles), tuple(t for *_, t in found_loops),
                                    own,
                                    own / clock, copies, own / clock + copies / bandwidth))
    return Estimate(chip, clock, source, tuple(computations), sum(c.seconds for c in computations))


# A JAX device of a megacore chip (v4, v5p) is the chip: its two TensorCores run one program, the compiler
# splitting a Pallas grid's "parallel" axes between them (JAX's Pallas TPU pipelining guide: "Megacore is
# only currently available on TPU v4 and TPU v5p"; the chip-version table in jax/_src/pallas/mosaic/
# tpu_info.py marks both as supporting megacore; a v4-8 shows "4 logical devices (2 cores per, 'MegaCore'
# mode)", pytorch/xla#3460), as tpuattn.chips models them (Chip.megacore,
# per_device). libtpu describes "v5p:2x2x1" that way, but "v4:2x2x1" as eight one-TensorCore devices
# unless asked for the megacore chip configuration (chip_config_name="megacore": four devices of two
# cores, as a v4-8 shows JAX). The estimate compiles for the device the measured runs ran on.
TOPOLOGY_OPTIONS = {"v4": {"chip_config_name": "megacore"}}
_TOPOLOGY_PRELUDE = """
from tpuattn.measure import aot as _aot
_aot.describe_topology({name!r}, **{options!r})
"""


def device_code(code: str, chip: str) -> str:
    """``code`` for the child compile, led by the topology the chip's JAX device has
    (:data:`TOPOLOGY_OPTIONS`: v4's megacore device) where libtpu's default describes another."""
    options = TOPOLOGY_OPTIONS.get(chips.get(chip).name)
    if not options:
        return code
    return _TOPOLOGY_PRELUDE.format(name=chips.get(chip).topology, options=options) + code


def dump(code: str, chip: str, out_dir, *, timeout: float = 300) -> Path:
    """:func:`tpuattn.measure.static.dump` of ``code`` compiled for ``chip``'s JAX device
    (:func:`device_code`)."""
    return static.dump(device_code(code, chip), chip, out_dir, timeout=timeout)


def estimate(code: str, chip: str = "v5e", weights: dict[str, Weights] | None = None, *,
             out_dir=None) -> Estimate:
    """Compile the program ``code`` describes (see :func:`tpuattn.measure.static.dump`) for ``chip``'s JAX
    device (:func:`dump`) with libtpu's dumps and estimate it (the dump kept in ``out_dir`` if given, else
    deleted)."""
    with tempfile.TemporaryDirectory(prefix="tpuattn_estimate_") as scratch:
        out = dump(code, chip, scratch if out_dir is None else out_dir)
        return estimate_dump(out, chip, weights)


# ---------------------------------------------------------------------------- the programs of attention
SPLASH_CODE = """
import jax, jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as sa
mask = sa.MultiHeadMask([{mask}(({seq_len}, {seq_len}))] * {heads})
blocks = sa.BlockSizes(block_q={block}, block_kv={block}, block_kv_compute={block},
                       block_q_dkv={block}, block_kv_dkv={block}, block_kv_dkv_compute={block},
                       block_q_dq={block}, block_kv_dq={block})
kernel = sa.make_splash_mha(mask, block_sizes=blocks, head_shards=1, q_seq_shards=1)
attend = jax.vmap(kernel)
def FN(q, k, v):
    if {backward}:
        loss = lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    return attend(q, k, v)
ARGS = [jax.ShapeDtypeStruct(({batch}, {heads}, {seq_len}, {head_dim}), jnp.{dtype})] * 3
"""

FLASH_CODE = """
import jax, jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import flash_attention as fa
blocks = fa.BlockSizes(block_q={block}, block_k_major={block}, block_k={block}, block_b=1)
def FN(q, k, v):
    return fa.flash_attention(q, k, v, causal={causal}, sm_scale=1.0, block_sizes=blocks)
ARGS = [jax.ShapeDtypeStruct(({batch}, {heads}, {seq_len}, {head_dim}), jnp.{dtype})] * 3
"""

XLA_CODE = """
import jax, jax.numpy as jnp
def attend(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k{precision})
    if {causal}:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v{precision})
def FN(q, k, v):
    if {backward}:
        loss = lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    return attend(q, k, v)
ARGS = [jax.ShapeDtypeStruct(({batch}, {seq_len}, {heads}, {head_dim}), jnp.{dtype})] * 3
"""


# apple/axlearn at 6789f847 (2023-10-18), the commit whose tpu_attention_benchmark.py printed the 261.7b
# layer's times: a dense bf16 bias [batch, heads, T, T] passed to both programs; the flash one is
# axlearn's tpu_attention.flash_attention (query scaled outside, heads-first einsums, JAX's Pallas
# flash_attention with ab=bias at block_size 512 everywhere), the reference utils.mha_reference under
# jax.default_matmul_precision("bfloat16"); "bwd" is jax.grad of the output's mean for q, k and v.
AXLEARN_FLASH_CODE = """
import jax, jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import flash_attention as fa
b = {block}
blocks = fa.BlockSizes(block_q=b, block_k_major=b, block_k=b, block_b=1, block_q_major_dkv=b,
                       block_k_major_dkv=b, block_k_dkv=b, block_q_dkv=b, block_k_major_dq=b, block_k_dq=b,
                       block_q_dq=b)
def attend(q, k, v, bias):
    q = q * {head_dim} ** -0.5
    q, k, v = (jnp.einsum("btnh->bnth", x) for x in (q, k, v))
    out = fa.flash_attention(q, k, v, ab=bias, causal={causal}, sm_scale=1.0, block_sizes=blocks)
    return jnp.einsum("bnth->btnh", out)
def FN(q, k, v, bias):
    if {backward}:
        return jax.grad(lambda q, k, v, b: attend(q, k, v, b).mean(), argnums=(0, 1, 2))(q, k, v, bias)
    return attend(q, k, v, bias)
ARGS = [jax.ShapeDtypeStruct(({batch}, {seq_len}, {heads}, {head_dim}), jnp.{dtype})] * 3 + [
    jax.ShapeDtypeStruct(({batch}, {heads}, {seq_len}, {seq_len}), jnp.{dtype})]
"""

AXLEARN_REFERENCE_CODE = """
import jax, jax.numpy as jnp
@jax.default_matmul_precision("bfloat16")
def FN(q, k, v, bias):
    q = q * {head_dim} ** -0.5
    logits = jnp.einsum("btnh,bsnh->bnts", q, k)
    logits += bias.astype(logits.dtype)
    if {causal}:
        rows = jax.lax.broadcasted_iota(jnp.int32, ({seq_len}, {seq_len}), 0)
        cols = jax.lax.broadcasted_iota(jnp.int32, ({seq_len}, {seq_len}), 1)
        logits = jnp.where((rows < cols)[None, None], -1e30, logits)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(logits.dtype)
    return jnp.einsum("bnts,bsnh->btnh", probs, v)
ARGS = [jax.ShapeDtypeStruct(({batch}, {seq_len}, {heads}, {head_dim}), jnp.{dtype})] * 3 + [
    jax.ShapeDtypeStruct(({batch}, {heads}, {seq_len}, {seq_len}), jnp.{dtype})]
"""


def tile_weights(seq_len: int, block: int, causal: bool) -> Weights:
    """A square problem's grid shares (:class:`Weights`) from the package's tile codes
    (:meth:`tpuattn.spec.MaskSpec.block_map`: EMPTY tiles skipped, PARTIAL masked)."""
    from tpuattn import spec as spec_module

    mask = spec_module.spec_from_shapes(seq_len, seq_len, causal=causal).mask
    codes = mask.block_map(block, block)
    total = codes.size
    visited = int((codes != spec_module.EMPTY).sum())
    partial = int((codes == spec_module.PARTIAL).sum())
    return Weights(compute=visited / total, partial=partial / total, edge=1 / codes.shape[1])


class EveryKernel(dict):
    """The same grid weights for every Pallas kernel of a program (a splash or tokamax program's forward
    and backward grids share the square problem's tile map); ``weights`` empty or None: each kernel as
    :func:`estimate_dump` weighs one not named."""

    def __init__(self, weights):
        super().__init__()
        self.weights = weights

    def get(self, key, default=None):
        return self.weights or default


def splash_weights(seq_len: int, block: int, causal: bool = True) -> EveryKernel:
    """JAX's splash kernels' grid shares at square ``block`` tiles. Every visited tile runs splash's whole
    body (its mask is applied inside it): the body's nested branch runs on each computing step, so its
    share is the computing share. With :func:`tile_weights` alone (that branch taken as the partial
    tiles') the dQ and dK/dV kernels would count their matmuls on the partial tiles only (about 40% of
    the visited ones at 8K tokens, 512 x 512)."""
    w = tile_weights(seq_len, block, causal)
    return EveryKernel(Weights(compute=w.compute, partial=w.compute, edge=w.edge))


def tokamax_weights(seq_len: int, block_q: int, block_kv: int, causal: bool = True) -> EveryKernel:
    """tokamax's kernels' shares (:class:`GridShares`): a grid over the visited tiles
    (:func:`visited_grid_weights`) or over every tile (:func:`tile_weights`, its masked and unmasked
    branches two siblings in the bundles, each weighed by its tiles' share)."""
    from tpuattn import spec as spec_module

    codes = spec_module.spec_from_shapes(seq_len, seq_len, causal=causal).mask.block_map(block_q, block_kv)
    full = Weights(compute=int((codes != spec_module.EMPTY).sum()) / codes.size,
                   partial=int((codes == spec_module.PARTIAL).sum()) / codes.size, edge=1 / codes.shape[1])
    return EveryKernel(GridShares(full, visited_grid_weights(seq_len, block_q, block_kv, causal)))


def visited_grid_weights(seq_len: int, block_q: int, block_kv: int, causal: bool = True) -> Weights:
    """The shares of a grid that steps over the visited tiles only (tokamax's splash kernels: their grid's
    size is a scalar operand, :func:`loops`): every step computes, the partial tiles' share of the visited
    ones is masked, and set-up and write-out run once per row of tiles."""
    from tpuattn import spec as spec_module

    codes = spec_module.spec_from_shapes(seq_len, seq_len, causal=causal).mask.block_map(block_q, block_kv)
    visited = int((codes != spec_module.EMPTY).sum())
    return Weights(compute=1.0, partial=int((codes == spec_module.PARTIAL).sum()) / visited,
                   edge=codes.shape[0] / visited)


def tokamax_blocks(out: str | os.PathLike) -> tuple[int, int] | None:
    """``(block_q, block_kv)`` of the tokamax forward a dump holds, from the configuration its program's
    HLO carries in its metadata (None: no tokamax op there)."""
    for hlo in sorted(Path(out, "llo").glob("*-TLP-hlo.txt")):
        found = re.search(r'block_q\\?":(\d+),\\?"block_kv\\?":(\d+)', hlo.read_text())
        if found:
            return int(found.group(1)), int(found.group(2))
    return None


def split_branches(out, result: Estimate, chip: str, weights: dict,
                   kernels=None) -> tuple[Estimate, list]:
    """The kernels (``kernels``: those names, else every Pallas kernel ``weights`` names) with their masked
    and unmasked branches weighed apart wherever :func:`regions` read them as two computing branches
    (``(estimate, the kernels so read again)``).

    Where the compiler nests a grid step's body in the pipeline's DMA-wait branch (the package's v5e
    forward at 32K tokens, 1024 x 1024), :func:`regions` finds the two branches under no computing parent
    and counts both on every computing step. Here the branch with more mask instructions runs on the
    partial tiles' share and its sibling on the rest, as :func:`regions` weighs them where a computing
    branch encloses them; the estimate's other terms are kept."""
    clock, _ = chips.estimate_clock(chip)
    fixed, names, read_files = [], [], {}
    for c in result.computations:
        named = weights.get(c.name) is not None if kernels is None else c.name in kernels
        w = weights.get(c.name) if c.kind == "pallas" and named else None
        computes = [r for r in c.regions if r.kind == "compute" and r.vmatmul]
        apart = len(computes) == 2 and (computes[0].stop <= computes[1].start
                                        or computes[1].stop <= computes[0].start)
        if w is None or not apart or any(r.kind in ("partial", "unmasked") for r in c.regions):
            fixed.append(c)
            continue
        if c.name not in read_files:
            read_files[c.name] = read(static.bundle_file(out, c.name))
        bundles = read_files[c.name]
        found_loops = [(*span, t) for span, t in zip(_loop_spans(bundles), c.trips, strict=True)]
        w = _grid_weights(bundles, found_loops, w)
        most = max(r.mask_ops for r in computes)
        masked = dict(kind="partial", frequency=w.partial)
        unmasked = dict(kind="unmasked", frequency=w.compute - w.partial)
        found = [r if r not in computes else
                 dataclasses.replace(r, **(masked if r.mask_ops == most else unmasked)) for r in c.regions]
        times = [1.0] * len(bundles)
        for start, stop, _depth, trips in found_loops:
            for index in range(start, stop):
                times[index] *= trips
        per_bundle = _frequencies(bundles, found)
        cycles = sum(f * t * b.cycles for f, t, b in zip(per_bundle, times, bundles, strict=True))
        seconds = c.seconds - c.compute_s + cycles / clock
        fixed.append(dataclasses.replace(c, cycles=cycles, compute_s=cycles / clock, seconds=seconds,
                                         regions=tuple(found)))
        names.append(c.name)
    if not names:
        return result, []
    total = sum(c.seconds for c in fixed)
    return dataclasses.replace(result, computations=tuple(fixed), seconds=total), names


def estimate_with_counts(code: str, chip: str, weights, *, split=None,
                         timeout: float = 1200) -> tuple[Estimate, dict]:
    """The estimate of ``code`` compiled for ``chip`` (:func:`dump`) and, per Pallas kernel, its static
    counts (:func:`tpuattn.measure.static.kernel_static`: loop bundles, vmatmul, vector-ALU and EUP
    instructions of one grid step) from the same dump. ``weights`` may be a function of the dump folder
    (a kernel whose blocks the dump names); ``split``: the kernels whose branches
    :func:`split_branches` weighs apart (True: every kernel ``weights`` weighs; named ``"branches
    split"`` in the counts)."""
    with tempfile.TemporaryDirectory(prefix="tpuattn_estimate_") as scratch:
        # a longer wait than the dump's default: the GQA backward's compile outlasts 300 s on a shared machine
        dump(code, chip, scratch, timeout=timeout)
        weights = weights(scratch) if callable(weights) else weights
        result = estimate_dump(scratch, chip, weights)
        names = []
        if split:
            result, names = split_branches(scratch, result, chip, weights, None if split is True else split)
        counts = {"branches split": names} if names else {}
        for name in static.kernel_names(scratch):
            try:
                k = static.kernel_static(scratch, name, chip)
            except (ValueError, OSError):
                continue
            counts[name] = dict(bundles=k.bundles, loop_bundles=k.loop_bundles, vmatmul=k.vmatmul,
                                ideal_vmatmul=k.ideal_vmatmul, valu=k.valu, eup=k.eup)
    return result, counts


# ---------------------------------------------------------------------------- a report row's field
ROW_FIELD = "static_estimate_s"  # the optional field an ``aot`` report row carries, beside its label


def row_fields(code: str, chip: str, weights: dict[str, Weights] | None = None) -> dict:
    """The fields a compile report row (:mod:`tpuattn.measure.aot`) may carry: the program's estimate in
    seconds and its label, ``compiled (static estimate, not run)``, kept apart from measured and
    modelled fields (the committed report files do not carry it: each would need a dump per row)."""
    result = estimate(code, chip, weights)
    return {ROW_FIELD: result.seconds, f"{ROW_FIELD}_label": LABEL}
