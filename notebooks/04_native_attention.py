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
# # 04 · Native attention: `jax.nn.dot_product_attention` and splash behind the same contract
#
# Notebooks 01–03 built attention three ways. JAX itself maintains two more: `jax.nn.dot_product_attention`
# (XLA, or cuDNN on a GPU) and the **splash attention** Pallas kernel that JAX ships for TPUs. They are
# usually as fast as a hand-written kernel and someone else keeps them working. This notebook answers:
# **what does it take to put the platform's attention behind our contract, are its numbers as good as
# ours, what does each implementation cost to keep working across JAX releases, and which one should
# you use for your shapes and chip?**
#
# **What you'll do**
# - see the two translations the native paths need: bottom-right causal alignment, and rows that see no key;
# - call `impl="xla"` and `impl="splash"` and check them against the package's reference;
# - compare the error of *every* implementation against a float64 NumPy attention, by dtype and length;
# - list which JAX APIs each implementation touches and what changed between JAX 0.7.2 and 0.10.2;
# - build a decision guide from measured (this machine), modelled (TPU roofline) and compiled (TPU
#   compiler) numbers, each in its own panel, and read the `impl="auto"` rule that encodes it;
# - write code: translate masks for `jax.nn` and for splash's mask objects, and register an
#   implementation with its own `supports`.
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/tpuattn/tpuattn/blob/main/notebooks/04_native_attention.ipynb)

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
from tpuattn.measure import runtime

PLATFORM = runtime.info()
print(PLATFORM.summary())

# %% tags=["parameters"]
SEED = 0
# Small problem for the checks: [batch, seq, heads, head_dim]; GQA with 2 query heads per kv head.
BATCH, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 1, 4, 2, 32
# Numerics: every implementation, at these lengths and dtypes (causal). Pallas kernels run in
# interpret mode off-TPU, so keep these small on CPU.
ERROR_LENGTHS = [128, 256, 512]
ERROR_DTYPES = ["float32", "bfloat16"]
# Timings on this machine (forward, causal) for the compiled implementations.
RUN_TIMINGS = True
TIMING_LENGTHS = [256, 1024]
TIMING_HEADS, TIMING_HEAD_DIM = 4, 64
# Modelled TPU for the decision guide (tpuattn.model.roofline).
MODEL_CHIP = "v5e"
MODEL_LENGTHS = [512, 1024, 2048, 4096, 8192, 16384, 32768]
# The hidden solution cells run only when this is True, so Run All shows your own results alone.
# The project's CI sets it (TPUATTN_RUN_SOLUTIONS=1): the committed outputs include the solutions'.
RUN_SOLUTIONS = os.environ.get("TPUATTN_RUN_SOLUTIONS") == "1"

# %%
import dataclasses
import inspect

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from tpuattn.measure.timing import time_jitted
from tpuattn.model import roofline
from tpuattn.viz import style

style.use_style()
rng = np.random.default_rng(SEED)
print("registered here:", tpuattn.implementations())

# %% [markdown]
# ## 1. Two translations the native paths need
#
# Our contract (notebook 01) aligns `causal=True` **bottom-right**: query $i$ sits at key position
# $p_i = i + T_k - T_q$, so the last query sees every key, which is what decoding with a KV cache needs.
# `jax.nn.dot_product_attention(..., is_causal=True)` builds `tril(ones(T_q, T_k))`: **top-left**.
# The two agree only when $T_q = T_k$.
#
# You do not have to take either on faith: a *probe* reads the mask off any attention function. Give
# it zero queries (every visible key gets the same logit) and one-hot values (`v[j] = e_j`); the output
# row $i$ is then uniform over the keys row $i$ sees, so `out > 0` *is* the mask.

# %%
def probe_visibility(attend, q_len, kv_len):
    """The [q_len, kv_len] visibility of `attend(q, k, v)`, read off its output."""
    q = jnp.zeros((1, q_len, 1, kv_len), jnp.float32)
    k = jnp.zeros((1, kv_len, 1, kv_len), jnp.float32)
    v = jnp.eye(kv_len, dtype=jnp.float32)[None, :, None, :]
    return np.asarray(attend(q, k, v))[0, :, 0, :] > 1e-6


Q_LEN, KV_LEN = 6, 10
seen_contract = probe_visibility(lambda q, k, v: tpuattn.attention(q, k, v, causal=True, impl="xla"),
                                 Q_LEN, KV_LEN)
seen_jax_nn = probe_visibility(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                               Q_LEN, KV_LEN)
seen_splash = probe_visibility(lambda q, k, v: tpuattn.attention(q, k, v, causal=True, impl="splash"),
                               Q_LEN, KV_LEN)
expected = np.arange(KV_LEN)[None, :] <= np.arange(Q_LEN)[:, None] + (KV_LEN - Q_LEN)
np.testing.assert_array_equal(seen_contract, expected)
np.testing.assert_array_equal(seen_splash, expected)
print("jax.nn is_causal=True == contract's causal:", bool((seen_jax_nn == expected).all()))

fig, axes = plt.subplots(1, 3, figsize=(10, 2.8))
style.show_mask(axes[0], seen_contract, title="impl='xla' (contract: bottom-right)")
style.show_mask(axes[1], seen_jax_nn, title="jax.nn is_causal=True (top-left)")
style.show_mask(axes[2], seen_splash, title=f"impl='splash' (CausalMask, offset {KV_LEN - Q_LEN})")
fig.suptitle(f"causal with q_len={Q_LEN}, kv_len={KV_LEN}, read off each function's output")
style.save_figure(fig, "04_alignment")
plt.show()
style.close(fig)

# %% [markdown]
# **How each path translates.**
#
# * `xla`: for square causal the flag is right and is passed as is (so cuDNN, on a GPU, can skip the
#   masked half). Anything else (bottom-right causal, windows, segment ids) becomes one explicit
#   boolean `mask` built from the package's `MaskSpec.visible`. XLA computes every score anyway, so the
#   explicit mask costs one fused `where`. `local_window_size` could express a band too, but it is
#   aligned top-left as well and cannot say "unbounded": the explicit mask says exactly what we mean.
# * `splash`: its masks take an `offset` ("offset of q start w.r.t. kv"): `CausalMask(shape,
#   offset=kv_len - q_len)` is our causal, and `LocalMask(shape, (left, right), offset)` our window
#   (with causal folded into `right = min(right, 0)`). Segment ids map onto its `SegmentIds`, softcap
#   onto `attn_logits_soft_cap`, and GQA onto the multi-head kernel with fewer key/value heads (its
#   index map reads kv head `h // group`) or, with one kv head, the MQA kernel. Splash does **not**
#   scale the logits, so `q` is multiplied by `scale` first.
#
# The second translation is about **a query that sees no key** (segment ids that appear only among
# the queries, or `causal` with `q_len > kv_len`). The contract returns zeros there, with zero
# gradients. `jax.nn` fills masked logits with a large *finite* negative number, so such a row gets
# a uniform softmax: the mean of `v`.

