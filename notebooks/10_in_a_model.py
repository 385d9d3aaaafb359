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
# # 10 · In a model: train, checkpoint and serve a small transformer, one argument apart
#
# The earlier notebooks built attention one call at a time. A model is where the choice of
# implementation is actually made, and where it should cost nothing to change. This notebook answers:
# **when a real model swaps its attention implementation, what changes in the model, and what tells
# you which one to use?**
#
# **What you'll do**
# - build a small byte-level transformer in Flax NNX (`tpuattn.lm`) whose attention is
#   `tpuattn.attention(..., impl=...)`, and check that every implementation gives the same logits;
# - train it on the CPU with each implementation from the same start: the loss curves overlap;
# - save and restore a checkpoint with orbax and get the same logits back;
# - serve it: prefill into a paged KV cache, then decode several prompts together through
#   `tpuattn.decode.attention(..., page_table=...)` with continuous batching, and check the greedy
#   tokens against recomputing the whole sequence;
# - compile one training step and one decode step of a realistic size for TPU v5e (compiled, not
#   run) and read the peak HBM each implementation needs.
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/tpuattn/tpuattn/blob/main/notebooks/10_in_a_model.ipynb)

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
import tempfile
import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from tpuattn import lm
from tpuattn.exercises import run_checks
from tpuattn.measure import aot, runtime
from tpuattn.viz import style

PLATFORM = runtime.info()
print(PLATFORM.summary())
print("flax", __import__("flax").__version__, "· optax", optax.__version__)

# %% tags=["parameters"]
# The small model trained and served here (runs anywhere; pallas in interpret mode off a TPU).
D_MODEL, LAYERS, HEADS, KV_HEADS, MLP_DIM = 64, 2, 4, 2, 128
TRAIN_IMPLS = ["reference", "xla", "blockwise", "pallas"]  # each trained from the same start
TRAIN_STEPS, BATCH, SEQ, LEARNING_RATE = 30, 8, 64, 1e-2
MORE_STEPS, MORE_IMPL = 120, "xla"  # then train one of them longer before serving it
SLOTS, PAGE_SIZE, NUM_PAGES = 2, 8, 12  # the server: decode batch and paged cache
NEW_TOKENS = [24, 8, 16, 12, 20]  # per prompt: sequences finish at different steps
# The realistic configuration compiled for TPU v5e (compiled, not run).
# One layer: every layer adds the same again, and each layer is compiled in full (minutes per layer here).
BIG_D_MODEL, BIG_LAYERS, BIG_HEADS, BIG_KV_HEADS, BIG_MLP_DIM = 1024, 1, 8, 2, 4096
BIG_SEQ = 8192  # tokens in one training sequence
BIG_SLOTS, BIG_PAGE, BIG_PAGES_PER_SEQ = 8, 64, 128  # decode: 8 sequences of up to 8192 positions
RUN_COMPILES = True  # section 5: compile for TPU v5e when the TPU compiler is installed
# The hidden solution cells run only when this is True, so Run All shows your own results alone.
# The project's CI sets it (TPUATTN_RUN_SOLUTIONS=1): the committed outputs include the solutions'.
RUN_SOLUTIONS = os.environ.get("TPUATTN_RUN_SOLUTIONS") == "1"

# %%
style.use_style()
config = lm.Config(d_model=D_MODEL, layers=LAYERS, heads=HEADS, kv_heads=KV_HEADS, mlp_dim=MLP_DIM)
data = lm.corpus()
print(f"corpus: {len(data)} bytes of the project's own prose, e.g. {lm.decode_bytes(data[:60])!r}")

# %% [markdown]
# ## 1 · The model, and the one argument
#
# `tpuattn.lm.Transformer` is a decoder-only transformer over bytes (a vocabulary of 256): an
# embedding, `LAYERS` pre-norm blocks (RMSNorm → attention → residual, RMSNorm → SwiGLU MLP →
# residual) and a final RMSNorm whose output meets the embedding again (tied weights) to give the
# logits. Positions enter through rotary embeddings (RoPE), so a cached key keeps its position. The
# attention is grouped-query (`HEADS` query heads share `KV_HEADS` key/value heads) and is one line
# of `tpuattn/lm/transformer.py`:
#
# ```python
# o = attention(q, k, v, causal=True, impl=impl)  # q [b, seq, heads, D]; k, v [b, seq, kv_heads, D]
# ```
#
# `impl` is fixed when the model is built and can be overridden per call. Same seed, same weights;
# the logits of every implementation against the reference's, each asserted to lie within
# `LOGITS_BOUND` of them:

# %% tags=["nbval-ignore-output"]
LOGITS_BOUND = 1e-4  # far above float32 rounding, far below a wrong result
model = lm.Transformer(config, rngs=nnx.Rngs(0), impl="reference")
params = nnx.state(model, nnx.Param)
print(f"{sum(x.size for x in jax.tree.leaves(params)):,} parameters; head_dim {config.head_dim}")
tokens = jnp.asarray(next(lm.batches(data, batch=2, seq=SEQ, seed=1))[:, :-1])
reference_logits = model(tokens)
for impl in TRAIN_IMPLS:
    difference = float(jnp.max(jnp.abs(model(tokens, impl=impl) - reference_logits)))
    print(f"{impl:>10}: logits {tuple(reference_logits.shape)}, largest difference from reference "
          f"{difference:.1e}")
    assert difference < LOGITS_BOUND, (impl, difference)

# %% [markdown]
# The differences are float32 rounding: each implementation adds the same products in a different
# order (blocks, an online softmax). Their exact size depends on the machine too (the order its
# CPU's vector instructions add in), so the cell asserts the bound, 1e-4, rather than the digits.
# `tests/test_lm.py` holds every one of them to a float64 NumPy forward pass of the same weights.
#
# ## 2 · Training, once per implementation
#
# `tpuattn.lm.train` runs AdamW (optax) on next-byte cross-entropy over random windows of the corpus.
# The step is functional: `nnx.split` separates the model's structure (which carries `impl`) from its
# parameters, `jax.value_and_grad` differentiates through the attention implementation (its own
# backward pass: the Pallas kernel's three backward passes in interpret mode here), optax updates the
# parameters. Each implementation starts from the same weights and sees the same batches.

# %% tags=["nbval-ignore-output"]
curves, seconds, trained = {}, {}, {}
for impl in TRAIN_IMPLS:
    start = time.perf_counter()
    trained[impl], curves[impl] = lm.train(lm.Transformer(config, rngs=nnx.Rngs(0), impl=impl),
                                           lm.batches(data, batch=BATCH, seq=SEQ, seed=0), TRAIN_STEPS,
                                           learning_rate=LEARNING_RATE)
    seconds[impl] = time.perf_counter() - start
    print(f"{impl:>10}: {TRAIN_STEPS} steps in {seconds[impl]:.1f} s (measured, {PLATFORM.backend}; "
          "compile included)")

# %% tags=["nbval-ignore-output"]
LOSS_BOUND = 1e-3  # nats per byte: the largest difference between implementations' losses allowed
fig, ax = plt.subplots(figsize=(6.5, 3.5))
for impl, losses in curves.items():
    ax.plot(np.arange(1, TRAIN_STEPS + 1), losses, label=impl, color=style.impl_colour(impl), lw=1.5,
            alpha=0.8)
ax.set(xlabel="step", ylabel="cross-entropy (nats per byte)",
       title=f"The same model and batches, {len(curves)} attention implementations ({PLATFORM.backend})")
ax.legend()
style.save_figure(fig, "10_loss_curves")
plt.show()
style.close(fig)
spread = max(np.max(np.abs(np.asarray(c) - np.asarray(curves["reference"]))) for c in curves.values())
print(f"loss from {curves['reference'][0]:.3f} to {curves['reference'][-1]:.3f} nats per byte; the largest "
      f"difference between implementations at any step: {spread:.1e}")
assert spread < LOSS_BOUND, spread
assert curves["reference"][-1] < curves["reference"][0] - 1, "the model did not learn"

# %% [markdown]
# The curves lie on each other: the largest difference printed above is rounding, carried through
# every step of training, and the cell asserts it stays below `LOSS_BOUND`, 1e-3 nats per byte (and
# that the loss fell by more than one nat). What changed when the implementation did is how
# attention was computed and what it cost, not what the model learned.
#
# Since the implementations learn the same model, it does not matter which one trains it further:
# `MORE_IMPL` continues for `MORE_STEPS` steps (a fresh AdamW state) before the model is saved and
# served.

# %% tags=["nbval-ignore-output"]
start = time.perf_counter()
model, more = lm.train(trained[MORE_IMPL], lm.batches(data, batch=2 * BATCH, seq=SEQ, seed=1), MORE_STEPS,
                       learning_rate=LEARNING_RATE)
