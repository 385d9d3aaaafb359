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
# # 09 · Puzzles, backward: gradients, masks, decode and the ring
#
# The forward puzzles ended with a flash forward, its causal schedule and GQA. This notebook asks:
# **can you write the kernels that come after the forward: the backward's dQ and dK/dV, a masked and
# soft-capped forward, split-K decode over a paged cache, and one step of ring attention?** Three
# broken kernels close it, each wrong in a way that a different check catches.
#
# **What you'll do**
# - write the dQ kernel and the dK/dV kernel from the forward's logsumexp and `delta = rowsum(dO·O)`;
# - mask a sliding window inside a tile and cap the scores with `tanh`;
# - write the page index map of split-K decode (scalar prefetch) and merge its chunks' partial results;
# - write one step of causal ring attention: attend the K/V block the ring's schedule says this device
#   holds, merge, pass K/V on with `jax.lax.ppermute` in the direction that schedule needs;
# - find and fix three bugs: an index map that fetches hidden blocks, a bfloat16 accumulator, and a
#   block shape the TPU compiler refuses.
#
# As in notebook 08, each `check(...)` runs your answer in interpret mode on the CPU against a float64
# NumPy answer, then compiles it for a TPU v5e with the real TPU compiler (compiled, not run), and prints
# one line: `PASS`, `not written yet`, the first mismatch (naming the output: `dQ`, `dK`, `dV`), a rule
# the values cannot show (a block index outside its array, scratch carried across a `"parallel"` grid
# axis, a copy the pipeline need not make), or the compiler's message. Each puzzle has a collapsed
# solution cell after its check: try first. As in notebook 08, solutions run only with
# `RUN_SOLUTIONS = True` (parameters cell), so Run All shows your own answers' checks alone.
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/tpuattn/tpuattn/blob/main/notebooks/09_puzzles_backward.ipynb)

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

from tpuattn.measure import runtime
from tpuattn.puzzles import backward_puzzles as puzzles
from tpuattn.puzzles import check, draw_grid
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
WASTED = style.STEP_COLOURS["fetch_idle"]
EMPTY, PARTIAL = style.TILE_COLOURS[0], style.TILE_COLOURS[1]
SCALE = puzzles.SCALE  # 1/sqrt(128)


def panels(n=1, width=3.2, height=2.6):
    """A row of ``n`` small panels for a puzzle's picture."""
    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False)
    return fig, axes[0]


def qk(a, b):
    """a bᵀ without a transpose, in float32 (contract the last dimensions)."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def tn(a, b):
    """aᵀ b without a transpose, in float32 (contract the first dimensions)."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


# %% [markdown]
# ## The backward in five lines
#
# For one head with `S = Q Kᵀ · scale`, `P = softmax(S)` and `O = P V`, the gradients of a loss with
# `dO = ∂L/∂O` are
#
# ```
# dV = Pᵀ dO           dP = dO Vᵀ           dS = P ∘ (dP − δ),  δ = rowsum(dO ∘ O)
# dQ = dS K · scale    dK = dSᵀ Q · scale
# ```
#
# A flash backward never keeps `P`: it recomputes each tile as `P = exp(S − lse)` from the forward's
# per-row logsumexp `lse`, and takes `δ` from a small first pass (bug E below is that pass). Both
# arrive as `[256, 1]` float32 columns, so a `(64, 1)` block of them lines up with a `(64, 128)`
# block of rows. Puzzles 9 and 10 split the work as JAX's own Pallas TPU kernels do (flash attention's
# `_flash_attention_bwd_dq` and `_flash_attention_bwd_dkv`, splash's `_splash_attention_bwd_dq` and
# `_splash_attention_bwd_dkv`): one kernel owns a block of dQ and loops over K/V; another owns a block
# of dK and dV and loops over Q. (FlashAttention-2 on GPUs instead loops over K/V once and adds into dQ
# with atomic adds.)