# %%
q_e, k_e, v_e = (jnp.asarray(rng.standard_normal((1, n, 1, 8)), jnp.float32) for n in (5, 3, 3))
hidden = np.arange(3)[None, :] <= np.arange(5)[:, None] - 2  # causal, q_len > kv_len: rows 0, 1 see nothing
raw = jax.nn.dot_product_attention(q_e, k_e, v_e, mask=jnp.asarray(hidden)[None, None])
ours = tpuattn.attention(q_e, k_e, v_e, causal=True, impl="xla")
np.testing.assert_allclose(raw[0, :2, 0], np.broadcast_to(v_e[0, :, 0].mean(0), (2, 8)), rtol=1e-5)
np.testing.assert_array_equal(ours[0, :2], 0.0)
print("jax.nn, rows that see nothing: mean of v  ->  impl='xla' selects zeros there")

# %% [markdown]
# `impl="xla"` selects zeros for those rows after the call; `jnp.where` also sends a zero cotangent
# into them, so their gradients are exactly zero and nothing is NaN.
#
# Splash without help is worse, in one of two ways depending on its schedule. If the mask makes it
# skip every kv tile of the row's block, the row keeps its initial running sum of 0 and ends with
# $0/0$, a NaN, which its backward pass (it reads the row's log-sum-exp) spreads into `dk` and `dv`.
# If a tile is computed with all of the row's scores masked, each masked score is `mask_value`
# ($-0.7\cdot$ float32 max), their exponentials are all equal, and the row silently returns the
# mean of `v`, as `jax.nn` did above.
# Splash has an option meant for something else, **attention sinks**: one extra logit per head that
# joins every row's softmax with value 0. We pass a sink of $-10^{30}$: next to any real logit $m$ it
# contributes $e^{-10^{30} - m} = 0$, but it keeps an empty row's sum at $1$, so the row returns
# $0 / 1 = 0$ and its backward sees $p = e^{\text{mask\_value} + 10^{30}} = 0$. Padded query rows (splash
# needs lengths in whole 128-row tiles) can be empty too, which is why the sink is always passed.

# %%
d_out = rng.standard_normal((1, 5, 1, 8)).astype(np.float32)
for impl in ("xla", "splash"):
    out, vjp = jax.vjp(lambda q, k, v, impl=impl: tpuattn.attention(q, k, v, causal=True, impl=impl),
                       q_e, k_e, v_e)
    dq, dk, dv = vjp(jnp.asarray(d_out))
    assert np.all(np.asarray(out[0, :2]) == 0) and np.all(np.asarray(dq[0, :2]) == 0)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in (dq, dk, dv))
    print(f"{impl:>6}: empty rows -> output 0, dq 0, all gradients finite")

# %% [markdown]
# ## 2. The native paths through the contract
#
# Same call, different `impl`. Check right after building: each against the package's reference on
# a GQA problem with bottom-right causal and a sliding window. Tolerance `2e-5` for float32: both sides
# compute in float32 with different summation orders (and splash folds the scale into `q`), so they
# agree to a few float32 ulps of the outputs, which are O(1).

# %%
q_len, kv_len = 100, 230
q = jnp.asarray(rng.standard_normal((BATCH, q_len, NUM_HEADS, HEAD_DIM)), jnp.float32)
k = jnp.asarray(rng.standard_normal((BATCH, kv_len, NUM_KV_HEADS, HEAD_DIM)), jnp.float32)
v = jnp.asarray(rng.standard_normal((BATCH, kv_len, NUM_KV_HEADS, HEAD_DIM)), jnp.float32)
features = dict(causal=True, window=(64, 0))
expected = tpuattn.attention(q, k, v, impl="reference", **features)
for impl in ("xla", "splash"):
    got = tpuattn.attention(q, k, v, impl=impl, **features)
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=2e-5)
    print(f"{impl:>6} == reference within 2e-5 (causal, window (64, 0), GQA {NUM_HEADS}/{NUM_KV_HEADS})")

# %% [markdown]
# What each native path refuses, and why, comes back as a `ValueError` naming the feature:

# %%
for impl, kwargs, dtype in (("xla", dict(softcap=30.0), jnp.float32), ("splash", {}, jnp.float16)):
    try:
        tpuattn.attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), impl=impl, **kwargs)
    except ValueError as err:
        print(f"{impl}: {err}\n")

# %% [markdown]
# ## 3. Numerics: every implementation against float64
#
# A float64 attention in NumPy is a few lines. It is the yardstick here (the test suite has an
# independent one with gradients; notebooks never import tests).