print(f"{MORE_IMPL}: {MORE_STEPS} more steps in {time.perf_counter() - start:.1f} s (measured, "
      f"{PLATFORM.backend}); loss {more[0]:.3f} -> {more[-1]:.3f} nats per byte")
assert more[-1] < more[0], "the loss did not fall"

# %% [markdown]
# ## 3 · A checkpoint, saved and restored (orbax)
#
# The parameters are an `nnx.State`, a pytree of arrays, so orbax saves them as they are. To restore,
# build the model's shape without computing any weights (`nnx.eval_shape`) and let orbax fill it in.

# %%
_, state = nnx.split(model)
with tempfile.TemporaryDirectory() as directory:
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(f"{directory}/model", state)
    checkpointer.wait_until_finished()
    abstract = nnx.eval_shape(lambda: lm.Transformer(config, rngs=nnx.Rngs(1), impl="reference"))
    graphdef, abstract_state = nnx.split(abstract)
    restored = nnx.merge(graphdef, checkpointer.restore(f"{directory}/model", abstract_state))
same = bool(jnp.array_equal(restored(tokens), model(tokens)))
print(f"restored model's logits equal the trained model's: {same}")
assert same

# %% [markdown]
# ## 4 · Serving: prefill, a paged KV cache, continuous batching
#
# `tpuattn.lm.serve` decodes many prompts with `SLOTS` sequences in flight. Each loop:
#
# 1. **admit**: an empty slot takes the next prompt if the free list has the pages it needs
#    (prompt + new tokens, in pages of `PAGE_SIZE` rows); the prompt runs through the model once
#    (**prefill**, `tpuattn.attention` over the whole prompt) and its keys and values are written
#    into those pages;
# 2. **decode**: every slot advances one token in one call, `tpuattn.decode.attention(q, k_pages,
#    v_pages, lengths, page_table=...)`; an empty slot rides along with length 0 on a scratch page,
#    so the step's shapes never change and it compiles once;
# 3. **retire**: a finished sequence gives its pages back to the free list; the next prompt takes them.
#
# The check, `tpuattn.lm.recompute`, decodes each prompt alone with no cache at all: the whole
# sequence through the model at every step.

# %%
prompts = ["A", "The kernel", "Attention on TPUs", "Pallas", "The online softmax keeps"]
served = lm.serve(model, [lm.encode(p) for p in prompts], NEW_TOKENS, slots=SLOTS, page_size=PAGE_SIZE,
                  num_pages=NUM_PAGES)
for step, kind, i, slot, pages in served.events:
    print(f"step {step:3d}: {kind:>6} prompt {i} ({len(prompts[i]):2d} bytes) in slot {slot}, "
          f"pages {list(pages)}")
print(f"{served.steps} decode steps for {len(prompts)} prompts; pages handed out again after being "
      f"returned: {served.reused}")
assert served.reused > 0

# %% [markdown]
# When sequences are admitted and retired depends only on the prompts' lengths and `NEW_TOKENS`.
# Which bytes the model writes depends on its trained weights, and so on the machine that trained
# it (its rounding, carried through every training step): the continuations below may differ on
# yours. What must not differ is checked in the cell after them: the tokens equal recomputation.

# %% tags=["nbval-ignore-output"]
for prompt, new in zip(prompts, served.tokens, strict=True):
    print(f"{prompt!r} -> {lm.decode_bytes(new)!r}")
assert [len(new) for new in served.tokens] == NEW_TOKENS

# %%
matches = [bool(np.array_equal(new, lm.recompute(model, lm.encode(p), n)))
           for p, n, new in zip(prompts, NEW_TOKENS, served.tokens, strict=True)]
print(f"greedy tokens equal recomputation, prompt by prompt: {matches}")
assert all(matches)

# %% [markdown]
# A model trained for seconds on a few kilobytes writes the corpus's commonest words; the point
# is that the cached, paged, batched decoding gives exactly the tokens of the slow, cache-free one,
# while the pages of finished sequences are reused (the events above).
#
# ## 4b · Mixed batches: chunked prefill beside the decodes, and a quantized cache
#
# Above, a new prompt gets a call of its own (its prefill) while the running sequences wait. TPU
# inference engines (JAX's `ragged_paged_attention`, vLLM's TPU backend) do not wait: each step is
# one **ragged batch**, a chunk of each new prompt's tokens beside one token of every running
# sequence, with per-sequence query lengths `cu_q_lens`. `lm.serve(..., chunk=C)` steps that way:
# an admitted prompt feeds `C` tokens a step into its pages (`tpuattn.decode.write`) and attends
# through `tpuattn.decode.attention(q, k_pages, v_pages, lengths, page_table=..., cu_q_lens=...)`,
# each query causal within its own sequence; its first new token comes the step its last chunk is
# in. The check is the same: the tokens equal recomputation.