# %% [markdown]
# ## Puzzle 9 · the dQ kernel (★★☆, 15 min)
#
# One head, non-causal: `q`, `k`, `v`, `do` `[256, 128]` float32, `lse` and `delta` `[256, 1]`. The
# grid is `(query blocks, kv blocks) = (4, 2)`; step `(i, j)` gets `q_ref`, `do_ref` `(64, 128)`,
# `lse_ref`, `delta_ref` `(64, 1)` (block `i`), `k_ref`, `v_ref` `(128, 128)` (block `j`), the output
# `dq_ref` (block `i`) and `acc_ref`, a `(64, 128)` float32 scratch that persists over `j`.
#
# Write the body: zero `acc` at `j == 0`; each step recompute `P = exp(S − lse)`, form
# `dS = P ∘ (dO Vᵀ − δ)` and add `dS K · scale`; write `acc` at the last `j`. The helpers `qk(a, b)`
# (`a bᵀ`) and `tn(a, b)` (`aᵀ b`) are defined above; `SCALE` is `1/√128`.

# %%
fig, axes = panels(2, width=3.4)
draw_grid(axes[0], 4, 2, labels={(1, 0): "j=0", (1, 1): "j=1"}, colours={(1, 0): FETCH, (1, 1): FETCH},
          title="the grid (i, j): row i = 1 shaded", xlabel="kv block j (128 keys)",
          ylabel="query block i (64 rows)")
draw_grid(axes[1], 4, 1, labels={(1, 0): "dq, acc"}, colours={(1, 0): FETCH}, title="dq: block i",
          ylabel="query block i")
fig.suptitle("dQ of query block 1 sums over both K/V blocks", fontsize=9, y=1.08)
plt.show()


# %% tags=["puzzle"]
def dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, acc_ref):
    raise NotImplementedError("init acc at j == 0; acc += dS K * scale; write at the last j")


# %%
check(puzzles.DQ, dq_kernel, chip=CHIP)


# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solution: open after trying (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    def dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, acc_ref):
        j = pl.program_id(1)

        @pl.when(j == 0)
        def _init():
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        k = k_ref[...]
        p = jnp.exp(qk(q_ref[...], k) * SCALE - lse_ref[...])  # (64, 128): this tile of P, recomputed
        ds = p * (qk(do_ref[...], v_ref[...]) - delta_ref[...])
        acc_ref[...] += jnp.dot(ds, k, preferred_element_type=jnp.float32) * SCALE

        @pl.when(j == pl.num_programs(1) - 1)
        def _write():
            dq_ref[...] = acc_ref[...]

    check(puzzles.DQ, dq_kernel, chip=CHIP)

# %% [markdown]
# ## Puzzle 10 · the dK/dV kernel (★★☆, 15 min)
#
# The same arrays; now the grid is `(kv blocks, query blocks) = (2, 4)` and the query axis is the
# reduction. Step `(j, i)` gets the same blocks as in puzzle 9, and two outputs `dk_ref`, `dv_ref`
# (block `j`, `(128, 128)`) with two float32 scratch accumulators `dk_acc`, `dv_acc`.
#
# Write the body: zero both at `i == 0`; each step recompute `P` and `dS` for the tile, add `Pᵀ dO`
# to `dv_acc` and `dSᵀ Q · scale` to `dk_acc` (`tn` contracts the rows, no transpose needed); write
# both at the last `i`. This kernel recomputes `S` and `dP` that puzzle 9 computed too: count the
# matmuls per tile in the two bodies (3 and 4) against the forward's 2. That is the price of never
# storing `P`.

# %%
fig, axes = panels(2, width=3.4)
draw_grid(axes[0], 2, 4, labels={(0, i): f"i={i}" for i in range(4)},
          colours={(0, i): FETCH for i in range(4)}, title="the grid (j, i): row j = 0 shaded",
          xlabel="query block i (64 rows)", ylabel="kv block j (128 keys)")
draw_grid(axes[1], 2, 1, labels={(0, 0): "dk, dv"}, colours={(0, 0): FETCH}, title="dk, dv: block j",
          ylabel="kv block j")
fig.suptitle("dK and dV of K/V block 0 sum over all four query blocks", fontsize=9, y=1.02)
plt.show()


# %% tags=["puzzle"]
def dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_acc, dv_acc):
    raise NotImplementedError("init at i == 0; dv += Pᵀ dO, dk += dSᵀ Q * scale; write at the last i")


# %%
check(puzzles.DKV, dkv_kernel, chip=CHIP)


# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solution: open after trying (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    def dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_acc, dv_acc):
        i = pl.program_id(1)

        @pl.when(i == 0)
        def _init():
            dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
            dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

        q, do = q_ref[...], do_ref[...]
        p = jnp.exp(qk(q, k_ref[...]) * SCALE - lse_ref[...])
        ds = p * (qk(do, v_ref[...]) - delta_ref[...])
        dv_acc[...] += tn(p, do)
        dk_acc[...] += tn(ds, q) * SCALE

        @pl.when(i == pl.num_programs(1) - 1)
        def _write():
            dk_ref[...] = dk_acc[...]
            dv_ref[...] = dv_acc[...]

    check(puzzles.DKV, dkv_kernel, chip=CHIP)

# %% [markdown]
# ## Puzzle 11 · softcap and a sliding window, inside a tile (★★★, 15 min)
#
# Back to the forward, with two of the contract's options. `q`, `k`, `v` `[256, 128]`, blocks of 64,
# grid `(4, 4)`, the scratch of puzzle 5 (`m_ref`, `l_ref` `(64, 1)`, `acc_ref` `(64, 128)`):
#
# - **softcap** (Gemma 2): scores are squashed before the softmax, `s ← cap · tanh(s / cap)` with
#   `cap = puzzles.SOFTCAP`;
# - **sliding window** (Mistral), causal: query `r` sees key `c` iff `r − window < c ≤ r` with
#   `window = puzzles.WINDOW` keys, which is not a multiple of the block, so the mask cuts through tiles.
#
# Every grid step runs; write a body that masks each tile by element (`jax.lax.broadcasted_iota`
# gives a tile's row and column numbers; add `i · 64` and `j · 64`). A row of a tile may see no key
# at all, and before its first visible tile a row's running maximum is still `−inf`: `exp(−inf − (−inf))`
# is NaN, so subtract a safe maximum (0 where it is `−inf`). Skipping a tile that nothing sees with
# `pl.when` is optional here.

# %%
n = puzzles.MASK_GRID[0]
B = puzzles.MASK_BLOCK
visible = puzzles.window_visible()
seen = visible.reshape(n, B, n, B).any(axis=(1, 3))
print(f"window {puzzles.WINDOW}, softcap {puzzles.SOFTCAP}; tiles any row sees:\n{seen.astype(int)}")
print("largest |score| before the cap:",
      round(float(np.abs(np.asarray(qk(*puzzles.MASKED.inputs()[:2])) * SCALE).max()), 2))
fig, axes = panels(2, width=3.6, height=3.2)
draw_grid(axes[0], n, n,
          colours={(i, j): PARTIAL if seen[i, j] else EMPTY for i in range(n) for j in range(n)},
          labels={(i, j): "mask" if seen[i, j] else "" for i in range(n) for j in range(n)},
          title="tiles: masked inside, or hidden", xlabel="kv block j", ylabel="query block i")
axes[1].imshow(visible, cmap="Greys", interpolation="nearest")
axes[1].set_title("visible (query, key) pairs", fontsize=9)
axes[1].set_xlabel("key", fontsize=8)
axes[1].set_ylabel("query", fontsize=8)
plt.show()


# %% tags=["puzzle"]
def masked_kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref):
    raise NotImplementedError("online softmax with a tanh softcap and an element mask r - window < c <= r")


# %%
check(puzzles.MASKED, masked_kernel, chip=CHIP)


# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solution: open after trying (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    def masked_kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref):
        i, j = pl.program_id(0), pl.program_id(1)

        @pl.when(j == 0)
        def _init():
            m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        s = qk(q_ref[...], k_ref[...]) * SCALE
        s = puzzles.SOFTCAP * jnp.tanh(s / puzzles.SOFTCAP)  # the cap first, then the mask
        rows = i * B + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
        cols = j * B + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where((cols <= rows) & (cols > rows - puzzles.WINDOW), s, -jnp.inf)
        m_old = m_ref[...]
        m_new = jnp.maximum(m_old, s.max(axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that has seen nothing yet: p, alpha = 0
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m_old - m_safe)
        l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
        acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p, v_ref[...], preferred_element_type=jnp.float32)
        m_ref[...] = m_new

        @pl.when(j == pl.num_programs(1) - 1)
        def _write():
            o_ref[...] = acc_ref[...] / l_ref[...]  # every row sees itself: l > 0

    check(puzzles.MASKED, masked_kernel, chip=CHIP)

