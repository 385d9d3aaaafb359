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
# # 01 · Naive attention: the formula, a stable softmax, masks, and the memory it costs
#
# Attention is three lines of linear algebra. Written the obvious way it builds a score matrix with
# one entry per (query, key) pair, and that matrix, not the arithmetic, is what stops long sequences
# from running. This notebook answers: **what exactly does `attention(q, k, v)` compute, with which
# masks, and at what sequence length does the obvious implementation stop fitting on a TPU?**
#
# **What you'll do**
# - write attention from its formula and check it against a float64 NumPy version;
# - see the naive softmax overflow at logits around 1000, and fix it;
# - build the masks this project supports (causal, sliding window, segments) and GQA, and see why
#   `causal=True` here (bottom-right) differs from `jax.nn.dot_product_attention` (top-left) when
#   `q_len != kv_len`;
# - measure the memory the score matrix takes on this machine, and compute when it outgrows a TPU's HBM.
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/tpuattn/tpuattn/blob/main/notebooks/01_naive_attention.ipynb)

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

import tpuattn
from tpuattn.exercises import run_checks
from tpuattn.measure import runtime

PLATFORM = runtime.info()
print(PLATFORM.summary())

# %% tags=["parameters"]
SEED = 0
# Small problem for the checks: [batch, seq, heads, head_dim].
BATCH, SEQ_LEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 2, 48, 4, 2, 32
# Sequence lengths at which the reference's peak memory is measured (one child process each), with
# MEASURE_HEADS heads of head_dim 16: eight lengths spanning a factor 5, spaced evenly on a log axis, so
# the slope of log(memory) against log(T) can be read; a small head_dim keeps the arithmetic cheap.
MEASURE_LENGTHS = [512, 640, 800, 1024, 1280, 1600, 2048, 2560]
MEASURE_HEADS = 32
RUN_MEMORY = True
# The model whose score matrix we size for a TPU: batch 1, 32 heads, float32 scores.
MODEL_BATCH, MODEL_HEADS = 1, 32
# The hidden solution cells run only when this is True, so Run All shows your own results alone.
# The project's CI sets it (TPUATTN_RUN_SOLUTIONS=1): the committed outputs include the solutions'.
RUN_SOLUTIONS = os.environ.get("TPUATTN_RUN_SOLUTIONS") == "1"

# %%
import functools
import math

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from tpuattn.spec import MaskSpec
from tpuattn.viz import style

style.use_style()
rng = np.random.default_rng(SEED)

# %% [markdown]
# ## 1. The formula
#
# For one batch element and one head, with queries $Q \in \mathbb{R}^{T_q \times d}$ and keys and
# values $K, V \in \mathbb{R}^{T_k \times d}$:
#
# $$ S = s\,QK^\top \in \mathbb{R}^{T_q \times T_k}, \qquad P = \operatorname{softmax}_{\text{row}}(S),
# \qquad O = PV \in \mathbb{R}^{T_q \times d}, $$
#
# with scale $s = 1/\sqrt{d}$ by default. Row $i$ of $O$ is a weighted average of the value rows,
# weighted by how well query $i$ matches each key. Arrays here are laid out
# `[batch, seq, heads, head_dim]`, as in `jax.nn.dot_product_attention`.
#
# First, the yardstick: a float64 NumPy version, written for clarity, loops over batch and heads.
# It takes a boolean `visible[b, i, j]` mask (we build masks in section 3) and maps query head `h`
# to key/value head `h // group` (GQA, section 3.3). A row that sees no key returns zeros.


