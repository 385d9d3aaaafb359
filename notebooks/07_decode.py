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
# # 07 · Decode: one query against a long, paged KV cache
#
# Training attends thousands of queries to thousands of keys at once; serving a language model does
# something else. Each decode step adds **one new token per sequence** (a few with speculative
# decoding), and that token's query attends to everything the sequence has seen, kept in a **KV
# cache**. A serving batch holds sequences of very different lengths, and the cache lives in
# fixed-size **pages** handed out as sequences grow. This notebook answers: **why is decode bound by
# memory bandwidth rather than by the MXU, and how does a kernel read a ragged, paged cache without
# touching the parts that do not matter?**
#
# **What you'll do**
# - put one decode step on a roofline: the cache is the traffic (modelled, for v5e, v6e and v5p);
# - build a paged KV cache with a page table in NumPy, and check `tpuattn.decode.attention` on it
#   against the contiguous cache and against `tpuattn.attention`;
# - split the cache into chunks (flash-decoding), compute partial softmax states and merge them;
# - read the Pallas decode kernel: lengths and page tables in SMEM, an index map that clamps, the
#   blocks it fetches and skips on a ragged batch; run it in interpret mode against the reference;
# - see which cases JAX's own paged-attention kernels serve, and which they refuse;
# - read what the TPU compiler says about each implementation for a v5e serving batch (compiled,
#   not run);
# - write code: bytes per step, a gather of pages, the clamping index map, the merge of partials.
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/tpuattn/tpuattn/blob/main/notebooks/07_decode.ipynb)

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
from matplotlib.colors import ListedColormap

import tpuattn
from tpuattn import chips, decode, softmax
from tpuattn.decode import kernel as decode_kernel
from tpuattn.decode.reference import gather_cache
from tpuattn.errors import UnsupportedInput
from tpuattn.exercises import run_checks
from tpuattn.measure import aot, runtime
from tpuattn.model import decode_roofline as roofline
from tpuattn.spec import EMPTY, FULL
from tpuattn.viz import style

PLATFORM = runtime.info()
print(PLATFORM.summary())

# %% tags=["parameters"]
# The small paged cache of sections 2-5 (runs anywhere, interpret mode included).
BATCH, HEADS, KV_HEADS, HEAD_DIM = 4, 4, 2, 32
PAGE_SIZE, PAGES_PER_SEQ, Q_LEN = 8, 6, 2
# The serving batch of sections 1 and 6 (modelled and compiled only: never run here).
SERVE_BATCH, SERVE_HEADS, SERVE_KV_HEADS, SERVE_HEAD_DIM = 8, 32, 8, 128
SERVE_LEN = 4096  # positions per sequence in the roofline
COMPILE_PAGE, COMPILE_PAGES_PER_SEQ = 64, 16  # the compiled cache: 16 pages of 64 rows per sequence
RUN_COMPILES = True  # section 6: compile for TPU v5e when the TPU compiler is installed
RUN_BENCHMARKS = True  # section 7: a small CPU timing (measured)
# The hidden solution cells run only when this is True, so Run All shows your own results alone.
# The project's CI sets it (TPUATTN_RUN_SOLUTIONS=1): the committed outputs include the solutions'.
RUN_SOLUTIONS = os.environ.get("TPUATTN_RUN_SOLUTIONS") == "1"

# %%
style.use_style()
rng = np.random.default_rng(0)

# %% [markdown]
# ## 1 · Why decode is different: the cache is the traffic
#
# One decode step for one sequence of length `L`: `q_len` new query rows per head (1 for plain
# decode) against the `L` cached keys and values of every kv head. Per cached position it reads K
# and V, `2 · kv_heads · head_dim · itemsize` bytes, and does `4 · q_len · heads · head_dim` FLOPs
# (`q·k` and `p·v`). Their ratio, the **arithmetic intensity**, is
#
# $$\frac{\text{FLOPs}}{\text{bytes}} \approx \frac{4\, q_{len}\, H\, D}{2\, H_{kv}\, D \cdot \text{itemsize}}
# = \frac{2\, q_{len}\cdot \text{group}}{\text{itemsize}},$$
#
# i.e. `group × q_len` FLOPs per (K, V) byte pair in bf16, where `group = heads / kv_heads` (GQA).
# The batch is not in it: every sequence reads its *own* cache, so a bigger batch adds bytes and
# FLOPs in the same ratio. A chip stops being memory-bound at its **ridge point**, peak FLOP/s over
# HBM bandwidth, which is in the hundreds of FLOPs per byte. `tpuattn.model.decode_roofline` models one step
# (every number below is **modelled**, a lower bound; chip figures from `tpuattn.chips`, JAX's
# `tpu_info` table where it agrees with Google Cloud's TPU pages, the page's figure where it does not:
# v5p's HBM bandwidth, 2765 GB/s, https://cloud.google.com/tpu/docs/v5p).

# %%
serve_lengths = [SERVE_LEN] * SERVE_BATCH
print(f"one decode step: batch {SERVE_BATCH} x {SERVE_LEN} positions, heads {SERVE_HEADS} on "
      f"{SERVE_KV_HEADS} kv heads (group {SERVE_HEADS // SERVE_KV_HEADS}), head_dim {SERVE_HEAD_DIM}, bf16, "
      f"q_len 1 ({roofline.LABEL})")
print(f"{'chip':>5} {'HBM GB/s':>9} {'bf16 TFLOP/s':>13} {'ridge F/B':>10} {'cache MiB':>10} "
      f"{'intensity F/B':>14} {'time us':>8} {'bound':>7} {'memory-bound up to q_len':>25}")
for name in ("v5e", "v6e", "v5p"):
    chip = chips.get(name)
    r = roofline.decode_roofline(serve_lengths, q_len=1, heads=SERVE_HEADS, kv_heads=SERVE_KV_HEADS,
                                 head_dim=SERVE_HEAD_DIM, chip=name)
    print(f"{name:>5} {chip.hbm_bandwidth / 1e9:>9.0f} {chip.bf16_flops / 1e12:>13.0f} {r.ridge:>10.0f} "
          f"{r.cache_bytes / 2**20:>10.0f} {r.intensity:>14.2f} {r.time_s * 1e6:>8.1f} "
          f"{'memory' if r.memory_bound else 'compute':>7} {r.crossover_q_len:>25.0f}")