# %% [markdown]
# ## Puzzle 12 · split-K decode over pages (★★★, 20 min)
#
# Decoding: each sequence adds **one** query token, with 8 query heads sharing one K/V head (the heads
# are the 8 rows of a tile, as in puzzle 8). The KV cache is a pool of pages, `k_pages`, `v_pages`
# `[16 pages, 16 tokens, 128]`; sequence `b`'s token `t` sits in page `page_table[b, t // 16]` at row
# `t % 16`, and `lengths[b]` tokens are valid. Page-table entries past a sequence's last page are
# padding: pages that hold none of its tokens.
#
# One query row per head is too little work for one long loop, so split-K decode splits each
# sequence's pages into **chunks** that run independently and merges them afterwards. The grid is
# `(sequence b, chunk c, page p in the chunk) = (2, 2, 4)`: chunk `c` covers the sequence's pages
# `4c … 4c + 3`, runs the online softmax over them (the body is given; it masks tokens past
# `lengths[b]` and skips pages past the end), and writes a partial result `(out, m, l)`: `out`
# normalised by its own `l`; a chunk with no token gives `out = 0, m = −inf, l = 0`.
#
# Write `decode_parts()` returning two functions:
#
# - `page_index_map(b, c, p, page_table_ref, lengths_ref)` → `(page, 0, 0)`: the K/V page step
#   `(b, c, p)` reads (the page table and lengths are scalar-prefetch arrays in SMEM). A step past the
#   sequence's last page must fetch nothing new: re-name its last page, as in puzzle 6. Write integer
#   division as `jax.lax.div(a, b)` (the lengths are positive): on JAX 0.10.2, `//` on int32 lowers
#   through `sign`, whose TPU lowering asks the local device for its TPU generation, which a
#   compile-only setup on a CPU host does not have (JAX 0.7.2 compiles `//` here).
# - `merge(out, m, l)` with `out` `[2, 2, 8, 128]`, `m`, `l` `[2, 2, 8, 1]` (`[sequence, chunk, head, …]`)
#   → `[2, 8, 128]`: weigh each chunk by `l · exp(m − max m)`; an empty chunk must weigh 0.

# %%
table, lengths = puzzles.decode_tables()
print("page_table =\n", table, "\nlengths =", lengths)
n_chunks, per_chunk, page = puzzles.DECODE_CHUNKS, puzzles.PAGES_PER_CHUNK, puzzles.PAGE_SIZE
fig, axes = panels(2, width=3.6, height=2.2)
for b, ax in enumerate(axes):
    last = (int(lengths[b]) - 1) // page
    draw_grid(ax, n_chunks, per_chunk,
              labels={(c, p): int(table[b, c * per_chunk + p]) if c * per_chunk + p <= last else "pad"
                      for c in range(n_chunks) for p in range(per_chunk)},
              colours={(c, p): FETCH if c * per_chunk + p <= last else IDLE
                       for c in range(n_chunks) for p in range(per_chunk)},
              title=f"sequence {b}: {int(lengths[b])} tokens", xlabel="page p in the chunk", ylabel="chunk c")
fig.suptitle("the page each grid step (b, c, p) reads; padding steps must fetch nothing new", fontsize=9,
             y=1.04)
plt.show()


# %% tags=["puzzle"]
def decode_parts():
    def page_index_map(b, c, p, page_table_ref, lengths_ref):
        raise NotImplementedError("the page of step (b, c, p); past the end, the sequence's last page")

    def merge(out, m, l):  # noqa: E741 - l is the softmax's row sum, as in the papers
        raise NotImplementedError("weigh each chunk by l * exp(m - max m)")

    return page_index_map, merge


# %%
check(puzzles.DECODE, decode_parts, chip=CHIP)


# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solution: open after trying (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    def decode_parts():
        def page_index_map(b, c, p, page_table_ref, lengths_ref):
            last = jax.lax.div(lengths_ref[b] - 1, puzzles.PAGE_SIZE)  # the sequence's last page
            return page_table_ref[b, jnp.minimum(c * puzzles.PAGES_PER_CHUNK + p, last)], 0, 0

        def merge(out, m, l):  # noqa: E741
            weight = l * jnp.exp(m - m.max(axis=1, keepdims=True))  # an empty chunk: 0 * exp(-inf) = 0
            return (weight * out).sum(axis=1) / weight.sum(axis=1)

        return page_index_map, merge

    check(puzzles.DECODE, decode_parts, chip=CHIP)
    index_map, _ = decode_parts()
    print("page fetches:", len(puzzles.fetches(index_map, puzzles.DECODE_GRID, table, lengths)),
          "of", int(np.prod(puzzles.DECODE_GRID)), "grid steps")