# %%
def numpy_attention(q, k, v, visible=None, scale=None):
    """Float64 attention, one (batch, head) at a time. visible: bool [batch, q_len, kv_len] or None."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, q_len, heads, dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(dim) if scale is None else scale
    group = heads // kv_heads
    out = np.zeros(q.shape)
    for b in range(batch):
        for h in range(heads):
            s = scale * q[b, :, h] @ k[b, :, h // group].T  # [q_len, kv_len]
            keep = np.ones((q_len, kv_len), bool) if visible is None else visible[b]
            s = np.where(keep, s, -np.inf)
            row_max = s.max(axis=1, keepdims=True)
            row_max[~np.isfinite(row_max)] = 0.0  # rows that see nothing
            p = np.where(keep, np.exp(s - row_max), 0.0)
            total = p.sum(axis=1, keepdims=True)
            out[b, :, h] = (p / np.where(total > 0, total, 1.0)) @ v[b, :, h // group]
    return out


def random_qkv(q_len=SEQ_LEN, kv_len=SEQ_LEN, heads=NUM_HEADS, kv_heads=NUM_HEADS, scale=1.0):
    q = scale * rng.standard_normal((BATCH, q_len, heads, HEAD_DIM)).astype(np.float32)
    k = scale * rng.standard_normal((BATCH, kv_len, kv_heads, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((BATCH, kv_len, kv_heads, HEAD_DIM)).astype(np.float32)
    return q, k, v


# %% [markdown]
# Now the same formula in JAX, exactly as written: one `einsum` for the scores, `jax.nn.softmax`,
# one `einsum` for the output. (`precision=HIGHEST` asks TPUs for full float32 matmuls; they default
# to faster bfloat16 passes.)


# %%
def naive_attention(q, k, v):
    """softmax(q k^T / sqrt(d)) v for [batch, seq, heads, head_dim] arrays with equal head counts."""
    scale = 1 / math.sqrt(q.shape[-1])
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * scale
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v, precision="highest")


q, k, v = random_qkv()
out = naive_attention(q, k, v)
# float32 against float64: each output is a sum of SEQ_LEN products of O(1) numbers, so rounding
# errors are a few float32 ulps (~1e-7 relative); 2e-5 leaves room without hiding a real bug.
np.testing.assert_allclose(out, numpy_attention(q, k, v), atol=2e-5, rtol=2e-5)
print("naive_attention matches the float64 NumPy version:", out.shape, out.dtype)

# %% [markdown]
# ## 2. The softmax has to be stable
#
# `jax.nn.softmax` hides a detail that every kernel in this project has to write out by hand.
# Written straight from its definition, $\operatorname{softmax}(s)_j = e^{s_j} / \sum_l e^{s_l}$
# overflows as soon as a logit passes $\log(\text{FLT\_MAX})$, the log of the largest finite float
# (printed below for float32 and float64). Logits that large are not exotic:
# they appear when queries and keys grow in norm during training, which is why some models cap
# them (`softcap`, see the exercises).


# %%
def softmax_naive(s):
    e = jnp.exp(s)
    return e / e.sum(axis=-1, keepdims=True)


def softmax_stable(s):
    # softmax(s) == softmax(s - c) for any constant c: subtracting the row max makes every
    # exponent <= 0, so exp never overflows and the largest term is exactly 1.
    m = s.max(axis=-1, keepdims=True)
    e = jnp.exp(s - m)
    return e / e.sum(axis=-1, keepdims=True)


for dtype in (np.float32, np.float64):
    largest = np.finfo(dtype).max
    print(f"{np.dtype(dtype).name}: largest finite {largest:.3g}, exp overflows above log(max) = "
          f"{np.log(largest):.2f}")
logits = jnp.array([1000.0, 999.0, 998.0])
print("exp(logits)          :", jnp.exp(logits))
print("naive softmax        :", softmax_naive(logits))
print("stable softmax       :", softmax_stable(logits))
with np.errstate(over="ignore", invalid="ignore"):  # NumPy would warn about the overflow we want to show
    e64 = np.exp(np.float64(1000.0))
    print("float64 NumPy, naive :", e64 / e64, "(overflows too)")

# %%
# Check the stable version against float64 on logits of magnitude ~1e3, where the naive one is NaN.
big = jnp.asarray(rng.uniform(-1000, 1000, size=(4, 16)).astype(np.float32))
s64 = np.asarray(big, np.float64)
want = np.exp(s64 - s64.max(axis=-1, keepdims=True))
want /= want.sum(axis=-1, keepdims=True)
assert bool(jnp.isnan(softmax_naive(big)).any())
# Relative to 1 (the largest probability), float32 rounding of logits ~1e3 is ~6e-5 absolute in the
# exponent; the probabilities themselves are in [0, 1].
np.testing.assert_allclose(softmax_stable(big), want, atol=1e-4)
print("stable softmax matches float64 on logits of magnitude 1e3; the naive one gives NaN")

# %% [markdown]
# `tpuattn`'s reference implementation does the same: it stops the gradient through the max (the
# softmax does not depend on it) and replaces the max of a row that sees no key (`-inf`) by 0, so
# that row gives zeros instead of `exp(-inf - -inf) = NaN`. With it the same large-logit input is
# fine end to end:

# %%
q, k, v = random_qkv(scale=6.0)  # large logits with head_dim 32 (the largest is printed)
out = tpuattn.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), impl="reference")
max_logit = float(np.abs(np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(HEAD_DIM)).max())
print(f"max |logit| in this batch: {max_logit:.0f}")
# Large logits make rows nearly one-hot; float32 rounding of logits of this size (a float32 ulp between
# 128 and 256 is 1.5e-5) moves each weight by a few 1e-5 relative, so compare with a looser 1e-3.
np.testing.assert_allclose(out, numpy_attention(q, k, v), atol=1e-3, rtol=1e-3)
print("reference attention is finite and matches float64 on large logits")

# %% [markdown]
# ## 3. Masks
#
# A mask says which keys a query may see. The contract (`tpuattn.attention`) places query `i` at
# key position $p_i = i + (T_k - T_q)$: **bottom-right alignment**. When $T_q = T_k$ that is just
# $p_i = i$. When there are fewer queries than keys (decoding with a cache, chunked prefill) the
# last query sits at the last key, so a single decoding query sees the whole cache.
#
# | mask | keeps key `j` for query `i` when |
# |---|---|
# | `causal=True` | $j \le p_i$ |
# | `window=(left, right)` | $p_i - \text{left} \le j \le p_i + \text{right}$ (an int `w` means `(w, w)`) |
# | `segment_ids` | key `j` is in the same segment as query `i` (packed sequences) |
#
# All given masks combine with AND. Here they are written from that table in NumPy; then we check
# that `tpuattn.spec.MaskSpec`, which every implementation uses, agrees.


# %%
def numpy_mask(q_len, kv_len, causal=False, window=None, q_seg=None, kv_seg=None):
    """bool [q_len, kv_len] from the table above (bottom-right alignment)."""
    pos = np.arange(q_len)[:, None] + (kv_len - q_len)
    j = np.arange(kv_len)[None, :]
    keep = np.ones((q_len, kv_len), bool)
    if causal:
        keep &= j <= pos
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        keep &= (j >= pos - left) & (j <= pos + right)
    if q_seg is not None:
        keep &= np.asarray(q_seg)[:, None] == np.asarray(kv_seg)[None, :]
    return keep


def package_mask(q_len, kv_len, **kwargs):
    spec = MaskSpec(q_len, kv_len, causal=kwargs.get("causal", False), window=kwargs.get("window"))
    vis = spec.visible(np.arange(q_len)[:, None], np.arange(kv_len)[None, :])
    return np.broadcast_to(vis, (q_len, kv_len))


segments = np.repeat([0, 1, 2], [5, 3, 4])  # three packed sequences of lengths 5, 3, 4
examples = {
    "causal, 12 x 12": numpy_mask(12, 12, causal=True),
    "causal, 4 queries x 12 keys\n(bottom-right: tpuattn)": numpy_mask(4, 12, causal=True),
    "is_causal, 4 queries x 12 keys\n(top-left: jax.nn)": np.tril(np.ones((4, 12), bool)),
    "window (3, 0), 12 x 12\n(sliding window, causal)": numpy_mask(12, 12, window=(3, 0)),
    "segments 5|3|4 + causal": numpy_mask(12, 12, causal=True, q_seg=segments, kv_seg=segments),
}
for kwargs in ({"causal": True}, {"window": (3, 0)}, {"window": (2, 1), "causal": True}):
    for q_len, kv_len in ((12, 12), (4, 12), (12, 4)):
        np.testing.assert_array_equal(package_mask(q_len, kv_len, **kwargs),
                                      numpy_mask(q_len, kv_len, **kwargs))
print("tpuattn.spec.MaskSpec agrees with the table on", 9, "mask/shape combinations")

fig, axes = plt.subplots(1, len(examples), figsize=(16, 3.4))
for ax, (title, mask) in zip(axes, examples.items(), strict=True):
    style.show_mask(ax, mask, title=title)
fig.suptitle("Which keys each query sees (dark = visible)", y=1.04)
style.save_figure(fig, "01_masks")
plt.show()

# %% [markdown]
# ### 3.1 Bottom-right here, top-left in `jax.nn.dot_product_attention`
#
# `jax.nn.dot_product_attention(..., is_causal=True)` builds its causal mask as a lower-triangular
# matrix anchored at the **top-left**: query `i` sees keys `j <= i` whatever the lengths. With
# $T_q = T_k$ both conventions agree. With 4 queries and 12 keys they do not: top-left lets the
# last query see only 4 keys, bottom-right lets it see all 12. Which one is right depends on where
# the queries are: for queries that *follow* a cache (decoding), it is bottom-right.

# %%
q, k, v = random_qkv(q_len=4, kv_len=12)
jq, jk, jv = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
top_left = np.tril(np.ones((4, 12), bool))
bottom_right = numpy_mask(4, 12, causal=True)

ours = tpuattn.attention(jq, jk, jv, causal=True, impl="reference")
theirs = jax.nn.dot_product_attention(jq, jk, jv, is_causal=True)
np.testing.assert_allclose(ours, numpy_attention(q, k, v, np.broadcast_to(bottom_right, (BATCH, 4, 12))),
                           atol=2e-5, rtol=2e-5)
np.testing.assert_allclose(theirs, numpy_attention(q, k, v, np.broadcast_to(top_left, (BATCH, 4, 12))),
                           atol=2e-5, rtol=2e-5)
print("tpuattn causal == float64 with the bottom-right mask")
print("jax.nn causal  == float64 with the top-left mask")
print("largest difference between the two:", f"{float(jnp.abs(ours - theirs).max()):.2f}")
# Equal lengths: the two conventions coincide.
q, k, v = (jnp.asarray(x) for x in random_qkv())
np.testing.assert_allclose(tpuattn.attention(q, k, v, causal=True, impl="reference"),
                           jax.nn.dot_product_attention(q, k, v, is_causal=True), atol=2e-5, rtol=2e-5)
print("with q_len == kv_len they agree")

# %% [markdown]
# ### 3.2 A mask explorer
#
# Move the sliders (in a live notebook) to see how lengths, causality and the window combine.

# %% tags=["nbval-ignore-output"]
try:
    import ipywidgets as widgets

    def explore(q_len=8, kv_len=16, causal=True, left=16, right=16):
        fig, ax = plt.subplots(figsize=(4.5, 3))
        style.show_mask(ax, numpy_mask(q_len, kv_len, causal, (left, right)),
                        title=f"q_len={q_len}, kv_len={kv_len}, causal={causal}, window=({left}, {right})")
        plt.show()

    widgets.interact(explore, q_len=(1, 24), kv_len=(1, 24), causal=True, left=(0, 24), right=(0, 24))
except ImportError:
    print("pip install ipywidgets for the interactive explorer")

# %% [markdown]
# ### 3.3 Grouped-query attention (GQA)
#
# Keys and values may have fewer heads than queries: with `num_q_heads = 4` and `num_kv_heads = 2`
# each K/V head serves a *group* of 2 query heads; query head `h` reads K/V head `h // 2`. MQA is the
# extreme, one K/V head for all. The K/V cache shrinks by the group size, the score matrix does not:
# every query head still gets its own `[T_q, T_k]` scores.

# %%
q, k, v = random_qkv(heads=NUM_HEADS, kv_heads=NUM_KV_HEADS)
group = NUM_HEADS // NUM_KV_HEADS
print("query head -> kv head:", {h: h // group for h in range(NUM_HEADS)})
out = tpuattn.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal=True, impl="reference")
visible = np.broadcast_to(numpy_mask(SEQ_LEN, SEQ_LEN, causal=True), (BATCH, SEQ_LEN, SEQ_LEN))
np.testing.assert_allclose(out, numpy_attention(q, k, v, visible), atol=2e-5, rtol=2e-5)
# Same thing as repeating each kv head `group` times and running plain multi-head attention.
k_rep, v_rep = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
np.testing.assert_allclose(out, numpy_attention(q, k_rep, v_rep, visible), atol=2e-5, rtol=2e-5)
np.testing.assert_allclose(out, jax.nn.dot_product_attention(q, k, v, is_causal=True), atol=2e-5, rtol=2e-5)
print(f"GQA ({NUM_HEADS} query heads, {NUM_KV_HEADS} kv heads) matches float64, repeated heads and jax.nn")

# %% [markdown]
# ## 3b. Masks end to end, and rows that see nothing
#
# A query whose segment has no key (below: query segment 3 never appears among the keys), or that
# sits before key 0 under a causal mask when $T_q > T_k$, sees nothing. The contract returns zeros
# for such a row, never NaN. Each case below runs through `tpuattn.attention` and is checked
# against the float64 NumPy version with the mask built from the table.

# %%
cases = [
    dict(q_len=SEQ_LEN, kv_len=SEQ_LEN, causal=True),
    dict(q_len=16, kv_len=SEQ_LEN, causal=True),
    dict(q_len=SEQ_LEN, kv_len=16, causal=True),  # the first 32 queries see nothing
    dict(q_len=SEQ_LEN, kv_len=SEQ_LEN, window=(8, 0)),
    dict(q_len=SEQ_LEN, kv_len=SEQ_LEN, window=(4, 4), causal=True),
    dict(q_len=SEQ_LEN, kv_len=SEQ_LEN, causal=True, segments=True),
]
for case in cases:
    q_len, kv_len = case["q_len"], case["kv_len"]
    q, k, v = random_qkv(q_len, kv_len)
    kwargs, visible = {}, np.empty((BATCH, q_len, kv_len), bool)
    q_seg = kv_seg = None
    if case.get("segments"):
        q_seg = np.sort(rng.integers(0, 4, (BATCH, q_len)), axis=1).astype(np.int32)
        kv_seg = np.minimum(q_seg, 2)  # keys have segments 0..2: queries of segment 3 see nothing
        kwargs["segment_ids"] = (jnp.asarray(q_seg), jnp.asarray(kv_seg))
    for b in range(BATCH):
        visible[b] = numpy_mask(q_len, kv_len, case.get("causal", False), case.get("window"),
                                None if q_seg is None else q_seg[b], None if kv_seg is None else kv_seg[b])
    out = tpuattn.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal=case.get("causal", False),
                            window=case.get("window"), impl="reference", **kwargs)
    np.testing.assert_allclose(out, numpy_attention(q, k, v, visible), atol=2e-5, rtol=2e-5)
    blind = ~visible.any(axis=2)
    assert np.all(np.asarray(out)[blind] == 0.0) and np.isfinite(np.asarray(out)).all()
    label = ", ".join(f"{key}={value}" for key, value in case.items())
    print(f"ok  {label:<60} rows that see nothing: {int(blind.sum())}")

# %% [markdown]
# ## 4. The score matrix's memory
#
# The naive implementation stores $S$ (and the probabilities $P$, same shape) for every batch element
# and head: $B \cdot H \cdot T_q \cdot T_k$ floats. In float32, with $T_q = T_k = T$, that is
# $4BHT^2$ bytes, **quadratic in the sequence length** while Q, K, V and O grow linearly.
#
# ### 4.1 Measured on this machine
#
# `tpuattn.measure.memory.measure_peak_memory` runs one forward call of the reference in a fresh process
# and reports the peak memory minus what was held before the call (batch 1, `MEASURE_HEADS` heads,
# head_dim 16, float32): on a CPU the process's peak resident memory, on a TPU the device's own
# peak HBM in use (the host's memory says nothing about the TPU's). Beside it, the bytes of one
# float32 score matrix.

# %% tags=["nbval-ignore-output"]
from tpuattn.measure.memory import measure_peak_memory

MIB = 2**20
measured = []
if RUN_MEMORY:
    print(f"{'seq_len':>8} {'call peak MiB':>14} {'one score matrix MiB':>21}   "
          f"({style.backend_label(measured=True)})")
    for seq_len in MEASURE_LENGTHS:
        peak = measure_peak_memory("reference", seq_len, mode="fwd", heads=MEASURE_HEADS, head_dim=16)
        scores_mib = 1 * MEASURE_HEADS * seq_len * seq_len * 4 / MIB
        measured.append((seq_len, peak.call_mib if peak.ok else float("nan"), scores_mib))
        note = "" if peak.ok else f"  failed: {peak.error}"
        print(f"{seq_len:>8} {measured[-1][1]:>14.0f} {scores_mib:>21.0f}{note}")
    print(f"measured as: {peak.method}")
    (t0, m0, s0), (t1, m1, _) = measured[0], measured[-1]
    print(f"from T={t0} to T={t1} ({t1 / t0:.2f}x) the call's peak grew {m1 / m0:.2f}x "
          f"(T^2 grew {(t1 / t0) ** 2:.2f}x); peak / one score matrix: "
          + ", ".join(f"{m / s:.1f}" for _, m, s in measured))
    seq, peaks = np.array([row[0] for row in measured], float), np.array([row[1] for row in measured])
    ok = np.isfinite(peaks) & (peaks > 0)
    slope = np.polyfit(np.log(seq[ok]), np.log(peaks[ok]), 1)[0]
    print(f"slope of log(call peak) against log(T), least squares over {int(ok.sum())} lengths: {slope:.2f} "
          "(a square law gives 2)")

# %% [markdown]
# The call's peak follows the score matrix: it grows with $T^2$ (the lines above set the two growths
# side by side and fit the slope on log-log axes; the left panel of the figure below draws it). XLA
# fuses the softmax, so the peak is a small multiple of one score matrix (the ratios printed above:
# the scores and their exponentials) rather than one copy per operation. The measurement is the
# operating system's view of the process (its peak resident memory after a reset just before the
# call), so a few MiB of allocator noise show at the shortest lengths.
#
# ### 4.2 Computed for a TPU's HBM
#
# Now size the score matrix of a model with `MODEL_BATCH` sequences and `MODEL_HEADS` heads in
# float32 against the HBM of one TPU chip (capacities from `tpuattn.chips`: JAX's own table, which
# agrees with Google Cloud's published numbers). This is a *lower bound* on what the naive forward
# needs: the weights, the activations, $P$ for the backward pass all come on top.

# %%
from tpuattn.model import roofline

GIB = 2**30
chips = {name: roofline.chip_spec(name).hbm_capacity for name in ("v5e", "v6e", "v5p")}


def scores_bytes(seq_len, batch=MODEL_BATCH, heads=MODEL_HEADS, bytes_per_element=4):
    return batch * heads * seq_len * seq_len * bytes_per_element


def longest_fitting(capacity, batch=MODEL_BATCH, heads=MODEL_HEADS, bytes_per_element=4):
    """Largest T with batch * heads * T^2 * bytes <= capacity."""
    return math.isqrt(int(capacity // (batch * heads * bytes_per_element)))


print(f"float32 scores of batch {MODEL_BATCH} x {MODEL_HEADS} heads (modelled)")
print(f"{'seq_len':>8} {'scores GiB':>11}  " + "  ".join(f"{'fits ' + n:>9}" for n in chips))
for seq_len in (2048, 4096, 8192, 16384, 32768, 65536, 131072):
    gib = scores_bytes(seq_len) / GIB
    fits = "  ".join(f"{'yes' if scores_bytes(seq_len) <= cap else 'NO':>9}" for cap in chips.values())
    print(f"{seq_len:>8} {gib:>11.1f}  {fits}")
print()
for name, capacity in chips.items():
    print(f"TPU {name}: {capacity / GIB:5.1f} GiB HBM -> the score matrix alone stops fitting "
          f"above T = {longest_fitting(capacity):,}")

# %% [markdown]
# The figure puts both on log-log axes, where a power law $y \propto T^k$ is a straight line of slope
# $k$. Left, the score matrix's $T^2$ is a line of slope 2, and the measured peak runs nearly parallel
# to it (its fitted slope is printed in section 4.1; a constant overhead bends it down a little at
# the short end). Right, each chip's HBM is a horizontal line; where the score line crosses it (the
# verticals, labelled with the lengths printed above) the scores alone no longer fit.

# %%
REFERENCE_COLOUR = style.impl_colour("reference")  # one colour per implementation, in every figure
fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(13, 4.6))
if measured:
    lengths, call_mib, score_mib = (np.array(col) for col in zip(*measured, strict=True))
    ax_m.plot(lengths, call_mib, "o-", color=REFERENCE_COLOUR,
              label=f"reference forward, call peak ({style.backend_label(measured=True)})")
    ax_m.plot(lengths, score_mib, "s:", color=REFERENCE_COLOUR, alpha=0.6,
              label="one float32 score matrix, 4 * heads * T^2 bytes (computed)")
    ax_m.set_xscale("log", base=2)
    ax_m.set_yscale("log", base=2)
    ax_m.set_xticks(lengths, [str(t) for t in lengths], rotation=45)
    ax_m.minorticks_off()
    ax_m.legend(fontsize=8)
else:
    ax_m.text(0.5, 0.5, "RUN_MEMORY = False", ha="center", transform=ax_m.transAxes)
ax_m.set_xlabel("sequence length T (log scale)")
ax_m.set_ylabel("MiB (log scale)")
ax_m.set_title(style.labelled(f"Peak memory of naive attention, batch 1 x {MEASURE_HEADS} heads x d 16",
                              measured=True))

t = np.logspace(np.log2(1024), np.log2(262144), 60, base=2)
ax_t.plot(t, scores_bytes(t) / GIB, color=REFERENCE_COLOUR,
          label=f"reference: float32 scores, batch {MODEL_BATCH} x {MODEL_HEADS} heads (slope 2)")
for (name, capacity), line in zip(chips.items(), (":", "--", "-."), strict=True):
    crossover = longest_fitting(capacity)
    ax_t.axhline(capacity / GIB, color="grey", linestyle=line,
                 label=f"TPU {name} HBM ({capacity / GIB:.1f} GiB)")
    ax_t.axvline(crossover, color="grey", linestyle=line, alpha=0.6)
    ax_t.annotate(f"{name}: T = {crossover:,}", (crossover, capacity / GIB), xytext=(4, -14),
                  textcoords="offset points", fontsize=8, rotation=90, va="top")
ax_t.set_xscale("log", base=2)
ax_t.set_yscale("log", base=2)
ax_t.set_xlabel("sequence length T (log scale)")
ax_t.set_ylabel("GiB (log scale)")
ax_t.set_title(style.labelled("Score matrix vs one chip's HBM (tpuattn.chips)", measured=False,
                              chip="TPU v5e / v6e / v5p"))
ax_t.legend(fontsize=8, loc="upper left")
fig.tight_layout()
style.save_figure(fig, "01_memory")
plt.show()

# %% [markdown]
# ## Takeaways
#
# > **Takeaway.** Attention is `softmax(s * q k^T) v`; everything else in this project computes
# > exactly that, to within float32 rounding of this notebook's float64 version.
#
# > **Takeaway.** Always subtract the row max before `exp`: float32 overflows at logits above 88.72.
# > A row that sees no key must give zeros, which takes one more guard (max of nothing is `-inf`).
#
# > **Takeaway.** Masks are positions compared with positions. Here causal is aligned bottom-right
# > (query `i` sits at key `i + kv_len - q_len`), unlike `jax.nn.dot_product_attention`'s top-left;
# > the two agree only when `q_len == kv_len`.
#
# > **Takeaway.** The score matrix costs $4BHT^2$ bytes, a line of slope 2 on log-log axes: at batch 1
# > and 32 heads it outgrows a v5e's 16.0 GiB above T = 11,592 and a v5p's 95.9 GiB above T = 28,367
# > (printed in section 4.2), before a single weight is stored. Notebook 02 computes the same result
# > without ever storing it.
#
# ## Exercises
#
# Each stub raises `NotImplementedError`; fill it in and re-run the cell, which calls
# `check_exercises` with your functions. Worked solutions are in the hidden cell at the end of the
# notebook, which runs the same checks on them. Easier first:
#
# 1. **Budget** (★☆☆, 5 min). Using `scores_bytes`, write `largest_batch()`: the largest batch for
#    which float32 scores of 32 heads at T = 4096 fit in half of a v6e's HBM.
# 2. **Decoding** (★☆☆, 10 min). Write `decode_visible(kv_len, window)`: the boolean `[kv_len]` row
#    of keys a single new query sees with `causal=True` and a left window `window` (bottom-right
#    alignment). Checked against `numpy_mask`.
# 3. **Softcap** (★★☆, 10 min). Gemma-style models replace each logit $s$ by $c \tanh(s / c)$ so it
#    never exceeds $c$. Change `naive_attention` into `softcapped_attention(q, k, v, cap)` (no masks,
#    equal head counts); it is checked against `tpuattn.attention(..., softcap=cap)`.
# 4. **Rows that see nothing** (★★☆, 15 min). Write `masked_attention(q, k, v, visible)` in JAX for a
#    boolean `visible[batch, q_len, kv_len]` (the same for every head, equal head counts): the stable
#    softmax of section 2 over the visible keys only, zeros for a row that sees no key -- and no NaN
#    in its gradient either. Checked against `numpy_attention` on a causal `q_len > kv_len` case and a
#    segment case with blind rows, and `jax.grad` of it must be finite and zero for blind rows.
# 5. **GQA without copies** (★★★, 20 min). Write `grouped_attention(q, k, v)` for `num_q_heads` a
#    multiple of `num_kv_heads` (no mask) *without* repeating K or V: reshape the query heads into
#    `(kv_heads, group)` so one `einsum` serves the whole group. Checked against
#    `tpuattn.attention(..., impl="reference")`, and the traced program (its jaxpr) must hold no array
#    larger than K that has K's sequence and head dimensions -- which a `jnp.repeat(k, ...)` would.


# %%
def largest_batch():
    raise NotImplementedError("FILL ME IN")


def decode_visible(kv_len, window):
    raise NotImplementedError("FILL ME IN")


def softcapped_attention(q, k, v, cap):
    raise NotImplementedError("FILL ME IN")


def masked_attention(q, k, v, visible):
    raise NotImplementedError("FILL ME IN")


def grouped_attention(q, k, v):
    raise NotImplementedError("FILL ME IN")


def _avals(jaxpr):
    """Every intermediate's abstract value in a jaxpr, nested jaxprs (jit, custom_jvp) included."""
    for eqn in jaxpr.eqns:
        yield from (var.aval for var in eqn.outvars)
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _avals(inner)


