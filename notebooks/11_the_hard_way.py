# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 11 · The hard way: what the TPU compiler refuses, and what it makes
#
# A. Zhang's write-up "Forcing Flash Attention onto a TPU and Learning the Hard Way" (2026,
# https://archerzhang.me/forcing-flash-attention-onto-a-tpu) tried to force a GPU flash-attention
# kernel onto a Colab TPU v5e and learned the hard way: its own Pallas kernel never worked, broken
# by block-shape rules, memory limits and JAX upgrades. Every one of those failures can be met on
# purpose, without a TPU, because the real TPU compiler (libtpu) compiles for a chip it does not
# have. This notebook answers: **what does each refusal say, line by line, and once a kernel
# compiles, what did the compiler make of it?**
#
# **What you'll do**
# - meet each failure with a kernel of a few lines, compiled for real chips (compiled, not run): the
#   (8, 128) tile rule and bfloat16's packed tiles, bfloat16 matmuls on v2 and v3, scoped VMEM and
#   `vmem_limit_bytes`, SMEM filled by a scalar-prefetch table, HBM out of memory, a kernel that lowers
#   but does not compile, interpret mode passing where the compiler refuses, and a JAX upgrade break;
# - read a kernel's Mosaic MLIR after its passes and its final VLIW bundles, and count its `vmatmul`
#   instructions per grid step against the ideal (compiled, static);
# - see how a real TPU run is profiled (`jax.profiler`, XProf), with a CPU trace as the mechanism.
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/tpuattn/tpuattn/blob/main/notebooks/11_the_hard_way.ipynb)

# %%
# On Colab, install the package at the version this notebook belongs to (main); elsewhere this does
# nothing. Colab's image has everything else the notebooks import, at versions the package supports,
# so pip adds the package alone. (Written by ci/install_cell.py from pyproject.toml.)
import subprocess
import sys

TPUATTN = "tpuattn @ git+https://github.com/tpuattn/tpuattn@main"
if "google.colab" in sys.modules:
    result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", TPUATTN],
                            capture_output=True, text=True)
    print(result.stdout + result.stderr)  # pip's own messages, its errors included
    if result.returncode != 0:
        raise RuntimeError(
            f"pip could not install {TPUATTN!r} (exit {result.returncode}; its messages are above). "
            "If github.com is not reachable from this runtime, build a wheel from a clone elsewhere "
            "(python -m pip wheel --no-deps .), upload it to the runtime and pip install it.")

# %% tags=["nbval-ignore-output"]
import inspect
import os
import re
import tempfile
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import tpuattn
from tpuattn import chips
from tpuattn.exercises import NotCheckable, run_checks
from tpuattn.measure import aot, runtime, static
from tpuattn.pallas import compat

PLATFORM = runtime.info()
print(PLATFORM.summary())
print("TPU compiler:", aot.versions_text() if aot.tpu_available() else "not installed")

# %% tags=["parameters"]
CHIP = "v5e"  # the chip most sections compile for (compiled, not run)
RUN_STATIC = True  # section 9: dump and read the compiler's output (child processes, about 20 s)
# The hidden solution cells run only when this is True, so Run All shows your own results alone.
# The project's CI sets it (TPUATTN_RUN_SOLUTIONS=1): the committed outputs include the solutions'.
RUN_SOLUTIONS = os.environ.get("TPUATTN_RUN_SOLUTIONS") == "1"

# %%
COMPILER = aot.tpu_available()  # the compile-only TPU topologies come with libtpu
if not COMPILER:
    print('The TPU compiler is not installed: pip install "jax[tpu]" to see its messages here.')
S = jax.ShapeDtypeStruct


def compile_error(chip, fn, args):
    """Compile ``fn`` for ``chip``; return the compiler's error, or None when it compiles."""
    try:
        aot.compile_for(chip, fn, args)
    except Exception as error:  # noqa: BLE001 - JAX's error types differ by version: keep them all
        return error
    return None


def read(error, lines=6):
    """Print an error's message line by line (paths to this notebook's cells and frame ids shortened)."""
    if error is None:
        print("compiles")
        return
    text = re.sub(r"\b(at |source_file=\")(/[^\s\"]+|<[^>\s]+>)", r"\1<cell>", str(error))
    text = re.sub(r"stack_frame_id=\d+", "stack_frame_id=N", text)  # differs from run to run
    kept = [line.rstrip() for line in text.splitlines() if line.strip()][:lines]
    print(f"{type(error).__name__}:")
    for number, line in enumerate(kept, 1):  # each line wrapped, at most 4 rows of it
        rows = textwrap.wrap(line, 100)
        print(f"  {number}| " + "\n   | ".join(rows[:4]) + (" ..." if len(rows) > 4 else ""))


# %% [markdown]
# ## 1 · The tile rule: blocks of (8, 128), and bfloat16's packed tiles
#
# A TPU core computes on vector registers of 8 **sublanes** by 128 **lanes** of 32-bit words, and
# keeps 2-D arrays in memory as tiles of that shape. Pallas's TPU lowering asks the same of every
# block, whatever its dtype: its last two dimensions must be multiples of 8 and 128, or the array's
# whole dimensions. A copy kernel is enough to meet the rule:

# %%
def double_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2


def double(block, shape, dtype, compiler_params=None, interpret=False):
    """``2 * x`` over a 2-D grid of ``block`` s (the smallest kernel that moves blocks)."""
    index = lambda i, j: (i, j)
    return lambda x: pl.pallas_call(
        double_kernel, grid=(shape[0] // block[0], shape[1] // block[1]),
        in_specs=[pl.BlockSpec(block, index)], out_specs=pl.BlockSpec(block, index),
        out_shape=S(shape, dtype), compiler_params=compiler_params, interpret=interpret)(x)


if COMPILER:
    for block in ((8, 128), (4, 128), (8, 64)):
        print(f"float32 block {block} of a (64, 256) array, {CHIP}:", end=" ")
        read(compile_error(CHIP, double(block, (64, 256), jnp.float32), [S((64, 256), jnp.float32)]),
             lines=1)

# %% [markdown]
# Read the refusal line by line:
#
# 1. *"The Pallas TPU lowering currently requires that the last two dimensions of your block shape
#    are divisible by 8 and 128 respectively, or be equal to the respective dimensions of the
#    overall array."* It comes from **JAX's Pallas lowering** (Python, before libtpu sees anything):
#    a `ValueError`, raised while the kernel is lowered.
# 2. *"Block spec for args[0] ... has block shape (Blocked(block_size=4), Blocked(block_size=128)),
#    array shape (64, 256)"*: which operand (`args[0]`: the first input), the block it was given and
#    the array it tiles. The fix is in the sublane dimension: 8 rows (or 16, 32, ...), never "make it
#    128"; 128 is the lane dimension's rule.
#
# bfloat16 packs two values into each 32-bit word, so its tiles hold twice as many rows. The
# compiled program says so in its layouts: `T(8,128)` is a tile of 8 x 128 words, `(2,1)` a second
# level that packs 2 consecutive rows into each word.

# %%
if COMPILER:
    for dtype in (jnp.float32, jnp.bfloat16):
        compiled = aot.compile_for(CHIP, double((32, 128), (64, 256), dtype), [S((64, 256), dtype)])
        layout = re.search(r"\w+\[64,256\]\{1,0:(T[^}]*)\}", compiled.as_text()).group(1)
        print(f"{jnp.dtype(dtype).name:>9} (64, 256): layout {layout}")
    print(f"bfloat16 block (8, 128), {CHIP}:", end=" ")
    read(compile_error(CHIP, double((8, 128), (64, 256), jnp.bfloat16), [S((64, 256), jnp.bfloat16)]))

# %% [markdown]
# So a bfloat16 tile holds (16, 128) values, but the block rule stays (8, 128): the bfloat16 block of
# 8 rows above compiles, and covers half of a tile; a block of 16 bfloat16 rows (or a multiple)
# covers whole tiles.
#
# ## 2 · bfloat16 matmuls on v2 and v3
#
# The MXU of TPU v2 and v3 multiplies bfloat16, but Mosaic's matmul on those targets does not take
# bfloat16 operands. The same kernel compiles for v5e, and for v2 and v3 in float32 only:

# %%
def matmul_kernel(a_ref, b_ref, o_ref):
    o_ref[...] = jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)


def matmul(n, interpret=False):
    return lambda a, b: pl.pallas_call(matmul_kernel, out_shape=S((n, n), jnp.float32),
                                       interpret=interpret)(a, b)


if COMPILER:
    for chip, dtype in (("v5e", jnp.bfloat16), ("v2", jnp.float32), ("v2", jnp.bfloat16),
                        ("v3", jnp.float32), ("v3", jnp.bfloat16)):
        if not aot.chip_known(chip):
            print(f"{chip}: not known to this TPU compiler")
            continue
        print(f"{chip} {jnp.dtype(dtype).name} matmul:", end=" ")
        read(compile_error(chip, matmul(128), [S((128, 128), dtype)] * 2), lines=4)

# %% [markdown]
# 1. *"INTERNAL: Mosaic failed to compile TPU kernel"*: this time the refusal comes from **Mosaic**,
#    the kernel compiler inside libtpu, after JAX's lowering accepted the kernel (section 6 shows the
#    two stages apart). JAX 0.10.2's libtpu adds a code, *"E2001: CompileTimeMosaicUnsupportedRhsType"*,
#    and a link to its page; JAX 0.7.2's libtpu gives the same sentence without the code.
# 2. *"Unsupported matmul RHS type on target: vector<128x128xbf16>"*: the operation is the
#    right-hand side of a matmul, a 128 x 128 bfloat16 vector value, and *target* is the chip.
# 3. *"The MLIR operation involved: ... tpu.matmul"*: the line of Mosaic's own program that failed,
#    with its operand types: the place to look when the kernel has many `jnp.dot`s.
#
# The v3 refusal is the same message. The fix on v2 and v3 is float32 operands (`a.astype(jnp.float32)`),
# the float32 lines above.
#
# ## 3 · Scoped VMEM, and `vmem_limit_bytes`
#
# A Pallas kernel's blocks live in VMEM, double-buffered: while step `i` computes, the block of step
# `i + 1` is being copied in and the output of step `i - 1` copied out. The compiler gives a kernel a
# **scoped** share of VMEM, smaller than the chip's VMEM, unless the kernel asks for more with
# `pltpu.CompilerParams(vmem_limit_bytes=...)`. A float32 block of 4096 x 1024 is 16 MiB; in and out,
# twice each:

# %%
BIG_BLOCK, BIG_ARRAY = (4096, 1024), (8192, 1024)
SIZES = re.compile(r"Scoped allocation with size \S+ and limit \S+ exceeded scoped vmem limit by \S+")
if COMPILER:
    for limit in (None, 100 * 2**20):
        print(f"vmem_limit_bytes={limit}:", end=" ")
        params = pltpu.CompilerParams(vmem_limit_bytes=limit)
        error = compile_error(CHIP, double(BIG_BLOCK, BIG_ARRAY, jnp.float32, params),
                              [S(BIG_ARRAY, jnp.float32)])
        read(error, lines=3)
        if error is not None:
            sizes = SIZES.search(str(error))
            print("  the sizes:", sizes.group(0) if sizes else "(none in this message)")
    print("the VMEM model: 2 buffers x (in + out) x", 4096 * 1024 * 4 // 2**20, "MiB =",
          2 * 2 * 4096 * 1024 * 4 // 2**20, "MiB")

# %% [markdown]
# 1. *"RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom"* (the code with JAX 0.10.2's libtpu):
#    out of memory at compile time, in scoped VMEM.
# 2. *"Ran out of memory in memory space vmem while allocating on stack for %_lambda_.1 =
#    f32[8192,1024]... custom-call"*: the kernel is one custom call in XLA's program
#    (`tpu_custom_call`); `%_lambda_.1` is its name there (named after the Python function).
# 3. *"Scoped allocation with size 64.00M and limit 16.00M exceeded scoped vmem limit by 48.00M"*:
#    the limit is the compiler's default scoped share on v5e; with JAX 0.10.2's compiler the size is
#    the model's 64 MiB (four buffers of 16 MiB). JAX 0.7.2's compiler reports *"size 32.00M"* for the
#    same kernel: one allocation of two, the one that did not fit. The size in the message is an
#    allocation, not always the kernel's total. Raising `vmem_limit_bytes` to 100 MiB (under v5e's
#    128 MiB of VMEM) compiles the same kernel with both.
#
# ## 4 · SMEM: a scalar-prefetch table that does not fit
#
# Scalar prefetch hands the kernel small integer tables (a block schedule, page tables) in **SMEM**,
# the scalar core's memory: 1 MiB on v5e. A table indexed by the grid grows with the problem;
# 262,144 int32 entries are exactly 1 MiB, with nothing left for the compiler's own scalars:

# %%
def gather_rows_kernel(table_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...]  # the table chose which block of x this step reads


def gather_rows(table_len):
    def fn(table, x):
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(8,),
            in_specs=[pl.BlockSpec((8, 128), lambda i, table: (table[i], 0))],
            out_specs=pl.BlockSpec((8, 128), lambda i, table: (i, 0)))
        return pl.pallas_call(gather_rows_kernel, grid_spec=grid_spec, out_shape=S((64, 128), jnp.float32))(
            table, x)
    return fn, [S((table_len,), jnp.int32), S((64, 128), jnp.float32)]


if COMPILER:
    for table_len in (1024, 2**18):
        print(f"table of {table_len} int32 ({table_len * 4 // 1024} KiB):", end=" ")
        error = compile_error(CHIP, *gather_rows(table_len))
        read(error, lines=1)
        if error is not None:  # the message goes on with the largest allocations: size, then what
            allocations = re.findall(r"Size: (\S+)\n(?:.*\n)*?\s+(?:Tag|XLA label): ([^\n]+)", str(error))
            for size, what in allocations:
                print(f"  allocation {size}: {what[:70]}")

# %% [markdown]
# 1. *"RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space smem."*
#    It is XLA's buffer assignment this time, not Mosaic: SMEM is allocated for the whole program.
# 2. *"Used 1.00M of 1.00M smem. Exceeded smem capacity by 1.1K."*: the table took all of it; the
#    next lines of the full message list the largest allocations (printed above, size first): the
#    table (*"Tag: prefetched SMEM operand 0"*), then the register allocator's spill slots.
#
# A block schedule kept in such tables gives a kernel a longest sequence per call: the tables must be
# chunked, compressed, or computed in the index map. The package's Pallas kernels compute theirs from
# the block indices wherever positions alone decide what a query sees (`tpuattn.pallas.plan`'s
# `IntervalRule`, notebook 03), so nothing in SMEM grows with the length; only with segment ids, where
# the data decide, do they prefetch tables, and only there does this limit remain.
#
# ## 5 · HBM out of memory
#
# The compiler checks the whole program against the chip's HBM before anything runs: 16 GiB in and
# 16 GiB out does not fit a 16 GiB v5e.

