"""What the TPU compiler made of a Pallas kernel: its Mosaic MLIR and its final VLIW bundles, read statically.

libtpu writes its intermediate programs when asked at load time (the flags are read once, when the
library starts, so the compile runs in a child process)::

    LIBTPU_INIT_ARGS="--xla_jf_dump_to=DIR --xla_jf_dump_llo_text=true
                      --xla_jf_dump_llo_pass_label_regex=final_bundles --xla_mosaic_dump_to=DIR"

``--xla_jf_dump_*`` writes, per compiled computation (each Pallas kernel is one, named after its
kernel function), ``<id>-<name>-01-final_bundles.txt``: one line per VLIW bundle, the instructions
issued together separated by ``;;``, a ``>`` per enclosing loop (the grid is one loop) and ``LB:``
where a loop body starts. ``--xla_mosaic_dump_to`` writes the kernel's MLIR after each Mosaic pass
(``0001-...-original`` to ``0018-...-post-finalize-llo``).

From them, per kernel (:class:`KernelStatic`): the bundles inside the innermost loop (one grid step),
the ``vmatmul`` instructions there, and the ideal count for the matmuls the kernel's MLIR contains
(``tpu.matmul``): one ``vmatmul`` pushes one LHS vector register (8 sublanes of 32 bits: 8 float32 rows,
16 bfloat16 rows) through one MXU-sized weight tile, so an ``M x K @ K x N`` matmul needs at least
``ceil(M / rows) * ceil(K / mxu) * ceil(N / mxu)``. Every count is **compiled (static)**: read from the
program, both sides of every branch counted once (a causal kernel's masked and unmasked paths each
hold their matmuls), nothing run and nothing timed.

``python -m tpuattn.aot --static [--chip v5e] [--seq-len 2048]`` prints the table for the package's
Pallas forward and backward kernels (:func:`package_report`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from tpuattn import chips

LABEL = "compiled (static)"
# Each libtpu flag above, as one string for LIBTPU_INIT_ARGS (``{dir}`` filled in).
FLAGS = ("--xla_jf_dump_to={dir}/llo --xla_jf_dump_llo_text=true "
         "--xla_jf_dump_llo_pass_label_regex=final_bundles --xla_mosaic_dump_to={dir}/mosaic")

_BUNDLE = re.compile(r"^\s*(?:0x[0-9a-f]+|\d+)\s+(?:[A-Z]{2})?:\s*(>*)\s*\{")
_MATMUL = re.compile(r"tpu\.matmul .*?: vector<(\d+)x(\d+)x(\w+)>, vector<[^>]*>, vector<[^>]*> -> "
                     r"vector<(\d+)x(\d+)x\w+>")
_OPCODE = re.compile(r"=\s*(v[a-z0-9]+(?:\.[\w]+)*)")
# The instructions counted as work per element (the vector ALUs) and as the transcendental unit's
# (EUP) pushes; loads, stores, matmul pushes and result pops are neither. Names as libtpu prints them.
VALU_OPS = frozenset({"vadd", "vsub", "vmul", "vmax", "vmin", "vsel", "vcmp", "vand", "vor", "vxor",
                      "vpack", "vcvt", "vweird", "vmand", "vmor"})
EUP_OPS = frozenset({"vpow2", "vpow", "vtanh", "vrcp", "vlog2", "vrsqrt", "vexp", "vsqrt", "vsigmoid"})
_CHILD = """
import os, sys
os.environ.setdefault("JAX_PLATFORMS", "cpu")
namespace = {}
exec(compile(sys.stdin.read(), "<static kernel>", "exec"), namespace)
from tpuattn.measure import aot
aot.compile_for(sys.argv[1], namespace["FN"], namespace["ARGS"])
"""


class DumpFailed(RuntimeError):
    """The child compile failed or libtpu wrote no dump (the flags misbehaved); the message says which."""


@dataclasses.dataclass(frozen=True)
class KernelStatic:
    """One compiled kernel's static facts (all ``compiled (static)``)."""

    name: str
    bundles: int               # every bundle of the kernel's program
    loop_depth: int            # how many loops enclose the innermost bundles (the grid is one)
    loop_bundles: int          # bundles at that depth: one trip of the innermost loop
    vmatmul: int               # vmatmul instructions inside the loop (every branch)
    valu: int                  # vector-ALU arithmetic inside the loop (vadd, vsub, vmul, vmax, vsel, ...)
    eup: int                   # pushes to the transcendental unit inside the loop (vpow2, vtanh, vrcp, ...)
    eup_per_bundle: int        # the most EUP pushes in one bundle of the loop (chips.EUP_PUSHES_PER_CYCLE)
    matmuls: tuple             # (M, K, N, lhs dtype) of each tpu.matmul in the kernel's MLIR
    ideal_vmatmul: int | None  # the fewest vmatmuls those matmuls need on this chip's MXU
    label: str = LABEL