# %%
def attention_f64(q, k, v, causal):
    """float64 attention, [batch, seq, heads, dim], GQA, bottom-right causal. Teaching code."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if causal:
        t_q, t_k = s.shape[-2:]
        s = np.where(np.arange(t_k) <= np.arange(t_q)[:, None] + t_k - t_q, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)


np.testing.assert_allclose(attention_f64(q, k, v, causal=True),
                           tpuattn.attention(q, k, v, causal=True, impl="reference"), atol=2e-5)

# %%
errors = {}  # (impl, dtype, length) -> max |out - float64|
for length in ERROR_LENGTHS:
    x = [rng.standard_normal((1, length, NUM_HEADS if i == 0 else NUM_KV_HEADS, HEAD_DIM)) for i in range(3)]
    for dtype in ERROR_DTYPES:
        qkv = [jnp.asarray(a, dtype) for a in x]
        want = attention_f64(*qkv, causal=True)  # the rounded inputs the implementation saw
        for impl in tpuattn.implementations():
            run = jax.jit(lambda q, k, v, impl=impl: tpuattn.attention(q, k, v, causal=True, impl=impl))
            got = np.asarray(run(*qkv).astype(jnp.float32), np.float64)
            errors[impl, dtype, length] = float(np.abs(got - want).max())

# %% tags=["nbval-ignore-output"]
impls = list(tpuattn.implementations())
print(f"max |out - float64| (causal, GQA {NUM_HEADS}/{NUM_KV_HEADS}, head_dim {HEAD_DIM}); "
      f"{PLATFORM.label()}, measured")
print(f"{'impl':>10} " + " ".join(f"{d[:4]} {n:>5}" for d in ERROR_DTYPES for n in ERROR_LENGTHS))
for impl in impls:
    cells = [f"{errors[impl, d, n]:10.1e}" for d in ERROR_DTYPES for n in ERROR_LENGTHS]
    print(f"{impl:>10} " + " ".join(cells))

tolerance = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 2e-3}  # the oracle suite's forward tolerances
markers = dict(zip(impls, "osD^vx*", strict=False))
fig, axes = plt.subplots(1, len(ERROR_DTYPES), figsize=(5.5 * len(ERROR_DTYPES), 3.4), squeeze=False,
                         layout="constrained")
for ax, dtype in zip(axes[0], ERROR_DTYPES, strict=True):
    for impl in impls:
        ax.plot(ERROR_LENGTHS, [errors[impl, dtype, n] for n in ERROR_LENGTHS], marker=markers[impl],
                markerfacecolor="none", label=impl, color=style.impl_colour(impl))
    ax.axhline(tolerance[dtype], color="grey", linestyle="--", label="suite tolerance")
    ax.set(xscale="log", yscale="log", xlabel="sequence length", xticks=ERROR_LENGTHS,
           xticklabels=[str(n) for n in ERROR_LENGTHS], ylim=(tolerance[dtype] / 1000, tolerance[dtype] * 3),
           title=style.labelled(f"{dtype} inputs, causal (overlapping lines = equal errors)", measured=True))
    ax.xaxis.set_minor_locator(plt.NullLocator())
axes[0, 0].set_ylabel("max |out - float64|")
axes[0, -1].legend(loc="lower right", fontsize="small")
style.save_figure(fig, "04_errors")
plt.show()
style.close(fig)

# %%
# Deterministic checks on the same numbers: every implementation within the test suite's tolerances.
for (impl, dtype, length), err in errors.items():
    assert err < {"float32": 2e-5, "bfloat16": 2e-2}[dtype], (impl, dtype, length, err)
print("every implementation within 2e-5 (float32) and 2e-2 (bfloat16) of float64")

# %% [markdown]
# What to read in the table: in float32 every implementation is within a few 1e-7 of float64. The
# outputs are averages of values of size 1, so float32 rounding of ~6e-8 per operation accumulates
# only slowly with length; the implementations differ by summation order, not by accuracy. In
# bfloat16 the inputs are exact for every implementation (the float64 yardstick sees the same rounded
# inputs), so the error is each implementation's own rounding: chiefly *which* probabilities are
# rounded to bfloat16 before the second matmul -- the materialised paths round the normalised `P`
# (every weight at most 1), the flash kernels round each tile's unnormalised `exp(S - m)` and divide
# by the row sum in float32 at the end -- and the bfloat16 output. Length barely matters because
# softmax weights are averaged, not summed.
#
# One difference appears only at extreme logits, in the gradients, and the test suite pins it down:
# splash's backward reads **one float32 log-sum-exp per row**. With logits in the thousands its
# rounding (the float32 spacing printed below) perturbs $p = e^{s - \mathrm{lse}}$ by as much, and the
# suite's `logits-1e3-spread-causal` case sees splash's `dk` outside the gradient tolerance that the
# others meet (`tests/test_hardening.py` measures it). The package's blockwise
# and pallas keep the running max and the log of the sum as two float32 terms and compute $\delta$ as
# `rowsum(P * dP)` (notebook 03): both pass that case, and the suite checks it. No input the
# contract can check reveals this in advance, so splash cannot refuse it: it is a property to know.

# %%
for logit in (1.0, 1000.0, 4000.0):
    print(f"float32 spacing at a log-sum-exp of {logit:6.0f}: {np.spacing(np.float32(logit)):.1e} "
          f"-> relative error of p up to {np.expm1(np.spacing(np.float32(logit))):.1e}")

# %% [markdown]
# ## 4. What each implementation costs to keep working
#
# * `reference`: `jnp.einsum`, `jnp.where`, `jnp.exp`. Maintained by us, but it is one short function
#   of stable public API.
# * `blockwise`: `jax.custom_vjp`, `lax.cond` and `jnp`. Maintained by us: the online softmax and its
#   backward.
# * `pallas`: `pl.pallas_call`, `pl.BlockSpec`, `pltpu.PrefetchScalarGridSpec`,
#   `pltpu.CompilerParams`, `pltpu.VMEM`/`SMEM` scratch, `pltpu.get_tpu_info` (>= 0.8.1), interpret
#   mode. Maintained by us: the kernel, its backward, block sizes, and every Pallas API change.
# * `xla`: `jax.nn.dot_product_attention` only (public, stable). Maintained by JAX (XLA; NVIDIA for
#   the cuDNN path).
# * `splash`: `jax.experimental.pallas.ops.tpu.splash_attention`: `make_splash_mha`/`_mqa`,
#   `BlockSizes`, `CausalMask`, `LocalMask`, `FullMask`, `MultiHeadMask`, `SegmentIds`, `sinks`.
#   Maintained by JAX's TPU team, in an *experimental* namespace with no stability promise.
#
# What actually differs between the two JAX versions this project supports (0.7.2, Colab's TPU
# runtime, and 0.10.2), found by diffing the two installs:
#
# * `jax.nn.dot_product_attention` gained `return_residual=` (0.10.2); nothing we use changed.
#   It still has no softcap and still aligns `is_causal` top-left in both.
# * Pallas TPU: `pltpu.get_tpu_info` / `get_tpu_info_for_chip` exist only in 0.10.2 (>= 0.8.1);
#   `pltpu.repeat` and `pltpu.ANY` exist only in 0.7.2. `pltpu.CompilerParams` (the old
#   `TPUCompilerParams` name is gone in both), `InterpretParams` and `force_tpu_interpret_mode` are
#   in both, so the kernels use them directly; `tpuattn/pallas/compat.py` keeps only what really
#   differs (how a kernel's output is typed inside a `shard_map`, where the race flag lives).
# * splash: its public names and the `make_splash_mha` signature are identical in both, but the
#   kernel underneath changed: `pltpu.repeat` became `jnp.tile`, the `sinks` operand's block became
#   `(8, num_heads)` "to allow vmap", kernel names and profiler metadata changed. None of it reaches us
#   because we only call the public names; code that imported its private helpers
#   (`_splash_attention_forward`, whose argument order changed) would have broken.
#
# The next cell checks the facts that differ on *this* install:

# %% tags=["nbval-ignore-output"]
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import splash_attention as splash

print(f"JAX {jax.__version__}")
print("  jax.nn.dot_product_attention has return_residual:",
      "return_residual" in inspect.signature(jax.nn.dot_product_attention).parameters)
for name in ("get_tpu_info", "get_tpu_info_for_chip", "repeat", "ANY", "CompilerParams", "InterpretParams"):
    print(f"  pltpu.{name}: {hasattr(pltpu, name)}")
print("  splash.make_splash_mha takes interpret=:",
      "interpret" in inspect.signature(splash.make_splash_mha).parameters)

# %% [markdown]
# **How the contract isolates it.** Callers only ever write `tpuattn.attention(q, k, v, ...,
# impl=name)`. Everything version-specific lives in one module per implementation
# (`tpuattn/impl/xla.py`, `tpuattn/impl/splash.py` for both native paths) and reaches the rest of
# the package only through `register(name, fn, supports=...)`. When JAX changes, one file changes,
# the shared float64 oracle suite says whether the translation still holds, and `supports()` turns a
# missing feature into a clear refusal instead of a wrong answer.

# %% [markdown]
# ## 5. A decision guide
#
# Three kinds of evidence, from three different machines, labelled as such and never drawn on one
# axis:
#
# * **measured** on this machine: wall-clock of the compiled implementations (`tpuattn.measure.timing`:
#   compile separately, warm up, median of repeats). The Pallas kernels are timed only on a TPU
#   (in bf16 with 8 heads of 128 there): off a TPU they run in interpret mode, which says nothing
#   about kernel speed, so they are left out here rather than drawn beside compiled code. That TPU
#   path is written for a TPU runtime and has not been run on one by the project (the test command
#   runs its Python with a CPU standing in for a v5e, at small sizes).
# * **modelled** for a TPU: the roofline lower bound from `tpuattn.model.roofline` (notebook 05 explains
#   it): `xla` materialises the score matrix, `splash` streams tiles through VMEM and skips the masked
#   ones.
# * **compiled** for a TPU: what the real TPU compiler plans for each implementation, built on this
#   machine without running it (`tpuattn.measure.aot`, shipped as a report with the package).
#
# A CPU millisecond and a modelled TPU millisecond are different quantities: compare implementations
# *within* a panel, never across panels. Notebook 05 measures every implementation over a sweep (and,
# on a TPU runtime, the real chip); run it on your hardware before trusting any rule of thumb here.

# %%
timings = {}  # (impl, length) -> median seconds, forward, causal
ON_TPU = PLATFORM.on_tpu
# On a TPU the Pallas kernels compile, so they are timed too, at a shape people train with (bf16, 8
# heads of 128); elsewhere only the compiled XLA paths, at the small float32 shape above.
TIMED = ("reference", "blockwise", "xla") + (("pallas", "splash") if ON_TPU else ())
TIMED_DTYPE, TIMED_HEADS, TIMED_HEAD_DIM = ((jnp.bfloat16, 8, 128) if ON_TPU
                                            else (jnp.float32, TIMING_HEADS, TIMING_HEAD_DIM))
if RUN_TIMINGS:
    compiled = [name for name in TIMED if name in tpuattn.implementations()]
    for length in TIMING_LENGTHS:
        x = [jnp.asarray(rng.standard_normal((1, length, TIMED_HEADS, TIMED_HEAD_DIM)), TIMED_DTYPE)
             for _ in range(3)]
        for impl in compiled:
            fn = lambda q, k, v, impl=impl: tpuattn.attention(q, k, v, causal=True, impl=impl)
            timings[impl, length] = time_jitted(fn, *x, repeats=3, min_total_s=0.05).median_s

# %% [markdown]
# The modelled side, on the chip named in the parameters: the lower-bound time of each path and the
# first length at which splash's bound is below xla's.

# %%
model_rows = {}
for impl in ("xla", "splash"):
    model_rows[impl] = [roofline.predict(impl, roofline.problem(n, heads=8, head_dim=128, causal=True),
                                         MODEL_CHIP, "fwd") for n in MODEL_LENGTHS]
print(f"modelled on {MODEL_CHIP} (bf16, causal, 8 heads x 128): xla / splash lower-bound time and bound")
for n, rx, rs in zip(MODEL_LENGTHS, model_rows["xla"], model_rows["splash"], strict=True):
    print(f"  {n:>6}: xla {rx.time_s * 1e3:8.3f} ms ({rx.bound}, fits HBM: {rx.fits_hbm})  "
          f"splash {rs.time_s * 1e3:8.3f} ms ({rs.bound})  xla / splash {rx.time_s / rs.time_s:4.1f}x")
model_crossover = next((n for n, rx, rs in zip(MODEL_LENGTHS, model_rows["xla"], model_rows["splash"],
                                               strict=True) if rs.time_s < rx.time_s), None)
ratios = [rx.time_s / rs.time_s for rx, rs in zip(model_rows["xla"], model_rows["splash"], strict=True)
          if rx.time_s > rs.time_s]
print(f"modelled crossover on {MODEL_CHIP}: splash below xla from T = {model_crossover} "
      f"(of {MODEL_LENGTHS}); from there xla's bound is {min(ratios):.1f}-{max(ratios):.1f}x splash's")

# %% [markdown]
# Short sequences go the other way in the model: below the crossover the whole score matrix fits in
# the chip's VMEM, the compiler can keep it on chip, and the materialised path moves almost nothing
# through HBM, while splash still pays for padding to its tiles.
#
# **Compiled for a TPU.** The model's HBM numbers can be checked against the real TPU compiler
# without a TPU: `python -m tpuattn.aot` compiles each implementation for a chip and reads the
# compiler's memory analysis (notebook 03 shows how). The package ships one such report, made by
# the command it records; below, the peak HBM each path needs for one training step's attention
# (forward + backward) on one device of each chip. `out_of_memory` is the compiler's own refusal.

# %%
import shlex

from tpuattn import chips
from tpuattn.measure import aot

report = aot.committed_report()
print(f"{aot.LABEL}: {report['problem']}, forward + backward; JAX {report['jax_version']}, "
      f"libtpu {report['libtpu_version']}")
print(f"  made by: {shlex.join(report['command'])}")
compiled_rows = {(r["chip"], r["impl"], r["seq_len"]): r for r in report["rows"]
                 if r["mode"] == "fwd+bwd"}
lengths = sorted({r["seq_len"] for r in report["rows"]})
report_chips = list(dict.fromkeys(r["chip"] for r in report["rows"]))
print(f"{'chip':<6} {'impl':<7}" + "".join(f"{f'T={n}':>16}" for n in lengths) + "   (peak HBM, MiB)")
for chip in report_chips:
    for impl in ("xla", "splash", "pallas"):
        cells = []
        for n in lengths:
            r = compiled_rows[chip, impl, n]
            ok = r["status"] == "ok"
            cells.append(f"{r['peak_hbm_bytes'] / 2**20:16.0f}" if ok else f"{r['status']:>16}")
        print(f"{chip:<6} {impl:<7}" + "".join(cells))
longest = lengths[-1]
oom = [c for c in report_chips if compiled_rows[c, "xla", longest]["status"] == "out_of_memory"]
at_longest = {c: (compiled_rows[c, "xla", longest], compiled_rows[c, "pallas", longest])
              for c in report_chips}
fits = {c: x["peak_hbm_bytes"] / p["peak_hbm_bytes"] for c, (x, p) in at_longest.items()
        if x["status"] == "ok" and p["status"] == "ok"}
print(f"at T={longest}: xla is out of memory on {', '.join(oom)}; where it fits "
      + ", ".join(f"{c} needs {ratio:.0f}x" for c, ratio in fits.items()) + " the Pallas kernel's HBM")
with chips.target("v2"):  # what impl="auto" picks for bfloat16 on Colab's legacy v2-8
    v2_spec = tpuattn.spec_from_shapes(2048, num_q_heads=8, head_dim=128, dtype="bfloat16", causal=True)
    print("auto on a v2, bfloat16:", tpuattn.choose(v2_spec, "tpu"))

# %% [markdown]
# The last lines above say where the materialised path runs out of HBM at the longest length, and how
# many times the Pallas kernel's memory it needs on the chips where it still fits; the two flash
# kernels need little beyond their inputs and outputs. On the v2 (Colab's legacy runtime) both Pallas
# kernels refuse bfloat16 -- Mosaic there has no bfloat16 matmul -- so `impl="auto"` picks `xla` for
# bfloat16 on that chip.
#
# The three kinds of evidence side by side, one panel each (one colour per implementation throughout):

# %% tags=["nbval-ignore-output"]
fig, (ax_measured, ax_model, ax_compiled) = plt.subplots(1, 3, figsize=(15, 4.2), layout="constrained")
measured_impls = [name for name in TIMED if any(key[0] == name for key in timings)]
for impl in measured_impls:
    ax_measured.plot(TIMING_LENGTHS, [timings[impl, n] * 1e3 for n in TIMING_LENGTHS], "o-", label=impl,
                     color=style.impl_colour(impl))
ax_measured.set(xscale="log", yscale="log", xlabel="sequence length",
                ylabel=f"ms per call, measured on {PLATFORM.label()}",
                title=style.labelled(f"measured: forward, causal, {TIMED_HEADS} heads x {TIMED_HEAD_DIM}, "
                                     f"{jnp.dtype(TIMED_DTYPE).name}", measured=True))
if timings:
    ax_measured.legend()
else:
    ax_measured.text(0.5, 0.5, "RUN_TIMINGS = False", ha="center", transform=ax_measured.transAxes)
for impl, rows in model_rows.items():
    ax_model.plot(MODEL_LENGTHS, [r.time_s * 1e3 for r in rows], "o-", label=impl,
                  color=style.impl_colour(impl))
ax_model.set(xscale="log", yscale="log", xlabel="sequence length",
             ylabel=f"ms, modelled lower bound on TPU {MODEL_CHIP}",
             title=style.labelled("modelled: forward, causal, 8 heads x 128, bf16", measured=False,
                                  chip=f"TPU {MODEL_CHIP}"))
ax_model.legend()
for impl in ("xla", "splash", "pallas"):
    rows = [compiled_rows[MODEL_CHIP, impl, n] for n in lengths]
    ok = [(n, r["peak_hbm_bytes"] / 2**20) for n, r in zip(lengths, rows, strict=True) if r["status"] == "ok"]
    ax_compiled.plot(*zip(*ok, strict=True), "o-", label=impl, color=style.impl_colour(impl))
    for n, r in zip(lengths, rows, strict=True):
        if r["status"] == "out_of_memory":
            ax_compiled.plot(n, chips.get(MODEL_CHIP).per_device()["hbm_bytes"] / 2**20, "x", ms=10,
                             color=style.impl_colour(impl))
ax_compiled.axhline(chips.get(MODEL_CHIP).per_device()["hbm_bytes"] / 2**20, color=style.MISSING_COLOUR,
                    ls="--", lw=0.8, label="HBM of one device (x: out of memory)")
ax_compiled.set(xscale="log", yscale="log", xlabel="sequence length",
                ylabel=f"peak HBM (MiB), compiled for TPU {MODEL_CHIP}",
                title=f"compiled: forward + backward, peak HBM\n({aot.LABEL}, TPU {MODEL_CHIP})")
ax_compiled.legend(fontsize="small", loc="center right")
for ax, ticks in ((ax_measured, TIMING_LENGTHS), (ax_model, MODEL_LENGTHS[::2]), (ax_compiled, lengths)):
    ax.set_xticks(ticks, [str(n) for n in ticks])
    ax.xaxis.set_minor_locator(plt.NullLocator())
fig.suptitle("three kinds of evidence from three machines: compare implementations within a panel, "
             "not across panels", fontsize="medium")
style.save_figure(fig, "04_decision")
plt.show()
style.close(fig)

print(f"measured here ({PLATFORM.label()}), forward causal, median ms:")
for length in TIMING_LENGTHS:
    print(f"  {length:>6}: " + "  ".join(f"{impl} {timings[impl, length] * 1e3:8.1f}"
                                       for impl in measured_impls))

# %% [markdown]
# **The rule, as code.** `impl="auto"` calls `tpuattn.choose(spec, backend)` (or
# `choose_implementation` for the name alone); its docstring and each implementation's `auto_rank`
# carry the evidence. Every registered, available implementation that *supports the input* offers a
# rank, and the lowest wins (so `softcap` skips `xla`, float16 skips `splash`), with `reference`
# last:
#
# * **TPU**: `splash` when `q_len >= 128` and `kv_len >= 512` (`tpuattn.supports.long_enough_for_flash`:
#   below one 128-row query tile a flash kernel pads most of its tile), else `xla`, which also serves
#   decoding (`q_len < 128`). The threshold sits below the modelled crossover printed above; the
#   rule's docstring rests it on the compiled peak HBM (the right panel), where splash needs a
#   fraction of xla's memory at every length in the report.
# * **GPU**: `xla`, which uses cuDNN's fused kernel when the case allows.
# * **CPU**: `xla`, unless its float32 score matrix would pass 1 GiB (the rule's constant); then
#   `blockwise`: on a CPU it is memory, not speed, that makes the switch (the measured panel above
#   shows how the speeds compare on this machine).

# %%
shapes = [
    ("decode 1 x 8192", dict(q_len=1, kv_len=8192, causal=True)),
    ("prefill 256", dict(q_len=256, kv_len=256, causal=True)),
    ("train 4096", dict(q_len=4096, kv_len=4096, causal=True)),
    ("train 4096 + softcap", dict(q_len=4096, kv_len=4096, causal=True, softcap=50.0)),
    ("train 32768, 8 heads", dict(q_len=32768, kv_len=32768, causal=True, heads=8)),
]


def spec_for(q_len, kv_len, heads=4, causal=True, softcap=None):
    # Only shapes, dtype and mask matter to the rule: roofline.problem builds a spec without arrays.
    spec = roofline.problem(q_len, kv_len=kv_len, heads=heads, head_dim=128, dtype="bfloat16", causal=causal)
    return dataclasses.replace(spec, softcap=softcap)


print(f"{'shape':>22} " + " ".join(f"{b:>10}" for b in ("cpu", "gpu", "tpu")))
for name, kw in shapes:
    spec = spec_for(**kw)
    choices = [tpuattn.choose_implementation(spec, backend) for backend in ("cpu", "gpu", "tpu")]
    print(f"{name:>22} " + " ".join(f"{c:>10}" for c in choices))

# %% [markdown]
# ## 6. A third native path: tokamax
#
# Google's kernel library for JAX, tokamax
# ([github.com/openxla/tokamax](https://github.com/openxla/tokamax)), puts several attention kernels
# behind one call, `tokamax.dot_product_attention(..., implementation="mosaic" | "xla" | ...)`:
# `"mosaic"` is its Pallas TPU kernel, `"xla"` materialises the scores as `jax.nn` does. Behind the
# contract it is one more name, `impl="tokamax"` (`tpuattn/impl/tokamax.py`), with the same
# translations as `jax.nn` (top-left flags, so any other mask becomes a boolean mask; zeros for a row
# that sees no key), and it passes the same oracle suite on the CPU. It needs JAX 0.9.2 or newer: on an
# older JAX it is listed as unavailable, with that reason, and nothing else changes. `impl="auto"`
# never picks it; whether it should is a question for the evidence. The package ships a compile
# report of it beside splash and the package's kernel (made by the command it records); below, the
# peak HBM per device of one attention call, forward and forward + backward.

# %%
tokamax_report = aot.committed_report(aot.TOKAMAX_REPORT)
print(f"{aot.LABEL}: JAX {tokamax_report['jax_version']}, libtpu {tokamax_report['libtpu_version']}; "
      f"made by: {shlex.join(tokamax_report['command'])}")
t_rows = {(r["chip"], r["impl"], r["mode"], r["seq_len"]): r for r in tokamax_report["rows"]}
t_lengths = sorted({r["seq_len"] for r in tokamax_report["rows"]})
t_chips = list(dict.fromkeys(r["chip"] for r in tokamax_report["rows"]))
t_impls = list(dict.fromkeys(r["impl"] for r in tokamax_report["rows"]))


def peak(row):
    return f"{row['peak_hbm_bytes'] / 2**20:10.0f}" if row["status"] == "ok" else f"{row['status']:>10}"


print(f"{'chip':<5} {'impl':<8} {'mode':<8}" + "".join(f"{f'T={n}':>11}" for n in t_lengths)
      + "   (peak HBM, MiB)")
for chip in t_chips:
    for mode in ("fwd", "fwd+bwd"):
        for impl in t_impls:
            print(f"{chip:<5} {impl:<8} {mode:<8}" + "".join(f" {peak(t_rows[chip, impl, mode, n])}"
                                                           for n in t_lengths))
middle = t_lengths[len(t_lengths) // 2]
ratio = (t_rows["v5e", "tokamax", "fwd+bwd", middle]["peak_hbm_bytes"]
         / t_rows["v5e", "splash", "fwd+bwd", middle]["peak_hbm_bytes"])
oom = [n for n in t_lengths if t_rows["v5e", "tokamax", "fwd+bwd", n]["status"] == "out_of_memory"]
print(f"v5e, T={middle}: tokamax's forward + backward needs {ratio:.0f}x splash's HBM; out of memory "
      f"from T={oom[0] if oom else None}")
print("tokamax on this installation:", "available" if "tokamax" in tpuattn.implementations()
      else tpuattn.api.REGISTRY.unavailable_reason("tokamax"))

# %% [markdown]
# The three forwards are close: at the two shorter lengths tokamax's and the package's kernel need nothing
# beyond their inputs and output (splash a little more), and at the longest all three keep buffers of a layout
# change beside them. tokamax's default backward is another matter: its fused dK/dV kernel also writes one
# float32 partial dQ for every 128-key block and sums them outside the kernel, a buffer that grows with the
# square of the length (`tests/test_aot_tokamax.py` holds the compiler to it): the line under the table says
# how many times splash's HBM that is, and where a training step stops fitting. That is a fact about one
# configuration of one release (tokamax 0.0.12's defaults, compiled, not run), found without a TPU and in one
# argument: the contract makes the swap cheap, and the compiler, not the name, says which kernel to train
# with.

# %% [markdown]
# ## Takeaways
#
# > **Takeaway.** The platform's attention is a few lines behind a contract, but only after two
# > translations you must know about: `jax.nn` aligns causal top-left, and neither native path
# > returns zeros for a query that sees no key unless you make it (a `where` for XLA, a $-10^{30}$
# > sink for splash).
#
# > **Takeaway.** Numerically, every implementation here agrees with float64 to float32 rounding;
# > in bfloat16 the error is each implementation's own rounding, well inside the suite's tolerance.
# > Splash's single float32 log-sum-exp costs gradient bits only at very large logits.
#
# > **Takeaway.** Cost to keep working is the API surface you touch: `jax.nn.dot_product_attention` is
# > public and stable; splash lives under `experimental` but its public names did not move between
# > 0.7.2 and 0.10.2; our Pallas kernel touches the Pallas APIs that did. Keep each behind `register`,
# > keep the oracle suite, and choose by evidence of the right kind: on TPU the model and the
# > compiler favour splash for long sequences; on CPU xla until memory runs out.


# %% [markdown]
# ## Exercises
#
# Each stub raises `NotImplementedError`; fill it in and re-run the check cell below them. Solutions
# are in the hidden cell at the end of the notebook (it runs the same checks). Difficulty from ★☆☆ to
# ★★★, with the time it takes at a workshop.
#
# **1. Top-left to bottom-right with `local_window_size`** (★★☆, 10 min). `jax.nn`'s
# `local_window_size=(l, r)` keeps keys `i - l <= j <= i + r` (top-left). Write
# `jax_nn_window(left, right, q_len, kv_len)` that returns the `(l, r)` giving the contract's
# bottom-right window `(left, right)`; the check reads both masks with the probe of section 1. (The
# checked cases keep both of `jax.nn`'s sides non-negative. On JAX 0.7.2's CPU backend
# `local_window_size` masked nothing at all, so there the check says it cannot run.)
#
# **2. Why a sink of $-10^{30}$ and not $-\infty$?** (★☆☆, 5 min). Splash's running max starts at
# the sink; a masked key has the logit `mask_value` (`splash_kernel.DEFAULT_MASK_VALUE`,
# $-0.7\cdot$ float32 max). Write `masked_key_weight(sink)`: the float32 weight `exp(s - m)` a masked
# key gets in the first tile of a row that sees no key, where `m = max(sink, s)` is the running max
# after that tile. The check tries a sink of $-\infty$ and of $-10^{30}$; say which one returns zeros
# for empty rows, and why.
#
# **3. A mask in splash's own objects** (★★☆, 15 min). Splash describes a head's mask with objects from
# `splash_attention_mask`: `FullMask(shape)`, `CausalMask(shape, offset=...)` and
# `LocalMask(shape, window_size=(left, right), offset=...)` (`None` for an unbounded side); indexing
# one, `mask[:, :]`, gives its dense boolean array. Write `splash_mask(q_len, kv_len, causal, window)`
# that returns the object whose array is the contract's mask (`tpuattn.MaskSpec(q_len, kv_len,
# causal=..., window=...).dense()`, broadcast to `[q_len, kv_len]`), for `window` `None` or a pair.
# The check compares the two arrays for square and rectangular shapes, causal or not, with windows
# bounded on one side or both. (The package's own translation is `tpuattn/impl/splash.py`; write
# yours before reading it.)
#
# **4. Register an implementation with its own `supports`** (★★★, 20 min). A team wants `xla` only for
# short sequences, where its score matrix stays small. Write `supports_short(spec, backend=None)`:
# `None` when `spec.kv_len <= 1024` and `spec.softcap is None`, otherwise a sentence that names the
# field (`"kv_len ..."` or `"softcap ..."`) and says what to use instead. Then write
# `register_xla_short()` that registers an implementation named `"xla_short"` with `tpuattn.register`,
# reusing `xla`'s function (`tpuattn.registry.registered()["xla"].fn`) and your `supports`, and never
# chosen by `impl="auto"`. The check registers it, runs it against `impl="reference"`, expects
# `tpuattn.UnsupportedInput` with your sentence for a long or soft-capped input, and unregisters it.
#
# **5. Measure your own crossover** (★★☆, 20 min; no automatic check: the answer is your machine's).
# Set `TIMING_LENGTHS = [256, 1024, 2048, 4096]` and time the forward *and* `jax.grad` of each
# compiled implementation. At which length does `blockwise` overtake `xla` on this machine, and does
# the backward change the answer?

# %%
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_masks

from tpuattn import registry
from tpuattn.exercises import NotCheckable, run_checks


def jax_nn_window(left, right, q_len, kv_len):
    raise NotImplementedError("FILL ME IN")


def masked_key_weight(sink):
    raise NotImplementedError("FILL ME IN")


def splash_mask(q_len, kv_len, causal, window):
    raise NotImplementedError("FILL ME IN")


def supports_short(spec, backend=None):
    raise NotImplementedError("FILL ME IN")


def register_xla_short():
    raise NotImplementedError("FILL ME IN")


def top_left_band_holds(q_len, kv_len):
    """Does this JAX's ``local_window_size=(0, 1)`` keep exactly ``i <= j <= i + 1`` on a q_len x kv_len
    problem, as documented? (Run on JAX 0.7.2's CPU backend, it masked nothing.)"""
    got = probe_visibility(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, local_window_size=(0, 1)),
                           q_len, kv_len)
    i, j = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    return bool(np.array_equal(got, (j >= i) & (j <= i + 1)))


