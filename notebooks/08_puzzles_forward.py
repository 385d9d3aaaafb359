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
# # 08 · Puzzles, forward: write the kernels yourself
#
# The walk so far showed you kernels; here you write them. Each puzzle asks for one piece of a
# Pallas TPU kernel (a kernel body, its BlockSpecs or an index map) and checks it at once, the way
# GPU-Puzzles does for CUDA. This notebook answers: **can you write a flash-attention forward kernel,
# its causal schedule and its GQA layout, one small piece at a time?**
#
# **What you'll do**
# - write a copy, a tiled bias add (its BlockSpecs), a matmul with a float32 accumulator, a row
#   softmax and the online-softmax (flash) forward;
# - write the index maps that skip hidden blocks: clamped for a causal mask, read from a
#   scalar-prefetch table for a sliding window;
# - start the online softmax with an attention sink already in it;
# - fold the query heads of a GQA group into the rows of one grid step;
# - find and fix two bugs: a DMA race and a missing accumulator init.
#
# Each `check(...)` runs your answer in interpret mode on the CPU against a float64 NumPy answer,
# then compiles it for a TPU v5e with the real TPU compiler (compiled, not run: no TPU is needed),
# and prints one line: `PASS`, `not written yet`, the first mismatch, a race, a rule the values
# cannot show (the section before the takeaways lists them), or the compiler's message. Replace each
# `raise NotImplementedError` with your code and run the check. Each heading gives the puzzle's
# difficulty (★☆☆ to ★★★) and its minutes at a workshop. A collapsed solution follows each check:
# try first. Solutions run only with `RUN_SOLUTIONS = True` (parameters cell), so Run All shows your
# own checks alone.
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/tpuattn/tpuattn/blob/main/notebooks/08_puzzles_forward.ipynb)

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
import os

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpuattn.measure import runtime
from tpuattn.puzzles import check, draw_grid
from tpuattn.puzzles import forward_puzzles as puzzles
from tpuattn.viz import style

PLATFORM = runtime.info()
print(PLATFORM.summary())

# %% tags=["parameters"]
CHIP = "v5e"  # the chip every check compiles for (compile-only: no TPU needed)
# The hidden solution cells run only when this is True, so Run All shows your answers' checks alone.
# The project's CI sets it (TPUATTN_RUN_SOLUTIONS=1): the committed outputs include the solutions'.
RUN_SOLUTIONS = os.environ.get("TPUATTN_RUN_SOLUTIONS") == "1"

# %%
style.use_style()
FETCH, IDLE = style.STEP_COLOURS["fetch"], style.STEP_COLOURS["idle"]
HIDDEN = style.TILE_COLOURS[0]  # the colour of a skipped tile


def picture(n_panels=1, width=3.2, height=2.4):
    """A small row of panels for a puzzle's picture."""
    fig, axes = plt.subplots(1, n_panels, figsize=(width * n_panels, height), squeeze=False)
    return fig, axes[0]


# %% [markdown]
# ## Puzzle 1 · copy (★☆☆, 5 min)
#
# `x` is `[16, 256]` float32. The grid is `(2, 2)`; at step `(i, j)` the BlockSpecs hand your kernel
# the `(8, 128)` block `x[8i : 8i+8, 128j : 128j+128]` as `x_ref` and the matching block of the output
# as `o_ref` (both in VMEM). Write the body: `o = x`.
#
# Refs are read with `x_ref[...]` and written with `o_ref[...] = value`. Why `(8, 128)`: a float32
# vector register holds 8 sublanes × 128 lanes, so a block's last two dimensions must be multiples of
# 8 and 128 (or the array's whole dimension), which is the rule the v5e compile enforces.

# %%
fig, (ax,) = picture(width=5)
draw_grid(ax, 2, 2, labels={(i, j): f"step ({i}, {j})" for i in range(2) for j in range(2)},
          colours={(0, 1): FETCH}, title="x [16, 256] in (8, 128) blocks; step (0, 1) shaded",
          xlabel="column block j", ylabel="row block i")