# %%
if COMPILER:
    read(compile_error(CHIP, lambda x: jnp.exp(x) + 1, [S((2**32,), jnp.float32)]), lines=1)

# %% [markdown]
# 1. *"RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries
#    (32.00G) exceeds available HBM (15.75G)."* (JAX 0.10.2's compiler; 0.7.2's says *"Ran out of
#    memory in memory space hbm. Used 16.00G of 15.75G hbm"*): the program's buffers against the HBM
#    the compiler may use, a little under the chip's 16 GiB. The package's reports call this
#    `out_of_memory`, a fact about the problem size, not a bug in the code.
#
# ## 6 · A kernel that lowers but does not compile
#
# `jax.jit(f).lower(...)` runs JAX's part: tracing, the Pallas lowering (section 1's checks) and the
# kernel serialised as Mosaic MLIR inside a `tpu_custom_call`. `.compile()` runs libtpu's part: Mosaic
# and XLA:TPU (sections 2-5). A kernel can pass the first and fail the second:

# %%
if COMPILER and aot.chip_known("v2"):
    device = aot.topology_device(chips.get("v2"))
    placed = [S((128, 128), jnp.bfloat16, sharding=jax.sharding.SingleDeviceSharding(device))] * 2
    with chips.target("v2"):
        lowered = jax.jit(matmul(128)).lower(*placed)
        print("lowered:", "tpu_custom_call" in lowered.as_text(), "(a tpu_custom_call in the program)")
        try:
            lowered.compile()
            print("compiled")
        except Exception as error:  # noqa: BLE001
            read(error, lines=1)

# %% [markdown]
# Section 3's VMEM overflow is the same kind: it lowers, then the compiler sizes its buffers and
# refuses.
# A test that only lowers (or only runs in interpret mode) proves nothing about the compile.
#
# ## 7 · Interpret mode passes where the compiler refuses
#
# `interpret=True` runs the kernel body with ordinary JAX operations on the CPU: the right values,
# with none of the hardware's rules. Both refused kernels above give the right answer there:

# %%
x = np.arange(64 * 256, dtype=np.float32).reshape(64, 256)
np.testing.assert_array_equal(double((4, 128), x.shape, jnp.float32, interpret=True)(x), 2 * x)
print("(4, 128) blocks in interpret mode: correct (the compiler refuses them, section 1)")
a = jnp.asarray(np.random.default_rng(0).standard_normal((128, 128)), jnp.bfloat16)
got = matmul(128, interpret=True)(a, a)
want = np.asarray(a, np.float64) @ np.asarray(a, np.float64)
np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)  # bf16 products are exact in float32
print("bfloat16 matmul in interpret mode: correct (Mosaic refuses it for v2, section 2)")

# %% [markdown]
# > **Takeaway.** Three gates, three kinds of message: JAX's Pallas lowering (`ValueError`: block
# > shapes, unsupported primitives), Mosaic's kernel compile inside libtpu (`INTERNAL: Mosaic failed
# > to compile TPU kernel`, `E2xxx` on JAX 0.10.2: what the chip's vector units support), and XLA:TPU
# > allocating the program's memory (`RESOURCE_EXHAUSTED`: a kernel's scoped VMEM, `E1001`, allocated
# > for its custom call; SMEM; HBM). Interpret mode checks none of them; only a compile for the chip
# > does, and a compile needs no TPU.
#
# ## 8 · A JAX upgrade break, and where the package contains it
#
# Code written for Colab's JAX 0.7.2 that types a kernel's output inside a `shard_map` spells it
# `jax.ShapeDtypeStruct(shape, dtype, vma=...)`; JAX 0.8 renamed the field. Run here, on this JAX:

# %%
print("JAX", jax.__version__)
for spelling in ("vma", "manual_axis_type"):
    try:
        jax.ShapeDtypeStruct((8, 128), jnp.float32, **{spelling: frozenset()})
        print(f"{spelling}=: accepted")
    except TypeError as error:
        print(f"{spelling}=: TypeError: {error}")

# %% [markdown]
# On JAX 0.10.2, `vma=` is refused: *"ShapeDtypeStruct.__init__() got an unexpected keyword argument
# 'vma'"* (and `manual_axis_type=` wants a `jax.sharding.ManualAxisType`, not a set). On JAX 0.7.2
# it is the other way round: `vma=` is accepted and `manual_axis_type=` is *"an unexpected keyword
# argument"* (both checked with the two JAX versions this notebook runs on in CI).
#
# The package keeps every such difference in one module, `tpuattn.pallas.compat`, which asks the
# running JAX what it has instead of comparing version numbers; the kernels call `compat.out_struct`
# and never spell the field:

# %%
print(inspect.getsource(compat.out_struct))
print(compat.out_struct((8, 128), jnp.float32, jnp.zeros((8, 128))))

# %% [markdown]
# ## 9 · What the compiler made: Mosaic MLIR and the final VLIW bundles
#
# libtpu writes its intermediate programs when flags ask for them. The flags are read when libtpu
# loads, once per process, so `tpuattn.measure.static` compiles in a child process with
#
# ```
# LIBTPU_INIT_ARGS="--xla_jf_dump_to=DIR --xla_jf_dump_llo_text=true
#                   --xla_jf_dump_llo_pass_label_regex=final_bundles --xla_mosaic_dump_to=DIR"
# ALLOW_MULTIPLE_LIBTPU_LOAD=1   # this notebook's process holds libtpu already
# ```
#
# The lesson kernel is one step of flash attention's forward: a 128-row block of queries against a
# 128-row block of keys, the online softmax kept in VMEM scratch across the key blocks.

# %%
BLOCK, HEAD_DIM, SEQ = 128, 128, 512


def lesson_kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    s = jax.lax.dot_general(q_ref[...], k_ref[...], (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)  # [BLOCK, BLOCK] scores (scale in q)
    m_new = jnp.maximum(m_ref[...], s.max(axis=1, keepdims=True))
    p = jnp.exp(s - m_new)
    correction = jnp.exp(m_ref[...] - m_new)
    l_ref[...] = correction * l_ref[...] + p.sum(axis=1, keepdims=True)
    acc_ref[...] = correction * acc_ref[...] + jnp.dot(p.astype(v_ref.dtype), v_ref[...],
                                                       preferred_element_type=jnp.float32)
    m_ref[...] = m_new

    @pl.when(j == pl.num_programs(1) - 1)
    def _write():
        o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)


def lesson(q, k, v, interpret=False):
    """softmax(q k^T) v for one head, ``[SEQ, HEAD_DIM]`` each, in (BLOCK x BLOCK) tiles."""
    rows = pl.BlockSpec((BLOCK, HEAD_DIM), lambda i, j: (i, 0))
    keys = pl.BlockSpec((BLOCK, HEAD_DIM), lambda i, j: (j, 0))
    return pl.pallas_call(
        lesson_kernel, grid=(q.shape[0] // BLOCK, k.shape[0] // BLOCK),
        in_specs=[rows, keys, keys], out_specs=rows, out_shape=S(q.shape, q.dtype),
        scratch_shapes=[pltpu.VMEM((BLOCK, 1), jnp.float32), pltpu.VMEM((BLOCK, 1), jnp.float32),
                        pltpu.VMEM((BLOCK, HEAD_DIM), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret)(q, k, v)


rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((SEQ, HEAD_DIM)) * 0.3, jnp.bfloat16) for _ in range(3))
got = lesson(q, k, v, interpret=True)
want = tpuattn.attention(q[None, :, None], k[None, :, None], v[None, :, None], scale=1.0,
                         impl="reference")[0, :, 0]
np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)
print("lesson kernel (interpret mode) matches the reference within bfloat16's rounding (2e-2)")

# %% [markdown]
# The tolerance is bfloat16's: the output is rounded to 8 significant bits and `p` is rounded to
# bfloat16 before its matmul, as on the chip. Now the same kernel, compiled for v5e in a child process
# with the dump flags; the child runs the source of the two functions above:

# %%
LESSON_CODE = "\n".join([
    "import jax, jax.numpy as jnp",
    "from jax.experimental import pallas as pl",
    "from jax.experimental.pallas import tpu as pltpu",
    f"S = jax.ShapeDtypeStruct\nBLOCK, HEAD_DIM, SEQ = {BLOCK}, {HEAD_DIM}, {SEQ}",
    inspect.getsource(lesson_kernel), inspect.getsource(lesson),
    "FN = lesson\nARGS = [S((SEQ, HEAD_DIM), jnp.bfloat16)] * 3"])
DUMP = None
if COMPILER and RUN_STATIC:
    DUMP = Path(tempfile.mkdtemp(prefix="tpuattn_11_"))
    try:
        static.dump(LESSON_CODE, CHIP, DUMP)
    except static.DumpFailed as failure:  # say so, never invent numbers
        print("no dump:", failure)
        DUMP = None
if DUMP:
    run_id = static.mosaic_file(DUMP, "lesson_kernel", "original").name.split("-")[0]
    stages = [re.sub(r"^\d+-\d+-mosaic-dump-\w+?-|\.txt$", "", p.name)
              for p in sorted((DUMP / "mosaic").glob(f"{run_id}-*"))]
    print(f"Mosaic wrote the kernel after each of {len(stages)} stages:", ", ".join(stages))

# %% [markdown]
# Mosaic's program after its first stage (`original`: what JAX's lowering handed over) still reads
# like the kernel: the two `jnp.dot`s are `tpu.matmul` operations on whole blocks.

