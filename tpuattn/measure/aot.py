"""Compiled for TPU without a TPU: ``tpuattn.attention`` through the real TPU compiler, as reports.

JAX ships compile-only TPU devices: with ``libtpu`` installed (``pip install "jax[tpu]==<version>"``),
``jax.experimental.topologies.get_topology_desc("v5e:2x2", platform="tpu")`` describes a slice that
``jax.jit(f).lower(ShapeDtypeStruct(..., sharding=...)).compile()`` compiles for, on any machine: XLA:TPU
for the XLA paths and Mosaic for the Pallas kernels. The result has ``memory_analysis()``,
``cost_analysis()`` and the optimised HLO. Every row here is **compiled** -- a third kind of number
beside *measured* and *modelled* -- and says so: compiled for a TPU chip, not run.

Inside :func:`compile_row` the code works for the target chip (:func:`tpuattn.chips.target`): the Pallas
kernels compile instead of interpreting, size their blocks for that chip's VMEM, and an implementation
that cannot serve the chip refuses (a row ``unsupported``, never ``compile_error``).

From a shell::

    python -m tpuattn.aot --chips v5e,v6e --impls xla,pallas,splash --seq-lens 2048,8192 \\
        --modes fwd,fwd+bwd --dtype bfloat16 --out out/aot

One invocation writes one whole report file (:func:`document`): its rows with the ``command`` (argv),
``created`` date, ``versions`` (python, jax, jaxlib, libtpu) and ``problems`` (the sweep the rows were
compiled from). ``python -m tpuattn.aot --reproduce FILE [--limit N]`` (:mod:`tpuattn.measure.reports`)
compiles a report's problems again and prints a row-by-row diff.

Keep the compile-only environment apart from the notebooks' (libtpu makes JAX look for a TPU at start):
the CLI sets ``JAX_PLATFORMS=cpu`` before JAX starts, which leaves the topologies available.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import time
from pathlib import Path

LABEL = "compiled (TPU compiler, not run)"
# ``out_of_memory``: the compiler's own verdict that the program does not fit the chip's HBM (a fact
# about the problem size, e.g. materialised scores at 32k tokens), not a failure of the code;
# ``compile_error``: anything else the compiler refused -- for a supported input, a bug.
STATUSES = ("ok", "out_of_memory", "compile_error", "unsupported")
HBM_OOM = "Ran out of memory on HBM"
# The compiler's HBM verdict as libtpu words it: "... on HBM" (JAX 0.10.2's) or, for some programs with
# JAX 0.7.2's, "Ran out of memory in memory space hbm. Used 16.00G of 15.75G".
HBM_OOM_PATTERN = re.compile(r"Ran out of memory (?:on HBM|in memory space hbm)")
REPORT = Path(__file__).with_name("compiled_report.json")
# impl="tokamax" beside splash and the package's kernel (v5e, v6e; tokamax needs JAX 0.9.2 or newer, so
# it is a report of its own: the main one is remade on every supported compiler's JAX).
TOKAMAX_REPORT = Path(__file__).with_name("compiled_tokamax.json")
COLUMNS = ("chip", "impl", "mode", "seq_len", "kv_len", "batch", "heads", "kv_heads", "head_dim", "dtype",
           "causal", "window", "softcap", "segments", "status", "error", "peak_hbm_bytes", "argument_bytes",
           "output_bytes", "temp_bytes", "compile_s", "flops", "bytes_accessed", "optimal_seconds",
           "fusions", "custom_calls", "label", "jax_version", "libtpu_version")


@dataclasses.dataclass(frozen=True)
class Problem:
    """One configuration to compile (the contract's options, shapes without arrays)."""

    seq_len: int
    kv_len: int | None = None
    batch: int = 1
    heads: int = 8
    kv_heads: int | None = None
    head_dim: int = 128
    dtype: str = "bfloat16"
    causal: bool = True
    window: tuple | None = None
    softcap: float | None = None
    segments: bool = False

    def shapes(self):
        kv_len = self.seq_len if self.kv_len is None else self.kv_len
        kv_heads = self.heads if self.kv_heads is None else self.kv_heads
        return ((self.batch, self.seq_len, self.heads, self.head_dim),
                (self.batch, kv_len, kv_heads, self.head_dim))


def tpu_available() -> bool:
    """True when libtpu is installed, so that compile-only TPU topologies can be described."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return False
    return True


_COMPILER_PROBLEMS: dict[str, str | None] = {}


def compiler_problem(chip_name: str) -> str | None:
    """None if the installed TPU compiler compiles a one-tile Pallas copy kernel for ``chip_name``; else
    why not (libtpu missing, the chip unknown to it, or its message). Asked once per chip and process:
    a check that calls a learner's kernel refused uses it to tell a broken installation from a kernel
    the compiler rejects."""
    if chip_name in _COMPILER_PROBLEMS:
        return _COMPILER_PROBLEMS[chip_name]
    if not tpu_available():
        problem = "libtpu is not installed"
    elif not chip_known(chip_name):
        problem = f"the installed libtpu does not know {chip_name}"
    else:
        from tpuattn.pallas import compat

        try:
            compile_for(chip_name, compat.probe_kernel(), [compat.probe_argument()])
            problem = None
        except Exception as error:  # noqa: BLE001 - JAX's runtime error class differs between versions
            problem = f"it cannot compile even a one-tile copy kernel ({first_error_line(error)})"
    _COMPILER_PROBLEMS[chip_name] = problem
    return problem


def topology_device(chip):
    """One compile-only device of ``chip`` (a 2x2 topology: the smallest JAX describes for every chip)."""

    return _topology(chip.topology).devices[0]


def chip_known(chip_name: str) -> bool:
    """Whether the installed TPU compiler knows ``chip_name`` (libtpu 0.0.23, JAX 0.7.2's, has no tpu7x)."""
    from tpuattn import chips

    name = chips.get(chip_name).topology
    if name in _UNKNOWN_TOPOLOGIES:
        return False
    try:
        _topology(name)
    except Exception as error:  # noqa: BLE001 - JAX raises XlaRuntimeError / JaxRuntimeError by version
        if "lockfile" in str(error):  # another process holds libtpu: not a fact about the chip
            raise RuntimeError(f"chip_name: cannot ask the TPU compiler about {chip_name!r} now: "
                               f"{error}") from error
        _UNKNOWN_TOPOLOGIES.add(name)
        return False
    return True


_TOPOLOGIES: dict = {}
_UNKNOWN_TOPOLOGIES: set = set()  # names the installed compiler refused: asked once, not per row


def _topology(name: str):
    if name not in _TOPOLOGIES:
        describe_topology(name)
    return _TOPOLOGIES[name]


def describe_topology(name: str, **options):
    """Describe the compile-only topology ``name`` with libtpu's ``options`` (for example
    ``chip_config_name="megacore"``, see :data:`tpuattn.measure.estimate.TOPOLOGY_OPTIONS`) and make it
    the one this process compiles for under that name (:func:`compile_for`, :func:`topology_device`)."""
    from jax.experimental import topologies

    from tpuattn.pallas import compat

    with _native_stderr_silenced():  # libtpu warns, at start-up, about TPU_* variables not needed here
        _TOPOLOGIES[name] = topologies.get_topology_desc(topology_name=name, platform="tpu", **options)
        # Lower for the installed libtpu (an older one reads only older Mosaic serializations).
        compat.match_installed_libtpu(_TOPOLOGIES[name].devices[0])
    return _TOPOLOGIES[name]


@contextlib.contextmanager
def _native_stderr_silenced():
    """Send file descriptor 2 to /dev/null for the duration (C++ logging bypasses ``sys.stderr``);
    Python exceptions still carry their messages."""
    import os
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _versions() -> tuple[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    import jax

    try:
        libtpu = version("libtpu")
    except PackageNotFoundError:
        libtpu = "none"
    return jax.__version__, libtpu


def versions_text() -> str:
    """``"JAX 0.10.2, libtpu 0.0.42.1"``: what compiled the rows."""
    jax_version, libtpu_version = _versions()
    return f"JAX {jax_version}, libtpu {libtpu_version}"


def first_error_line(error: BaseException) -> str:
    """The compiler's message in one line: its first error line, plus the sizes of a VMEM overflow.

    Terminal colour codes (JAX colours jaxprs it prints inside Jupyter) are removed and source paths
    shortened to the file's name (``/home/me/tpuattn/puzzles/backward_puzzles.py:564`` ->
    ``backward_puzzles.py:564``), so the message reads the same on every machine."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    text = re.sub(r"(?:[A-Za-z]:)?[/\\][^\s:'\"]*[/\\]([^/\\\s:'\"]+\.py)\b", r"\1", text)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = next((line for line in lines
                  if re.search(r"E\d{4}:|RESOURCE_EXHAUSTED|[Vv]mem|VMEM|out of memory|INTERNAL", line)),
                 lines[0] if lines else "")
    sizes = re.search(r"Scoped allocation with size \S+ and limit \S+ exceeded scoped vmem limit by \S+"
                      r"|Used \S+ of \S+ vmem", text)
    if sizes and sizes.group(0) not in first:
        first = f"{first} {sizes.group(0)}"
    return f"{type(error).__name__}: {first}"[:500]


def _hlo_counts(text: str) -> tuple[int, int]:
    fusions = len(re.findall(r"^\s*(?:ROOT )?%?\S+ = \S+ fusion\(", text, flags=re.M))
    custom_calls = len(re.findall(r"custom-call\(", text))
    return fusions, custom_calls


# ---------------------------------------------------------------------------- HBM-resident bytes
_HLO_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2,
              "u16": 2, "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}
_HLO_ARRAY = re.compile(r"(\w+)\[([\d,]*)\](\{[^}]*\})?")
_HLO_NO_TRAFFIC = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "copy-done", "after-all",
                   "partition-id", "iota"}


def _hbm_array_bytes(shape: str) -> int:
    """Bytes of the arrays of an HLO shape that live in HBM (a layout with ``S(1)`` is in VMEM)."""
    total = 0
    for dtype, dims, layout in _HLO_ARRAY.findall(shape):
        if dtype in _HLO_BYTES and "S(1)" not in (layout or ""):
            total += math.prod(int(d) for d in dims.split(",") if d) * _HLO_BYTES[dtype]
    return total


_HLO_MOVES = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) (copy|transpose|reshape)\(", re.M)


def data_movement_ops(hlo_text: str, min_bytes: int) -> list[tuple[str, str, str, int]]:
    """``(name, op, shape, bytes)`` of every ``copy``, ``transpose`` and ``reshape`` in an optimised
    program whose result holds at least ``min_bytes`` (its logical size, in any memory, fused or not):
    the layout copies a wrapper makes around its kernels. (A reshape the optimised program keeps moves
    data: one that only renames dimensions of the same bytes is a ``bitcast`` there. On a TPU,
    ``[b, T, H, D]`` is tiled over its last two dimensions ``(H, D)`` and ``[b, T, H * D]`` over
    ``(T, H * D)``, so even that reshape moves every byte.) A Mosaic kernel is one ``custom-call``, so nothing
    inside a kernel is listed. ``shape`` is the result's HLO shape without its layout
    (``"bf16[1,4096,16,128]"``)."""
    found = []
    for name, shape, op in _HLO_MOVES.findall(hlo_text):
        arrays = _HLO_ARRAY.findall(shape)
        size = sum(math.prod(int(d) for d in dims.split(",") if d) * _HLO_BYTES.get(dtype, 0)
                   for dtype, dims, _ in arrays)
        if size >= min_bytes:
            found.append((name, op, ", ".join(f"{dtype}[{dims}]" for dtype, dims, _ in arrays), size))
    return found


def hbm_resident_bytes(hlo_text: str) -> int:
    """HBM bytes an optimised TPU program must move: every executed instruction's operands and results
    that its buffer assignment placed in HBM, once each (a lower bound of its traffic; XLA's cost
    analysis ``bytes accessed`` counts operands in VMEM too). A ``conditional`` counts its costlier
    branch; a ``while`` loop raises (its trip count is not counted here). Reads the text of
    ``compiled.as_text()``, whose layouts mark VMEM as ``S(1)``."""
    comps, entry, current = {}, None, None
    for line in hlo_text.splitlines():
        head = re.match(r"^(ENTRY )?%(\S+) .*\{\s*$", line)
        if head:
            current = head.group(2)
            comps[current] = []
            entry = current if head.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            inst = re.match(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([\w-]+)\((.*)$", line)
            if inst:
                comps[current].append(inst.groups())
    if entry is None:
        raise ValueError("hlo_text: expected an optimised HLO module with an ENTRY computation, got none")

    def walk(name: str) -> int:
        shapes = {n: shape for n, shape, _, _ in comps[name]}
        total = 0
        for _, shape, op, rest in comps[name]:
            if op in _HLO_NO_TRAFFIC:
                continue
            if op == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", rest).group(1)
                total += max(walk(b.strip().lstrip("%")) for b in branches.split(","))
                continue
            if op == "while":
                raise ValueError("hlo_text: a while loop; its trip count is not counted here")
            operands = re.findall(r"%([\w.\-]+)", rest.split("), ")[0])
            total += sum(_hbm_array_bytes(shapes[o]) for o in operands if o in shapes)
            total += 0 if op == "copy-start" else _hbm_array_bytes(shape)  # a prefetch writes VMEM
        return total

    return walk(entry)


def compile_for(chip_name: str, fn, args):
    """Compile ``jax.jit(fn)`` for one device of ``chip_name`` with ``args`` (``ShapeDtypeStruct`` s
    whose sharding is ignored) -- inside :func:`tpuattn.chips.target`, so the code works for that chip.

    Returns the compiled executable; the compiler's errors propagate. Any function compiles this
    way, the notebooks' own lesson kernels included.
    """
    import jax

    from tpuattn import chips

    chip = chips.get(chip_name)
    sharding = jax.sharding.SingleDeviceSharding(topology_device(chip))
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
    with chips.target(chip):
        return jax.jit(fn).lower(*placed).compile()


def memory_facts(compiled) -> dict:
    """A compiled program's HBM per device: arguments, outputs, temporaries and their sum (its peak)."""
    memory = compiled.memory_analysis()
    parts = {key: getattr(memory, f"{key}_size_in_bytes", None) for key in ("argument", "output", "temp")}
    return dict(argument_bytes=parts["argument"], output_bytes=parts["output"], temp_bytes=parts["temp"],
                peak_hbm_bytes=sum(v for v in parts.values() if v is not None))


def compile_failure(error: BaseException) -> dict:
    """``status`` and ``error`` of a compile the compiler refused: ``out_of_memory`` for its own HBM
    verdict, ``compile_error`` for anything else."""
    message = first_error_line(error)
    return dict(status="out_of_memory" if HBM_OOM_PATTERN.search(message) else "compile_error", error=message)


def compiled_facts(compiled) -> dict:
    """What the compiler says about a compiled program: memory, cost and HLO counts."""
    facts = dict(memory_facts(compiled), flops=None, bytes_accessed=None, optimal_seconds=None)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    if cost:
        facts.update(flops=cost.get("flops"), bytes_accessed=cost.get("bytes accessed"),
                     optimal_seconds=cost.get("optimal_seconds"))
    facts["fusions"], facts["custom_calls"] = _hlo_counts(compiled.as_text())
    return facts


def compile_row(chip_name: str, impl: str, mode: str, problem: Problem, options: dict | None = None) -> dict:
    """Compile one (chip, implementation, mode, problem) for a TPU; return its report row."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import tpuattn
    from tpuattn import chips
    from tpuattn.errors import UnavailableImplementation, UnsupportedInput
    from tpuattn.measure.flops import check_mode

    check_mode(mode)
    chip = chips.get(chip_name)
    jax_version, libtpu_version = _versions()
    row = {key: None for key in COLUMNS}
    row.update(chip=chip.name, impl=impl, mode=mode, seq_len=problem.seq_len,
               kv_len=problem.kv_len or problem.seq_len, batch=problem.batch, heads=problem.heads,
               kv_heads=problem.kv_heads or problem.heads, head_dim=problem.head_dim, dtype=problem.dtype,
               causal=problem.causal, window=problem.window, softcap=problem.softcap,
               segments=problem.segments, label=LABEL, jax_version=jax_version,
               libtpu_version=libtpu_version)
    q_shape, kv_shape = problem.shapes()
    dtype = jnp.dtype(problem.dtype)
    args = [jax.ShapeDtypeStruct(q_shape, dtype), jax.ShapeDtypeStruct(kv_shape, dtype),
            jax.ShapeDtypeStruct(kv_shape, dtype)]
    if problem.segments:
        args.append(jax.ShapeDtypeStruct(q_shape[:2], np.int32))
    kwargs = dict(causal=problem.causal, window=problem.window, softcap=problem.softcap, impl=impl,
                  **(options or {}))

    def attend(q, k, v, *segments):
        seg = segments[0] if segments else None
        return tpuattn.attention(q, k, v, segment_ids=seg, **kwargs)

    def loss(q, k, v, *segments):
        return jnp.sum(attend(q, k, v, *segments).astype(jnp.float32))

    fn = attend if mode == "fwd" else jax.grad(loss, argnums=(0, 1, 2))
    if not chip_known(chip.name):
        row.update(status="unsupported",
                   error=f"chip: the installed TPU compiler ({versions_text()}) does not know {chip.name}")
        return row
    start = time.perf_counter()
    try:
        compiled = compile_for(chip.name, fn, args)
    except (UnsupportedInput, UnavailableImplementation) as error:
        row.update(status="unsupported", error=str(error))
        return row
    except Exception as error:  # noqa: BLE001 - the compiler's own errors have many types
        row.update(compile_failure(error), compile_s=time.perf_counter() - start)
        return row
    row["compile_s"] = time.perf_counter() - start
    row.update(status="ok", **compiled_facts(compiled))
    return row


def wrapper_moves(chip_name: str, problem: Problem, mode: str = "fwd", *, projected: bool = False):
    """``(compiled, moves)``: ``impl="pallas"`` compiled for ``chip_name`` (``mode`` ``"fwd"`` or
    ``"fwd+bwd"``, the gradient of a sum) and its :func:`data_movement_ops` of at least a K/V's bytes,
    the data movement outside the kernels. ``projected``: Q, K, V arrive as a projection makes them,
    ``[batch, seq, heads * head_dim]`` reshaped to the contract's shape, and O leaves as one takes it;
    otherwise the arguments and result are in the contract's ``[batch, seq, heads, head_dim]``."""
    import jax
    import jax.numpy as jnp

    import tpuattn

    if mode not in ("fwd", "fwd+bwd"):
        raise ValueError(f"mode: expected 'fwd' or 'fwd+bwd', got {mode!r}")
    q_shape, kv_shape = problem.shapes()
    options = dict(causal=problem.causal, window=problem.window, softcap=problem.softcap, impl="pallas")

    def attend(q, k, v):
        if not projected:
            return tpuattn.attention(q, k, v, **options)
        split = lambda x, shape: x.reshape(shape)
        out = tpuattn.attention(split(q, q_shape), split(k, kv_shape), split(v, kv_shape), **options)
        return out.reshape(q.shape)

    flat = lambda shape: (*shape[:2], shape[2] * shape[3])
    shapes = [flat(q_shape), flat(kv_shape), flat(kv_shape)] if projected else [q_shape, kv_shape, kv_shape]
    args = [jax.ShapeDtypeStruct(s, jnp.dtype(problem.dtype)) for s in shapes]
    loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32))
    fn = attend if mode == "fwd" else jax.grad(loss, argnums=(0, 1, 2))
    compiled = compile_for(chip_name, fn, args)
    kv_bytes = math.prod(kv_shape) * jnp.dtype(problem.dtype).itemsize
    return compiled, data_movement_ops(compiled.as_text(), min_bytes=kv_bytes)


def layout_copy_bytes(chip_name: str, problem: Problem) -> float:
    """Compiled bytes accessed by the Pallas wrapper's own data movement alone (forward): Q, K, V from
    the contract's ``[batch, seq, heads, head_dim]`` into the kernels' view and O back
    (:class:`tpuattn.pallas.layout.Layout`: ``[batch, seq, heads * head_dim]``, a relayout between the
    TPU's two tilings, for head_dim a multiple of 128 or 64 on paired kv heads; the padded heads-first
    copy otherwise)."""
    import jax
    import jax.numpy as jnp

    from tpuattn.pallas.layout import LANES, Layout

    q_shape, kv_shape = problem.shapes()
    dtype = jnp.dtype(problem.dtype)
    layout = Layout.for_head_dim(problem.head_dim, problem.kv_heads or problem.heads)
    o_kernel = layout.shape(problem.batch, problem.heads, problem.seq_len)

    def copies(q, k, v, o):
        return (layout.operand(q, LANES), layout.operand(k, LANES), layout.operand(v, LANES),
                layout.result(o, problem.seq_len, problem.heads, problem.head_dim))

    args = [jax.ShapeDtypeStruct(s, dtype) for s in (q_shape, kv_shape, kv_shape, o_kernel)]
    return compiled_facts(compile_for(chip_name, copies, args))["bytes_accessed"]


# ---------------------------------------------------------------------------- block sizes
BLOCK_CANDIDATES = (128, 256, 512, 1024)
BLOCK_COLUMNS = ("chip", "kernel", "head_dim", "dtype", "block_q", "block_kv", "status", "error",
                 "modelled_vmem_bytes", "compile_s", "label", "jax_version", "libtpu_version")
KERNELS = ("forward", "backward")


def block_row(chip_name: str, kernel: str, block_q: int, block_kv: int, head_dim: int, dtype: str) -> dict:
    """Does the Pallas kernel compile for ``chip_name`` with these blocks, at Mosaic's default scoped
    VMEM limit? ``kernel`` is ``"forward"`` or ``"backward"`` (both backward passes share the blocks;
    the forward then runs at 128 x 128, which always fits)."""
    import jax.numpy as jnp

    from tpuattn.pallas import blocks as pallas_blocks
    from tpuattn.pallas.layout import Layout, padded_head_dim

    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
    small = pallas_blocks.BlockSizes.uniform(128)
    if kernel == "forward":
        sizes = pallas_blocks.BlockSizes(pallas_blocks.ForwardBlocks(block_q, block_kv), small.backward)
        vmem_model = pallas_blocks.forward_vmem_bytes
    else:
        sizes = pallas_blocks.BlockSizes(small.forward, pallas_blocks.BackwardBlocks(block_q, block_kv))
        vmem_model = pallas_blocks.backward_vmem_bytes
    # One head, or at head_dim 64 a kv head pair: its two heads share a 128-lane tile and every step
    # holds both (tpuattn.pallas.layout.Layout), so those blocks are compiled and tabled apart.
    heads = Layout.for_head_dim(head_dim, num_kv_heads=2).pack
    problem = Problem(seq_len=max(BLOCK_CANDIDATES), heads=heads, head_dim=head_dim, dtype=dtype,
                      causal=False)
    row = compile_row(chip_name, "pallas", "fwd" if kernel == "forward" else "fwd+bwd", problem,
                      {"block_sizes": sizes})
    modelled = vmem_model(block_q, block_kv, padded_head_dim(head_dim), jnp.dtype(dtype).itemsize, heads)
    return {"chip": row["chip"], "kernel": kernel, "head_dim": head_dim, "dtype": dtype, "block_q": block_q,
            "block_kv": block_kv, "status": row["status"], "error": row["error"],
            "modelled_vmem_bytes": modelled, "compile_s": row["compile_s"], "label": LABEL,
            "jax_version": row["jax_version"], "libtpu_version": row["libtpu_version"]}


def block_jobs(problems: dict) -> list[tuple]:
    """``(chip, kernel, block_q, block_kv, head_dim, dtype)`` for every pair ``block_kv <= block_q`` of
    a block sweep's ``problems`` (``chips``, ``kernels``, ``head_dims``, ``dtypes``, ``candidates``)."""
    return [(c, k, bq, bk, d, t) for c in problems["chips"] for k in problems["kernels"]
            for d in problems["head_dims"] for t in problems["dtypes"]
            for bq in problems["candidates"] for bk in problems["candidates"] if bk <= bq]


def block_table(chip_names, head_dims=(128, 256), dtypes=("bfloat16", "float32"),
                candidates=BLOCK_CANDIDATES, kernels=KERNELS, progress: bool = True) -> list:
    """:func:`block_row` for every chip, kernel, head_dim, dtype and pair ``block_kv <= block_q``.

    The kernels compute head_dim 64 in 128-lane tiles: padded (odd kv heads) it takes 128's blocks; its
    paired heads (two to a tile, compiled with a kv head pair) have a sweep of their own
    (``--head-dims 64``: ``tpuattn/pallas/compiled_blocks_paired.json``)."""
    jobs = block_jobs(dict(chips=list(chip_names), kernels=list(kernels), head_dims=list(head_dims),
                           dtypes=list(dtypes), candidates=list(candidates)))
    rows = []
    for n, job in enumerate(jobs, 1):
        rows.append(block_row(*job))
        if progress:
            r = rows[-1]
            print(f"[{n}/{len(jobs)}] {r['chip']} {r['kernel']} d={r['head_dim']} {r['dtype']} "
                  f"{r['block_q']}x{r['block_kv']}: {r['status']}", flush=True)
    return rows


# ---------------------------------------------------------------------------- reports and the CLI
def report_jobs(problems: dict) -> list[tuple]:
    """``(chip, impl, mode, Problem)`` of a report's ``problems`` (``chips``, ``impls``, ``modes`` and
    ``problems``, each a :class:`Problem` as a dict), in the report's row order."""
    return [(c, i, m, p) for c in problems["chips"] for p in _problems(problems) for i in problems["impls"]
            for m in problems["modes"]]


def _problems(problems: dict) -> list[Problem]:
    return [Problem(**{**p, "window": None if p.get("window") is None else tuple(p["window"])})
            for p in problems["problems"]]


def report(chip_names, impls, modes, problems, *, options: dict | None = None, progress: bool = True) -> list:
    """Compile every (chip, impl, mode, problem); return the rows (``progress`` prints one line each)."""
    rows = []
    jobs = report_jobs(dict(chips=list(chip_names), impls=list(impls), modes=list(modes),
                            problems=[dataclasses.asdict(p) for p in problems]))
    for n, (chip, impl, mode, problem) in enumerate(jobs, 1):
        row = compile_row(chip, impl, mode, problem, (options or {}).get(impl))
        rows.append(row)
        if progress:
            detail = f"{row['compile_s']:.1f} s" if row["compile_s"] is not None else ""
            print(f"[{n}/{len(jobs)}] {chip} {impl} {mode} T={problem.seq_len}: {row['status']} {detail}",
                  flush=True)
    return rows


def committed_report(path: Path = REPORT) -> dict:
    """A compile report shipped with the package (by default the main one, :data:`REPORT`; also
    :data:`TOKAMAX_REPORT`): what the notebooks show as compiled facts where no TPU compiler is
    installed. Made by the command it records (``python -m tpuattn.aot --reproduce`` compiles its
    problems again and compares the rows)."""
    return json.loads(Path(path).read_text())


# ---------------------------------------------------------------------------- reproducible reports
# A report file is one command's whole output: ``kind`` ("report", "blocks" or "slices"), ``command``
# (its argv), ``created`` (UTC date), ``versions`` (what compiled it), ``problems`` (everything the
# rows were compiled from: the sweep, which :func:`tpuattn.measure.reports.jobs` expands into one job
# per row, in row order) and ``rows``. ``jax_version`` and ``libtpu_version`` repeat two of the
# versions for the notebooks. :mod:`tpuattn.measure.reports` compiles a report file again and diffs it.
KINDS = ("report", "blocks", "slices")
FILE_NAMES = {"report": "aot", "blocks": "blocks", "slices": "slices"}
UNKNOWN = "unknown (before recording)"
BLOCKS_WHAT = ("Which Pallas block sizes the real TPU compiler accepts for tpuattn's kernels at Mosaic's "
               "default scoped VMEM limit (compiled, not run)")


def versions() -> dict:
    """``{"python", "jax", "jaxlib", "libtpu"}``: what compiles rows here (``"none"``: not installed)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "libtpu"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "none"
    return found


def document(kind: str, rows, *, command, problems: dict, label: str = LABEL, **extra) -> dict:
    """One whole report: ``rows`` with the command, date, versions and problems that made them."""
    import datetime

    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {list(KINDS)}, got {kind!r}")
    found = versions()
    return {"kind": kind, "label": label, **extra, "command": [str(a) for a in command],
            "created": datetime.datetime.now(datetime.UTC).date().isoformat(), "versions": found,
            "jax_version": found["jax"], "libtpu_version": found["libtpu"], "problems": problems,
            "rows": [_as_json(row) for row in rows]}


def _as_json(row: dict) -> dict:
    """A row as the JSON file holds it (tuples as lists, anything else unusual as its string)."""
    return json.loads(json.dumps(row, default=str))


def save(doc: dict, out_dir, columns=COLUMNS) -> tuple:
    """Write a :func:`document` to ``out_dir/<name>.json`` (whole) and its rows to ``<name>.csv``
    (``<name>``: ``aot``, ``blocks`` or ``slices`` by kind); return the two paths."""
    import csv

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = FILE_NAMES[doc["kind"]]
    csv_path, json_path = out / f"{name}.csv", out / f"{name}.json"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(doc["rows"])
    json_path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return csv_path, json_path


def describe_problems(problems: dict) -> str:
    """``"batch 1, 8 heads x 128, bfloat16, causal"``: what a report's problems share, in words."""
    shared = {key: {json.dumps(p.get(key)) for p in problems["problems"]}
              for key in ("batch", "heads", "kv_heads", "head_dim", "dtype", "causal")}
    if any(len(values) > 1 for values in shared.values()):
        return "several shapes (see problems)"
    p = problems["problems"][0]
    kv = "" if p.get("kv_heads") in (None, p["heads"]) else f" on {p['kv_heads']} kv heads"
    return (f"batch {p['batch']}, {p['heads']} heads x {p['head_dim']}{kv}, {p['dtype']}, "
            f"{'causal' if p['causal'] else 'not causal'}")


def table(rows) -> str:
    """One line per row: what compiled, its peak HBM and compile time, or why not."""
    lines = [f"{'chip':<6} {'impl':<10} {'mode':<8} {'T':>6} {'status':<14} {'peak HBM MiB':>12} "
             f"{'compile s':>9}  ({LABEL})"]
    for r in rows:
        peak = f"{r['peak_hbm_bytes'] / 2**20:12.1f}" if r["peak_hbm_bytes"] is not None else f"{'-':>12}"
        secs = f"{r['compile_s']:9.1f}" if r["compile_s"] is not None else f"{'-':>9}"
        why = f"  {r['error'][:90]}" if r["error"] else ""
        lines.append(f"{r['chip']:<6} {r['impl']:<10} {r['mode']:<8} {r['seq_len']:>6} {r['status']:<14} "
                     f"{peak} {secs}{why}")
    return "\n".join(lines)


def _parser():
    import argparse

    from tpuattn import chips
    from tpuattn.measure.flops import MODES

    parser = argparse.ArgumentParser(prog="python -m tpuattn.aot",
                                     description="Compile tpuattn.attention for TPU chips (no TPU needed).")
    parser.add_argument("--chips", default="v5e", help=f"comma-separated, from {','.join(chips.NAMES)}")
    parser.add_argument("--impls", default="xla,pallas,splash")
    parser.add_argument("--seq-lens", default="2048")
    parser.add_argument("--modes", default="fwd", help=f"comma-separated, from {','.join(MODES)}")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", choices=("true", "false"), default="true")
    parser.add_argument("--out", default="out/aot")
    parser.add_argument("--blocks", action="store_true",
                        help="instead: which Pallas block sizes compile per chip, head_dim (--head-dims) and "
                             "dtype (--dtypes), written to blocks.csv/json")
    parser.add_argument("--head-dims", default="128,256",
                        help="--blocks: 128,256 (compiled_blocks.json); 64: paired heads, two a step "
                             "(compiled_blocks_paired.json)")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def parse(argv) -> tuple[str, dict, object]:
    """``(kind, problems, args)`` of a command line (``--blocks``: the block sweep, else the report)."""
    args = _parser().parse_args(argv)
    split = lambda text: [item for item in text.split(",") if item]
    if args.blocks:
        return "blocks", dict(chips=split(args.chips), kernels=list(KERNELS),
                              head_dims=[int(d) for d in split(args.head_dims)], dtypes=split(args.dtypes),
                              candidates=list(BLOCK_CANDIDATES)), args
    problems = [Problem(seq_len=int(t), batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
                        head_dim=args.head_dim, dtype=args.dtype, causal=args.causal == "true")
                for t in split(args.seq_lens)]
    return "report", dict(chips=split(args.chips), impls=split(args.impls), modes=split(args.modes),
                          problems=[dataclasses.asdict(p) for p in problems]), args


def main(argv=None) -> list:
    """``python -m tpuattn.aot``: one invocation writes one whole report (rows, command, versions,
    problems); ``--reproduce FILE`` is :func:`tpuattn.measure.reports.main`."""
    import sys

    argv = sys.argv[1:] if argv is None else list(argv)
    kind, problems, args = parse(argv)
    if not tpu_available():
        _parser().error('libtpu is not installed: pip install "jax[tpu]==<your JAX version>" '
                        "(the compile-only TPU devices come with it)")
    command = ["python", "-m", "tpuattn.aot", *argv]
    if kind == "blocks":
        rows = block_table(problems["chips"], problems["head_dims"], problems["dtypes"],
                           problems["candidates"], problems["kernels"], progress=not args.no_progress)
        print("wrote", *save(document("blocks", rows, command=command, problems=problems, what=BLOCKS_WHAT),
                             args.out, BLOCK_COLUMNS))
        return rows
    rows = report(problems["chips"], problems["impls"], problems["modes"], _problems(problems),
                  progress=not args.no_progress)
    print(table(rows))
    print("wrote", *save(document("report", rows, command=command, problems=problems,
                                  problem=describe_problems(problems)), args.out))
    return rows


# ---------------------------------------------------------------------------- decode engines compiled
# One serving step of an inference engine compiled for a TPU chip (compiled, not run): the package's
# decode kernel (``tpuattn.decode.attention(..., impl="pallas")``: split-K for the dense serving batch,
# token-major for the ragged mixed batch) beside JAX's ragged paged
# attention kernel (``jax.experimental.pallas.ops.tpu.ragged_paged_attention``, called directly with the
# cache in its own layout: K and V interleaved per page, ``[pages, page, 2 * kv_heads, head_dim]``, and
# its block sizes tuned per chip) at the same shapes, with full-width and quantized caches.
# The shapes: notebook 07's serving batch (8 sequences, 1 new token each, 16 pages of 64 rows per
# sequence, 32 query heads on 8 kv heads of 128) and a mixed batch in the same cache layout (4 prefill
# chunks of 256 tokens beside 60 single-token decodes), every sequence's cache full (the compiler
# cannot know the lengths).
DECODE_ENGINE_HEADS = dict(heads=32, kv_heads=8, head_dim=128)
DECODE_ENGINE_SHAPES = {
    "serve": dict(q_lens=(1,) * 8, page=64, pages_per_sequence=16),
    "mixed": dict(q_lens=(256,) * 4 + (1,) * 60, page=64, pages_per_sequence=16),
}
DECODE_CACHE_DTYPES = ("bfloat16", "int8", "float8_e4m3fn")
DECODE_ENGINES = ("tpuattn", "jax_ragged")
# tpu-inference (vLLM's TPU backend, PyPI ``tpu-inference``): its ragged paged attention v3, compiled
# where the module imports (benchmarks/decode_engine.py --tpu-inference DIR); not a default engine.
TPU_INFERENCE_KERNEL = "tpu_inference.kernels.ragged_paged_attention.v3.kernel"
OPTIONAL_DECODE_ENGINES = ("tpu_inference",)
# ``unavailable``: the engine has no such input yet (or is not installed); its error says which.
DECODE_ENGINE_STATUSES = (*STATUSES, "unavailable")
DECODE_ENGINE_COLUMNS = ("chip", "engine", "shape", "cache_dtype", "batch", "tokens", "status", "error",
                         "bytes_accessed", "peak_hbm_bytes", "argument_bytes", "output_bytes", "temp_bytes",
                         "compile_s", "blocks", "label", "jax_version",
                         "libtpu_version")
# A quantized cache's scales, per tensor.
DECODE_SCALE = 0.5


def _decode_scales(cache_dtype: str) -> dict:
    """Every engine's ``k_scale``/``v_scale`` for a ``cache_dtype`` cache: none for bfloat16, else
    :data:`DECODE_SCALE` as Python floats, compiled in (like for like: JAX's kernels take no other; two
    float32 ``[]`` arguments would add 512 B each to the peak HBM on the TPU)."""
    return {} if cache_dtype == "bfloat16" else dict(k_scale=DECODE_SCALE, v_scale=DECODE_SCALE)


@contextlib.contextmanager
def jax_kernels_see(chip_name: str):
    """Let JAX's TPU kernels, lowered off a TPU, ask the *target* chip what they ask the local device.

    JAX 0.10.2 lowers ``jnp.sign`` inside a Pallas TPU kernel by asking the local device for its TPU
    generation (``jax/_src/pallas/mosaic/lowering.py``, ``_sign_lowering_rule`` ->
    ``tpu_info.get_tpu_info()``), and ``ragged_paged_attention``'s tuned block sizes read
    ``jax.devices()[0].device_kind`` (``tuned_block_sizes.get_tpu_version``, ``get_device_name``). On a CPU
    machine both see a CPU. Inside this context they see ``chip_name``'s compile-only device (its
    ``device_kind``; one TensorCore a device, as on v5e and v6e), so the kernel lowers and picks its
    blocks as it would on that chip. Nothing else changes; JAX 0.7.2 (whose ``sign`` asks no device)
    gets only the block-size half."""
    import importlib

    from tpuattn import chips

    try:
        from jax._src.pallas.mosaic import tpu_info
    except ImportError:  # JAX 0.7.2 has no tpu_info (and its sign lowering asks no device)
        tpu_info = None

    kind = topology_device(chips.get(chip_name)).device_kind  # "TPU v5 lite", "TPU v6 lite"
    version = int(kind.split()[1].lstrip("v")) if kind.split()[1] != "7x" else 7
    saved = []

    def patch(module, name, value):
        if hasattr(module, name):
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, value)

    chip_version = getattr(tpu_info, "chip_version_from_device_kind", lambda kind: None)(kind)
    if chip_version is not None and hasattr(tpu_info, "get_tpu_info_for_chip"):
        patch(tpu_info, "get_tpu_info", lambda: tpu_info.get_tpu_info_for_chip(chip_version, 1))
    tuned = importlib.import_module("jax.experimental.pallas.ops.tpu.ragged_paged_attention."
                                    "tuned_block_sizes")
    patch(tuned, "get_tpu_version", lambda: version)
    patch(tuned, "get_device_name", lambda num_devices=None: " ".join(kind.split()[:2]))
    try:
        yield kind
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