def assert_budget(batch):
    half = chips["v6e"] / 2
    assert scores_bytes(4096, batch=batch) <= half < scores_bytes(4096, batch=batch + 1), batch


def check_masked(masked_attention):
    q_seg = np.sort(rng.integers(0, 4, (BATCH, SEQ_LEN)), axis=1)
    kv_seg = np.minimum(q_seg, 2)  # queries of segment 3 see no key
    for q_len, kv_len, seg in ((SEQ_LEN, 16, None), (SEQ_LEN, SEQ_LEN, (q_seg, kv_seg))):
        q, k, v = (jnp.asarray(x) for x in random_qkv(q_len, kv_len))
        visible = np.stack([numpy_mask(q_len, kv_len, causal=True, q_seg=None if seg is None else seg[0][b],
                                       kv_seg=None if seg is None else seg[1][b]) for b in range(BATCH)])
        out = masked_attention(q, k, v, jnp.asarray(visible))
        np.testing.assert_allclose(out, numpy_attention(q, k, v, visible), atol=2e-5, rtol=2e-5)
        loss = functools.partial(lambda q, k, v, visible: masked_attention(q, k, v, visible).sum(),
                                 k=k, v=v, visible=jnp.asarray(visible))
        d_q = jax.grad(loss)(q)
        blind = ~visible.any(axis=2)  # [batch, q_len]
        assert blind.any() and np.isfinite(np.asarray(d_q)).all(), "NaN in the gradient"
        assert np.all(np.asarray(d_q)[blind] == 0.0), "a row that sees nothing must have a zero gradient"


