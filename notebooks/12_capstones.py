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
# # 12 · Capstones: write the whole kernel
#
# The puzzles of notebooks 08 and 09 each gave you all of a kernel but one piece. Here nothing is
# given but the spec and the check. This notebook asks: **can you write a whole attention kernel, its
# `pallas_call` included (the grid, the BlockSpecs, the scratch, the dimension semantics, the
# schedule), then its backward and the wiring to `jax.grad`, then kernels that move their own data
# with DMAs, on one chip and across chips?**
#
# **What you'll do**
# - F: write a causal GQA flash-attention forward with its logsumexp, on a block-skip schedule you
#   build yourself (a scalar-prefetch table of the K/V blocks each query block visits), checked in
#   float32 and in bfloat16;
# - G: write its backward, a dQ launch and a dK/dV launch, and the `jax.custom_vjp` that joins them to
#   your forward, checked through `jax.grad`;
# - H: write a decode step that copies its KV-cache pages itself, double-buffered
#   (`pltpu.make_async_copy`, DMA semaphores, two VMEM slots), checked by the race detector;
# - I: write causal ring attention over four devices in one kernel per device, passing K/V to the
#   next device with `pltpu.make_async_remote_copy`, checked by the race detector across devices.
#
# Each capstone has a spec, a picture, a stub that raises `NotImplementedError`, a check, three
# collapsed hints of rising detail, and a collapsed solution: try before you open a hint. Solutions run
# only with `RUN_SOLUTIONS = True` (parameters cell), so Run All shows your own answers' checks alone.
# A capstone takes a workshop 30 to 60 minutes.
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/tpuattn/tpuattn/blob/main/notebooks/12_capstones.ipynb)

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

# %% [markdown]
# Capstone I runs four devices. On a CPU, XLA can split the host into several devices; the flag must
# be set before JAX starts, so this cell sets it before any `import jax` (on a TPU runtime it affects
# only the CPU backend, where the checks run the ring).

# %% tags=["nbval-ignore-output"]
import os

FLAG = "--xla_force_host_platform_device_count=4"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FLAG}".strip()

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpuattn.measure import runtime
from tpuattn.puzzles import capstones as puzzles
from tpuattn.puzzles import check, draw_grid
from tpuattn.puzzles.capstones import pallas_call
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
FETCH, RESIDENT = style.STEP_COLOURS["fetch"], style.STEP_COLOURS["resident"]
EMPTY, PARTIAL, FULL = (style.TILE_COLOURS[code] for code in (0, 1, 2))  # skipped, masked, whole
BLOCK, SCALE = puzzles.BLOCK, puzzles.SCALE  # 128 rows a block; 1/sqrt(128)


def panels(n=1, width=3.4, height=2.8):
    """A row of ``n`` small panels for a capstone's picture."""
    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False)
    return fig, axes[0]


def causal_colour(row_block, col_block):
    """A tile's colour: on the diagonal masked, below it whole, above it hidden (skipped)."""
    return PARTIAL if col_block == row_block else FULL if col_block < row_block else EMPTY


def qk(a, b):
    """a bᵀ without a transpose, in float32 (contract the last dimensions)."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def tn(a, b):
    """aᵀ b without a transpose, in float32 (contract the first dimensions)."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


# %% [markdown]
# ## How a capstone is checked
#
# Your answer is a function that builds its `pallas_call`s and calls them, passing its `interpret=`
# argument through to each. Build them with `pallas_call` from `tpuattn.puzzles.capstones` (imported
# above): `pl.pallas_call` with the same arguments plus `in_names=` (the inputs after any
# scalar-prefetch operands) and `out_names=`, so the check can walk your index maps and name your
# operands. `check(...)` then
#
# 1. runs your function in interpret mode on the CPU against a float64 NumPy oracle written from the
#    formulas (H and I in the TPU simulator with its race detector), and again with your scratch set
#    to NaN wherever a `"parallel"` axis moves on, as a megacore chip's two cores would run it;
# 2. audits what values cannot show: every index map walked over the whole grid (a block outside its
#    array; a tile the causal mask hides, copied for nothing; more copies than tiles), the launches
#    the capstone asks for, the copies H must make itself;
# 3. compiles your function for a TPU v5e with the real TPU compiler (compiled, not run),
#
# and prints one line: `PASS`, `not written yet`, the first mismatch, a race, an audit's sentence or
# the compiler's message.
#
# Two habits the compiler asks for. Divide a grid index with `jax.lax.div(h, 2)`, not `h // 2`:
# Python's floor division lowers through `sign`, which the compile-only TPU compiler cannot lower
# ("Unsupported TPU device kind: cpu"). And in H and I a wait for a copy that was never started waits
# for ever, in the simulator as on a TPU: interrupt the kernel and look at your starts and waits.