def _decode_shape(shape: str) -> dict:
    if shape not in DECODE_ENGINE_SHAPES:
        raise ValueError(f"shape: expected one of {list(DECODE_ENGINE_SHAPES)}, got {shape!r}")
    s = DECODE_ENGINE_SHAPES[shape]
    batch = len(s["q_lens"])
    return dict(s, batch=batch, tokens=sum(s["q_lens"]), pages=batch * s["pages_per_sequence"],
                uniform=len(set(s["q_lens"])) == 1, **DECODE_ENGINE_HEADS)


def _tpuattn_decode_step(shape: dict, cache_dtype: str):
    """``(fn, args)`` of ``tpuattn.decode.attention(impl="pallas")`` at ``shape``, or a string: why the
    contract has no such input (yet)."""
    import inspect

    import jax
    import jax.numpy as jnp

    from tpuattn import decode

    taken = inspect.signature(decode.attention).parameters
    quantized = cache_dtype != "bfloat16"
    if quantized and "k_scale" not in taken:
        return "tpuattn.decode.attention takes no quantized cache (k_scale, v_scale) in this version"
    if not shape["uniform"] and "cu_q_lens" not in taken:
        return "tpuattn.decode.attention takes no ragged batch (cu_q_lens) in this version"
    h, hk, d, b = shape["heads"], shape["kv_heads"], shape["head_dim"], shape["batch"]
    cache = jax.ShapeDtypeStruct((shape["pages"], shape["page"], hk, d), jnp.dtype(cache_dtype))
    lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
    table = jax.ShapeDtypeStruct((b, shape["pages_per_sequence"]), jnp.int32)
    if shape["uniform"]:
        q = jax.ShapeDtypeStruct((b, shape["q_lens"][0], h, d), jnp.bfloat16)
        args = [q, cache, cache, lengths, table]
    else:
        q = jax.ShapeDtypeStruct((shape["tokens"], h, d), jnp.bfloat16)
        args = [q, cache, cache, lengths, table, jax.ShapeDtypeStruct((b + 1,), jnp.int32)]
    scales = _decode_scales(cache_dtype)

    def fn(q, k, v, lengths, table, *rest):
        ragged = dict(cu_q_lens=rest[0]) if not shape["uniform"] else {}
        return decode.attention(q, k, v, lengths, page_table=table, impl="pallas", **ragged, **scales)

    return fn, args