plt.show()


# %% tags=["puzzle"]
def copy_kernel(x_ref, o_ref):
    raise NotImplementedError("write o = x")


# %%
passed = check(puzzles.COPY, copy_kernel, chip=CHIP)


# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solution: open after trying (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    def copy_kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    passed = check(puzzles.COPY, copy_kernel, chip=CHIP)

# %% [markdown]
# ## Puzzle 2 · bias add: the BlockSpecs (★☆☆, 5 min)
#
# `out[r, c] = x[r, c] + bias[0, c]` with `x` `[16, 512]` and `bias` `[1, 512]`. The kernel body is
# given (`o_ref[...] = x_ref[...] + bias_ref[...]`, a `(1, 128)` row broadcast over 8 rows) and the
# grid is `(2, 4)`: row blocks × column blocks. Write `add_specs()` returning three
# `pl.BlockSpec(block_shape, index_map)`: for `x`, for `bias`, for the output. An index map takes the
# grid indices `(i, j)` and returns the **block** index along each dimension (not the element index).
#
# A `(1, 128)` block is legal: its second-to-last dimension is the bias's whole dimension (1). The
# check evaluates your index maps at every grid step: a block index outside an array (interpret mode
# clamps it, so the values may still come out right) fails.

# %%
fig, axes = picture(2, width=4)
draw_grid(axes[0], 2, 4, labels={(i, j): f"({i},{j})" for i in range(2) for j in range(4)},
          colours={(1, 2): FETCH}, title="x and out: (8, 128) blocks", xlabel="j", ylabel="i")
draw_grid(axes[1], 1, 4, labels={(0, j): f"(0,{j})" for j in range(4)}, colours={(0, 2): FETCH},
          title="bias: (1, 128) blocks", xlabel="j")
fig.suptitle("grid step (1, 2) reads the shaded blocks", fontsize=9, y=1.06)
plt.show()


# %% tags=["puzzle"]
def add_specs():
    raise NotImplementedError("return (x_spec, bias_spec, out_spec)")


# %%
passed = check(puzzles.ADD, add_specs, chip=CHIP)


# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solution: open after trying (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    def add_specs():
        tile = pl.BlockSpec((8, 128), lambda i, j: (i, j))
        bias_row = pl.BlockSpec((1, 128), lambda i, j: (0, j))  # every row block reads the same bias block
        return tile, bias_row, tile

    passed = check(puzzles.ADD, add_specs, chip=CHIP)

# %% [markdown]
# ## Puzzle 3 · matmul with a float32 accumulator (★★☆, 10 min)
#
# `o = x @ y` with `x` `[32, 256]` and `y` `[256, 256]` in **bfloat16**, `o` in bfloat16. The grid is
# `(i, j, k) = (2, 2, 2)`: at step `(i, j, k)` you get `x_ref` = block `(i, k)` of shape `(16, 128)`,
# `y_ref` = block `(k, j)` of shape `(128, 128)`, `o_ref` = block `(i, j)`, and `acc_ref`, a
# `(16, 128)` float32 VMEM scratch that persists across grid steps. `k` is the last grid axis
# (`"arbitrary"`: it runs in order), so one output block sees `k = 0, 1` back to back. `i` and `j` are
# `"parallel"`: a megacore chip (v4, v5p) may split them between its two TensorCores, each with its
# own scratch, so zero the accumulator at every output block's first `k`, not once.
#
# Write the body: zero `acc_ref` when `k == 0` (`@pl.when(pl.program_id(2) == 0)`), add
# `jnp.dot(x, y, preferred_element_type=jnp.float32)`, and write `acc` cast to `o_ref.dtype` at the
# last `k` (`pl.num_programs(2) - 1`). Accumulating in float32 and rounding once is what the MXU does
# natively; bfloat16 keeps only 8 significant bits.