# %%
if DUMP:
    original = static.mosaic_file(DUMP, "lesson_kernel", "original").read_text()
    for line in original.splitlines():
        if "tpu.matmul" in line or "math.exp" in line:
            print(line.strip()[:150])
    print(static.matmuls(original))

# %% [markdown]
# After `apply-vector-layout`, every operation is on single (8, 128) vector registers; after
# `finalize-llo` the program is LLO, the low-level operations libtpu schedules into bundles. Each line
# of the final bundles is one VLIW bundle: the instructions issued in one cycle, separated by `;;`,
# with a `>` per enclosing loop. The grid is one loop, so the `>` bundles are one grid step.

# %%
if DUMP:
    final_text = static.mosaic_file(DUMP, "lesson_kernel", "post-finalize-llo").read_text()
    print("LLO operations after finalize-llo:", len(re.findall(r"= llo\.", final_text)))
    bundles = static.bundle_file(DUMP, "lesson_kernel").read_text().splitlines()
    matmul_bundles = [line for line in bundles if "vmatmul" in line]
    print("a bundle that pushes rows of q through the MXUs:")
    for part in matmul_bundles[0].split(";;")[:4]:
        print("   ", re.sub(r"\s+", " ", part.strip())[:110])
    lesson_static = static.kernel_static(DUMP, "lesson_kernel", CHIP)
    print(f"\n{static.LABEL}, {CHIP}, the lesson kernel ({BLOCK} x {BLOCK} tiles, head_dim {HEAD_DIM},"
          " bf16):")
    print(f"  bundles in the program {lesson_static.bundles}, in the grid loop {lesson_static.loop_bundles}")
    print(f"  vmatmul per grid step {lesson_static.vmatmul}, ideal {lesson_static.ideal_vmatmul}")
    text = "\n".join(bundles)
    per_mxu = {mxu: len(re.findall(rf"vmatmul\S*\.{mxu}\b", text))
               for mxu in sorted(set(re.findall(r"vmatmul\S*\.(mxu\d)", text)))}
    print("  vmatmul per MXU:", ", ".join(f"{mxu} {n}" for mxu, n in per_mxu.items()),
          f"| vmatpush {len(re.findall(r'= vmatpush', text))}, vpop {len(re.findall(r'= vpop', text))}")

# %% [markdown]
# The ideal: each `vmatmul` pushes one vector register of LHS rows (8 sublanes of 32-bit words: 16
# bfloat16 rows) through a 128 x 128 weight tile held in an MXU. Two matmuls of `BLOCK x HEAD_DIM x
# BLOCK` per step, at 128: `2 x (128 / 16) x (128 / 128) x (128 / 128) = 16`, the same as
# `2 x BLOCK x BLOCK x HEAD_DIM x 2` FLOPs over the `2 x 16 x 128 x 128` FLOPs of one `vmatmul`.
# The bundle printed above issues two `vmatmul`s in one cycle, to `mxu0` and `mxu2`; over the whole
# step the 16 are spread across four MXUs, `mxu0` to `mxu3` (the count per MXU above: v5e's
# TensorCore has four, https://cloud.google.com/tpu/docs/v5e). `vmatpush` loads a weight tile (K,
# then V) into an MXU and `vpop` reads results back, each counted above. The other bundles of the
# step are the softmax's vector work, the DMAs of the next blocks and the loop's scalar bookkeeping:
# with 128 x 128 tiles the `vmatmul`s sit in a small share of the step's bundles.
#
# The same count for the package's kernels, forward and backward (`python -m tpuattn.aot --static`
# prints this table). Their code has a masked and an unmasked path for each tile, and a static
# count holds both, so a grid step runs half of the `vmatmul`s listed. The last two columns count
# the loop's other work: `valu`, the vector unit's arithmetic instructions (`vadd`, `vmul`, `vmax`,
# `vsel`, ...), and `eup`, the pushes to the transcendental unit (EUP: `vpow2` for each `exp`, `vrcp`,
# `vtanh`, ...), which the softmax's exponentials keep busy:

# %%
if COMPILER and RUN_STATIC:
    try:
        print(static.table(static.package_report(CHIP, seq_len=2048, heads=1), CHIP))
    except static.DumpFailed as failure:
        print("no static report:", failure)

# %% [markdown]
# Every kernel issues exactly the ideal number of `vmatmul`s for the matmuls in its code: the
# compiler adds no MXU passes. What differs between them is the number of matmuls (the backward's
# three kernels do 2, 3 and 4 per tile) and everything around them, in the loop's bundles.
#
# libtpu has one more flag, `--xla_jf_dump_static_llo_profile_to=DIR`, which writes an estimate of
# each program's cycles. This notebook does not use it: tried on the package's forward and backward
# for v5e with JAX 0.10.2's libtpu (0.0.42.1), it stopped the child process with a fatal check
# (signal 6) on one of XLA's own gather fusions: *"Static LLO profiling of gather_fusion.1 failed:
# INVALID_ARGUMENT: Unsupported DMA direction: 10 on VL/VLP"*. A static estimate would also have to
# pick one side of each branch, where a causal kernel skips or masks tiles.
#
# The package reads one from the final bundles instead (`tpuattn.measure.estimate`): a bundle is one
# cycle, a loop's body runs as many times as its exit test's constant says (`scmp.ge ... N /* loop
# exit test */`), a branch (`sbr.rel ... target = $regionN`) skips the bundles up to its target region,
# weighed by how often the grid takes it, and the sum at the chip's clock is a time labelled
# **compiled (static estimate, not run)**. The lesson kernel, read that way from the dump above: no
# mask, so every grid step computes (its matmuls sit outside any branch), and its two `pl.when`
# regions, the set-up at the first key block and the write-out at the last, run on one step in
# `SEQ / BLOCK` (the weights `estimate.tile_weights` reads from the package's tile codes):