def check_grouped(grouped_attention):
    q, k, v = (jnp.asarray(x) for x in random_qkv(q_len=16, kv_len=SEQ_LEN, heads=NUM_HEADS,
                                                    kv_heads=NUM_KV_HEADS))
    np.testing.assert_allclose(grouped_attention(q, k, v), tpuattn.attention(q, k, v, impl="reference"),
                               atol=2e-5, rtol=2e-5)
    for aval in _avals(jax.make_jaxpr(grouped_attention)(q, k, v).jaxpr):
        shape = getattr(aval, "shape", ())
        assert not (math.prod(shape) > k.size and SEQ_LEN in shape and HEAD_DIM in shape), (
            f"an array of shape {shape} (larger than K {k.shape}): K or V repeated per query head?")


def check_exercises(*, largest_batch, decode_visible, softcapped_attention, masked_attention,
                    grouped_attention):
    """Run the five checks on the functions given (the stubs above, or the solutions at the end)."""
    q, k, v = (jnp.asarray(x) for x in random_qkv(scale=3.0))
    checks = {
        "1 budget": lambda: assert_budget(largest_batch()),
        "2 decoding": lambda: np.testing.assert_array_equal(
            decode_visible(10, 3), numpy_mask(1, 10, causal=True, window=(3, 0))[0]),
        "3 softcap": lambda: np.testing.assert_allclose(
            softcapped_attention(q, k, v, 20.0), tpuattn.attention(q, k, v, softcap=20.0, impl="reference"),
            atol=2e-5, rtol=2e-5),
        "4 rows that see nothing": lambda: check_masked(masked_attention),
        "5 GQA without copies": lambda: check_grouped(grouped_attention),
    }
    return run_checks(checks, hint="see the exercise text above the stubs")