# %% [markdown]
# The step reads its whole cache and does almost nothing with each byte: an intensity of about
# `group × q_len` against ridge points in the hundreds. Its time is the cache's bytes over the HBM
# bandwidth, so the fastest possible decode kernel is one that reads each needed byte once and no
# other. Only more queries per cached key raise the intensity: a larger GQA group, or several query
# tokens per sequence (speculative decoding, chunked prefill). Batch size changes nothing:

# %%
for batch in (1, SERVE_BATCH, 64):
    r = roofline.decode_roofline([SERVE_LEN] * batch, heads=SERVE_HEADS, kv_heads=SERVE_KV_HEADS,
                                 head_dim=SERVE_HEAD_DIM, chip="v5e")
    print(f"v5e, batch {batch:>2}: intensity {r.intensity:.2f} FLOP/byte, {r.time_s * 1e6:8.1f} us per step "
          f"({roofline.LABEL})")
print()
for q_len in (1, 4, 16, 64, 128):
    r = roofline.decode_roofline(serve_lengths, q_len=q_len, heads=SERVE_HEADS, kv_heads=SERVE_KV_HEADS,
                                 head_dim=SERVE_HEAD_DIM, chip="v5e")
    print(f"v5e, q_len {q_len:>3}: memory {r.memory_s * 1e6:7.1f} us, compute {r.compute_s * 1e6:7.1f} us "
          f"-> {'memory' if r.memory_bound else 'compute'}-bound ({roofline.LABEL})")

# %% [markdown]
# > **Takeaway.** Decode is a streaming read of the KV cache. Its time per step is the bytes of the
# > cache that the queries can see over the HBM bandwidth; batching does not change that ratio, only
# > more queries per cached key (GQA group, `q_len`) do.

# %% [markdown]
# ## 2 · A KV cache, and why it is paged
#
# The simplest cache reserves `max_len` rows per sequence: `[batch, max_len, kv_heads, head_dim]`.
# A serving batch mixes a short chat with a long document, so most of those rows sit
# unused (**fragmentation**), and two sequences with the same prompt keep two copies of it. vLLM's
# PagedAttention (Kwon et al. 2023) manages the cache like virtual memory: one pool of fixed-size
# **pages** `[num_pages, page_size, kv_heads, head_dim]`, and per sequence a **page table** whose
# entry `i` names the page holding positions `i·page_size … (i+1)·page_size − 1`. A sequence takes a
# page when it needs one, wasting at most `page_size − 1` rows; sequences with a common prefix can
# point at the same pages (**sharing**).
#
# Below: a pool of pages in a random order, a page table that hands out only the pages each length
# needs (`-1`: not allocated; those entries are never read), and sequence 2 sharing its first page
# with sequence 0.

# %%
capacity = PAGE_SIZE * PAGES_PER_SEQ
lengths = np.array([capacity, 13, 23, 1], np.int32)[:BATCH]  # full, ragged, and shorter than a page
num_pages = BATCH * PAGES_PER_SEQ
k_pages = rng.standard_normal((num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM)).astype(np.float32)
v_pages = rng.standard_normal((num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM)).astype(np.float32)
q = rng.standard_normal((BATCH, Q_LEN, HEADS, HEAD_DIM)).astype(np.float32)