# %%
CHUNK = 16  # prompt tokens a step per prefilling sequence: the longest prompt here takes two steps
mixed = lm.serve(model, [lm.encode(p) for p in prompts], NEW_TOKENS, slots=SLOTS, page_size=PAGE_SIZE,
                 num_pages=NUM_PAGES, chunk=CHUNK, keep_logits=True)
print(f"mixed batches: {mixed.steps} calls of the model, each {SLOTS} x {CHUNK} token rows, for "
      f"{len(prompts)} prompts; prefill then decode above: {served.steps + len(prompts)} calls "
      f"({served.steps} decode steps, {len(prompts)} prefills)")
matches = [bool(np.array_equal(a, b)) for a, b in zip(mixed.tokens, served.tokens, strict=True)]
print(f"greedy tokens equal the tokens above (and so recomputation): {matches}")
assert all(matches)

# %% [markdown]
# Decode reads the whole cache every step, so the cache's bytes are the step's traffic
# (notebook 07). Engines therefore keep it in one byte an entry: int8, or fp8 (`float8_e4m3fn`),
# each entry `e` standing for `e * scale` with a float32 scale per layer and kv head.
# `lm.calibrate` sets the scales from the largest key and value the prompts' prefill writes (times a
# headroom of 1.25 for the decoded tokens, as engines calibrate cache scales offline), and the decode
# kernel dequantizes as it reads. Quantization changes the numbers: the cell measures how far the
# logits move from the full-width cache's (teacher-forced along the served tokens, relative to the
# largest logit) and whether the greedy tokens change.

# %% tags=["nbval-ignore-output"]
def teacher_forced(tokens):
    """The full-width model's logits along the served tokens: every prompt and its new tokens in one
    call, padded at the end (causal attention: the padding changes no earlier logit)."""
    rows = [np.concatenate([lm.encode(p), new[:-1]]) for p, new in zip(prompts, tokens, strict=True)]
    padded = np.zeros((len(rows), max(len(r) for r in rows)), np.int32)
    for i, row in enumerate(rows):
        padded[i, :len(row)] = row
    logits = np.asarray(model(padded))
    starts = [len(lm.encode(p)) - 1 for p in prompts]
    return np.concatenate([logits[i, start:len(row)] for i, (start, row) in enumerate(zip(starts, rows,
                                                                                           strict=True))])


drift = {}
for cache_dtype in ("int8", "float8_e4m3fn"):
    quant = lm.serve(model, [lm.encode(p) for p in prompts], NEW_TOKENS, slots=SLOTS,
                     page_size=PAGE_SIZE, num_pages=NUM_PAGES, chunk=CHUNK, cache_dtype=cache_dtype,
                     keep_logits=True)
    expected = teacher_forced(quant.tokens)
    drift[cache_dtype] = float(np.abs(np.concatenate(quant.logits) - expected).max()
                               / np.abs(expected).max())
    same = sum(bool(np.array_equal(a, b)) for a, b in zip(quant.tokens, mixed.tokens, strict=True))
    print(f"{cache_dtype:>14} cache: logits within {drift[cache_dtype]:.1e} of the full-width cache's "
          f"(relative); {same} of {len(prompts)} prompts' greedy tokens unchanged")
# The property, on every machine: quantization moves the logits, a little (int8 less than fp8's 3
# mantissa bits).
assert 0 < drift["int8"] < drift["float8_e4m3fn"] < 0.1