# %%
if DUMP:
    from tpuattn.measure import estimate

    lesson_weights = estimate.tile_weights(SEQ, BLOCK, causal=False)
    print(lesson_weights)
    try:
        lesson_estimate = estimate.estimate_bundles(static.bundle_file(DUMP, "lesson_kernel"), CHIP,
                                                    lesson_weights, name="lesson_kernel")
    except ValueError as unread:  # a libtpu that prints its bundles otherwise: say so, invent nothing
        print("no estimate:", unread)
        lesson_estimate = None
if DUMP and lesson_estimate:
    clock_hz, clock_source = chips.estimate_clock(CHIP)
    print(f"{estimate.LABEL}, {CHIP}, the lesson kernel:")
    print(f"  grid loop trips {lesson_estimate.trips[0]} (the grid's steps plus the pipeline's warm-up "
          f"and drain), bundles in the file {lesson_estimate.bundles}")
    for region in lesson_estimate.regions:
        print(f"  branch region of {region.stop - region.start} bundles: {region.kind}, "
              f"{region.vmatmul} vmatmul, run on {region.frequency:.2f} of the steps")
    print(f"  cycles {lesson_estimate.cycles:,.0f} at {clock_hz / 1e9:.2f} GHz ({clock_source}): "
          f"{lesson_estimate.seconds * 1e6:.2f} us")

# %% [markdown]
# The same reading for whole programs, the Pallas kernels and XLA's fusions each from its own
# bundles file, set beside every published TPU measurement, is the page *A time from the compiler*
# in the book (`python -m tpuattn.aot --estimate-validate`).
#
# ## 10 · Profiling a real TPU run
#
# Static counts say what the compiler made, not how long it takes. On a TPU, time comes from a
# trace: `jax.profiler.trace(dir)` records every program, kernel and copy on the device timeline,
# and XProf (`pip install xprof`, then `xprof --logdir dir`, or TensorBoard's profile plugin) shows
# it: the trace viewer, each op's time, and the roofline of every kernel. **This project has not run
# it on a TPU.** The mechanism is the same on the CPU; here is a small trace:

# %% tags=["nbval-ignore-output"]
trace_dir = Path(tempfile.mkdtemp(prefix="tpuattn_trace_"))
with jax.profiler.trace(str(trace_dir)):
    out = tpuattn.attention(q[None, :, None], k[None, :, None], v[None, :, None], impl="xla")
    out.block_until_ready()
for path in sorted(trace_dir.rglob("*")):
    if path.is_file():
        print(path.relative_to(trace_dir), f"{path.stat().st_size:,} bytes")

# %% [markdown]
# The `.xplane.pb` file under `plugins/profile/<run>/` is what XProf reads. On a TPU, wrap a few
# steps after warm-up (the first call compiles), call `block_until_ready()` inside the block, and name
# regions with `jax.profiler.TraceAnnotation("...")` so they can be found in the timeline.
#
# > **Takeaway.** The compiler answers "does it compile" and "what did it make" without a TPU; only a
# > trace on the chip answers "how long". Label each number with where it came from: compiled,
# > compiled (static), measured.
#
# ## Exercises
#
# Each stub raises `NotImplementedError`; fill it in and re-run its cell. Solutions are at the end.
#
# 1. **Rows of a tile** (★☆☆, 5 min). `tile_rows(dtype)`: the rows of one memory tile of a 2-D array
#    of `dtype` on v5e (float32 and bfloat16). Checked against the layouts the compiler gives
#    (section 1).
# 2. **The scoped VMEM a copy asks for** (★★☆, 10 min). `copy_vmem_bytes(block, dtype)`: the VMEM the
#    `double` kernel's blocks need (section 3's model). Checked with the compiler: the kernel must
#    compile with `vmem_limit_bytes` set to your answer, and fail with 4 KiB less.
# 3. **Ideal vmatmuls** (★☆☆, 5 min). `ideal_vmatmuls(m, k, n, dtype)`: the fewest `vmatmul`
#    instructions for an `m x k @ k x n` matmul on v5e's 128 x 128 MXU. Checked against
#    `tpuattn.measure.static.ideal_vmatmul` and the lesson kernel's compiled count.


# %%
def tile_rows(dtype):
    raise NotImplementedError("FILL ME IN")