# %% [markdown]
# ## Capstone F · a causal GQA flash forward on your own schedule (★★★, 45 min)
#
# `q` is `[4, 512, 128]` (four query heads), `k` and `v` are `[2, 512, 128]` (two kv heads: query
# head `h` uses kv head `h // 2`), float32. Write `flash_forward(q, k, v, *, interpret)` that returns
# `out` (like `q`) and `lse` `[4, 512, 1]` float32, the natural-log logsumexp of each row's scores
# `s = q·k / √128`, causal (query `r` sees key `c` iff `c ≤ r`), in blocks of 128 rows.
#
# All of it is yours: the grid, the BlockSpecs and index maps, the scratch, the dimension semantics,
# and the schedule, a NumPy table you build and pass by scalar prefetch
# (`pltpu.PrefetchScalarGridSpec`): for each query block, the K/V blocks it visits. The check asks
# that no step names a tile the mask hides and that no array is copied more often than once per
# visible tile. The same function is checked again with bfloat16 inputs of 256 rows (`out` then
# bfloat16, `lse` still float32).

# %%
n = puzzles.SEQ // BLOCK
fig, axes = panels(2)
draw_grid(axes[0], n, n, labels={(i, j): f"j={j}" for i in range(n) for j in range(i + 1)},
          colours={(i, j): causal_colour(i, j) for i in range(n) for j in range(n)},
          title="one head's tiles: visited at step j", xlabel="K/V block", ylabel="query block")
draw_grid(axes[1], n, n, labels={(i, j): str(min(j, i)) for i in range(n) for j in range(n)},
          colours={(i, j): FETCH if j <= i else RESIDENT for i in range(n) for j in range(n)},
          title="the table: K/V block at (i, j)", xlabel="grid step j", ylabel="query block i")
fig.suptitle("10 of 16 tiles visible; a row past its count repeats its last block: no copy", fontsize=9,
             y=1.02)
plt.show()


# %% tags=["puzzle"]
def flash_forward(q, k, v, *, interpret):
    raise NotImplementedError("build the schedule table, then the whole pallas_call; return out, lse")


# %%
check(puzzles.FORWARD, flash_forward, chip=CHIP)
check(puzzles.FORWARD_BF16, flash_forward, chip=CHIP)

# %% [markdown] jupyter={"source_hidden": true} tags=["hint", "hide-cell"]
# **Hint 1 of 3: the shape of the launch.** Grid `(heads, query blocks, schedule steps)` = `(4, 4, 4)`:
# the first two axes own an output block (`"parallel"`), the last reduces into scratch
# (`"arbitrary"`). The table: `table[i, j]` is the K/V block query block `i` visits at step `j`,
# `counts[i]` how many it visits. Index maps receive the grid indices, then the scalar-prefetch refs:
# `lambda h, i, j, table, counts: ...`. The K/V map names kv head `jax.lax.div(h, 2)` and block
# `table[i, j]`.

# %% [markdown] jupyter={"source_hidden": true} tags=["hint", "hide-cell"]
# **Hint 2 of 3: blocks, scratch and body.** BlockSpecs `(None, 128, 128)` for `q`, `k`, `v`, `out`
# (`None` squeezes the head dimension away) and `(None, 128, 1)` for `lse`; scratch `m`, `l`
# `(128, 1)` and `acc` `(128, 128)`, float32. The kernel's arguments: the two tables, `q`, `k`, `v`,
# `out`, `lse`, then the scratch. At `j == 0` set `m = -inf`, `l = 0`, `acc = 0`; when `j < counts[i]`
# take one online-softmax step, masking with the global row `i·128 + r` and column `table[i, j]·128 + c`;
# at the last `j` write `out = acc / l` and `lse = m + log l` (without `m` it is the log of a sum of
# `exp(s - m)`, not of `exp(s)`). Pad each row of the table with its last block, so the padded steps
# name the block the step before them named and the pipeline copies nothing.

# %% [markdown] jupyter={"source_hidden": true} tags=["hint", "hide-cell"]
# **Hint 3 of 3: the launch, nearly whole.**
#
# ```python
# n = seq // BLOCK
# table = np.stack([np.minimum(np.arange(n), i) for i in range(n)]).astype(np.int32)
# counts = np.arange(1, n + 1, dtype=np.int32)
# q_spec = pl.BlockSpec((None, BLOCK, d), lambda h, i, j, table, counts: (h, i, 0))
# kv_spec = pl.BlockSpec((None, BLOCK, d),
#                        lambda h, i, j, table, counts: (jax.lax.div(h, group), table[i, j], 0))
# grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=2, grid=(heads, n, n),
#                                          in_specs=[q_spec, kv_spec, kv_spec],
#                                          out_specs=[q_spec, lse_spec], scratch_shapes=[...])
# return pallas_call(kernel, grid_spec=grid_spec, out_shape=[...], compiler_params=pltpu.CompilerParams(
#     dimension_semantics=("parallel", "parallel", "arbitrary")), interpret=interpret,
#     in_names=("q", "k", "v"), out_names=("out", "lse"))(jnp.asarray(table), jnp.asarray(counts), q, k, v)
# ```


# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solution: open after trying (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    def causal_schedule(seq, block):
        """(table [n, n], counts [n]): query block i visits K/V blocks 0..i, padded with block i."""
        n = seq // block
        table = np.stack([np.minimum(np.arange(n), i) for i in range(n)]).astype(np.int32)
        return table, np.arange(1, n + 1, dtype=np.int32)

    def forward_kernel(table_ref, counts_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref):
        i, j = pl.program_id(1), pl.program_id(2)
        kv = table_ref[i, j]  # the K/V block this step holds

        @pl.when(j == 0)
        def _init():
            m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        @pl.when(j < counts_ref[i])
        def _step():
            s = qk(q_ref[...], k_ref[...]) * SCALE
            rows = i * BLOCK + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
            cols = kv * BLOCK + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
            s = jnp.where(cols <= rows, s, -jnp.inf)  # only the diagonal tile masks anything
            m_old = m_ref[...]
            m_new = jnp.maximum(m_old, s.max(axis=1, keepdims=True))
            p = jnp.exp(s - m_new)
            alpha = jnp.exp(m_old - m_new)
            l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
            acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p.astype(v_ref.dtype), v_ref[...],
                                                          preferred_element_type=jnp.float32)
            m_ref[...] = m_new

        @pl.when(j == pl.num_programs(2) - 1)
        def _finish():
            o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)
            lse_ref[...] = m_ref[...] + jnp.log(l_ref[...])

    def flash_forward(q, k, v, *, interpret):
        heads, seq, d = q.shape
        group = heads // k.shape[0]
        table, counts = causal_schedule(seq, BLOCK)
        q_spec = pl.BlockSpec((None, BLOCK, d), lambda h, i, j, table, counts: (h, i, 0))
        kv_spec = pl.BlockSpec((None, BLOCK, d),
                               lambda h, i, j, table, counts: (jax.lax.div(h, group), table[i, j], 0))
        lse_spec = pl.BlockSpec((None, BLOCK, 1), lambda h, i, j, table, counts: (h, i, 0))
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(heads, seq // BLOCK, table.shape[1]),
            in_specs=[q_spec, kv_spec, kv_spec], out_specs=[q_spec, lse_spec],
            scratch_shapes=[pltpu.VMEM((BLOCK, 1), jnp.float32), pltpu.VMEM((BLOCK, 1), jnp.float32),
                            pltpu.VMEM((BLOCK, d), jnp.float32)])
        return pallas_call(
            forward_kernel, grid_spec=grid_spec,
            out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                       jax.ShapeDtypeStruct((heads, seq, 1), jnp.float32)],
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
            interpret=interpret, in_names=("q", "k", "v"), out_names=("out", "lse"),
        )(jnp.asarray(table), jnp.asarray(counts), q, k, v)

    check(puzzles.FORWARD, flash_forward, chip=CHIP)
    check(puzzles.FORWARD_BF16, flash_forward, chip=CHIP)
    print("the schedule table:\n", causal_schedule(puzzles.SEQ, BLOCK)[0])

# %% [markdown]
# ## Capstone G · the backward and its custom VJP (★★★, 60 min)
#
# Write `flash_attention(q, k, v, *, interpret)` that returns `out` and is differentiable: a
# `jax.custom_vjp` whose forward is your `flash_forward` (it saves `q`, `k`, `v`, `out` and `lse` for
# the backward; if you skipped F, `puzzles.package_forward` is the package's own Pallas forward in
# F's layout) and whose backward makes two launches: one writing dQ (`out_names=("dq",)`) and one
# writing dK and dV (`out_names=("dk", "dv")`). The shapes are F's with 256 rows (two blocks).
#
# For each head, with `P = exp(S − lse)` recomputed per tile and `δ = rowsum(dO ∘ O)`:
# `dV = Pᵀ dO`, `dS = P ∘ (dO Vᵀ − δ)`, `dQ = dS K · scale`, `dK = dSᵀ Q · scale`; a kv head's dK and
# dV sum over the query heads of its group. The check takes `jax.grad` of `Σ out ∘ dO` with respect to
# `q`, `k`, `v`, compares it with the float64 oracle's gradients (a mismatch names dQ, dK or dV), and
# audits both backward launches as it audits the forward's.

# %%
n = puzzles.GRAD_SEQ // BLOCK
fig, axes = panels(2, width=3.0)
draw_grid(axes[0], n, n, labels={(i, j): f"t={j}" for i in range(n) for j in range(i + 1)},
          colours={(i, j): causal_colour(i, j) for i in range(n) for j in range(n)},
          title="dQ: query block i, steps over K/V", xlabel="K/V block", ylabel="query block i")
draw_grid(axes[1], n, n, labels={(j, i): f"t={i - j}" for j in range(n) for i in range(j, n)},
          colours={(j, i): causal_colour(i, j) for j in range(n) for i in range(n)},
          title="dK, dV: K/V block j, steps over queries", xlabel="query block", ylabel="K/V block j")
fig.suptitle("the same visible tiles, walked by rows for dQ and by columns for dK and dV", fontsize=9,
             y=1.02)
plt.show()


# %% tags=["puzzle"]
def flash_attention(q, k, v, *, interpret):
    raise NotImplementedError("a jax.custom_vjp: your forward, then a dQ launch and a dK/dV launch")