# %% [markdown]
# int8 keeps 8 bits of each entry against fp8's 3 mantissa bits, so its logits move less at the same
# byte count; either halves a bfloat16 cache's bytes, which `benchmarks/decode_engine.py` compiles
# for v5e and v6e beside JAX's own ragged kernel (the book's *decode engine* page).
#
# ## 5 · A realistic size, compiled for TPU v5e (compiled, not run)
#
# Now the same code at a size where the implementation matters: `BIG_LAYERS` layers of width
# `BIG_D_MODEL`, 8 query heads on 2 kv heads (head_dim 128), bf16, one training sequence of `BIG_SEQ`
# tokens; and a decode step for `BIG_SLOTS` sequences over a paged cache of `BIG_PAGES_PER_SEQ`
# pages of `BIG_PAGE` rows each. `tpuattn.measure.aot.compile_for("v5e", ...)` compiles them with the
# real TPU compiler from shapes alone (no weights are ever allocated: `nnx.eval_shape`), and the
# compiled program reports the HBM it needs. One layer is compiled (each layer is compiled in full and
# takes minutes on a CPU machine); what differs between implementations is the memory attention
# needs inside a layer, and a deeper model stores that for every layer it trains.

# %% tags=["nbval-ignore-output"]
big = lm.Config(d_model=BIG_D_MODEL, layers=BIG_LAYERS, heads=BIG_HEADS, kv_heads=BIG_KV_HEADS,
                mlp_dim=BIG_MLP_DIM, dtype="bfloat16")


def train_step_program(impl):
    """One training step (forward, backward, AdamW) as a function of flat arrays, and their shapes."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: lm.Transformer(big, rngs=nnx.Rngs(0), impl=impl)))
    optimizer = optax.adamw(3e-4)
    step = lm.make_train_step(graphdef, optimizer)
    leaves, tree = jax.tree.flatten((params, jax.eval_shape(optimizer.init, params)))

    def fn(*args):
        return step(*jax.tree.unflatten(tree, args[:-1]), args[-1])

    return fn, [*leaves, jax.ShapeDtypeStruct((1, BIG_SEQ + 1), jnp.int32)]


def decode_step_program(impl):
    """One decode step of the served batch, as a function of flat arrays, and their shapes."""
    graphdef, params = nnx.split(nnx.eval_shape(
        lambda: lm.Transformer(big, rngs=nnx.Rngs(0), decode_impl=impl)))
    cache = jax.eval_shape(lambda: lm.PagedCache.empty(big, BIG_SLOTS * BIG_PAGES_PER_SEQ + 1, BIG_PAGE))
    leaves, tree = jax.tree.flatten((params, cache))
    vector = jax.ShapeDtypeStruct((BIG_SLOTS,), jnp.int32)
    table = jax.ShapeDtypeStruct((BIG_SLOTS, BIG_PAGES_PER_SEQ), jnp.int32)

    def fn(*args):
        params, cache = jax.tree.unflatten(tree, args[:-3])
        return nnx.merge(graphdef, params).decode_step(*args[-3:-1], cache, args[-1])

    return fn, [*leaves, vector, vector, table]


def compiled_peak(program, impl):
    """Peak HBM in GiB, or why not: the compiler's own verdict (out of HBM) or its error."""
    try:
        return aot.memory_facts(aot.compile_for("v5e", *program(impl)))["peak_hbm_bytes"] / 2**30, ""
    except Exception as error:  # noqa: BLE001 - the compiler's errors vary by version
        failure = aot.compile_failure(error)
        verdict = "does not fit in HBM" if failure["status"] == "out_of_memory" else "does not compile"
        return None, f"{verdict}: {failure['error']}"


peaks = {}
COMPILE = RUN_COMPILES and aot.tpu_available()
if not RUN_COMPILES:
    print("RUN_COMPILES is False: compiles skipped")
elif not COMPILE:
    print("The TPU compiler (libtpu) is not installed here: compiled numbers skipped "
          "(pip install 'jax[tpu]' to see them)")
else:
    print(f"compiled (v5e, not run), {aot.versions_text()}; {big.layers} layer(s), d_model {big.d_model}, "
          f"heads {big.heads} on {big.kv_heads}, head_dim {big.head_dim}, bf16")


def show_compiled(kind, impl):
    """Compile one program for v5e, print its peak HBM (or why not) and keep it in ``peaks``."""
    if not COMPILE:
        return
    program = train_step_program if kind == "train step" else decode_step_program
    start = time.perf_counter()
    peaks[kind, impl] = peak, why = compiled_peak(program, impl)
    verdict = f"peak HBM {peak:6.2f} GiB" if peak is not None else why
    print(f"{kind}, {impl}: {verdict}  (compiled (v5e, not run); compile "
          f"{time.perf_counter() - start:.0f} s)")


# %% [markdown]
# One training step of `BIG_SEQ` tokens (forward, backward and the AdamW update), one implementation
# per cell:

# %% tags=["nbval-ignore-output"]
show_compiled("train step", "reference")

# %% tags=["nbval-ignore-output"]
show_compiled("train step", "xla")

# %% tags=["nbval-ignore-output"]
show_compiled("train step", "pallas")

# %% tags=["nbval-ignore-output"]
show_compiled("train step", "splash")

# %% [markdown]
# One decode step of the served batch (every page of every sequence in the page table), through the
# materialised reference and the split-K Pallas kernel:

# %% tags=["nbval-ignore-output"]
show_compiled("decode step", "reference")
show_compiled("decode step", "pallas")

# %% [markdown]
# ## 6 · What changed when the implementation did
#
# One argument changed, `impl=`. The cell below reads the runs above back and says what moved.

# %%
print(f"logits: every implementation within {LOGITS_BOUND:g} of the reference (section 1); loss "
      f"curves within {LOSS_BOUND:g} nats per byte over {TRAIN_STEPS} steps (section 2).")
for kind in ("train step", "decode step"):
    row = {impl: peak for (k, impl), (peak, _) in peaks.items() if k == kind}
    if row:
        fits = [impl for impl, peak in row.items() if peak is not None]
        text = ", ".join(f"{impl} {peak:.2f} GiB" if peak is not None else f"{impl} did not compile"
                         for impl, peak in row.items())
        if fits:
            low, high = min(row[i] for i in fits), max(row[i] for i in fits)
            least = [i for i in fits if row[i] <= low * 1.01]  # within 1% of the least
            summary = f"least HBM: {' and '.join(least)}; the most needs {high / low:.1f}x the least"
        else:
            summary = "none compiled"
        print(f"{kind}, compiled (v5e, not run): {text}; {summary}.")

# %% [markdown]
# The model's numbers (logits, losses, generated tokens) did not move beyond rounding; the cost did:
# the training step's peak HBM differs several-fold between the implementations that materialise the
# scores and the kernels that do not (the ratio above), a difference a longer sequence grows with the
# square of its length and every further layer adds to. The decode step's peak is the cache itself,
# the same for both; what separates decode implementations is the bandwidth they use (notebook 07).
# That is the lesson of swappable parts behind one contract: the choice is one argument, so it can be made
# per shape, per chip and per phase (prefill and training with one implementation, decode with
# another) from what the compiler and the measurements say, and changed again when a better kernel
# arrives, without touching the model.

# %% [markdown]
# ## Takeaways
#
# > **Takeaway.** Behind one contract the attention implementation is one argument of the model:
# > logits, losses and generated tokens agree to float32 rounding whichever computes them.
#
# > **Takeaway.** Serving is two contracts: prefill is `tpuattn.attention` over the prompt, decode is
# > `tpuattn.decode.attention` over a paged cache. Pages and a free list let sequences of any length
# > come and go (continuous batching) with fixed shapes, so the decode step compiles once.
#
# > **Takeaway.** Check a server against recomputation: greedy tokens from the cache must equal those
# > of running the whole sequence again, a test that catches a wrong page, position or length.
#
# > **Takeaway.** Engines step ragged batches: prompt chunks beside single-token decodes in one call
# > (`cu_q_lens`), so a new prompt never stalls the others; a quantized cache halves decode's traffic
# > for a measured change in the logits.
#
# > **Takeaway.** Which implementation to use is a question of cost at your shape, and the compiler
# > answers it before you rent a chip: read its peak HBM per implementation.
#
# ## Exercises
#
# Each stub raises `NotImplementedError`; fill it in and re-run the two cells below it (the second
# checks your functions). Solutions are in the hidden cell at the end of the notebook.
#
# 1. **Pages a sequence needs** (★☆☆, 5 min). `pages_needed(prompt_len, new_tokens, page_size)`: the
#    fewest pages of `page_size` rows that hold a prompt and every token generated after it. Checked
#    on a grid of sizes (the pages hold them, one page fewer would not) and against the pages `serve`
#    took for each prompt in section 4 (its `events`).
# 2. **One greedy token without a cache** (★★☆, 10 min). `next_token(model, tokens)`: the byte the
#    model picks after `tokens` (a 1-D array of byte ids), running the whole sequence through it:
#    `model(batch)` takes `[batch, length]` byte ids and returns `[batch, length, 256]` logits. Checked
#    against the tokens section 4's server generated with its paged cache (15 calls, each sequence one
#    token longer than the one before: every length the model has not seen compiles it again).
#
# Further questions (no check): serve with `decode_impl="pallas"` (the split-K kernel, interpreted
# here): are the tokens the same? Make `NUM_PAGES` too small for the longest prompt and its new
# tokens: what does `serve` say, and why must a sequence's pages be known before it is admitted in
# this design? Raise `BIG_SEQ` until the implementation with the least HBM no longer fits on a v5e:
# which part of the training step's memory is then the largest?