# %% [markdown]
# ## Puzzle 13 · one causal ring step with `ppermute` (★★☆, 15 min)
#
# Ring attention shards the sequence over devices: device `d` of 4 holds query block `d` (32 queries)
# and, at first, K/V block `d` (32 keys and values). The mask is causal over the whole sequence of 128
# tokens, so query block `d` sees K/V blocks `0 … d − 1` whole, block `d` up to the diagonal, and none
# after it. In 4 steps every device sees every K/V block: at each step it attends its queries to the
# K/V block it holds, merges that partial result into its running `(out, m, l)`, and passes the block on.
#
# The block carries no label: which block a device holds at step `s` is the ring's **schedule**,
# `(d − s) mod 4` (the one its neighbour `d − 1` held at step `s − 1`), and the causal mask is computed
# from it. The check hands your step that block number as `kv_block`. Write
# `ring_step(q, k, v, out, m, l, kv_block)` → `(out, m, l, k, v)`, the code one device runs inside
# `shard_map` over a mesh axis named `puzzles.RING_AXIS`:
#
# - `puzzles.block_partial(q, k, v, kv_block)` gives this block's `(out, m, l)`, masked causally as
#   K/V block `kv_block` (`out` normalised by its `l`; a row that sees no key of the block gives
#   `out = 0, m = −inf, l = 0`);
# - merge it with the running state (the state starts at `out = 0, m = −inf, l = 0`; step 0 is the
#   device's own diagonal block, where every row sees a key; the merge of puzzle 12 for two parts);
# - pass `k` and `v` on: `jax.lax.ppermute(x, axis_name, perm)` with `perm` a list of
#   `(source, destination)` pairs, one per device. Which way round the ring makes device `d` hold
#   block `(d − s) mod 4` at step `s`? Sent the other way, a device masks one block as if it were
#   another, and the values are wrong.
#
# The check runs 4 steps on every device. With 4 devices here it uses `shard_map`; with fewer it runs
# the same code under `jax.vmap(..., axis_name=...)`, where `ppermute` and `jax.lax.axis_index` mean the
# same (printed below). The compile is for a compile-only v5e 2x2 slice: four chips.

# %%
print("the check runs on:", puzzles.ring_runs_on())
N = puzzles.RING_DEVICES
held = {(d, s): (d - s) % N for d in range(N) for s in range(N)}
fig, (ax,) = panels(width=4.2, height=3.2)
draw_grid(ax, N, N, labels={(d, s): f"K/V {b}" for (d, s), b in held.items()},
          colours={(d, s): FETCH if b < d else PARTIAL if b == d else EMPTY for (d, s), b in held.items()},
          title="K/V block device d holds at step s: seen, diagonal, hidden", xlabel="step s",
          ylabel="device d (query block d)")
plt.show()


# %% tags=["puzzle"]
def ring_step(q, k, v, out, m, l, kv_block):  # noqa: E741
    raise NotImplementedError("attend block kv_block (causal), merge into (out, m, l), ppermute k and v")


# %%
check(puzzles.RING, ring_step, chip=CHIP)


# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solution: open after trying (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    def ring_step(q, k, v, out, m, l, kv_block):  # noqa: E741
        block_out, block_m, block_l = puzzles.block_partial(q, k, v, kv_block)
        m_new = jnp.maximum(m, block_m)  # finite from step 0 on: the diagonal block shows every row a key
        old, new = l * jnp.exp(m - m_new), block_l * jnp.exp(block_m - m_new)  # a hidden block weighs 0
        out = (old * out + new * block_out) / (old + new)
        # Device d holds block (d - s) mod N at step s, the block device d - 1 held at step s - 1: so every
        # device receives from d - 1, that is, sends to d + 1.
        perm = [(d, (d + 1) % N) for d in range(N)]
        k, v = (jax.lax.ppermute(x, puzzles.RING_AXIS, perm) for x in (k, v))
        return out, m_new, old + new, k, v

    check(puzzles.RING, ring_step, chip=CHIP)