# %%
fig, axes = picture(3, width=2.6)
draw_grid(axes[0], 2, 2, colours={(0, 0): FETCH, (0, 1): FETCH}, labels={(0, 0): "k=0", (0, 1): "k=1"},
          title="x: blocks (i, k)", xlabel="k", ylabel="i")
draw_grid(axes[1], 2, 2, colours={(0, 1): FETCH, (1, 1): FETCH}, labels={(0, 1): "k=0", (1, 1): "k=1"},
          title="y: blocks (k, j)", xlabel="j", ylabel="k")
draw_grid(axes[2], 2, 2, colours={(0, 1): FETCH}, labels={(0, 1): "acc"}, title="o: block (i, j)",
          xlabel="j", ylabel="i")
fig.suptitle("output block (0, 1): two grid steps, k = 0 and k = 1, add into one accumulator",
             fontsize=9, y=1.06)
plt.show()


# %% tags=["puzzle"]
def matmul_kernel(x_ref, y_ref, o_ref, acc_ref):
    raise NotImplementedError("init acc at k == 0, accumulate, write at the last k")


# %%
passed = check(puzzles.MATMUL, matmul_kernel, chip=CHIP)


# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solution: open after trying (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    def matmul_kernel(x_ref, y_ref, o_ref, acc_ref):
        k = pl.program_id(2)

        @pl.when(k == 0)
        def _init():
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

        @pl.when(k == pl.num_programs(2) - 1)
        def _write():
            o_ref[...] = acc_ref[...].astype(o_ref.dtype)

    passed = check(puzzles.MATMUL, matmul_kernel, chip=CHIP)

# %% [markdown]
# ## Puzzle 4 · row softmax (★☆☆, 5 min)
#
# `x` is `[16, 256]` float32, scaled so that some entries pass 88.7 (printed below): `exp` of them
# overflows float32, whose largest value is about `3.4e38 ≈ exp(88.7)`. The grid is `(2,)`; each
# step gets `(8, 256)`: whole rows. Write the body: `o = softmax(x)` along the last axis, subtracting
# each row's maximum before `exp` so nothing overflows.

# %%
print("largest |x|:", float(np.abs(puzzles.SOFTMAX.inputs()[0]).max()))
fig, (ax,) = picture(width=4, height=2)
draw_grid(ax, 2, 1, labels={(0, 0): "step 0: rows 0-7, all 256 columns", (1, 0): "step 1: rows 8-15"},
          colours={(0, 0): FETCH}, title="x [16, 256]: one block holds whole rows", ylabel="row block")
ax.set_aspect("auto")
plt.show()


# %% tags=["puzzle"]
def softmax_kernel(x_ref, o_ref):
    raise NotImplementedError("o = exp(x - max) / sum(exp(x - max)), per row")


# %%
passed = check(puzzles.SOFTMAX, softmax_kernel, chip=CHIP)


# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solution: open after trying (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    def softmax_kernel(x_ref, o_ref):
        x = x_ref[...]
        p = jnp.exp(x - x.max(axis=1, keepdims=True))
        o_ref[...] = p / p.sum(axis=1, keepdims=True)

    passed = check(puzzles.SOFTMAX, softmax_kernel, chip=CHIP)

# %% [markdown]
# ## Puzzle 5 · the flash forward (online softmax) (★★★, 15 min)
#
# One head: `q` `[32, 128]`, `k` and `v` `[256, 128]`, float32; `o = softmax(q kᵀ · scale) v` with
# `scale = puzzles.SCALE` (`1/√128`). The grid is `(query blocks, kv blocks) = (2, 2)`; step `(i, j)`
# gets `q_ref` `(16, 128)` (block `i`), `k_ref` and `v_ref` `(128, 128)` (block `j`), `o_ref`
# (block `i`), and three float32 scratch buffers that persist over `j`: `m_ref` and `l_ref`
# `(16, 1)` (running row maximum and row sum) and `acc_ref` `(16, 128)`.
#
# Write the body of notebook 02's online softmax: at `j == 0` set `m = -inf`, `l = 0`, `acc = 0`; at
# every step `s = q kᵀ · scale`, `m_new = max(m, rowmax(s))`, `p = exp(s - m_new)`,
# `α = exp(m - m_new)`, `l = α l + rowsum(p)`, `acc = α acc + p v`, `m = m_new`; at the last `j`,
# `o = acc / l`. `q kᵀ` without a transpose:
# `jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)`.