def dump(code: str, chip: str = "v5e", out_dir: str | os.PathLike | None = None, *,
         timeout: float = 300) -> Path:
    """Compile, in a child process with libtpu's dump flags, the program ``code`` describes.

    ``code`` is Python source that defines ``FN`` (the function) and ``ARGS`` (its
    ``jax.ShapeDtypeStruct`` arguments); the child compiles them for ``chip`` with
    :func:`tpuattn.measure.aot.compile_for`. Returns the dump folder (``llo/`` and ``mosaic/``; a new
    temporary folder, the caller's to delete, when ``out_dir`` is None).
    Raises :class:`DumpFailed` with the child's last error lines when the compile fails or writes nothing.
    """
    if not isinstance(code, str) or "FN" not in code or "ARGS" not in code:
        raise ValueError(f"code: expected Python source defining FN and ARGS, got {code!r:.80}")
    out = Path(tempfile.mkdtemp(prefix="tpuattn_static_") if out_dir is None else out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1",
               LIBTPU_INIT_ARGS=FLAGS.format(dir=out))
    done = subprocess.run([sys.executable, "-c", _CHILD, chip], input=code, env=env, text=True,
                          capture_output=True, timeout=timeout)
    if done.returncode != 0:
        tail = [line for line in done.stderr.splitlines() if line.strip()][-6:]
        raise DumpFailed(f"the child compile for {chip} failed (exit {done.returncode}):\n" + "\n".join(tail))
    if not list((out / "llo").glob("*final_bundles.txt")):
        raise DumpFailed(f"libtpu wrote no final bundles under {out / 'llo'}: the dump flags "
                         f"({FLAGS.format(dir=out)}) were not honoured by this libtpu")
    return out


def _body_names(text: str) -> set[bytes]:
    """The words in the serialized Mosaic kernels a schedule-analysis file embeds (base64 bytecode)."""
    import base64

    words = set()
    for body in re.findall(r'"body":\s*"([A-Za-z0-9+/=]+)"', text):
        words |= set(re.findall(rb"[A-Za-z_][A-Za-z0-9_]*", base64.b64decode(body)))
    return words


def bundle_file(out: str | os.PathLike, kernel: str) -> Path:
    """The final-bundles file of the Pallas kernel named ``kernel`` (``tpuattn_flash_forward``).

    libtpu names each file after its HLO instruction (``tpuattn_flash_forward.1`` with JAX 0.10.2's
    libtpu, ``jvp__.1`` with 0.7.2's), so the file is found by the kernel name inside the serialized
    kernel its schedule analysis embeds."""
    for analysis in sorted(Path(out, "llo").glob("*-00-schedule-analysis_final_bundles.txt")):
        if "-TLP-" in analysis.name:  # the whole program: it embeds every kernel
            continue
        if kernel.encode() in _body_names(analysis.read_text()):
            return analysis.with_name(analysis.name.replace("-00-schedule-analysis_final_bundles",
                                                            "-01-final_bundles"))
    raise ValueError(f"kernel: expected one of the dumped kernels {kernel_names(out)}, got {kernel!r}")


def _mosaic_name(path: Path) -> str | None:
    match = re.search(r"-mosaic-dump-(\w+?)-(?:original|post-[\w-]+)\.txt$", path.name)
    return match.group(1) if match and match.group(1) != "anonymous" else None