# %%
check(puzzles.BACKWARD, flash_attention, chip=CHIP)

# %% [markdown] jupyter={"source_hidden": true} tags=["hint", "hide-cell"]
# **Hint 1 of 3: the plan.** In the backward compute `δ = Σ_d out ∘ dO` (a `[4, 256, 1]` column) in
# plain JAX. The dQ launch is the forward's: the same grid, table and K/V map, inputs
# `q, k, v, do, lse, delta`, one `(128, 128)` float32 accumulator. The dK/dV launch turns the walk
# around: grid `(kv heads, K/V blocks, query heads of the group, query-block steps)`, with a second
# table: K/V block `j` is seen by query blocks `j, j + 1, …` (pad each row with its last). Its query
# side names head `hk * 2 + g`, its two accumulators sum over both of the last two axes.

# %% [markdown] jupyter={"source_hidden": true} tags=["hint", "hide-cell"]
# **Hint 2 of 3: the bodies.** Recompute the tile `P = where(cols <= rows, exp(S − lse), 0)` from the
# global rows and columns. dQ: `acc += (P ∘ (dO Vᵀ − δ)) K · scale`, zeroed at the first step, written
# at the last. dK/dV: `dv_acc += Pᵀ dO`, `dk_acc += dSᵀ Q · scale` (`tn(a, b)` is `aᵀ b`); zero them
# when `g == 0` and `t == 0`, write them when both are at their last index, and mark both of those
# axes `"arbitrary"`: their steps share one output block.

# %% [markdown] jupyter={"source_hidden": true} tags=["hint", "hide-cell"]
# **Hint 3 of 3: the wiring.**
#
# ```python
# def flash_attention(q, k, v, *, interpret):
#     @jax.custom_vjp
#     def attention(q, k, v):
#         return flash_forward(q, k, v, interpret=interpret)[0]
#
#     def attention_forward(q, k, v):
#         out, lse = flash_forward(q, k, v, interpret=interpret)
#         return out, (q, k, v, out, lse)
#
#     def attention_backward(residuals, do):
#         return flash_backward(*residuals, do, interpret=interpret)  # -> (dq, dk, dv)
#
#     attention.defvjp(attention_forward, attention_backward)
#     return attention(q, k, v)
# ```


# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solution: open after trying (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    def tile_probabilities(q, k, lse, i, j):
        """P of query block i against K/V block j, recomputed from the logsumexp, masked causally."""
        s = qk(q, k) * SCALE
        rows = i * BLOCK + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
        cols = j * BLOCK + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        return jnp.where(cols <= rows, jnp.exp(s - lse), 0.0)

    def dq_kernel(table_ref, counts_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, acc_ref):
        i, t = pl.program_id(1), pl.program_id(2)

        @pl.when(t == 0)
        def _init():
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        @pl.when(t < counts_ref[i])
        def _step():
            k = k_ref[...]
            p = tile_probabilities(q_ref[...], k, lse_ref[...], i, table_ref[i, t])
            ds = p * (qk(do_ref[...], v_ref[...]) - delta_ref[...])
            acc_ref[...] += jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32) * SCALE

        @pl.when(t == pl.num_programs(2) - 1)
        def _write():
            dq_ref[...] = acc_ref[...].astype(dq_ref.dtype)

    def dkv_kernel(table_ref, counts_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref,
                   dk_acc, dv_acc):
        j, g, t = pl.program_id(1), pl.program_id(2), pl.program_id(3)

        @pl.when((g == 0) & (t == 0))
        def _init():
            dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
            dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

        @pl.when(t < counts_ref[j])
        def _step():
            q, do = q_ref[...], do_ref[...]
            p = tile_probabilities(q, k_ref[...], lse_ref[...], table_ref[j, t], j)
            ds = p * (qk(do, v_ref[...]) - delta_ref[...])
            dv_acc[...] += tn(p.astype(do.dtype), do)
            dk_acc[...] += tn(ds.astype(q.dtype), q) * SCALE

        @pl.when((g == pl.num_programs(2) - 1) & (t == pl.num_programs(3) - 1))
        def _write():
            dk_ref[...] = dk_acc[...].astype(dk_ref.dtype)
            dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)

    def transposed_schedule(seq, block):
        """(table [n, n], counts [n]): K/V block j is seen by query blocks j..n-1, padded with block n-1."""
        n = seq // block
        table = np.stack([np.minimum(np.arange(n) + j, n - 1) for j in range(n)]).astype(np.int32)
        return table, (n - np.arange(n)).astype(np.int32)

    def flash_backward(q, k, v, out, lse, do, *, interpret):
        heads, seq, d = q.shape
        kv_heads = k.shape[0]
        group, n = heads // kv_heads, seq // BLOCK
        delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1, keepdims=True)
        inputs = ("q", "k", "v", "do", "lse", "delta")

        table, counts = causal_schedule(seq, BLOCK)  # dQ: the forward's walk
        row = pl.BlockSpec((None, BLOCK, d), lambda h, i, t, table, counts: (h, i, 0))
        stat = pl.BlockSpec((None, BLOCK, 1), lambda h, i, t, table, counts: (h, i, 0))
        kv = pl.BlockSpec((None, BLOCK, d),
                          lambda h, i, t, table, counts: (jax.lax.div(h, group), table[i, t], 0))
        dq = pallas_call(
            dq_kernel, grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=2, grid=(heads, n, n), in_specs=[row, kv, kv, row, stat, stat],
                out_specs=row, scratch_shapes=[pltpu.VMEM((BLOCK, d), jnp.float32)]),
            out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
            interpret=interpret, in_names=inputs, out_names=("dq",),
        )(jnp.asarray(table), jnp.asarray(counts), q, k, v, do, lse, delta)

        table, counts = transposed_schedule(seq, BLOCK)  # dK, dV: the walk turned around

        def query_side(hk, j, g, t, table, counts):
            return hk * group + g, table[j, t], 0

        row, stat = pl.BlockSpec((None, BLOCK, d), query_side), pl.BlockSpec((None, BLOCK, 1), query_side)
        kv = pl.BlockSpec((None, BLOCK, d), lambda hk, j, g, t, table, counts: (hk, j, 0))
        dk, dv = pallas_call(
            dkv_kernel, grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=2, grid=(kv_heads, n, group, n), in_specs=[row, kv, kv, row, stat, stat],
                out_specs=[kv, kv], scratch_shapes=[pltpu.VMEM((BLOCK, d), jnp.float32)] * 2),
            out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "arbitrary", "arbitrary")),
            interpret=interpret, in_names=inputs, out_names=("dk", "dv"),
        )(jnp.asarray(table), jnp.asarray(counts), q, k, v, do, lse, delta)
        return dq, dk, dv

    def flash_attention(q, k, v, *, interpret):
        forward = flash_forward  # or puzzles.package_forward

        @jax.custom_vjp
        def attention(q, k, v):
            return forward(q, k, v, interpret=interpret)[0]

        def attention_forward(q, k, v):
            out, lse = forward(q, k, v, interpret=interpret)
            return out, (q, k, v, out, lse)

        def attention_backward(residuals, do):
            return flash_backward(*residuals, do, interpret=interpret)

        attention.defvjp(attention_forward, attention_backward)
        return attention(q, k, v)

    check(puzzles.BACKWARD, flash_attention, chip=CHIP)