# %%
fig, (ax,) = picture(width=4)
draw_grid(ax, 2, 2, labels={(i, j): f"{2 * i + j + 1}" for i in range(2) for j in range(2)},
          colours={(0, 0): FETCH, (0, 1): FETCH}, title="the grid: step order; row 0's steps shaded",
          xlabel="kv block j (128 keys)", ylabel="query block i (16 rows)")
plt.show()


# %% tags=["puzzle"]
def flash_kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref):
    raise NotImplementedError("init at j == 0, one online-softmax step, normalise at the last j")


# %%
passed = check(puzzles.FLASH, flash_kernel, chip=CHIP)


# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solution: open after trying (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    def flash_kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref):
        j = pl.program_id(1)

        @pl.when(j == 0)
        def _init():
            m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        s = jax.lax.dot_general(q_ref[...], k_ref[...], (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * puzzles.SCALE
        m_old = m_ref[...]
        m_new = jnp.maximum(m_old, s.max(axis=1, keepdims=True))
        p = jnp.exp(s - m_new)
        alpha = jnp.exp(m_old - m_new)
        l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
        acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p, v_ref[...], preferred_element_type=jnp.float32)
        m_ref[...] = m_new

        @pl.when(j == pl.num_programs(1) - 1)
        def _write():
            o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)

    passed = check(puzzles.FLASH, flash_kernel, chip=CHIP)

# %% [markdown]
# ## Puzzle 6 · causal skip: a clamped index map (★★☆, 10 min)
#
# Causal attention, `q`, `k`, `v` `[256, 128]`, blocks of 64: a `(4, 4)` grid. Query block `i` sees
# K/V blocks `0 … i`; the body (given) skips the compute of a hidden step with `pl.when(j <= i)`.
# Skipping the compute does not skip the **copy**: the pipeline fetches whatever block the index map
# names, before the body runs. It does skip a copy when a step names the same block as the step
# before it. So write `kv_index_map(i, j)` (used for both K and V) so that hidden steps re-name the
# last visible block and no hidden block is ever fetched: return `(block, 0)`.
#
# The check compares the values, then walks the grid as the pipeline does and counts the K/V fetches
# your map starts: 9 are needed (16 without the clamp). `jnp.minimum` works on the grid indices.

# %%
n = puzzles.CAUSAL_GRID[0]
fig, (ax,) = picture(width=3.6, height=3.2)
draw_grid(ax, n, n, labels={(i, j): "sees" if j <= i else "hidden" for i in range(n) for j in range(n)},
          colours={(i, j): FETCH if j <= i else HIDDEN for i in range(n) for j in range(n)},
          title="causal, blocks of 64: which grid steps see their block", xlabel="kv block j",
          ylabel="query block i")
plt.show()


# %% tags=["puzzle"]
def kv_index_map(i, j):
    raise NotImplementedError("return (the K/V block for step (i, j), 0), never a hidden block")


# %%
passed = check(puzzles.CAUSAL, kv_index_map, chip=CHIP)


# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solution: open after trying (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    def kv_index_map(i, j):
        return jnp.minimum(j, i), 0  # a hidden step (j > i) re-names block i: no new DMA

    passed = check(puzzles.CAUSAL, kv_index_map, chip=CHIP)
    print("fetches, (step, block):", puzzles.fetched_blocks(kv_index_map, puzzles.CAUSAL_GRID))