# %% [markdown]
# ## Find the bug C · fetching hidden blocks (★★☆, 10 min)
#
# A causal dK/dV kernel (puzzle 10's body with a causal mask, blocks of 64 on both sides, grid
# `(kv block j, query block i) = (4, 4)`). K/V block `j` is seen only by query blocks `i ≥ j`; the body
# skips the other steps with `pl.when(i >= j)`. Its author wrote the index map of the query-side
# arrays (`q`, `do`, `lse`, `delta`) below. The values come out right. What is wrong? (Hint: which
# blocks does the pipeline copy at the skipped steps? `check` walks the grid as the pipeline does and
# lists the copies your map starts.)

# %%
n = puzzles.CAUSAL_GRID[0]
fig, (ax,) = panels(width=3.6, height=3.2)
draw_grid(ax, n, n, labels={(j, i): f"q {i}" if i >= j else "hidden" for j in range(n) for i in range(n)},
          colours={(j, i): FETCH if i >= j else EMPTY for j in range(n) for i in range(n)},
          title="grid (j, i): the steps that compute", xlabel="query block i", ylabel="kv block j")
plt.show()


# %% tags=["puzzle"]
def q_index_map(j, i):
    return i, 0


# %%
check(puzzles.CAUSAL_DKV, q_index_map, chip=CHIP)
print("copies started by this map:", len(puzzles.fetches(q_index_map, puzzles.CAUSAL_GRID)))


# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solution: open after trying (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    def q_index_map(j, i):
        # The bug: a hidden step (i < j) named query block i, so the pipeline copied it for nothing.
        # Clamp to the first block K/V block j sees; the steps after it re-name it: no copy.
        return jnp.maximum(i, j), 0

    check(puzzles.CAUSAL_DKV, q_index_map, chip=CHIP)
    print("copies started by this map:", len(puzzles.fetches(q_index_map, puzzles.CAUSAL_GRID)))

# %% [markdown]
# ## Find the bug D · a bfloat16 accumulator (★☆☆, 5 min)
#
# `o = x @ y` with `x` `[16, 4096]`, `y` `[4096, 128]` and `o` in bfloat16, over a grid of 32 steps
# along the reduction (blocks of 128). The inputs are non-negative, so the sums grow to about a
# thousand (printed below). The kernel below compiles and runs. Its output is off by more than the one
# rounding a bfloat16 output costs (at most half a spacing: `2⁻⁸` relative, since bfloat16 keeps 8
# significant bits), and `check`'s tolerance (twice that, `2⁻⁷`) says so. Why? (A float32 scratch
# `acc_ref` is provided and unused.)

# %% tags=["puzzle"]
def bf16_kernel(x_ref, y_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(0) == 0)
    def _init():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    partial = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)
    o_ref[...] += partial.astype(o_ref.dtype)


# %%
check(puzzles.BF16_ACC, bf16_kernel, chip=CHIP)

# %%
x, y = puzzles.BF16_ACC.inputs()
exact = puzzles.BF16_ACC.oracle(x, y)
got = np.asarray(puzzles.BF16_ACC.build(bf16_kernel, interpret=True)(x, y), np.float64)
spacing = 2.0 ** (np.floor(np.log2([exact.min(), exact.max()])) - 7)  # bfloat16: 8 significant bits
print(f"sums from {exact.min():.0f} to {exact.max():.0f}; "
      f"bfloat16's spacing there: {spacing[0]:g} to {spacing[1]:g}")
print(f"largest relative error of this kernel: {np.abs(got / exact - 1).max():.2%}")


# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solution: open after trying (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    def bf16_kernel(x_ref, y_ref, o_ref, acc_ref):
        # The bug: the running sum lived in the bfloat16 output, rounded to 8 significant bits at each of
        # the 32 steps. Keep it in the float32 scratch and round once, at the end.
        k = pl.program_id(0)

        @pl.when(k == 0)
        def _init():
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

        @pl.when(k == pl.num_programs(0) - 1)
        def _write():
            o_ref[...] = acc_ref[...].astype(o_ref.dtype)

    check(puzzles.BF16_ACC, bf16_kernel, chip=CHIP)
    got = np.asarray(puzzles.BF16_ACC.build(bf16_kernel, interpret=True)(x, y), np.float64)
    print(f"largest relative error now: {np.abs(got / exact - 1).max():.2%}")