def check_window(jax_nn_window):
    if not top_left_band_holds(8, 8):
        raise NotCheckable(f"JAX {jax.__version__}'s local_window_size keeps no band on this backend")
    for left, right, q_len, kv_len in ((5, 1, 6, 10), (2, 0, 8, 8), (9, 2, 5, 12)):
        window_tl = jax_nn_window(left, right, q_len, kv_len)
        got = probe_visibility(lambda q, k, v, w=window_tl: jax.nn.dot_product_attention(
            q, k, v, local_window_size=w), q_len, kv_len)
        want = probe_visibility(lambda q, k, v, w=(left, right): tpuattn.attention(
            q, k, v, window=w, impl="xla"), q_len, kv_len)
        np.testing.assert_array_equal(got, want, err_msg=f"window {(left, right)}, {q_len} x {kv_len}")


def check_sink(masked_key_weight):
    assert float(masked_key_weight(-np.inf)) == 1.0, "with a sink of -inf, what is max(sink, mask_value)?"
    assert float(masked_key_weight(-1e30)) == 0.0, "with a sink of -1e30 a masked key's weight should vanish"


def check_splash_mask(splash_mask):
    for q_len, kv_len in ((16, 16), (8, 24), (24, 8)):
        for causal in (False, True):
            for window in (None, (3, 2), (4, None), (None, 1), (0, 0)):
                want = np.broadcast_to(tpuattn.MaskSpec(q_len, kv_len, causal=causal, window=window).dense(),
                                       (q_len, kv_len))
                got = np.asarray(splash_mask(q_len, kv_len, causal, window)[:, :])
                np.testing.assert_array_equal(got, want, err_msg=f"{q_len}x{kv_len} causal={causal} {window}")