# %% [markdown]
# ## Puzzle 6b · an attention sink in the running state (★☆☆, 5 min)
#
# Some models (gpt-oss, after Xiao et al.'s *attention sinks*, https://arxiv.org/abs/2309.17453) give
# every row one more logit, the **sink** `z`, that takes softmax mass and adds no value:
# `o = Σ_j e^{s_j} v_j / (e^{z} + Σ_j e^{s_j})`, so a row can attend to "nothing". In the online
# softmax the sink is just one more part of the row, seen before the first key: a part whose running
# max is `z`, whose running sum is `e^{z - z} = 1` and whose accumulator is 0. The kernel is puzzle
# 6's causal flash kernel (given, with the clamped map); write only `init(m_ref, l_ref, acc_ref)`,
# which starts every row's running state at the first K/V step, for the sink `puzzles.SINK`
# (`tpuattn.attention(..., sinks=)` does the same for one sink per head, `tpuattn/sinks.py`).

# %%
n = puzzles.CAUSAL_GRID[0]
fig, (ax,) = picture(width=3.6, height=3.2)
draw_grid(ax, n, n, labels={(i, j): ("init + step" if j == 0 else "step") if j <= i else "hidden"
                            for i in range(n) for j in range(n)},
          colours={(i, j): FETCH if j <= i else HIDDEN for i in range(n) for j in range(n)},
          title="the sink enters at each row's first step (j = 0)", xlabel="kv block j",
          ylabel="query block i")
plt.show()


# %% tags=["puzzle"]
def init(m_ref, l_ref, acc_ref):
    raise NotImplementedError("start the running state (m, l, acc) with the sink already in it")


# %%
passed = check(puzzles.SINK_PUZZLE, init, chip=CHIP)


# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solution: open after trying (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    def init(m_ref, l_ref, acc_ref):
        # Without a sink: m = -inf, l = 0, acc = 0. The sink is a part of the row already seen: its max is
        # the sink's logit, its sum exp(z - z) = 1, and it adds nothing to the accumulator (no value).
        m_ref[...] = jnp.full(m_ref.shape, puzzles.SINK, jnp.float32)
        l_ref[...] = jnp.ones(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    passed = check(puzzles.SINK_PUZZLE, init, chip=CHIP)

# %% [markdown]
# ## Puzzle 6c · a quantized cache: dequantize in the kernel (★☆☆, 5 min)
#
# Serving engines keep the KV cache in one byte an entry, int8 or fp8, with a float32 **scale**: entry
# `e` stands for `e * scale`. Decode reads the whole cache every step, so halving its bytes (from
# bfloat16) halves the step's traffic (`tpuattn.model.decode_roofline`). The kernel below is one decode step
# for 8 query rows over 256 cached keys in two K/V blocks; the two scales arrive in SMEM by scalar
# prefetch (`scales_ref[0]` for K, `scales_ref[1]` for V). Write `dequantize(entries, scale)`, which
# the kernel calls on each int8 block before its matmuls: it returns float32 values. The check compares
# with float64 attention over the dequantized cache (the rounding is the cache's, not the kernel's).
# Since a scale is one number per tensor (or per kv head), the package's decode kernel folds `k_scale`
# into the logits' scale and `v_scale` into the output instead of scaling every entry; the result is
# the same.


# %% tags=["puzzle"]
def dequantize(entries, scale):
    raise NotImplementedError("int8 entries -> float32 values")


# %%
passed = check(puzzles.QUANT, dequantize, chip=CHIP)


# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solution: open after trying (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    def dequantize(entries, scale):
        # Widen first: int8 arithmetic would overflow, and the matmuls want float32 (or bfloat16) inputs.
        return entries.astype(jnp.float32) * scale

    passed = check(puzzles.QUANT, dequantize, chip=CHIP)

# %% [markdown]
# ## Puzzle 7 · the scalar-prefetch schedule (★★★, 15 min)
#
# Now causal **and** a sliding window of 128 keys (query `r` sees key `c` iff `r - 128 < c ≤ r`):
# the visible K/V blocks of a row no longer start at 0. Instead of a `(4, 4)` grid of mostly idle
# steps, the grid is `(4, 3)`: 3 is the most blocks any query block sees. A table, computed on the
# host and handed to the kernel through `pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=2, ...)`,
# lists them: `kv_blocks[i, :counts[i]]` are the K/V blocks query block `i` sees, in order; the rest
# of a row is padding (0). Scalar-prefetch arrays live in SMEM and are passed to every index map
# after the grid indices, and to the kernel before its other refs.
#
# Write `kv_index_map(i, j, kv_blocks_ref, counts_ref)`: the K/V block for step `(i, j)`. A padding
# step (`j ≥ counts[i]`) must fetch nothing new, as in puzzle 6. The body (given) computes only when
# `j < counts[i]`.

# %%
kv_blocks, counts = puzzles.window_schedule()
print("kv_blocks =\n", kv_blocks, "\ncounts =", counts)
B = puzzles.CAUSAL_BLOCK
tiles = puzzles.window_visible(puzzles.CAUSAL_SEQ).reshape(n, B, n, B).any(axis=(1, 3))
fig, axes = picture(2, width=3.6, height=3.2)
width = kv_blocks.shape[1]
draw_grid(axes[0], n, n, colours={(i, j): FETCH if tiles[i, j] else HIDDEN for i in range(n)
                                  for j in range(n)},
          title="window 128 + causal: visible blocks", xlabel="kv block", ylabel="query block i")
draw_grid(axes[1], n, width,
          labels={(i, j): int(kv_blocks[i, j]) if j < counts[i] else "pad" for i in range(n)
                  for j in range(width)},
          colours={(i, j): FETCH if j < counts[i] else IDLE for i in range(n) for j in range(width)},
          title="the grid (4, 3): kv_blocks[i, j]", xlabel="step j", ylabel="query block i")
plt.show()


# %% tags=["puzzle"]
def schedule_index_map(i, j, kv_blocks_ref, counts_ref):
    raise NotImplementedError("read the table; clamp padding steps to the row's last visible block")


# %%
passed = check(puzzles.SCHEDULE, schedule_index_map, chip=CHIP)


# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solution: open after trying (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    def schedule_index_map(i, j, kv_blocks_ref, counts_ref):
        last = counts_ref[i] - 1
        return kv_blocks_ref[i, jnp.minimum(j, last)], 0

    passed = check(puzzles.SCHEDULE, schedule_index_map, chip=CHIP)

# %% [markdown]
# ## Puzzle 8 · GQA folded into the rows: the BlockSpecs (★★☆, 10 min)
#
# Grouped-query attention: 4 query heads share 2 K/V heads (group of 2; query head `h` uses K/V head
# `h // 2`). `q` `[4, 16, 128]` is reshaped (for free) to `[kv_heads, group, seq_q, head_dim] =
# [2, 2, 16, 128]`, `k` and `v` are `[2, 128, 128]`. The grid is `(kv head h, query block i) =
# (2, 2)` with query blocks of 8. One grid step serves **all** query heads of a group: the body
# (given) reshapes its `q` block `(group, 8, 128)` into `(16, 128)` rows, so K and V are fetched once
# per group and the score matmul has twice the rows (`(16, 128)`, not `(8, 128)`).
#
# Write `gqa_specs()` returning `(q_spec, kv_spec, out_spec)` (the output has `q`'s folded layout;
# `kv_spec` serves both K and V). `None` in a block shape squeezes that dimension out of the ref.

# %%
fig, axes = picture(2, width=3.6, height=3)
draw_grid(axes[0], 4, 2, labels={(h, i): f"g{h % 2}, i{i}" for h in range(4) for i in range(2)},
          colours={(0, 1): FETCH, (1, 1): FETCH}, title="q: (group member g, query block i)",
          xlabel="query block i", ylabel="query head")
draw_grid(axes[1], 2, 1, labels={(0, 0): "K/V head 0", (1, 0): "K/V head 1"}, colours={(0, 0): FETCH},
          title="k, v: one block per kv head", ylabel="kv head")
fig.suptitle("grid step (h=0, i=1): both query heads of group 0, one K/V fetch", fontsize=9, y=1.06)
plt.show()


# %% tags=["puzzle"]
def gqa_specs():
    raise NotImplementedError("return (q_spec, kv_spec, out_spec) for the grid (kv head, query block)")


# %%
passed = check(puzzles.GQA, gqa_specs, chip=CHIP)


# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solution: open after trying (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    def gqa_specs():
        group, block_q, head_dim = puzzles.GQA_GROUP, puzzles.GQA_BLOCK_Q, puzzles.HEAD_DIM
        q_spec = pl.BlockSpec((None, group, block_q, head_dim), lambda h, i: (h, 0, i, 0))
        kv_spec = pl.BlockSpec((None, puzzles.GQA_KV, head_dim), lambda h, i: (h, 0, 0))
        return q_spec, kv_spec, q_spec

    passed = check(puzzles.GQA, gqa_specs, chip=CHIP)

# %% [markdown]
# ## Find the bug A · a race (★★☆, 10 min)
#
# This kernel doubles `x` `[16, 128]`, copying it from HBM itself in two chunks of 8 rows into a VMEM
# buffer with two slots (`buf`, `(2, 8, 128)`) and two DMA semaphores. It starts the second chunk's
# copy before it computes on the first, so that the copy overlaps the compute:
#
# ```
# copy chunk 0 -> slot 0, wait
# start copy chunk 1 -> slot ?          (in flight ...)
# read slot 0, write out rows 0-7       (... while this runs)
# wait for chunk 1, read it, write out rows 8-15
# ```
#
# Whether its values come out right depends on when the second copy lands, which is what a race is:
# the cell below the check runs it three ways. `check` runs this puzzle in the TPU simulator with its
# race detector on (`pltpu.InterpretParams(detect_races=True)`), which reports a DMA that writes
# memory another access may touch meanwhile, whatever the values. Find the race and fix it.

# %% tags=["puzzle"]
ROWS = puzzles.RACE_ROWS


def double_kernel(x_hbm, o_ref, buf, sem):
    first = pltpu.make_async_copy(x_hbm.at[pl.ds(0, ROWS)], buf.at[0], sem.at[0])
    first.start()
    first.wait()
    second = pltpu.make_async_copy(x_hbm.at[pl.ds(ROWS, ROWS)], buf.at[0], sem.at[0])
    second.start()
    o_ref[pl.ds(0, ROWS), :] = 2 * buf[0]
    second.wait()
    o_ref[pl.ds(ROWS, ROWS), :] = 2 * buf[0]


# %%
passed = check(puzzles.RACE, double_kernel, chip=CHIP)

# %%
# The broken kernel's values depend on when the DMA happens: the simulator performs a DMA at its wait
# by default ("on_wait") or as soon as it starts ("eager"); interpret=True is the plain interpreter.
(x,) = puzzles.RACE.inputs()
for label, mode in [("interpret=True", True),
                    ("simulator, DMA on wait", pltpu.InterpretParams(dma_execution_mode="on_wait")),
                    ("simulator, DMA eager", pltpu.InterpretParams(dma_execution_mode="eager"))]:
    doubled = puzzles.RACE.build(double_kernel, interpret=mode)(x)
    print(f"{label:24s} largest error {float(np.abs(np.asarray(doubled) - 2 * x).max()):.3g}")


# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solution: open after trying (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    def double_kernel(x_hbm, o_ref, buf, sem):
        first = pltpu.make_async_copy(x_hbm.at[pl.ds(0, ROWS)], buf.at[0], sem.at[0])
        first.start()
        first.wait()
        # The bug: chunk 1 was copied into slot 0 while slot 0 was still being read. Use the other slot
        # (and its own semaphore): double buffering.
        second = pltpu.make_async_copy(x_hbm.at[pl.ds(ROWS, ROWS)], buf.at[1], sem.at[1])
        second.start()
        o_ref[pl.ds(0, ROWS), :] = 2 * buf[0]
        second.wait()
        o_ref[pl.ds(ROWS, ROWS), :] = 2 * buf[1]

    passed = check(puzzles.RACE, double_kernel, chip=CHIP)

# %% [markdown]
# ## Find the bug B · the accumulator (★☆☆, 5 min)
#
# Puzzle 3's matmul again (the same grid, blocks and scratch), written by someone else. It compiles
# for v5e and it runs; its output is wrong. Why? (Hint: what is in `acc_ref` when an output block's
# first `k` step starts? The interpreter fills uninitialised scratch with NaN; a TPU leaves whatever
# the last step wrote.)

# %% tags=["puzzle"]
def buggy_matmul_kernel(x_ref, y_ref, o_ref, acc_ref):
    acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _write():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


# %%
passed = check(puzzles.MATMUL_BUG, buggy_matmul_kernel, chip=CHIP)


# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solution: open after trying (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    def buggy_matmul_kernel(x_ref, y_ref, o_ref, acc_ref):
        @pl.when(pl.program_id(2) == 0)  # the missing line: every output block starts from zero
        def _init():
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

        @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
        def _write():
            o_ref[...] = acc_ref[...].astype(o_ref.dtype)

    passed = check(puzzles.MATMUL_BUG, buggy_matmul_kernel, chip=CHIP)

# %% [markdown]
# ## What `check` audits beyond the values
#
# Interpret mode forgives two things a TPU does not: it clamps a block index outside its array, and
# it runs the grid in order on one core. So `check` also walks every index map over the whole grid (a
# block outside its array fails, naming the grid step and the block), and runs the kernel as a
# megacore chip may: each index of a `"parallel"` grid axis starting with nothing in its scratch.
#
# ## Takeaways
#
# > **Takeaway.** A Pallas TPU kernel is a body over VMEM blocks plus BlockSpecs that say which block
# > each grid step gets; index maps return block indices, and a block's last two dimensions are
# > multiples of 8 and 128, or the array's whole dimensions, in every dtype. A bfloat16 block of 8
# > rows compiles too, filling half of bfloat16's packed (16, 128) tile (notebooks 03 and 11 show it).
#
# > **Takeaway.** State that lives across grid steps (an accumulator, the online softmax's `m`, `l`,
# > `acc`) sits in scratch on an `"arbitrary"` axis: initialise it at the first step, write at the last.
#
# > **Takeaway.** `pl.when` skips compute, not copies: only an index map that repeats the previous
# > step's block (clamped, or read from a scalar-prefetch table) skips a fetch.
#
# > **Takeaway.** Interpret mode checks values; a race needs the simulator's race detector, and the
# > tile rules need the real compiler. `check` runs both.
#
# The backward, decode and ring puzzles continue in the next notebook of puzzles.
#
# ## References
#
# - JAX Pallas documentation: the quickstart https://docs.jax.dev/en/latest/pallas/quickstart.html,
#   the TPU guide (block shapes, the (8, 128) rule) https://docs.jax.dev/en/latest/pallas/tpu/details.html,
#   pipelining (a copy is skipped when consecutive steps name the same block)
#   https://docs.jax.dev/en/latest/pallas/tpu/pipelining.html, matrix multiplication (the float32
#   accumulator) https://docs.jax.dev/en/latest/pallas/tpu/matmul.html, scalar prefetch
#   https://docs.jax.dev/en/latest/pallas/tpu/sparse.html.
# - S. Rush, GPU-Puzzles, https://github.com/srush/GPU-Puzzles (the spec, picture, stub, check form).
# - T. Dao et al., "FlashAttention", 2022, arXiv:2205.14135 (the online-softmax forward).