# %% [markdown]
# ## Find the bug E · the tile rule (★☆☆, 5 min)
#
# The backward's first pass, `delta = rowsum(dO ∘ O)`, `o` and `do` `[256, 128]` float32, `delta`
# `[256, 1]`. The body (given) adds each block's row sums into `delta` along a second grid axis, so
# the kernel works for any split of the 128 columns; the grid follows from the block shape:
# `(256 / rows, 128 / cols)`. Its author split the columns in two, `(64, 64)` blocks, "to keep the
# blocks small". It is right in interpret mode; read what the compiler says, and fix the block.

# %%
fig, axes = panels(2, width=3.2)
draw_grid(axes[0], 4, 2, colours={(0, 0): WASTED}, labels={(0, 0): "64×64"},
          title="(64, 64) blocks", xlabel="column block", ylabel="row block")
draw_grid(axes[1], 4, 1, colours={(0, 0): FETCH}, labels={(0, 0): "64×128"},
          title="(64, 128) blocks", ylabel="row block")
fig.suptitle("a block's last dimension: a multiple of 128 lanes, or the whole 128", fontsize=9, y=1.02)
plt.show()


# %% tags=["puzzle"]
def delta_block_spec():
    return pl.BlockSpec((64, 64), lambda i, d: (i, d))


# %%
check(puzzles.TILE_RULE, delta_block_spec, chip=CHIP)


# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solution: open after trying (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    def delta_block_spec():
        # The bug: a last dimension of 64 is neither a multiple of 128 (the vector register's lanes) nor
        # the array's whole 128 columns. Take whole rows; the second grid axis then has one step.
        return pl.BlockSpec((64, 128), lambda i, d: (i, d))

    check(puzzles.TILE_RULE, delta_block_spec, chip=CHIP)

# %% [markdown]
# ## Takeaways
#
# > **Takeaway.** A flash backward recomputes each tile of `P` from the forward's logsumexp and
# > needs `δ = rowsum(dO ∘ O)` first; dQ reduces over K/V blocks, dK and dV over query blocks, so here
# > they are two kernels, each with its reduction on the last (`"arbitrary"`) grid axis.
#
# > **Takeaway.** Masks that do not follow block edges (a window, a causal diagonal) are applied inside
# > the tile by element, with a safe maximum for rows that have seen nothing yet; a softcap is one
# > `tanh` on the scores before the mask.
#
# > **Takeaway.** Split-K decode and ring attention are the same idea: partial results `(out, m, l)`
# > computed apart and merged by their maxima and row sums. A page table in SMEM picks the pages; an
# > index map that re-names the last page skips the copies past the end.
#
# > **Takeaway.** Three checks, three kinds of bug: the fetch walk finds copies the values cannot show,
# > the float64 oracle's tolerance finds a lost-precision accumulator, and only the real compiler
# > finds a block shape that breaks the tile rule.
#
# ## References
#
# - T. Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning", 2023,
#   arXiv:2307.08691 (the backward's recomputation from the logsumexp, and `δ`).
# - JAX's Pallas TPU kernels, in the installed `jax` package: `jax/experimental/pallas/ops/tpu/
#   flash_attention.py` and `splash_attention/splash_attention_kernel.py` (separate dQ and dK/dV kernels).
# - Gemma Team, "Gemma 2: Improving Open Language Models at a Practical Size", 2024, arXiv:2408.00118
#   (logit soft-capping); A. Q. Jiang et al., "Mistral 7B", 2023, arXiv:2310.06825 (sliding window).
# - W. Kwon et al., "Efficient Memory Management for Large Language Model Serving with
#   PagedAttention", 2023, arXiv:2309.06180 (the page table); T. Dao et al., "Flash-Decoding for
#   long-context inference", 2023, https://crfm.stanford.edu/2023/10/12/flashdecoding.html (split-K).
# - H. Liu, M. Zaharia, P. Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite
#   Context", 2023, arXiv:2310.01889.
# - JAX documentation: Pallas TPU details (the block-shape rule)
#   https://docs.jax.dev/en/latest/pallas/tpu/details.html, scalar prefetch
#   https://docs.jax.dev/en/latest/pallas/tpu/sparse.html, `shard_map` and collectives
#   https://docs.jax.dev/en/latest/notebooks/shard_map.html.