# %% [markdown]
# ## Capstone H · decode, pages copied by hand (★★★, 45 min)
#
# One decode step over a paged KV cache: `q` `[2, 8, 128]` (two sequences, one new token each, eight
# query heads sharing one kv head), the cache a pool of pages `k_pages`, `v_pages` `[12, 16, 128]`
# (12 pages of 16 tokens), `page_table` `[2, 8]` and `lengths` `[2]` int32 (100 and 37 tokens: 7
# pages and 3). Token `t` of sequence `b` sits in page `page_table[b, t // 16]`, row `t % 16`. Write
# `decode_step(q, k_pages, v_pages, page_table, lengths, *, interpret)` returning `out` `[2, 8, 128]`.
#
# The pipeline copies nothing for you here: the pools stay in HBM (`pl.BlockSpec(memory_space=pl.ANY)`),
# and the kernel copies each page it needs with `pltpu.make_async_copy` into one of two VMEM slots,
# starting page `p + 1`'s copy before it computes on page `p`, and waiting on a copy's DMA semaphore
# before it reads the slot. The check runs the TPU simulator's race detector, which sees a read of a
# slot that a copy may still be writing. The table's entries past a sequence's pages name page 11,
# whose values are NaN: compute with it and the output is NaN.

# %%
pages = -(-puzzles.DECODE_LENGTHS[0] // puzzles.PAGE_SIZE)
fig, (ax,) = panels(width=7.0, height=1.9)
labels, colours = {}, {}
for p in range(pages):
    labels[(p % 2, p)], colours[(p % 2, p)] = f"read {p}", FULL
    if p + 1 < pages:
        labels[((p + 1) % 2, p)], colours[((p + 1) % 2, p)] = f"copy {p + 1}", FETCH
draw_grid(ax, 2, pages, labels=labels, colours=colours, xlabel="loop step p", ylabel="VMEM slot",
          title="sequence 0: page p is read while page p + 1 arrives")
plt.show()


# %% tags=["puzzle"]
def decode_step(q, k_pages, v_pages, page_table, lengths, *, interpret):
    raise NotImplementedError("copy each page yourself into two VMEM slots, double-buffered")


# %%
check(puzzles.DECODE, decode_step, chip=CHIP)

# %% [markdown] jupyter={"source_hidden": true} tags=["hint", "hide-cell"]
# **Hint 1 of 3: the launch.** Grid `(2,)` over the sequences (`"parallel"`), the tables by scalar
# prefetch, `q` and `out` with `pl.BlockSpec((None, 8, 128), lambda b, table, lengths: (b, 0, 0))`,
# the pools with `pl.BlockSpec(memory_space=pl.ANY)`. Scratch: `pltpu.VMEM((2, 16, 128), ...)` for K
# and for V, and `pltpu.SemaphoreType.DMA((2, 2))` (K or V, slot). In the kernel, the number of pages
# is `jax.lax.div(length + 15, 16)`; loop over them with `jax.lax.fori_loop`, carrying the online
# softmax's `(m, l, acc)` as values.

# %% [markdown] jupyter={"source_hidden": true} tags=["hint", "hide-cell"]
# **Hint 2 of 3: the order.** Start page 0's copies into slot 0 before the loop. At step `p`, with
# `slot = jax.lax.rem(p, 2)`: wait for page `p`'s copies (a descriptor made again with the same
# source, destination and semaphore waits for the one started earlier); then, if `p + 1` is a page of
# the sequence, start its copies into slot `1 − slot`; then compute on slot `slot`, masking tokens at
# or past `length`. Started into the same slot, the next copy would overwrite the page being read: the
# race the detector reports.

# %% [markdown] jupyter={"source_hidden": true} tags=["hint", "hide-cell"]
# **Hint 3 of 3: the copies.**
#
# ```python
# def copies(p, slot):  # page p of sequence b into VMEM slot `slot`: one DMA for K, one for V
#     page = table_ref[b, p]
#     return (pltpu.make_async_copy(k_hbm.at[page], k_buf.at[slot], sems.at[0, slot]),
#             pltpu.make_async_copy(v_hbm.at[page], v_buf.at[slot], sems.at[1, slot]))
#
# for copy in copies(p, slot):
#     copy.wait()
# ```


# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solution: open after trying (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    PAGE_SIZE = puzzles.PAGE_SIZE

    def decode_kernel(table_ref, lengths_ref, q_ref, k_hbm, v_hbm, o_ref, k_buf, v_buf, sems):
        b = pl.program_id(0)
        length = lengths_ref[b]
        num_pages = jax.lax.div(length + PAGE_SIZE - 1, PAGE_SIZE)

        def copies(p, slot):  # page p of sequence b into VMEM slot `slot`: one DMA for K, one for V
            page = table_ref[b, p]
            return (pltpu.make_async_copy(k_hbm.at[page], k_buf.at[slot], sems.at[0, slot]),
                    pltpu.make_async_copy(v_hbm.at[page], v_buf.at[slot], sems.at[1, slot]))

        for copy in copies(0, 0):
            copy.start()
        q = q_ref[...]

        def step(p, state):
            m, l_sum, acc = state
            slot = jax.lax.rem(p, 2)
            for copy in copies(p, slot):
                copy.wait()

            @pl.when(p + 1 < num_pages)
            def _prefetch():  # the next page's copy runs while this page is read
                for copy in copies(p + 1, 1 - slot):
                    copy.start()

            s = qk(q, k_buf[slot]) * SCALE
            tokens = p * PAGE_SIZE + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
            s = jnp.where(tokens < length, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
            alpha, pr = jnp.exp(m - m_new), jnp.exp(s - m_new)
            acc = alpha * acc + jnp.dot(pr, v_buf[slot], preferred_element_type=jnp.float32)
            return m_new, alpha * l_sum + pr.sum(axis=1, keepdims=True), acc

        heads, d = q.shape
        state = (jnp.full((heads, 1), -jnp.inf, jnp.float32), jnp.zeros((heads, 1), jnp.float32),
                 jnp.zeros((heads, d), jnp.float32))
        _, l_sum, acc = jax.lax.fori_loop(0, num_pages, step, state)
        o_ref[...] = (acc / l_sum).astype(o_ref.dtype)

    def decode_step(q, k_pages, v_pages, page_table, lengths, *, interpret):
        batch, heads, d = q.shape
        row = pl.BlockSpec((None, heads, d), lambda b, table, lengths: (b, 0, 0))
        hbm = pl.BlockSpec(memory_space=pl.ANY)  # the pools stay in HBM: the kernel copies pages itself
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(batch,), in_specs=[row, hbm, hbm], out_specs=row,
            scratch_shapes=[pltpu.VMEM((2, PAGE_SIZE, d), k_pages.dtype),
                            pltpu.VMEM((2, PAGE_SIZE, d), v_pages.dtype), pltpu.SemaphoreType.DMA((2, 2))])
        return pallas_call(
            decode_kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)), interpret=interpret,
            in_names=("q", "k_pages", "v_pages"), out_names=("out",),
        )(page_table, lengths, q, k_pages, v_pages)

    check(puzzles.DECODE, decode_step, chip=CHIP)