def _jax_ragged_step(shape: dict, cache_dtype: str):
    """``(fn, args)`` of JAX's ``ragged_paged_attention`` at ``shape``, its cache in its own layout."""
    import functools

    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    h, hk, d, b = shape["heads"], shape["kv_heads"], shape["head_dim"], shape["batch"]
    scales = _decode_scales(cache_dtype)
    fn = functools.partial(ragged_paged_attention, sm_scale=d ** -0.5, **scales)
    args = [jax.ShapeDtypeStruct((shape["tokens"], h, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((shape["pages"], shape["page"], 2 * hk, d), jnp.dtype(cache_dtype)),
            jax.ShapeDtypeStruct((b,), jnp.int32),
            jax.ShapeDtypeStruct((b, shape["pages_per_sequence"]), jnp.int32),
            jax.ShapeDtypeStruct((b + 1,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)]
    return fn, args


def _tpu_inference_step(shape: dict, cache_dtype: str, chip_name: str):
    """``(fn, args)`` of tpu-inference's ragged paged attention v3 at ``shape`` (its cache in its own
    layout, ``[pages, page, 2 * kv_heads / packing, packing, head_dim]``, the page table flat, the
    batch's distribution: decodes first, then prefill chunks), attention alone (``update_kv_cache=False``;
    it still takes the new tokens' keys and values), or a string: why it cannot be compiled here."""
    import functools
    import importlib

    import jax
    import jax.numpy as jnp

    from tpuattn import chips

    try:
        kernel = importlib.import_module(TPU_INFERENCE_KERNEL)
        util = importlib.import_module(TPU_INFERENCE_KERNEL.rsplit(".", 1)[0] + ".util")
    except ImportError as error:
        return f"tpu-inference is not installed ({first_error_line(error)})"
    h, hk, d, b = shape["heads"], shape["kv_heads"], shape["head_dim"], shape["batch"]
    dtype = jnp.dtype(cache_dtype)
    kind = topology_device(chips.get(chip_name)).device_kind
    version = int(kind.split()[1].lstrip("v"))
    # Its version check reads jax.devices()[0] (a CPU here): the target's, as jax_kernels_see does for JAX.
    kernel.get_tpu_version = util.get_tpu_version = lambda: version
    scales = _decode_scales(cache_dtype)
    vmem = chips.get(chip_name).vmem_bytes  # its default: the chip's VMEM (pltpu.get_tpu_info())
    fn = functools.partial(kernel.ragged_paged_attention, sm_scale=d ** -0.5, update_kv_cache=False,
                           vmem_limit_bytes=vmem, **scales)
    new = jax.ShapeDtypeStruct((shape["tokens"], hk, d), dtype)
    args = [jax.ShapeDtypeStruct((shape["tokens"], h, d), jnp.bfloat16), new, new,
            jax.ShapeDtypeStruct(kernel.get_kv_cache_shape(shape["pages"], shape["page"], hk, d, dtype),
                                 dtype),
            jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((shape["pages"],), jnp.int32),
            jax.ShapeDtypeStruct((b + 1,), jnp.int32), jax.ShapeDtypeStruct((3,), jnp.int32)]
    return fn, args


def _compile_donating(chip_name: str, fn, args, donate: tuple):
    """:func:`compile_for` with ``donate`` arguments donated (a kernel that aliases its cache to an
    output then updates it in place, as engines run it, instead of copying it)."""
    import jax

    from tpuattn import chips

    sharding = jax.sharding.SingleDeviceSharding(topology_device(chips.get(chip_name)))
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
    with chips.target(chip_name):
        return jax.jit(fn, donate_argnums=donate).lower(*placed).compile()


def _jax_ragged_blocks(shape: dict, cache_dtype: str) -> str:
    """The (kv pages, queries) per block JAX's kernel picks for the target chip (inside
    :func:`jax_kernels_see`)."""
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel, tuned_block_sizes

    h, hk, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
    q_heads, kv_heads = kernel.get_min_heads_per_blk(h, 2 * hk, jnp.bfloat16, jnp.dtype(cache_dtype))
    pages, queries = tuned_block_sizes.get_tuned_block_sizes(
        jnp.bfloat16, jnp.dtype(cache_dtype), q_heads, kv_heads // 2, d, shape["page"], shape["tokens"],
        shape["pages_per_sequence"])
    return f"{pages} pages x {queries} queries"


def decode_engine_row(chip_name: str, engine: str, shape: str, cache_dtype: str) -> dict:
    """Compile one engine's serving step (``engine`` from :data:`DECODE_ENGINES`) at ``shape`` (a key of
    :data:`DECODE_ENGINE_SHAPES`) over a ``cache_dtype`` cache for ``chip_name``: a row of
    :data:`DECODE_ENGINE_COLUMNS`, **compiled (not run)**. ``bytes_accessed`` is XLA's cost analysis,
    which for a Mosaic kernel is the kernel's own ``pl.CostEstimate`` plus the ops around it: JAX's ragged
    kernel gives none, so XLA counts none of its traffic (a few KB of metadata); peak HBM (arguments,
    output and temporaries: ``memory_analysis()``) is what compares the two engines."""
    from tpuattn import chips
    from tpuattn.errors import UnavailableImplementation, UnsupportedInput

    if engine not in DECODE_ENGINES + OPTIONAL_DECODE_ENGINES:
        raise ValueError(f"engine: expected one of {list(DECODE_ENGINES + OPTIONAL_DECODE_ENGINES)}, "
                         f"got {engine!r}")
    if cache_dtype not in DECODE_CACHE_DTYPES:
        raise ValueError(f"cache_dtype: expected one of {list(DECODE_CACHE_DTYPES)}, got {cache_dtype!r}")
    s = _decode_shape(shape)
    chip = chips.get(chip_name)
    row = _decode_engine_base(chip.name, engine, shape, cache_dtype)
    if not chip_known(chip.name):
        return {**row, "status": "unsupported",
                "error": f"chip: the installed TPU compiler ({versions_text()}) does not know {chip.name}"}
    step = (_tpuattn_decode_step(s, cache_dtype) if engine == "tpuattn" else
            _jax_ragged_step(s, cache_dtype) if engine == "jax_ragged" else
            _tpu_inference_step(s, cache_dtype, chip.name))
    if isinstance(step, str):
        return {**row, "status": "unavailable", "error": step}
    fn, args = step
    start = time.perf_counter()
    try:
        with jax_kernels_see(chip.name):
            if engine == "jax_ragged":
                row["blocks"] = _jax_ragged_blocks(s, cache_dtype)
            compiled = (_compile_donating(chip.name, fn, args, (3,)) if engine == "tpu_inference"
                        else compile_for(chip.name, fn, args))
    except (UnsupportedInput, UnavailableImplementation) as error:
        return {**row, "status": "unsupported", "error": str(error)}
    except Exception as error:  # noqa: BLE001 - the compiler's own errors have many types
        return {**row, **compile_failure(error), "compile_s": time.perf_counter() - start}
    row["compile_s"] = time.perf_counter() - start
    facts = compiled_facts(compiled)
    kept = ("bytes_accessed", "peak_hbm_bytes", "argument_bytes", "output_bytes", "temp_bytes")
    row.update(status="ok", error=None, **{key: facts[key] for key in kept})
    return row


def _decode_engine_base(chip_name: str, engine: str, shape: str, cache_dtype: str) -> dict:
    s = _decode_shape(shape)
    jax_version, libtpu_version = _versions()
    row = {key: None for key in DECODE_ENGINE_COLUMNS}
    row.update(chip=chip_name, engine=engine, shape=shape, cache_dtype=cache_dtype, batch=s["batch"],
               tokens=s["tokens"], label=LABEL, jax_version=jax_version, libtpu_version=libtpu_version)
    return row


def decode_engine_row_isolated(chip_name: str, engine: str, shape: str, cache_dtype: str, *,
                               setup: str = "", timeout: float = 900) -> dict:
    """:func:`decode_engine_row` in a child process (``setup``: Python run there first). A failed check
    inside libtpu ends the process that compiles (``abort``); here it gives a ``compile_error`` row
    with the compiler's message instead of ending this one."""
    import os
    import subprocess
    import sys

    code = (f"{setup}\nimport json\nfrom tpuattn.measure import aot\n"
            f"row = aot.decode_engine_row({chip_name!r}, {engine!r}, {shape!r}, {cache_dtype!r})\n"
            "print('ROW' + json.dumps(row, default=str))\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env=env)
    for line in done.stdout.splitlines():
        if line.startswith("ROW"):
            return json.loads(line[3:])
    lines = done.stderr.strip().splitlines() or ["(no message)"]
    fatal = [line for line in lines if "Check failed" in line] or lines[-1:]
    message = re.sub(r"^F\d+ [\d:.]+\s+\d+ ", "", fatal[0]).strip()
    return {**_decode_engine_base(chip_name, engine, shape, cache_dtype), "status": "compile_error",
            "error": f"the compiler aborted (exit status {done.returncode}): {message}"}


def decode_engine_rows(chip_names=("v5e", "v6e"), engines=DECODE_ENGINES, shapes=tuple(DECODE_ENGINE_SHAPES),
                       cache_dtypes=DECODE_CACHE_DTYPES, *, progress: bool = False,
                       setup: str = "") -> list[dict]:
    """Every (chip, shape, cache dtype, engine) row, each compiled in a child process
    (:func:`decode_engine_row_isolated`)."""
    rows = []
    for chip in chip_names:
        for shape in shapes:
            for cache_dtype in cache_dtypes:
                for engine in engines:
                    rows.append(decode_engine_row_isolated(chip, engine, shape, cache_dtype, setup=setup))
                    if progress:
                        r = rows[-1]
                        print(f"{chip} {shape} {cache_dtype} {engine}: {r['status']}", flush=True)
    return rows


def decode_engine_table(rows, model_bytes=None) -> str:
    """The side-by-side table (Markdown): per chip, shape and cache dtype, each engine's compiled bytes
    accessed (XLA's cost analysis), peak HBM, and whether it compiled (its error if not).
    ``model_bytes``: an optional ``{(chip, shape, cache_dtype): bytes}``
    of :mod:`tpuattn.model.decode_roofline` (modelled) for a ratio column (the measuring layer does not import
    the model)."""
    mb = lambda value: "-" if value is None else f"{value / 1e6:.1f}"
    head = ["chip", "shape", "cache", "engine", "status", "bytes accessed MB", "peak HBM MB"]
    head += ["accessed / model"] if model_bytes else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {(r['error'] or '')[:160]}"
        cells = [r["chip"], r["shape"], r["cache_dtype"], r["engine"], status, mb(r["bytes_accessed"]),
                 mb(r["peak_hbm_bytes"])]
        if model_bytes:
            model = model_bytes.get((r["chip"], r["shape"], r["cache_dtype"]))
            # JAX's kernel passes no cost estimate: its bytes accessed are not its traffic
            cells.append("-" if model is None or r["bytes_accessed"] is None or r["engine"] != "tpuattn"
                         else f"{r['bytes_accessed'] / model:.2f}x")
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)