def check_register(supports_short, register_xla_short):
    register_xla_short()
    try:
        record = registry.registered()["xla_short"]
        assert record.supports is supports_short, "register your supports_short"
        assert record.auto_rank(spec_for(256, 256), "tpu") is None, "xla_short must never be chosen by auto"
        x = [jnp.asarray(rng.standard_normal((1, 256, 2, 32)), jnp.float32) for _ in range(3)]
        np.testing.assert_allclose(tpuattn.attention(*x, causal=True, impl="xla_short"),
                                   tpuattn.attention(*x, causal=True, impl="reference"), atol=2e-5, rtol=2e-5)
        long = [jnp.zeros((1, 2048, 2, 32), jnp.float32)] * 3
        for args, kwargs, field in ((long, {}, "kv_len"), (x, {"softcap": 30.0}, "softcap")):
            try:
                tpuattn.attention(*args, impl="xla_short", **kwargs)
            except tpuattn.UnsupportedInput as err:
                assert field in str(err), f"the refusal should name {field}: {err}"
            else:
                raise AssertionError(f"xla_short should refuse this input ({field})")
    finally:
        registry.unregister("xla_short")


def check_exercises(jax_nn_window, masked_key_weight, splash_mask, supports_short, register_xla_short):
    run_checks({
        "1 window": lambda: check_window(jax_nn_window),
        "2 sink": lambda: check_sink(masked_key_weight),
        "3 splash mask": lambda: check_splash_mask(splash_mask),
        "4 register": lambda: check_register(supports_short, register_xla_short),
    }, hint="see the exercise text above the stubs")