def mosaic_file(out: str | os.PathLike, kernel: str, stage: str = "original") -> Path:
    """The Mosaic MLIR of ``kernel`` after pass ``stage`` (``original``, ``post-apply-vector-layout``,
    ``post-finalize-llo``, ...): named in the file name (JAX 0.7.2's libtpu) or as the function (0.10.2's)."""
    for path in sorted(Path(out, "mosaic").glob(f"*-mosaic-dump-*-{stage}.txt")):
        if _mosaic_name(path) == kernel or re.search(rf"func\.func @{re.escape(kernel)}\(", path.read_text()):
            return path
    raise ValueError(f"kernel: no Mosaic dump at stage {stage!r} of {kernel!r} under {out}")


def kernel_names(out: str | os.PathLike) -> list[str]:
    """The Pallas kernels a dump holds, by name (the dump's file names carry ids that differ between
    runs, so their order is not the compile order), but the package's probe of the compiler
    (``compat.PROBE_KERNEL_NAME``, compiled once per process before the first compile-only program)."""
    from tpuattn.pallas.compat import PROBE_KERNEL_NAME  # the package's own question to the compiler

    names = []
    for path in sorted(Path(out, "mosaic").glob("*-original.txt")):
        named = _mosaic_name(path)
        names += [named] if named else [n for n in re.findall(r"func\.func @(\w+)\(", path.read_text())
                                        if not n.startswith("transform_")]
    return sorted(set(names) - {PROBE_KERNEL_NAME})


def read_bundles(path: str | os.PathLike) -> dict:
    """Count a final-bundles file: every bundle, the innermost loop's depth and bundles, the
    ``vmatmul`` instructions inside loops, and in the innermost loop the vector-ALU arithmetic and
    the transcendental unit's pushes (:data:`VALU_OPS`, :data:`EUP_OPS`), in all and the most in a bundle."""
    depths, vmatmul, mnemonics = [], 0, []
    for line in Path(path).read_text().splitlines():
        match = _BUNDLE.match(line)
        if not match:
            continue
        depth = len(match.group(1))
        depths.append(depth)
        if depth:
            vmatmul += len(re.findall(r"= vmatmul[.\s]", line))
            mnemonics.append((depth, _OPCODE.findall(line)))
    deepest = max(depths, default=0)
    inner = [[op.split(".")[0] for op in ops] for depth, ops in mnemonics if depth == deepest]
    eup = [sum(op in EUP_OPS for op in ops) for ops in inner]
    return dict(bundles=len(depths), loop_depth=deepest,
                loop_bundles=sum(d == deepest for d in depths) if deepest else 0, vmatmul=vmatmul,
                valu=sum(op in VALU_OPS for ops in inner for op in ops), eup=sum(eup),
                eup_per_bundle=max(eup, default=0))


def matmuls(mlir: str) -> tuple:
    """``(M, K, N, lhs dtype)`` of every ``tpu.matmul`` in a Mosaic MLIR text."""
    found = []
    for m_rows, k_cols, dtype, out_rows, n_cols in _MATMUL.findall(mlir):
        found.append((int(m_rows), int(k_cols), int(n_cols), dtype))
        assert int(out_rows) == int(m_rows)
    return tuple(found)