# %% [markdown]
# ## Capstone I · ring attention with remote copies, causal (★★★, 60 min)
#
# Four devices on the mesh axis `"ring"`. Device `d` holds query block `d` and, at first, K/V block
# `d` (32 rows × 128 each, one head, float32); attention is causal over the whole 128-row sequence.
# Write `ring_attention(q, k, v, *, interpret)`, called on each device inside `shard_map` with its own
# `[32, 128]` blocks, returning its `out` `[32, 128]` float32: one `pallas_call` without a grid whose
# kernel runs the ring's four steps. At step `s` the device holds K/V block `(d − s) mod 4`: it
# attends it (masked as that block, skipped when the mask hides all of it) and sends it on to device
# `d + 1` with `pltpu.make_async_remote_copy`, into that device's other slot. Sent the other way, a
# device holds another block than the one it masks for: with a causal mask, the direction matters.
#
# Two slots per array means a slot is written again two steps later, so before a device sends into
# its neighbour's slot it waits until the neighbour says it is done with it: a REGULAR semaphore the
# neighbour raises with `pl.semaphore_signal(sem, 1, device_id=..., device_id_type=pl.DeviceIdType.MESH)`.
#
# The check runs the four devices' kernels in interpret mode: JAX's TPU simulator
# (`pltpu.InterpretParams(detect_races=True)`) carries out remote copies and remote semaphore signals
# between the CPU devices of a `shard_map`, and its race detector watches every device's buffers. Then
# it compiles the ring for a compile-only 2×2 slice of v5e chips.