# %%
def pages_needed(prompt_len, new_tokens, page_size):
    raise NotImplementedError("FILL ME IN")


def next_token(model, tokens):
    raise NotImplementedError("FILL ME IN")


# %%
def check_exercises(pages_needed, next_token):
    def check_pages():
        for length in range(1, 40):
            for new in (1, 3, 8):
                for size in (1, 4, 8, 16):
                    n = int(pages_needed(length, new, size))
                    assert n * size >= length + new, ("too few", length, new, size, n)
                    assert (n - 1) * size < length + new, ("more than needed", length, new, size, n)
        taken = {i: len(pages) for _, kind, i, _, pages in served.events if kind == "admit"}
        for i, prompt in enumerate(prompts):
            assert int(pages_needed(len(lm.encode(prompt)), NEW_TOKENS[i], PAGE_SIZE)) == taken[i], i

    def check_token():
        for prompt, new in zip(prompts, served.tokens, strict=True):
            tokens = np.asarray(lm.encode(prompt), np.int32)
            for t in range(min(3, len(new))):  # the first tokens, each after the ones before it
                sequence = np.concatenate([tokens, new[:t]]).astype(np.int32)
                assert int(next_token(model, sequence)) == int(new[t]), (prompt, t)

    run_checks({"1 pages needed": check_pages, "2 next token": check_token})


check_exercises(pages_needed, next_token)

# %% [markdown]
# ## References
#
# - A. Vaswani et al., "Attention Is All You Need", 2017, arXiv:1706.03762 (the decoder-only
#   transformer's attention and residual blocks).
# - B. Zhang, R. Sennrich, "Root Mean Square Layer Normalization", 2019, arXiv:1910.07467 (RMSNorm).
# - J. Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021,
#   arXiv:2104.09864 (RoPE).
# - J. Ainslie et al., "GQA: Training Generalized Multi-Query Transformer Models from Multi-Head
#   Checkpoints", 2023, arXiv:2305.13245 (grouped-query attention).
# - N. Shazeer, "GLU Variants Improve Transformer", 2020, arXiv:2002.05202 (the SwiGLU MLP).
# - G.-I. Yu et al., "Orca: A Distributed Serving System for Transformer-Based Generative Models",
#   OSDI 2022 (iteration-level scheduling: continuous batching).
# - W. Kwon et al., "Efficient Memory Management for Large Language Model Serving with
#   PagedAttention", SOSP 2023, arXiv:2309.06180 (vLLM: the paged KV cache, pages from a free list).
# - Flax (NNX), https://flax.readthedocs.io/; optax,
#   https://optax.readthedocs.io/; Orbax checkpointing, https://orbax.readthedocs.io/.

# %% [markdown]
# ## Solutions
#
# The cell below is collapsed: open it after trying the exercises. It runs the same checks on the
# solutions, but only when `RUN_SOLUTIONS = True` (the parameters cell; the project's CI sets it), so
# Run All shows your own results alone.

# %% cellView="form" jupyter={"outputs_hidden": true, "source_hidden": true} tags=["solution", "hide-cell"]
# @title Solutions: open after trying the exercises (runs when RUN_SOLUTIONS = True)
if RUN_SOLUTIONS:
    def pages_needed_solution(prompt_len, new_tokens, page_size):
        return -(-(prompt_len + new_tokens) // page_size)  # ceil: the last page may be partly empty

    def next_token_solution(model, tokens):
        # The whole sequence, no cache. Every new length would compile the model again (seconds each on a
        # CPU), so pad to a multiple of 64: attention is causal, so the padding after the last token
        # changes nothing at it (lm.recompute does the same).
        padded = np.zeros((1, -(-len(tokens) // 64) * 64), np.int32)
        padded[0, :len(tokens)] = tokens
        logits = model(jnp.asarray(padded))  # [1, padded length, 256]
        return int(jnp.argmax(logits[0, len(tokens) - 1]))

    check_exercises(pages_needed_solution, next_token_solution)