def ideal_vmatmul(shapes, chip: str = "v5e") -> int:
    """The fewest ``vmatmul`` instructions for these matmuls: one per LHS vector register (8 sublanes of
    32-bit words: 8 float32 or 16 bfloat16 rows) per MXU-sized weight tile."""
    if chip not in chips.CHIPS:
        raise ValueError(f"chip: expected one of {sorted(chips.CHIPS)}, got {chip!r}")
    mxu = chips.CHIPS[chip].mxu_size  # the MXU's side: 128 through v5p, 256 from v6e
    total = 0
    for m_rows, k_cols, n_cols, dtype in shapes:
        bits = int(re.sub(r"\D", "", dtype) or 32)
        rows = 8 * max(1, 32 // bits)
        total += math.ceil(m_rows / rows) * math.ceil(k_cols / mxu) * math.ceil(n_cols / mxu)
    return total


def kernel_static(out: str | os.PathLike, kernel: str, chip: str = "v5e") -> KernelStatic:
    """One kernel of a dump, read: its bundles, loop, vmatmuls and their ideal."""
    counts = read_bundles(bundle_file(out, kernel))
    shapes = matmuls(mosaic_file(out, kernel).read_text())
    return KernelStatic(name=kernel, matmuls=shapes,
                        ideal_vmatmul=ideal_vmatmul(shapes, chip) if shapes else None, **counts)


def report(code: str, chip: str = "v5e", out_dir=None) -> list[KernelStatic]:
    """Every Pallas kernel of the program ``code`` describes (see :func:`dump`), compiled and read (the
    dump is kept in ``out_dir`` if given, else deleted)."""
    with tempfile.TemporaryDirectory(prefix="tpuattn_static_") as scratch:
        out = dump(code, chip, scratch if out_dir is None else out_dir)
        return [kernel_static(out, name, chip) for name in kernel_names(out)]


PACKAGE_CODE = """
import jax, jax.numpy as jnp
import tpuattn
def attend(q, k, v):
    return tpuattn.attention(q, k, v, causal={causal}, softcap={softcap}, impl="pallas")
def FN(q, k, v):
    loss = lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum()
    return {fn}
ARGS = [jax.ShapeDtypeStruct((1, {seq_len}, {heads}, {head_dim}), jnp.{dtype})] * 3
"""


def package_code(mode: str = "fwd+bwd", seq_len: int = 2048, heads: int = 2, head_dim: int = 128,
                 dtype: str = "bfloat16", causal: bool = True, softcap: float | None = None) -> str:
    """The child's source for ``attention(impl="pallas")`` (``fwd``: the forward kernel; ``fwd+bwd``:
    the forward and the backward's row-sum, dQ and dK/dV kernels)."""
    if mode not in ("fwd", "fwd+bwd"):
        raise ValueError(f"mode: expected 'fwd' or 'fwd+bwd', got {mode!r}")
    fn = "attend(q, k, v)" if mode == "fwd" else "jax.grad(loss, argnums=(0, 1, 2))(q, k, v)"
    return PACKAGE_CODE.format(causal=bool(causal), fn=fn, seq_len=int(seq_len), heads=int(heads),
                               head_dim=int(head_dim), dtype=dtype,
                               softcap=None if softcap is None else float(softcap))


def package_report(chip: str = "v5e", **problem) -> list[KernelStatic]:
    """The package's Pallas forward and backward kernels (:func:`package_code`), compiled and read."""
    return report(package_code("fwd+bwd", **problem), chip)


def table(rows: list[KernelStatic], chip: str = "v5e") -> str:
    """The rows as text, labelled."""
    lines = [f"{LABEL}, {chip}: per kernel, one grid step (the innermost loop), every branch counted",
             f"{'kernel':<26}{'bundles':>9}{'loop bundles':>14}{'matmuls':>9}{'vmatmul':>9}{'ideal':>7}"
             f"{'valu':>7}{'eup':>6}"]
    for row in rows:
        lines.append(f"{row.name:<26}{row.bundles:>9}{row.loop_bundles:>14}{len(row.matmuls):>9}"
                     f"{row.vmatmul:>9}{row.ideal_vmatmul if row.ideal_vmatmul is not None else '-':>7}"
                     f"{row.valu:>7}{row.eup:>6}")
    return "\n".join(lines)


def main(argv=None) -> list[KernelStatic]:
    """``python -m tpuattn.aot --static``: the package's kernels, compiled for one chip and read."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tpuattn.aot --static",
                                     description="Bundles and vmatmuls of the package's Pallas kernels, "
                                                 "compiled for a TPU (static: nothing runs).")
    parser.add_argument("--static", action="store_true")
    parser.add_argument("--chip", default="v5e")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--softcap", type=float, default=None)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        rows = package_report(args.chip, seq_len=args.seq_len, heads=args.heads, head_dim=args.head_dim,
                              dtype=args.dtype, softcap=args.softcap)
    except DumpFailed as error:
        print(f"no static report: {error}", file=sys.stderr)
        raise SystemExit(2) from error
    print(table(rows, args.chip))
    return rows