free = list(rng.permutation(num_pages))  # the pool's free list, in a random order
page_table = np.full((BATCH, PAGES_PER_SEQ), -1, np.int32)
for b, length in enumerate(lengths):
    for i in range(-(-int(length) // PAGE_SIZE)):  # ceil(length / page_size) pages
        page_table[b, i] = free.pop()
page_table[2, 0] = page_table[0, 0]  # a shared prefix page (same prompt start)
print("lengths:", lengths.tolist())
print("page table (-1: not allocated):")
print(page_table)
used_rows = int(sum(-(-int(n) // PAGE_SIZE) for n in lengths)) * PAGE_SIZE
print(f"rows reserved: contiguous {BATCH * capacity}, paged {used_rows} "
      f"({used_rows - int(lengths.sum())} of them past a length), one page shared")

# %% [markdown]
# Gathering the pages back through the table gives the contiguous cache (unallocated entries point
# anywhere, here at page 0: those rows lie past the length and never count). The decode contract
# takes either layout, `tpuattn.decode.attention(q, k_cache, v_cache, lengths, page_table=...)`, and
# the two calls must agree. Query `t` of sequence `b` sits at position `lengths[b] − q_len + t`: the
# same **bottom-right** causal alignment as `tpuattn.attention` with `kv_len = lengths[b]`, so the
# whole decode step is also plain causal attention on each sequence's valid prefix. (A sequence of
# length 1 with `q_len` 2 has its first query row at position −1: it sees nothing and returns
# zeros, as the contract says.)

# %%
k_contig = k_pages[np.maximum(page_table, 0)].reshape(BATCH, capacity, KV_HEADS, HEAD_DIM)
v_contig = v_pages[np.maximum(page_table, 0)].reshape(BATCH, capacity, KV_HEADS, HEAD_DIM)
out_paged = decode.attention(q, k_pages, v_pages, lengths, page_table=page_table, impl="reference")
out_contig = decode.attention(q, k_contig, v_contig, lengths, impl="reference")
print(f"paged vs contiguous cache: max |diff| = {float(jnp.max(jnp.abs(out_paged - out_contig))):.1e}")
worst = 0.0
for b, length in enumerate(lengths):
    want = tpuattn.attention(q[b:b + 1], k_contig[b:b + 1, :length], v_contig[b:b + 1, :length], causal=True,
                             impl="reference")
    worst = max(worst, float(jnp.max(jnp.abs(out_paged[b:b + 1] - want))))
print(f"decode vs tpuattn.attention(causal=True) on each valid prefix: max |diff| = {worst:.1e}")
print("sequence 3 (length 1), query row 0 (position -1):", float(jnp.max(jnp.abs(out_paged[3, 0]))))

# %% [markdown]
# ## 3 · Split-K (flash-decoding): partial softmax states, merged
#
# With one query row per sequence there is little to spread over the chip: `batch × kv_heads`
# independent problems, each a long reduction over the cache. Flash-decoding (Dao et al. 2023) splits
# that reduction: cut the cache into **chunks**, compute each chunk's attention independently (in
# parallel), and keep, per query row, the chunk's normalised output and its **logsumexp**. The
# partial results then merge exactly, each weighted by `exp(lse_chunk − lse_max)` — the same merge
# as the online softmax of notebook 02 and the ring of notebook 06, now over chunks of one cache.
# A chunk that sees no key has `lse = −inf` and weighs zero. Here is a chunk's partial in
# `jax.numpy`, then the package's one merge, `tpuattn.softmax.merge`: it takes each chunk as a
# `softmax.Partial` (`softmax.from_lse` builds one from an output and its logsumexp, whose rows the
# package keeps as `[batch, heads, q_len]`). The kernel hands its chunks to the same merge.


# %%
def chunk_partial(q, k, v, lengths, start, stop, scale):
    """Attention of ``q [b, q_len, heads, d]`` over keys ``[start, stop)`` of a contiguous cache
    ``[b, capacity, kv_heads, d]``: ``out [b, q_len, heads, d]`` (normalised over the chunk) and
    ``lse [b, q_len, heads]``."""
    b, tq, h, d = q.shape
    group = h // k.shape[2]
    kc = jnp.repeat(k[:, start:stop], group, axis=2)  # [b, c, heads, d]: GQA by repetition, for clarity
    vc = jnp.repeat(v[:, start:stop], group, axis=2)
    s = jnp.einsum("bthd,bchd->bthc", q, kc, precision="highest") * scale
    key = jnp.arange(start, stop)[None, None, None, :]
    pos = (lengths[:, None] - tq + jnp.arange(tq)[None, :])[:, :, None, None]  # bottom-right causal
    mask = (key < lengths[:, None, None, None]) & (key <= pos)
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
    total = jnp.sum(e, axis=-1)
    out = jnp.einsum("bthc,bchd->bthd", e, vc, precision="highest")
    out = out / jnp.where(total == 0, 1.0, total)[..., None]
    lse = jnp.where(total > 0, m_safe + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    return out, lse


chunk = 2 * PAGE_SIZE
parts = [chunk_partial(q, k_contig, v_contig, jnp.asarray(lengths), a, a + chunk, HEAD_DIM**-0.5)
         for a in range(0, capacity, chunk)]
lses = jnp.stack([s for _, s in parts])
merged = softmax.merge(*(softmax.from_lse(o, jnp.swapaxes(s, 1, 2)) for o, s in parts)).out
print(f"{len(parts)} chunks of {chunk} positions; chunks that saw no key, per sequence:",
      np.isneginf(np.asarray(lses)).all(axis=(2, 3)).sum(axis=0).tolist())
print(f"merged partials vs the whole: max |diff| = {float(jnp.max(jnp.abs(merged - out_paged))):.1e}")

# %% [markdown]
# ## 4 · The Pallas decode kernel (`impl="pallas"`)
#
# `tpuattn/decode/kernel.py` is a split-K kernel over a grid `(batch, kv_head_group, chunk, step)`:
# the first three axes are independent (`parallel`: the chunk axis is the split that keeps a chip
# busy when `batch × kv_heads` is small), the last runs the online softmax over a chunk's blocks in
# VMEM scratch (`arbitrary`). All query heads of a GQA group form one block of rows against their kv
# head's K/V, so each byte of the cache is read once for the whole group.
#
# The kernel reads the cache where it lies: a K/V block is a page as stored, `[page_size, kv_heads,
# head_dim]` (or 8 of the kv heads, a head group, when their number is a multiple of 8), and the
# kernel takes each kv head's rows in VMEM (`k_ref[:, h, :]`). Reshaping the cache to `[..., rows,
# kv_heads * head_dim]` before the kernel looks free, but a TPU stores an array's last two
# dimensions in (8, 128) tiles, so that reshape is a copy of the whole cache (section 6 shows the
# compiler's bytes).
#
# What makes it a *decode* kernel is what it knows before it starts: `lengths` and the flattened
# page table are **scalar-prefetched** into SMEM (`pltpu.PrefetchScalarGridSpec`), so the K/V
# **index maps** can read them. For step `p` of sequence `b` the index map asks for
#
# ```python
# kv_block(p, length) = min(max(p, first), max(last, first))   # last = ceil(length / block) - 1
# page = page_table[b, kv_block(p, length)]                      # paged: through the table
# ```
#
# A step past the length asks for the block the pipeline already holds, and Pallas issues **no DMA**
# when a block index repeats; the body runs under `pl.when(useful)`, so nothing is **computed**
# either. `tpuattn.decode.schedule` walks the same grid with the kernel's own `kv_block` and
# `is_useful`, and counts. Below, a ragged batch with pages of 16 rows, one page per step, and
# chunks of 4 pages; on the right with a sliding window of 24 positions (the clamp's `first`).

# %%
SCHED_PAGE, SCHED_PAGES, SCHED_CHUNK = 16, 8, 4
sched_lengths = np.array([128, 5, 40, 0, 77, 100])
for window in (None, 24):
    s = decode.schedule(sched_lengths, SCHED_PAGE, capacity=SCHED_PAGE * SCHED_PAGES, window=window,
                        chunk_blocks=SCHED_CHUNK, pages_per_step=1)
    print(f"window {window}: {s['steps']} grid steps per K/V operand ({s['num_chunks']} chunks of "
          f"{s['chunk_steps']} steps per sequence); computed {s['computed']}, skipped {s['skipped']}; "
          f"fetched {s['fetched']}, not fetched {s['not_fetched']}")


# %%
def visits(lengths, block, num_blocks, window_left=None, q_len=1):
    """Per sequence and block: (useful?, the block the index map asks for), from the kernel's own code."""
    p = np.arange(num_blocks)
    useful = np.array([decode_kernel.is_useful(p, int(n), q_len, window_left, block) for n in lengths])
    asked = np.array([decode_kernel.kv_block(p, int(n), q_len, window_left, block) for n in lengths])
    return useful, asked


fig, axes = plt.subplots(1, 2, figsize=(11, 3.4), sharey=True)
cmap = ListedColormap([style.TILE_COLOURS[EMPTY], style.TILE_COLOURS[FULL]])
for ax, window in zip(axes, (None, 24), strict=True):
    useful, asked = visits(sched_lengths, SCHED_PAGE, SCHED_PAGES, window)
    ax.imshow(useful, cmap=cmap, vmin=0, vmax=1, aspect="auto")
    for (b, p), a in np.ndenumerate(asked):
        ax.text(p, b, str(a), ha="center", va="center", fontsize=8,
                color="white" if useful[b, p] else "#555555")
    for x in range(SCHED_CHUNK, SCHED_PAGES, SCHED_CHUNK):
        ax.axvline(x - 0.5, color=style.ROOF_COLOUR, linewidth=1)
    ax.set_xticks(range(SCHED_PAGES))
    ax.set_yticks(range(len(sched_lengths)), [f"len {n}" for n in sched_lengths])
    ax.set_xlabel(f"step = page of the sequence ({SCHED_PAGE} rows)")
    ax.set_title(f"window {window}: blue visited, grey skipped", fontsize=9)
    ax.grid(False)
fig.suptitle("Pages each sequence visits; the number is the page its index map asks for (a repeat: no DMA);\n"
             "black line: split-K chunk boundary. Counted from the kernel's own index maps",
             fontsize=10, y=1.08)
style.save_figure(fig, "07_pages")
plt.show()
style.close(fig)

# %% [markdown]
# Blue cells are computed; grey cells are neither fetched nor computed: their number repeats the
# last useful page (or, before a window's first page, the first one), so the pipeline already holds
# it. The empty sequence still runs its grid steps (the grid is static) but fetches one block per
# head group and computes nothing. Now the kernel itself, on the paged cache of section 2, in
# **interpret mode** on this CPU (Pallas runs the kernel body in Python/XLA: a check of the
# logic, not of kernel speed), with chunks of 2 pages:

# %%
interpret = decode_kernel.resolve_interpret(None)
paged_spec = decode.make_decode_spec(q, k_pages, v_pages, lengths, page_table)[-1]
geo = decode_kernel.geometry(paged_spec, chunk_blocks=2, pages_per_step=1)
grid = (BATCH, KV_HEADS // geo.heads_per_block, geo.num_chunks, geo.chunk_steps)
print(f"grid (batch, kv head groups, chunks, steps) = {grid}: {geo.per_step} page of {geo.block} rows "
      f"per step, {geo.num_chunks} chunk partials merged per sequence")
out_pallas = decode.attention(q, k_pages, v_pages, lengths, page_table=page_table, impl="pallas",
                              chunk_blocks=2, pages_per_step=1)
print(f"pallas ({'interpret mode, not kernel speed' if interpret else 'compiled'}) vs reference, float32: "
      f"max |diff| = {float(jnp.max(jnp.abs(out_pallas - out_paged))):.1e}")
np.testing.assert_allclose(out_pallas, out_paged, atol=2e-5, rtol=2e-5)

# %% [markdown]
# The tolerance, 2e-5 in float32, is the one the package's tests use against a float64 oracle: both
# sides accumulate in float32 with full-precision matmuls, and differ only in the order of the sums.

# %% [markdown]
# ## 5 · JAX's own paged-attention kernels, behind the same contract
#
# JAX ships two TPU decode kernels in `jax.experimental.pallas.ops.tpu`: `paged_attention` (one query
# per sequence, K and V as `[kv_heads, pages, page_size, d]`) and `ragged_paged_attention` (mixed
# prefill and decode, K and V interleaved per page). `tpuattn.decode` translates the contract's
# arguments to each (`impl="jax_paged"`, `impl="jax_ragged"`) or refuses, in words. Each
# implementation's `supports(spec, backend)` returns `None` or the reason; here they are asked about
# a few serving cases for a TPU:

# %%
CASES = {
    "paged, q_len 1": dict(q_len=1),
    "paged, q_len 4 (speculative)": dict(q_len=4),
    "paged, window 256": dict(q_len=1, window=(256, 0)),
    "contiguous, q_len 1": dict(q_len=1, paged=False),
    "paged, head_dim 64": dict(q_len=1, head_dim=64),
}
print("implementations here:", decode.implementations())
for case, options in CASES.items():
    options = dict(options)
    paged = options.pop("paged", True)
    head_dim = options.pop("head_dim", SERVE_HEAD_DIM)
    pages = dict(page_size=COMPILE_PAGE, num_pages=SERVE_BATCH * COMPILE_PAGES_PER_SEQ,
                 pages_per_sequence=COMPILE_PAGES_PER_SEQ) if paged else dict(capacity=1024)
    spec = decode.decode_spec_from_shapes(batch=SERVE_BATCH, num_q_heads=SERVE_HEADS,
                                          num_kv_heads=SERVE_KV_HEADS, head_dim=head_dim, **pages, **options)
    print(f"\n{case}:")
    for name in decode.known_implementations():
        reason = decode.get_implementation(name).supports(spec, "tpu")
        print(f"  {name:>10}: {'serves it' if reason is None else 'refuses: ' + reason}")

# %% [markdown]
# Off a TPU the answers can differ: the kernels must also run in interpret mode, and JAX's TPU
# interpreter cannot run `ragged_paged_attention`. Asked about section 2's cache on this machine:

# %%
backend = jax.default_backend()
spec_here = decode.make_decode_spec(q[:, -1:], k_pages, v_pages, lengths, page_table)[-1]
for name in decode.known_implementations():
    reason = decode.get_implementation(name).supports(spec_here, backend)
    print(f"{name:>10} on {backend}: {'serves it' if reason is None else 'refuses: ' + reason}")
try:
    decode.attention(q, k_pages, v_pages, lengths, page_table=page_table, impl="jax_paged")
except UnsupportedInput as error:
    print("\nq_len 2 with impl='jax_paged' raises UnsupportedInput:", error)

# %% [markdown]
# `jax_paged` serves the last query of each sequence (`q_len` 1). It rounds K and V to bfloat16
# inside the kernel whatever their dtype, so on this float32 cache it agrees with the reference to
# bfloat16 accuracy, not float32's. (On a TPU runtime the cell below runs the kernel compiled: a path
# written for such a runtime and not yet run on one by the project.)

# %%
q_last = q[:, -1:]
out_jax = decode.attention(q_last, k_pages, v_pages, lengths, page_table=page_table, impl="jax_paged")
want_last = decode.attention(q_last, k_pages, v_pages, lengths, page_table=page_table, impl="reference")
print(f"jax_paged ({'interpret mode' if backend != 'tpu' else 'compiled'}) vs reference: "
      f"max |diff| = {float(jnp.max(jnp.abs(out_jax - want_last))):.1e} (bf16 inside the kernel)")
np.testing.assert_allclose(out_jax, want_last, atol=2e-2, rtol=2e-2)

# %% [markdown]
# ## 5b · A ragged batch and a quantized cache, as engines serve
#
# An inference engine's step is **ragged**: a chunk of a new prompt beside single-token decodes and
# idle slots, each sequence with its own number of new queries. JAX's `ragged_paged_attention` and
# vLLM's TPU kernels take the queries flat, `[total_tokens, heads, head_dim]`, with `cu_q_lens`
# (`batch + 1` offsets: sequence `i`'s queries are rows `cu_q_lens[i] … cu_q_lens[i+1] − 1`), and so
# does the contract: `decode.attention(q_flat, k_pages, v_pages, lengths, page_table=...,
# cu_q_lens=...)`. Each sequence's queries are the last of its `lengths[b]` positions, causal
# (bottom-right) as before; a sequence with no query is idle. Below, section 2's cache serves a
# 5-token prefill chunk, two decodes and an idle slot in one call of the split-K kernel (interpret
# mode here), checked against float64 NumPy attention over each sequence's prefix.

# %%
q_lens = np.array([5, 1, 0, 1], np.int32)[:BATCH]  # a prefill chunk, a decode, an idle slot, a decode
cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
q_flat = rng.standard_normal((int(cu_q_lens[-1]), HEADS, HEAD_DIM)).astype(np.float32)


def ragged_oracle(q_flat, k_contig, v_contig):
    """Float64 NumPy: each sequence's queries against its own prefix, causal from the bottom right."""
    out, group = np.zeros(q_flat.shape), HEADS // KV_HEADS
    for b in range(BATCH):
        rows = slice(cu_q_lens[b], cu_q_lens[b + 1])
        n, length = int(q_lens[b]), int(lengths[b])
        pos = length - n + np.arange(n)  # the queries' positions
        for h in range(HEADS):
            k64 = k_contig[b, :length, h // group].astype(np.float64)
            v64 = v_contig[b, :length, h // group].astype(np.float64)
            s = q_flat[rows, h].astype(np.float64) @ k64.T / np.sqrt(HEAD_DIM)
            s = np.where(np.arange(length)[None] <= pos[:, None], s, -np.inf)
            w = np.exp(s - s.max(axis=1, keepdims=True))
            out[rows, h] = (w / w.sum(axis=1, keepdims=True)) @ v64
    return out


want_ragged = ragged_oracle(q_flat, k_contig, v_contig)
for name in ("reference", "pallas"):
    got = decode.attention(q_flat, k_pages, v_pages, lengths, page_table=page_table, cu_q_lens=cu_q_lens,
                           impl=name)
    print(f"{name:>9}, ragged batch q_lens {q_lens.tolist()}: max |error| vs float64 = "
          f"{float(np.max(np.abs(np.asarray(got, np.float64) - want_ragged))):.1e}")
    np.testing.assert_allclose(np.asarray(got), want_ragged, atol=2e-5, rtol=2e-5)

# %% [markdown]
# Since decode streams its cache, the cache's bytes are the step's time (section 1). Engines keep
# it in **one byte an entry**: int8, or fp8 (`float8_e4m3fn`), entry `e` standing for `e × scale`
# with a float32 scale per tensor or per kv head. `decode.quantize` makes entries and scales;
# `decode.write` stores new rows into pages, quantizing them; the kernel reads the one-byte pages and
# folds `k_scale` into the logits' scale and `v_scale` into the output. Two errors are worth telling
# apart: the kernel's, against float64 attention over the *dequantized* cache (what the cache
# holds), and the quantization's, against the original float32 cache. The model gives the bytes.

# %%
for cache_dtype in ("int8", "float8_e4m3fn"):
    k_q, k_scale = decode.quantize(k_pages, cache_dtype)  # per kv head: [KV_HEADS] scales
    v_q, v_scale = decode.quantize(v_pages, cache_dtype)
    got = decode.attention(q_flat, k_q, v_q, lengths, page_table=page_table, cu_q_lens=cu_q_lens,
                           k_scale=k_scale, v_scale=v_scale, impl="pallas")
    got = np.asarray(got, np.float64)
    deq = lambda pages, scale: np.asarray(pages.astype(jnp.float32), np.float64) * np.asarray(
        scale, np.float64)[:, None]
    k_deq = deq(k_q, k_scale)[np.maximum(page_table, 0)].reshape(BATCH, capacity, KV_HEADS, HEAD_DIM)
    v_deq = deq(v_q, v_scale)[np.maximum(page_table, 0)].reshape(BATCH, capacity, KV_HEADS, HEAD_DIM)
    kernel_error = float(np.max(np.abs(got - ragged_oracle(q_flat, k_deq, v_deq))))
    quant_error = float(np.max(np.abs(got - want_ragged)))
    print(f"{cache_dtype:>14}: kernel vs float64 on the dequantized cache {kernel_error:.1e}; "
          f"vs the float32 cache {quant_error:.1e} (the quantization)")
    assert kernel_error < 2e-5 < quant_error < 0.5
for cache_dtype, scales in (("bfloat16", None), ("int8", "kv_head"), ("float8_e4m3fn", "kv_head")):
    r = roofline.decode_roofline(serve_lengths, heads=SERVE_HEADS, kv_heads=SERVE_KV_HEADS,
                                 head_dim=SERVE_HEAD_DIM, chip="v5e", cache_dtype=cache_dtype, scales=scales)
    print(f"serving batch, {cache_dtype:>14} cache: {r.cache_bytes / 2**20:6.0f} MiB a step, "
          f"{r.time_s * 1e6:6.1f} us on v5e ({roofline.LABEL})")

# %% [markdown]
# > **Takeaway.** An engine's step is a ragged batch, prompt chunks beside decodes, one call with
# > `cu_q_lens`; a one-byte cache halves a bfloat16 cache's bytes, and so decode's time, for a
# > measured change in the result. `benchmarks/decode_engine.py` compiles both for v5e and v6e beside
# > JAX's own ragged kernel (the book's *decode engine* page).

# %% [markdown]
# ## 6 · What the compiler says for a v5e serving batch (compiled, not run)
#
# The TPU compiler (libtpu) runs on a CPU machine: `tpuattn.measure.aot.compile_for("v5e", fn, args)`
# compiles for one v5e chip from shapes alone, and the compiled program reports its peak HBM and the
# bytes its operations access. The serving shape: 8 sequences, 16 pages of 64 rows each (1024
# positions), 32 query heads on 8 kv heads, head_dim 128, bf16, one query. The compiler cannot know
# the lengths, so it counts every page; the roofline's bytes (all positions full) are the floor.

# %% tags=["nbval-ignore-output"]
def compile_args(dtype=jnp.bfloat16):
    q_ = jax.ShapeDtypeStruct((SERVE_BATCH, 1, SERVE_HEADS, SERVE_HEAD_DIM), dtype)
    cache = jax.ShapeDtypeStruct((SERVE_BATCH * COMPILE_PAGES_PER_SEQ, COMPILE_PAGE, SERVE_KV_HEADS,
                                  SERVE_HEAD_DIM), dtype)
    return [q_, cache, cache, jax.ShapeDtypeStruct((SERVE_BATCH,), jnp.int32),
            jax.ShapeDtypeStruct((SERVE_BATCH, COMPILE_PAGES_PER_SEQ), jnp.int32)]


if not RUN_COMPILES:
    print("RUN_COMPILES is False: compiles skipped")
elif not aot.tpu_available():
    print("The TPU compiler (libtpu) is not installed here: compiled numbers skipped "
          "(pip install 'jax[tpu]' to see them)")
else:
    model = roofline.decode_roofline([COMPILE_PAGE * COMPILE_PAGES_PER_SEQ] * SERVE_BATCH, heads=SERVE_HEADS,
                                     kv_heads=SERVE_KV_HEADS, head_dim=SERVE_HEAD_DIM, chip="v5e",
                                     pages_per_sequence=COMPILE_PAGES_PER_SEQ)
    print(f"TPU v5e, {aot.LABEL}, {aot.versions_text()}: batch {SERVE_BATCH}, {COMPILE_PAGES_PER_SEQ} pages "
          f"of {COMPILE_PAGE} rows per sequence, heads {SERVE_HEADS} on {SERVE_KV_HEADS}, head_dim "
          f"{SERVE_HEAD_DIM}, bf16, q_len 1; roofline bytes {model.bytes / 2**20:.1f} MiB ({roofline.LABEL})")
    for name in decode.known_implementations():
        def fn(q, k, v, lengths, table, name=name):
            return decode.attention(q, k, v, lengths, page_table=table, impl=name)
        try:
            facts = aot.compiled_facts(aot.compile_for("v5e", fn, compile_args()))
        except UnsupportedInput as error:
            print(f"{name:>10}: refused: {error}")
            continue
        except Exception as error:  # noqa: BLE001 - the compiler's errors vary by version
            print(f"{name:>10}: does not compile here: {aot.first_error_line(error)}")
            continue
        print(f"{name:>10}: peak HBM {facts['peak_hbm_bytes'] / 2**20:6.1f} MiB, bytes accessed "
              f"{facts['bytes_accessed'] / 2**20:6.1f} MiB ({facts['bytes_accessed'] / model.bytes:.1f}x the "
              f"roofline's), custom calls {facts['custom_calls']}")

# %% [markdown]
# Compare each implementation's peak HBM with the roofline's bytes: the arguments (the cache) are
# what a decode step holds. Bytes accessed is the compiler's count over *every* page (it cannot know
# the lengths) plus what each implementation does around its kernel (the reference's gather and
# materialised scores, the split-K kernel's partials and their merge when the cache is several chunks,
# `jax_paged`'s transposed copy of the cache), and for a Pallas kernel the cost its author declared
# (`pl.CostEstimate`): a compiled upper view, not a measurement. The split-K kernel reads the cache in
# place, and here the cache (1024 positions) is one chunk, which the kernel finishes itself (no
# partials leave it, nothing is merged), so its bytes are the roofline's plus its padded query rows
# (the 1.0x above; 1.1x while the one chunk's partial was written out and merged); an earlier version
# reshaped the cache to `[..., rows, kv_heads * head_dim]` before the kernel, a copy of the cache on
# a TPU, and read 4.6x (`tests/test_aot_decode.py` now checks the optimised program for such
# copies). On JAX 0.10.2 `ragged_paged_attention`'s lowering asks the local device for its TPU
# generation, so it compiles only on a TPU host (with JAX 0.7.2 it compiles from a CPU machine too).

# %% [markdown]
# ## 7 · A small CPU benchmark (measured, cpu)
#
# On a CPU there is no kernel speed to see (the Pallas kernel only interprets), but one thing is
# visible: the `jax.numpy` implementations do work proportional to the cache **capacity**, not to
# the lengths. Below, the reference (gather pages, materialised softmax) and a plain `jax.numpy`
# decode over a contiguous cache (score every slot, mask by length), on full, ragged and mostly
# short batches, as ratios to the plain decode on the full batch, next to the fraction of blocks the
# Pallas kernel's schedule would compute.


# %%
from tpuattn.decode import plain_decode
from tpuattn.measure.timing import time_jitted

# Three untimed calls before the five timed ones: a new executable's first calls can run slow on a CPU.
median_seconds = lambda fn, *args: time_jitted(fn, *args, warmup=3, repeats=5).median_s


# %% tags=["nbval-ignore-output"]
if RUN_BENCHMARKS:
    B_, CAP, PAGE = 8, 2048, 64
    qb = jnp.asarray(rng.standard_normal((B_, 1, 8, 64)), jnp.float32)
    kb = jnp.asarray(rng.standard_normal((B_, CAP, 2, 64)), jnp.float32)
    vb = jnp.asarray(rng.standard_normal((B_, CAP, 2, 64)), jnp.float32)
    table_b = jnp.arange(B_ * CAP // PAGE, dtype=jnp.int32).reshape(B_, CAP // PAGE)
    kb_pages, vb_pages = kb.reshape(-1, PAGE, 2, 64), vb.reshape(-1, PAGE, 2, 64)
    reference = jax.jit(lambda q, k, v, n, t: decode.attention(q, k, v, n, page_table=t, impl="reference"))
    plain = jax.jit(plain_decode)
    batches = {"full": np.full(B_, CAP), "ragged": rng.integers(1, CAP + 1, B_),
               "mostly short": np.where(np.arange(B_) == 0, CAP, CAP // 32)}
    batches = {kind: jnp.asarray(n, jnp.int32) for kind, n in batches.items()}
    for n in batches.values():  # warm every case up (one untimed call each) before timing any
        got, want_n = jax.block_until_ready((plain(qb, kb, vb, n),
                                             reference(qb, kb_pages, vb_pages, n, table_b)))
        np.testing.assert_allclose(got, want_n, atol=1e-4, rtol=1e-4)
    base = None
    print(f"batch {B_}, capacity {CAP}, heads 8 on 2, head_dim 64, float32, q_len 1; "
          f"{style.backend_label(measured=True)}, median of 5 after 3 untimed calls, "
          "ratios to plain on 'full'")
    for kind, n in batches.items():
        t_plain = median_seconds(plain, qb, kb, vb, n)
        t_ref = median_seconds(reference, qb, kb_pages, vb_pages, n, table_b)
        base = base or t_plain
        s = decode.schedule(np.asarray(n), PAGE, capacity=CAP, num_kv_heads=2, pages_per_step=1)
        print(f"{kind:>13}: mean length {float(n.mean()):6.0f}; plain {t_plain / base:5.2f}, "
              f"reference {t_ref / base:5.2f}; pallas would compute {s['computed'] / s['blocks']:.0%} "
              "of its blocks (schedule)")
else:
    print("RUN_BENCHMARKS is False: skipped")

# %% [markdown]
# Every case runs once before any is timed, and each timing starts after three untimed calls, so no
# case is timed cold; on a shared CPU the ratios still move by tens of percent from run to run. What
# does not move is the work. The `jax.numpy` decodes score every slot and mask afterwards, so their
# FLOPs and bytes are set by the capacity, whatever the lengths; the kernel's schedule follows the
# lengths. Only a kernel whose index maps know the lengths turns short sequences into fewer bytes
# read — and bytes are what a decode step costs (section 1).

# %% [markdown]
# ## Takeaways
#
# > **Takeaway.** A decode step's intensity is about `group × q_len` FLOPs per (K, V) byte pair,
# > far below the ridge points of v5e, v6e and v5p: it is HBM-bound, and the best kernel reads each
# > visible byte of the cache once and nothing else.
#
# > **Takeaway.** Pages remove fragmentation and let sequences share a prefix; the price is one
# > indirection, a page table the kernel reads from SMEM in its index maps.
#
# > **Takeaway.** Split-K (flash-decoding) cuts the cache into chunks that run in parallel, and the
# > partial softmax states merge exactly through their logsumexp — the same merge as notebooks 02
# > and 06.
#
# > **Takeaway.** A kernel skips work by clamping the block index past a sequence's length: the
# > pipeline sees a repeated block and issues no DMA, and `pl.when` skips the compute.
#
# ## Exercises
#
# Each stub raises `NotImplementedError`; fill it in and re-run its cell. Solutions are at the end.
#
# 1. **Bytes per step** (★☆☆, 5 min). `step_cache_bytes(lengths, kv_heads, head_dim, itemsize)`: the
#    bytes of K and V one decode step reads for a batch (no window). Checked against
#    `roofline.decode_roofline(...).cache_bytes`.
# 2. **Gather the pages** (★☆☆, 10 min). `gather_pages(pages, page_table)`: a paged cache
#    `[num_pages, page_size, kv_heads, d]` and a table `[batch, pages_per_sequence]` to the contiguous
#    `[batch, pages_per_sequence * page_size, kv_heads, d]`, in NumPy or `jax.numpy`. Checked against
#    the package's gather on a random table.
# 3. **The clamping index map** (★★☆, 15 min). `asked_block(p, length, q_len, left, block)`: the block
#    the K/V index map asks for at step `p` — `p` itself when the block holds a position some query can
#    see, else the nearest block that does (with a left window `left`, or `None`). For an empty
#    sequence any block is fine as long as it is the same for every step: return 0. Checked against
#    the kernel's `kv_block` for many lengths, windows and `q_len`.
# 4. **Merge chunk partials** (★★★, 20 min). `merge(outs, lses)`: `outs [chunks, ..., d]` normalised
#    over each chunk, `lses [chunks, ...]` (`-inf` for a chunk that saw nothing) to the output over
#    all keys, without `softmax.merge`, without overflow for large logits, and with zeros
#    (no NaN) for rows no chunk saw. Checked against the whole attention on section 2's cache, with
#    chunks of one page and logits scaled by 100.


# %%
def step_cache_bytes(lengths, kv_heads, head_dim, itemsize):
    raise NotImplementedError("FILL ME IN")


def gather_pages(pages, page_table):
    raise NotImplementedError("FILL ME IN")


def asked_block(p, length, q_len, left, block):
    raise NotImplementedError("FILL ME IN")


def merge(outs, lses):
    raise NotImplementedError("FILL ME IN")


def check_exercises(step_cache_bytes, gather_pages, asked_block, merge):
    def check_bytes():
        for lengths_, hk, d, itemsize in (([4096] * 8, 8, 128, 2), ([0, 7, 1000], 2, 64, 4), ([1], 1, 8, 2)):
            want = roofline.decode_roofline(lengths_, heads=hk, kv_heads=hk, head_dim=d,
                                            dtype="float32" if itemsize == 4 else "bfloat16").cache_bytes
            got = step_cache_bytes(lengths_, hk, d, itemsize)
            assert got == want, (lengths_, hk, d, itemsize, got, want)

    def check_gather():
        pages = rng.standard_normal((10, 4, 2, 3)).astype(np.float32)
        table = rng.permutation(10)[:9].reshape(3, 3).astype(np.int32)
        np.testing.assert_array_equal(np.asarray(gather_pages(pages, table)),
                                      np.asarray(gather_cache(jnp.asarray(pages), jnp.asarray(table))))

    def check_clamp():
        for length in range(0, 41):
            for q_len, left in ((1, None), (4, None), (1, 0), (2, 5), (4, 17)):
                for p in range(6):
                    want = int(decode_kernel.kv_block(p, length, q_len, left, 8))
                    got = int(asked_block(p, length, q_len, left, 8))
                    assert got == want, dict(p=p, length=length, q_len=q_len, left=left, got=got, want=want)

    def check_merge():
        big = 100.0 * HEAD_DIM**-0.5  # large logits: a naive exp() overflows
        for scale in (HEAD_DIM**-0.5, big):
            split = [chunk_partial(q, k_contig, v_contig, jnp.asarray(lengths), a, a + PAGE_SIZE, scale)
                     for a in range(0, capacity, PAGE_SIZE)]
            got = merge(jnp.stack([o for o, _ in split]), jnp.stack([s for _, s in split]))
            want = decode.attention(q, k_contig, v_contig, lengths, scale=scale, impl="reference")
            assert np.isfinite(np.asarray(got)).all(), "NaN or Inf in the merged output"
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4, err_msg=f"scale {scale}")

    run_checks({"1 bytes per step": check_bytes, "2 gather pages": check_gather,
                "3 clamping index map": check_clamp, "4 merge partials": check_merge})


check_exercises(step_cache_bytes, gather_pages, asked_block, merge)

# %% [markdown]
# ## References
#
# - T. Dao, D. Fu, S. Ermon, A. Rudra, C. Ré, *FlashAttention: Fast and Memory-Efficient Exact
#   Attention with IO-Awareness* (2022), https://arxiv.org/abs/2205.14135; T. Dao, *FlashAttention-2*
#   (2023), https://arxiv.org/abs/2307.08691.
# - T. Dao, D. Haziza, F. Massa, G. Sizov, *Flash-Decoding for long-context inference* (2023),
#   https://crfm.stanford.edu/2023/10/12/flashdecoding.html.
# - W. Kwon et al., *Efficient Memory Management for Large Language Model Serving with
#   PagedAttention* (vLLM, 2023), https://arxiv.org/abs/2309.06180.
# - JAX's TPU decode kernels: `jax/experimental/pallas/ops/tpu/paged_attention/` and
#   `jax/experimental/pallas/ops/tpu/ragged_paged_attention/`, https://github.com/jax-ml/jax.
# - J. Austin et al., *How to Scale Your Model* (2025), the inference chapter,
#   https://jax-ml.github.io/scaling-book/inference/.
# - Google Cloud TPU pages (chip figures via `tpuattn.chips`): https://cloud.google.com/tpu/docs/v5e,
#   https://cloud.google.com/tpu/docs/v5p, https://cloud.google.com/tpu/docs/v6e.
# - The 2026 write-up this collection answers: *Forcing Flash Attention onto a TPU and Learning the
#   Hard Way*.
#
# ## Solutions
#
# The cell below is collapsed: open it after trying the exercises. It runs the same checks on the
# solutions, but only when `RUN_SOLUTIONS = True` (the parameters cell; the project's CI sets it), so
# Run All shows your own results alone.

# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solutions: open after trying the exercises (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    def step_cache_bytes_solution(lengths, kv_heads, head_dim, itemsize):
        return float(sum(lengths) * 2 * kv_heads * head_dim * itemsize)  # K and V of every valid position

    def gather_pages_solution(pages, page_table):
        gathered = np.asarray(pages)[np.asarray(page_table)]  # [batch, pages_per_sequence, page_size, hk, d]
        b, n, size, hk, d = gathered.shape
        return gathered.reshape(b, n * size, hk, d)

    def asked_block_solution(p, length, q_len, left, block):
        last = -(-length // block) - 1  # the block of position length - 1 (-1 when empty)
        first = 0 if left is None else max(length - q_len - left, 0) // block  # earliest visible key's block
        return min(max(p, first), max(last, first))

    def merge_solution(outs, lses):
        m = jnp.max(lses, axis=0)
        m = jnp.where(jnp.isfinite(m), m, 0.0)  # rows no chunk saw: any finite shift
        w = jnp.exp(lses - m)  # <= 1: no overflow; exp(-inf) = 0 for empty chunks
        total = jnp.sum(w, axis=0)
        return jnp.sum(w[..., None] * outs, axis=0) / jnp.where(total == 0, 1.0, total)[..., None]

    check_exercises(step_cache_bytes_solution, gather_pages_solution, asked_block_solution, merge_solution)