# %%
N_DEV = puzzles.RING_DEVICES
held = {(d, s): (d - s) % N_DEV for d in range(N_DEV) for s in range(N_DEV)}
fig, (ax,) = panels(width=4.4, height=3.0)
draw_grid(ax, N_DEV, N_DEV, labels={key: f"K/V {b}" for key, b in held.items()},
          colours={(d, s): causal_colour(d, b) for (d, s), b in held.items()},
          title="device d at step s holds K/V block (d − s) mod 4", xlabel="ring step s", ylabel="device d")
plt.show()


# %% tags=["puzzle"]
def ring_attention(q, k, v, *, interpret):
    raise NotImplementedError("one kernel: attend the block you hold, send it to d + 1, four times")


# %%
devices = puzzles.ring_devices()
print(f"the ring's check runs on {len(devices)} {devices[0].platform.upper()} devices")
check(puzzles.RING, ring_attention, chip=CHIP)

# %% [markdown] jupyter={"source_hidden": true} tags=["hint", "hide-cell"]
# **Hint 1 of 3: the launch and the names.** `in_specs=[vmem] * 3`, `out_specs=vmem` with
# `vmem = pl.BlockSpec(memory_space=pltpu.VMEM)`; scratch: two `(2, 32, 128)` slots for K and V,
# `m`, `l` `(32, 1)` and `acc` `(32, 128)` float32, `pltpu.SemaphoreType.DMA((2,))` twice (send and
# receive, one each for K and V) and one `pltpu.SemaphoreType.REGULAR`. In the kernel,
# `d = jax.lax.axis_index(puzzles.RING_AXIS)`, `right = jax.lax.rem(d + 1, 4)`,
# `left = jax.lax.rem(d + 3, 4)`; copy `k_ref`, `v_ref` into slot 0, then a Python loop over the four
# steps, slot `s % 2`.

# %% [markdown] jupyter={"source_hidden": true} tags=["hint", "hide-cell"]
# **Hint 2 of 3: one step.** If `s < 3`: when `s > 0`, wait for `free` (the right neighbour is done with
# the slot you are about to fill); start the K and V remote copies from your slot `s % 2` to the right
# neighbour's slot `(s + 1) % 2`. Attend your slot `s % 2` under `pl.when(kv_block <= d)`, with `m`,
# `l`, `acc` in scratch and the columns of block `kv_block = (d − s) mod 4`. Then, if `s < 3`, wait for
# your copies (`.wait()` waits for your send to leave and the left neighbour's to arrive) and, when
# `s < 2`, signal `free` on the left neighbour: your slot `s % 2` is read and sent, so it may fill it
# at step `s + 1`. Two signals, two waits: every semaphore ends at zero.

# %% [markdown] jupyter={"source_hidden": true} tags=["hint", "hide-cell"]
# **Hint 3 of 3: the calls.**
#
# ```python
# sends = [pltpu.make_async_remote_copy(src_ref=buf.at[cur], dst_ref=buf.at[nxt], send_sem=send_sems.at[x],
#                                       recv_sem=recv_sems.at[x], device_id=(right,),
#                                       device_id_type=pl.DeviceIdType.MESH)
#          for x, buf in enumerate((k_buf, v_buf))]
# for send in sends:
#     send.start()
# ...
# pl.semaphore_wait(free_sem, 1)
# pl.semaphore_signal(free_sem, 1, device_id=(left,), device_id_type=pl.DeviceIdType.MESH)
# ```


# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solution: open after trying (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    ROWS, AXIS = puzzles.RING_ROWS, puzzles.RING_AXIS

    def ring_kernel(q_ref, k_ref, v_ref, o_ref, k_buf, v_buf, m_ref, l_ref, acc_ref, send_sems, recv_sems,
                    free_sem):
        d = jax.lax.axis_index(AXIS)
        right, left = jax.lax.rem(d + 1, N_DEV), jax.lax.rem(d + N_DEV - 1, N_DEV)
        k_buf[0] = k_ref[...]
        v_buf[0] = v_ref[...]
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        for s in range(N_DEV):
            cur, nxt = s % 2, (s + 1) % 2
            if s < N_DEV - 1:
                if s > 0:
                    pl.semaphore_wait(free_sem, 1)  # the right neighbour is done with its slot nxt
                sends = [pltpu.make_async_remote_copy(
                    src_ref=buf.at[cur], dst_ref=buf.at[nxt], send_sem=send_sems.at[x],
                    recv_sem=recv_sems.at[x], device_id=(right,), device_id_type=pl.DeviceIdType.MESH)
                    for x, buf in enumerate((k_buf, v_buf))]
                for send in sends:
                    send.start()
            kv_block = jax.lax.rem(d + N_DEV - s, N_DEV)  # the block the ring's schedule says we hold

            @pl.when(kv_block <= d)  # a block wholly in the future: nothing to attend
            def _attend(cur=cur, kv_block=kv_block):  # bound now: the loop moves on
                sc = qk(q_ref[...], k_buf[cur]) * SCALE
                rows = d * ROWS + jax.lax.broadcasted_iota(jnp.int32, sc.shape, 0)
                cols = kv_block * ROWS + jax.lax.broadcasted_iota(jnp.int32, sc.shape, 1)
                sc = jnp.where(cols <= rows, sc, -jnp.inf)
                m_old = m_ref[...]
                m_new = jnp.maximum(m_old, sc.max(axis=1, keepdims=True))
                alpha, p = jnp.exp(m_old - m_new), jnp.exp(sc - m_new)
                l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
                pv = jnp.dot(p, v_buf[cur], preferred_element_type=jnp.float32)
                acc_ref[...] = alpha * acc_ref[...] + pv
                m_ref[...] = m_new

            if s < N_DEV - 1:
                for send in sends:
                    send.wait()  # our copy has left slot cur, the left neighbour's has filled our slot nxt
                if s < N_DEV - 2:  # the left neighbour may fill our slot cur at step s + 1
                    pl.semaphore_signal(free_sem, 1, device_id=(left,), device_id_type=pl.DeviceIdType.MESH)
        o_ref[...] = acc_ref[...] / l_ref[...]

    def ring_attention(q, k, v, *, interpret):
        rows, d = q.shape
        vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
        return pallas_call(
            ring_kernel, out_shape=jax.ShapeDtypeStruct(q.shape, jnp.float32), in_specs=[vmem] * 3,
            out_specs=vmem,
            scratch_shapes=[pltpu.VMEM((2, rows, d), k.dtype), pltpu.VMEM((2, rows, d), v.dtype),
                            pltpu.VMEM((rows, 1), jnp.float32), pltpu.VMEM((rows, 1), jnp.float32),
                            pltpu.VMEM((rows, d), jnp.float32), pltpu.SemaphoreType.DMA((2,)),
                            pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.REGULAR],
            interpret=interpret, in_names=("q", "k", "v"), out_names=("out",))(q, k, v)

    check(puzzles.RING, ring_attention, chip=CHIP)

# %% [markdown]
# ## Takeaways
#
# > **Takeaway.** A `pallas_call` is five decisions: the grid (which axes own an output block, which
# > reduce), the BlockSpecs (what each step sees, and so what it copies), the scratch (what lives
# > across steps), the dimension semantics (what a megacore chip may split), and the scalar-prefetch
# > tables (a schedule as data, read by the index maps before the step runs).
#
# > **Takeaway.** The backward is the forward's tiles walked twice more, by rows for dQ and by columns
# > for dK and dV; the forward's logsumexp and `δ = rowsum(dO ∘ O)` are all it needs, and
# > `jax.custom_vjp` is the whole of the wiring.
#
# > **Takeaway.** A DMA you start yourself is yours to wait for: two slots let the next copy run while
# > the current one is read, and a read of a slot a copy may still be writing is a race, which the
# > simulator's race detector names even when the values happen to come out right.
#
# > **Takeaway.** A remote copy is the same DMA aimed at another chip, with one more rule: the
# > receiver must say when a slot is free. In a causal ring, the direction K/V travels is the schedule
# > the mask assumes; on a real slice the devices of early blocks idle while the late ones work, which
# > is what notebook 06's zigzag layout fixes.
#
# ## References
#
# - S. Rush, Triton-Puzzles, https://github.com/srush/Triton-Puzzles (the last chapter: the whole
#   flash-attention kernel); A. Vorushin, Pallas puzzles, https://github.com/vorushin/pallas_puzzles
#   ("configure your own pallas_call").
# - JAX documentation: Pallas TPU pipelining https://docs.jax.dev/en/latest/pallas/tpu/pipelining.html,
#   scalar prefetch and block-sparse kernels https://docs.jax.dev/en/latest/pallas/tpu/sparse.html,
#   distributed Pallas (remote copies, semaphores, the ring) https://docs.jax.dev/en/latest/pallas/tpu/distributed.html.
# - T. Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning", 2023,
#   arXiv:2307.08691 (the forward's logsumexp and the backward's recomputation).
# - W. Kwon et al., "Efficient Memory Management for Large Language Model Serving with
#   PagedAttention", 2023, arXiv:2309.06180 (the page table).
# - H. Liu, M. Zaharia, P. Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite
#   Context", 2023, arXiv:2310.01889.