def copy_vmem_bytes(block, dtype):
    raise NotImplementedError("FILL ME IN")


def ideal_vmatmuls(m, k, n, dtype):
    raise NotImplementedError("FILL ME IN")


def check_exercises(tile_rows, copy_vmem_bytes, ideal_vmatmuls):
    def check_tiles():
        if not COMPILER:
            raise NotCheckable("needs the TPU compiler (libtpu)")
        for dtype in (jnp.float32, jnp.bfloat16):
            compiled = aot.compile_for(CHIP, double((32, 128), (64, 256), dtype), [S((64, 256), dtype)])
            layout = re.search(r"\[64,256\]\{1,0:T\((\d+),128\)(?:\((\d+),1\))?", compiled.as_text())
            want = int(layout.group(1)) * int(layout.group(2) or 1)
            assert tile_rows(dtype) == want, (jnp.dtype(dtype).name, tile_rows(dtype), want)

    def check_vmem():
        if not COMPILER:
            raise NotCheckable("needs the TPU compiler (libtpu)")

        def fits(block, dtype, limit):
            shape = (2 * block[0], block[1])
            params = pltpu.CompilerParams(vmem_limit_bytes=int(limit))
            return compile_error(CHIP, double(block, shape, dtype, params), [S(shape, dtype)]) is None

        if fits((1024, 1024), jnp.float32, 16 * 2**20 - 4096):  # four 4 MiB buffers, 4 KiB short
            raise NotCheckable("this compiler compiles it 4 KiB under its blocks' total: it does not "
                               "hold the total to vmem_limit_bytes")
        for block, dtype in (((1024, 1024), jnp.float32), ((2048, 1024), jnp.bfloat16),
                             ((512, 256), jnp.float32)):
            answer = copy_vmem_bytes(block, dtype)
            assert fits(block, dtype, answer), f"{block} {jnp.dtype(dtype).name}: does not fit {answer}"
            assert not fits(block, dtype, answer - 4096), f"{block}: compiles in less than {answer}"

    def check_vmatmuls():
        for m, kk, n, dtype in ((128, 128, 128, "bf16"), (512, 128, 512, "bf16"), (64, 256, 128, "f32"),
                                (8, 128, 128, "f32")):
            got = ideal_vmatmuls(m, kk, n, jnp.bfloat16 if dtype == "bf16" else jnp.float32)
            assert got == static.ideal_vmatmul([(m, kk, n, dtype)], "v5e"), (m, kk, n, dtype, got)
        if DUMP:
            per_step = 2 * ideal_vmatmuls(BLOCK, HEAD_DIM, BLOCK, jnp.bfloat16)
            assert per_step == lesson_static.vmatmul, (per_step, lesson_static.vmatmul)

    run_checks({"1 rows of a tile": check_tiles, "2 scoped VMEM of a copy": check_vmem,
                "3 ideal vmatmuls": check_vmatmuls})


check_exercises(tile_rows, copy_vmem_bytes, ideal_vmatmuls)

# %% [markdown]
# ## References
#
# - JAX, *Pallas TPU details* (block shapes, memory spaces, what Mosaic supports),
#   https://docs.jax.dev/en/latest/pallas/tpu/details.html; *Grids and BlockSpecs*,
#   https://docs.jax.dev/en/latest/pallas/grid_blockspec.html.
# - OpenXLA, error pages E1001 and E2001 (linked from the messages above),
#   https://openxla.org/xla/errors/error_1001, https://openxla.org/xla/errors/error_2001.
# - JAX, *Profiling computation* (`jax.profiler`, XProf), https://docs.jax.dev/en/latest/profiling.html.
# - Google Cloud TPU pages (VMEM, SMEM, MXU per generation): https://cloud.google.com/tpu/docs/v5e.
# - A. Zhang, "Forcing Flash Attention onto a TPU and Learning the Hard Way", 2026,
#   https://archerzhang.me/forcing-flash-attention-onto-a-tpu -- the write-up this collection answers.
#
# ## Solutions
#
# The cell below is collapsed: open it after trying the exercises. It runs the same checks on the
# solutions, but only when `RUN_SOLUTIONS = True` (the parameters cell; the project's CI sets it), so
# Run All shows your own results alone.

# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solutions: open after trying the exercises (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    def tile_rows_solution(dtype):
        return 8 * (4 // jnp.dtype(dtype).itemsize)  # 8 sublanes of 32-bit words, packed rows per word

    def copy_vmem_bytes_solution(block, dtype):
        return 2 * 2 * block[0] * block[1] * jnp.dtype(dtype).itemsize  # (in + out) x double buffering

    def ideal_vmatmuls_solution(m, k, n, dtype):
        rows = 8 * (4 // jnp.dtype(dtype).itemsize)  # LHS rows in one vector register
        return -(-m // rows) * -(-k // 128) * -(-n // 128)

    check_exercises(tile_rows_solution, copy_vmem_bytes_solution, ideal_vmatmuls_solution)