progress = check_exercises(largest_batch=largest_batch, decode_visible=decode_visible,
                           softcapped_attention=softcapped_attention, masked_attention=masked_attention,
                           grouped_attention=grouped_attention)

# %% [markdown]
# ## References
#
# - A. Vaswani et al., "Attention Is All You Need", 2017, arXiv:1706.03762 (scaled dot-product
#   attention).
# - T. Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness",
#   2022, arXiv:2205.14135 -- why the score matrix, not the FLOPs, is the problem.
# - JAX, `jax.nn.dot_product_attention` (its mask and causal conventions, top-left aligned):
#   https://docs.jax.dev/en/latest/_autosummary/jax.nn.dot_product_attention.html.
# - Google Cloud, TPU system architecture (HBM per chip):
#   https://cloud.google.com/tpu/docs/system-architecture-tpu-vm; the numbers used here are JAX's own
#   table, `tpuattn.chips`.
# - Gemma 2 team, "Gemma 2: Improving Open Language Models at a Practical Size", 2024,
#   arXiv:2408.00118 (logit soft-capping).
# - A. Zhang, "Forcing Flash Attention onto a TPU and Learning the Hard Way", 2026,
#   https://archerzhang.me/forcing-flash-attention-onto-a-tpu -- the write-up this collection answers.