check_exercises(jax_nn_window, masked_key_weight, splash_mask, supports_short, register_xla_short)


# %% [markdown]
# ## References
#
# - JAX, `jax.nn.dot_product_attention`:
#   https://docs.jax.dev/en/latest/_autosummary/jax.nn.dot_product_attention.html.
# - JAX's splash attention kernel, `jax/experimental/pallas/ops/tpu/splash_attention/`
#   (https://github.com/jax-ml/jax/tree/main/jax/experimental/pallas/ops/tpu/splash_attention).
# - G. Xiao et al., "Efficient Streaming Language Models with Attention Sinks", 2023,
#   arXiv:2309.17453 (the sink logit splash exposes).
# - T. Dao, "FlashAttention-2", 2023, arXiv:2307.08691.
# - JAX's block-sparse Pallas guide: https://docs.jax.dev/en/latest/pallas/tpu/sparse.html.
# - A. Zhang, "Forcing Flash Attention onto a TPU and Learning the Hard Way", 2026,
#   https://archerzhang.me/forcing-flash-attention-onto-a-tpu -- `jax.nn.dot_product_attention`
#   matched fused attention there.

# %% [markdown]
# ## Solutions
#
# The cell below is collapsed: open it after trying the exercises. It runs the same checks on the
# solutions, but only when `RUN_SOLUTIONS = True` (the parameters cell; the project's CI sets it), so
# Run All shows your own results alone.

# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solutions: open after trying the exercises (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    def jax_nn_window_solution(left, right, q_len, kv_len):
        # The contract's query i sits at key position i + o, o = kv_len - q_len: shift both sides by o.
        # (An unbounded side has no local_window_size equivalent: use a number >= q_len + kv_len.)
        offset = kv_len - q_len
        return left - offset, right + offset

    def masked_key_weight_solution(sink):
        # m = max(sink, mask_value). A sink of -inf leaves m = mask_value, so every masked key gets
        # exp(0) = 1 and an empty row returns the mean of v. A finite sink above mask_value (and far below
        # any real logit) stays the max of an empty row: weights exp(mask_value + 1e30) = 0, sum 1 from the
        # sink itself, output 0; in a row with real keys it vanishes, exp(-1e30 - m) = 0.
        mask_value = np.float32(splash_kernel.DEFAULT_MASK_VALUE)
        running_max = np.maximum(np.float32(sink), mask_value)
        return np.exp(mask_value - running_max)

    def splash_mask_solution(q_len, kv_len, causal, window):
        shape, offset = (q_len, kv_len), kv_len - q_len   # offset: key position of query 0
        if window is None and not causal:
            return splash_masks.FullMask(shape)
        if window is None:
            return splash_masks.CausalMask(shape, offset=offset)
        left, right = window
        if causal:  # causal caps the right side at 0
            right = 0 if right is None else min(right, 0)
        return splash_masks.LocalMask(shape, window_size=(left, right), offset=offset)

    def supports_short_solution(spec, backend=None):
        if spec.kv_len > 1024:
            return (f"kv_len: xla_short serves at most 1024 keys, got {spec.kv_len}; "
                    "use impl='splash' or 'blockwise'")
        if spec.softcap is not None:
            return "softcap: jax.nn.dot_product_attention has no logit soft-capping; use impl='blockwise'"
        return None

    def register_xla_short_solution():
        tpuattn.register("xla_short", registry.registered()["xla"].fn, supports=supports_short_solution,
                         auto_rank=lambda spec, backend: None, replace=True,
                         description="jax.nn.dot_product_attention for short sequences only (exercise 4)")

    check_exercises(jax_nn_window_solution, masked_key_weight_solution, splash_mask_solution,
                    supports_short_solution, register_xla_short_solution)
    print("exercise 5: read the crossover off your own timings; there is no single answer")