# %% [markdown]
# ## Solutions
#
# The cell below is collapsed: open it after trying the exercises. It runs the same checks on the
# solutions, but only when `RUN_SOLUTIONS = True` (the parameters cell; the project's CI sets it), so
# Run All shows your own results alone.

# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solutions: open after trying the exercises (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    def largest_batch():
        half = chips["v6e"] / 2  # 32 GiB / 2
        return int(half // scores_bytes(4096, batch=1))  # 2 GiB of scores per sequence

    def decode_visible(kv_len, window):
        pos = kv_len - 1  # one query: p_0 = 0 + kv_len - 1, the last key
        j = np.arange(kv_len)
        return (j <= pos) & (j >= pos - window)

    def softcapped_attention(q, k, v, cap):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") / math.sqrt(q.shape[-1])
        s = cap * jnp.tanh(s / cap)  # after scaling, before the softmax (and before any mask)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v, precision="highest")

    def masked_attention(q, k, v, visible):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") / math.sqrt(q.shape[-1])
        keep = jnp.asarray(visible)[:, None]  # [batch, 1, q_len, kv_len]: the same mask for every head
        s = jnp.where(keep, s, -jnp.inf)
        m = jax.lax.stop_gradient(s.max(axis=-1, keepdims=True))  # the softmax does not depend on it
        m = jnp.where(jnp.isfinite(m), m, 0.0)  # a row that sees nothing has max -inf: shift by 0
        p = jnp.where(keep, jnp.exp(s - m), 0.0)  # exp(-inf) = 0: finite values and gradients
        total = p.sum(axis=-1, keepdims=True)
        p = p / jnp.where(total > 0, total, 1.0)  # blind rows: 0 / 1 = 0
        return jnp.einsum("bhqk,bkhd->bqhd", p, v, precision="highest")

    def grouped_attention(q, k, v):
        b, q_len, heads, d = q.shape
        kv_heads = k.shape[2]
        # Query head h = kv_head * group + member, so it reads kv head h // group: split the head axis.
        q_grouped = q.reshape(b, q_len, kv_heads, heads // kv_heads, d)
        s = jnp.einsum("bqkgd,bskd->bkgqs", q_grouped, k, precision="highest") / math.sqrt(d)
        out = jnp.einsum("bkgqs,bskd->bqkgd", jax.nn.softmax(s, axis=-1), v, precision="highest")
        return out.reshape(b, q_len, heads, d)

    done = check_exercises(largest_batch=largest_batch, decode_visible=decode_visible,
                           softcapped_attention=softcapped_attention, masked_attention=masked_attention,
                           grouped_attention=grouped_attention)
    assert all(done.values()), done
