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
# # 05 · Measure: timing, TFLOP/s, memory, and the roofline they should be read against
#
# Four notebooks built four ways to compute the same attention. Which one is fastest depends on the
# chip, the sequence length, the dtype and the mask, and a single number from a single machine
# decides nothing. This notebook answers: **how do you measure attention so that the numbers mean
# something, and how close can each implementation's schedule get to what a TPU can do?** It
# measures every implementation available here with the package's benchmark (`tpuattn.bench`,
# the same code as `python -m tpuattn.bench`), then *models* the TPU generations with
# `tpuattn.model.roofline`: FLOPs and HBM bytes of each schedule, the bound that applies, and the
# sequence length at which materialising the scores stops fitting on the chip.
#
# **What you'll do**
# - benchmark every implementation, forward and forward+backward, with compile time kept apart,
#   warm-up, the median and spread of repeats, TFLOP/s from the standard count, and peak memory;
# - see why interpret-mode timings (Pallas kernels off a TPU) are labelled and never turned into
#   TFLOP/s;
# - build the roofline of TPU v4, v5e, v5p and v6e, place each implementation's schedule on it, and
#   read off its bound and predicted time from 4k to 32k tokens;
# - find the crossover lengths: where materialised scores outgrow HBM, and where a fused kernel
#   without the online softmax would outgrow VMEM;
# - read published TPU measurements against the roofline: how far below it real kernels run;
# - on a TPU runtime: the fraction of the roofline each of your measured runs achieves;
# - write code: a roofline lower bound and an out-of-memory length by hand, from `tpuattn.chips`.
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/tpuattn/tpuattn/blob/main/notebooks/05_measure.ipynb)

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
# Measured sweep (shape [batch, seq, heads, head_dim]); small on CPU, larger on a TPU.
SEQ_LENS = [256, 512]
TPU_SEQ_LENS = [1024, 2048, 4096, 8192]  # used instead of SEQ_LENS on a TPU runtime
MODES = ["fwd", "fwd+bwd"]
CAUSAL = [True]  # [False, True] measures both (twice the rows)
BATCH, HEADS, KV_HEADS, HEAD_DIM = 1, 4, 4, 64
# On a TPU: a shape people train with (head_dim 128 fills the lanes; enough heads and batch that one
# call is not dominated by launch overhead).
TPU_BATCH = 4
TPU_HEADS = 16
TPU_KV_HEADS = 16
TPU_HEAD_DIM = 128
DTYPE = ""  # "" = bfloat16 on a TPU, float32 elsewhere (bf16 matmuls are emulated on CPU)
REPEATS = 3
IMPLS = "all"  # or a list such as ["reference", "blockwise"]
# Interpret-mode kernels (pallas, splash off a TPU) are slow and their times are not kernel speed:
# a short sweep shows the label and checks they run.
INTERPRET_SEQ_LENS = [128]
# Peak memory: one child process per row on CPU, forward, not causal.
MEASURE_MEMORY = True
MEMORY_IMPLS = ["reference", "blockwise"]
MEMORY_SEQ_LENS = [512, 1024, 2048]
MEMORY_HEADS = 8
# The modelled problem: one long-context layer, bf16.
MODEL_SEQ_LENS = [4096, 8192, 16384, 32768]
MODEL_BATCH, MODEL_HEADS, MODEL_HEAD_DIM, MODEL_DTYPE = 1, 8, 128, "bfloat16"
OUT_DIR = "../out/05"
PROGRESS = False  # True shows a progress bar (tqdm) while the sweeps run
# The hidden solution cells run only when this is True, so Run All shows your own results alone.
# The project's CI sets it (TPUATTN_RUN_SOLUTIONS=1): the committed outputs include the solutions'.
RUN_SOLUTIONS = os.environ.get("TPUATTN_RUN_SOLUTIONS") == "1"

# %%
import math

import matplotlib.pyplot as plt
import numpy as np

from tpuattn import chips
from tpuattn.measure import bench
from tpuattn.model import roofline
from tpuattn.viz import style
from tpuattn.viz import timings as bench_plots

style.use_style()
on_tpu = PLATFORM.on_tpu
dtype = DTYPE or ("bfloat16" if on_tpu else "float32")
seq_lens = TPU_SEQ_LENS if on_tpu else SEQ_LENS
if on_tpu:
    BATCH, HEADS, KV_HEADS, HEAD_DIM = TPU_BATCH, TPU_HEADS, TPU_KV_HEADS, TPU_HEAD_DIM
print(f"sweep shape: batch {BATCH}, heads {HEADS} (kv {KV_HEADS}), head_dim {HEAD_DIM}, {dtype}")
available = list(tpuattn.implementations()) if IMPLS == "all" else list(IMPLS)
compiled_impls = [name for name in available if not bench.runs_interpreted(name)]
interpreted_impls = [name for name in available if bench.runs_interpreted(name)]
print(f"compiled here: {compiled_impls}; interpret mode here: {interpreted_impls or 'none'}")

# %% [markdown]
# ## 1. What a benchmark row is
#
# `tpuattn.bench.run` takes implementations, shapes and modes and returns one row per combination.
# Each row is produced the same way (`tpuattn.timing.time_jitted`):
#
# 1. **compile separately**: `jax.jit(f).lower(q, k, v).compile()` is timed on its own
#    (`compile_s`); compilation costs many calls' worth of time (compare the `compile s` and
#    `median ms` columns of the table below) and must not leak into the steady state;
# 2. **warm up**: one call is run and discarded (first-call allocations, caches);
# 3. **repeat and synchronise**: each timed call ends with `jax.block_until_ready`; JAX dispatches
#    asynchronously, so without it you time the dispatch, not the work;
# 4. **report the median and the spread** `(max - min) / median`: the median ignores a stray slow
#    run; a large spread says the machine was busy and the row should be re-run.
#
# `fwd+bwd` times `jax.grad` of `sum(attention(q, k, v))` with respect to q, k and v, which runs
# the forward too. TFLOP/s uses the **standard count**, the convention FlashAttention's and
# Triton's benchmarks use, so numbers compare across implementations and papers:
#
# $$ F_\text{fwd} = 4\,B\,H\,T_q\,T_k\,D \;(\times \tfrac12 \text{ if causal}), \qquad
#    F_\text{fwd+bwd} = (1 + 2.5)\,F_\text{fwd}. $$
#
# The 4 is two matmuls ($QK^\top$ and $PV$) of one multiply and one add each; the backward is five
# such matmuls ($dV$, $dP$, $dQ$, $dK$ and the recomputed $S$), hence 2.5. It is a convention, not
# the work a schedule executes: a causal kernel with square blocks computes its diagonal tiles
# whole, and the materialised reference skips nothing. Section 3 counts the executed work.

# %%
flops = bench.attention_flops(batch=1, heads=8, q_len=4096, kv_len=4096, head_dim=128, causal=True,
                              mode="fwd+bwd")
assert flops == 4 * 8 * 4096 * 4096 * 128 * 0.5 * 3.5
print(f"causal fwd+bwd, 8 heads x 4096 tokens x d 128: {flops / 1e12:.3f} TFLOP (standard count)")

# %% [markdown]
# **Interpret mode is not kernel speed.** Off a TPU, the Pallas kernels (`pallas`, `splash`) run
# in interpret mode: each grid step is executed as ordinary JAX operations on the host. That is
# how this course runs and tests them on a laptop, and the time it takes says nothing about the
# kernel on a TPU. The benchmark still times them (so you know how long a lesson takes), labels
# the row `measured (interpret mode — not kernel speed)` and leaves its TFLOP/s empty.

# %%
for name in ("reference", "pallas"):
    print(f"{name:>9} on {PLATFORM.backend}: {bench.timing_kind(name, PLATFORM.backend)}")
    print(f"{name:>9} on tpu: {bench.timing_kind(name, 'tpu')}")

# %% [markdown]
# ## 2. Measured: every implementation on this machine
#
# The sweep below is the one the command line runs with
#
# ```
# python -m tpuattn.bench --impls all --seq-lens 256,512 --modes fwd,fwd+bwd --causal true \
#     --out out/bench --figures
# ```
#
# Rows that fail (out of memory, an input an implementation does not support, an implementation
# missing on this backend) are recorded with a `status`, not raised. The results, with the
# environment (JAX version, backend, device kind), go to `out/05/05_bench.csv` and `.json` so that
# runs from different machines can be put side by side.

# %% tags=["nbval-ignore-output"]
shapes = bench.sweep(seq_lens, batch=BATCH, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                     dtypes=[dtype], causal=CAUSAL)
results = bench.run(compiled_impls, shapes, MODES, repeats=REPEATS, progress=PROGRESS)
if interpreted_impls and INTERPRET_SEQ_LENS:
    short = bench.sweep(INTERPRET_SEQ_LENS, batch=BATCH, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                        dtypes=[dtype], causal=CAUSAL)
    results = results + bench.run(interpreted_impls, short, MODES, repeats=1, progress=PROGRESS)
csv_path, json_path = results.save(OUT_DIR, "05_bench")
print(results.table())
print(f"\nwrote {csv_path} and {json_path}")

# %% [markdown]
# Check the rows before reading them: every row has a known status, every interpret-mode row has
# no TFLOP/s, and every compiled row that ran has one that matches its FLOP count and median.

# %% tags=["nbval-ignore-output"]
for row in results.rows:
    assert row["status"] in bench.STATUSES, row
    if row["timing_kind"] == bench.TIMING_INTERPRET:
        assert row["tflops"] is None, row
    elif row["status"] == "ok":
        assert math.isclose(row["tflops"], row["flops"] / row["median_s"] / 1e12), row
failed = [(r["impl"], r["mode"], r["seq_len"], r["status"]) for r in results.rows if r["status"] != "ok"]
print(f"{len(results.rows)} rows checked; not ok: {failed or 'none'}")

# %% tags=["nbval-ignore-output"]
# Compiled rows on top (time, then TFLOP/s); interpret-mode rows, if any, on their own axes below:
# a Pallas kernel interpreted on the host is never drawn on the same time axis as compiled code.
has_interpreted = any(row["timing_kind"] == bench.TIMING_INTERPRET for row in results.rows)
rows = 3 if has_interpreted else 2
fig, axes = plt.subplots(rows, len(MODES), figsize=(6 * len(MODES), 4.2 * rows), squeeze=False)
for col, mode in enumerate(MODES):
    bench_plots.plot_time(results, axes[0, col], mode)
    bench_plots.plot_tflops(results, axes[1, col], mode)
    if has_interpreted:
        bench_plots.plot_time(results, axes[2, col], mode, interpret=True)
fig.tight_layout()
style.save_figure(fig, "05_time_tflops")
plt.show()
style.close(fig)

# %% [markdown]
# Read the figure with its label in mind. On a CPU the numbers say how the implementations compare
# *on this CPU*, under whatever else it was running at the time (the `spread` column says how much
# the repeats disagreed); they say nothing about a TPU, and the interpret-mode rows (the bottom
# panels, on axes of their own, at the shortest length only) not even about the kernels. On a TPU
# runtime the same cells measure the chip, and section 4 compares each row with the roofline.
#
# ### Memory against sequence length
#
# On CPU, memory is measured in a fresh child process that runs one call (`tpuattn.memory`): the
# figure shows what the call added to the process's peak resident set, on top of the JAX runtime
# and the inputs. On an accelerator it is XLA's memory plan for the compiled call (temporaries plus
# outputs). The dashed line is the model of what the materialised schedule keeps alive at once:
# the float32 scores $S$ and the probabilities $P$, $8 H T^2$ bytes in float32.

# %% tags=["nbval-ignore-output"]
memory_impls = [name for name in MEMORY_IMPLS if name in compiled_impls]
memory = None
if MEASURE_MEMORY and memory_impls:
    memory_shapes = bench.sweep(MEMORY_SEQ_LENS, heads=MEMORY_HEADS, head_dim=HEAD_DIM, dtypes=[dtype])
    memory = bench.run(memory_impls, memory_shapes, ["fwd"], memory=True, timing=False, progress=PROGRESS)
    memory.save(OUT_DIR, "05_memory")
    value = "call_mib" if PLATFORM.backend == "cpu" else "peak_mib"
    fig, ax = plt.subplots(figsize=(7, 4.4))
    bench_plots.plot_memory(memory, ax, "fwd", value=value)
    t = np.array(MEMORY_SEQ_LENS, float)
    itemsize = 4 if dtype == "float32" else 2
    ax.plot(t, (4 + itemsize) * BATCH * MEMORY_HEADS * t**2 / 2**20, "k--",
            label="materialised S + P (modelled)")
    ax.legend(fontsize="small")
    style.save_figure(fig, "05_memory")
    plt.show()
    style.close(fig)
    for row in memory.rows:
        mib = float("nan") if row[value] is None else row[value]
        print(f"{row['impl']:>10} T={row['seq_len']:>5}: {mib:8.0f} MiB {value} ({row['memory_method']})")
else:
    print("memory not measured (MEASURE_MEMORY = False)")

# %% [markdown]
# ## 3. Modelled: the roofline of a TPU
#
# A TPU chip can do at most `peak` FLOP/s on its matrix units and move at most `bandwidth` bytes/s
# between HBM and the core. A schedule that executes $F$ FLOPs and moves $M$ bytes therefore needs
# at least
#
# $$ t \;\ge\; \max\!\left(\frac{F}{\text{peak}},\ \frac{M}{\text{bandwidth}}\right), $$
#
# and which term wins depends on its **arithmetic intensity** $F/M$ against the chip's **ridge
# point** peak/bandwidth. The chip numbers come from JAX's `pltpu.get_tpu_info_for_chip` where the
# installed JAX has it (0.8.1 and later), else from the copy of JAX's table kept in `tpuattn.chips`;
# both are shown.
# float32 matmuls at `Precision.HIGHEST` (what every implementation here uses for float32) run as
# 6 bfloat16 passes, so the model's f32 peak is bf16 / 6: a *modelled* number.

# %% tags=["nbval-ignore-output"]
print(f"{'chip':<5} {'bf16 TFLOP/s':>12} {'f32 (model)':>11} {'HBM GB/s':>9} {'HBM GiB':>8} {'VMEM MiB':>9} "
      f"{'ridge FLOP/B':>12}  source")
for name in chips.NAMES:
    sources = ("table", "jax") if roofline.jax_has_tpu_info() else ("table",)
    for chip in (roofline.chip_spec(name, source=source) for source in sources):
        print(f"{name:<5} {chip.bf16_flops / 1e12:12.0f} {chip.f32_flops / 1e12:11.1f} "
              f"{chip.hbm_bandwidth / 1e9:9.0f} {chip.hbm_capacity / 2**30:8.1f} "
              f"{chip.vmem_bytes / 2**20:9.0f} "
              f"{chip.ridge_point():12.0f}  {chip.source}")
v5e = roofline.chip_spec("v5e")
# JAX's table; Google Cloud's v5e page says 197 TFLOP/s and 819 GB/s.
assert (v5e.bf16_flops, v5e.hbm_bandwidth) == (197e12, 820e9)

# %% [markdown]
# ### The schedules, counted
#
# `roofline.cost(impl, spec, mode)` counts what each implementation's schedule executes and moves:
#
# * **materialised** (`reference`, `xla`): $S = QK^\top$ is written to HBM in float32, fused with
#   the row max, and read back twice: by the row sum of exponentials, and by the normalisation fused
#   into the $PV$ matmul (the passes of `roofline.MATERIALISED_FWD_PASSES`, the fusions XLA:TPU makes
#   of `reference.py`'s graph; the breakdown below prints each with its bytes). For training the
#   forward also writes $P$, and the backward reads $P$ and $S$ again in its own fusions. Masks save
#   no work: every score is computed.
# * **flash** (`pallas`, `splash`): a query block stays in VMEM while K/V blocks stream past, so K
#   and V are re-read once per query block; scores never reach HBM; tiles that `MaskSpec.block_map`
#   marks EMPTY are skipped. Backward: a dK/dV kernel and a dQ kernel, each recomputing $S$.
# * **blockwise** (pure JAX): the same tiles, but each step is an XLA computation whose score tile
#   and running `(acc, max, sum)` state go through HBM, unless they fit the VMEM the compiler keeps
#   beside the kernels' scoped limit, where XLA:TPU keeps them (the model places them with the rule
#   it uses for materialised scores).
#
# Every byte is listed: here is the forward of the reference at 4096 tokens.

# %%
spec = roofline.problem(4096, batch=MODEL_BATCH, heads=MODEL_HEADS, head_dim=MODEL_HEAD_DIM,
                        dtype=MODEL_DTYPE, causal=True)
ref_cost = roofline.cost("reference", spec, "fwd")
for what, nbytes in ref_cost.breakdown:
    print(f"{nbytes / 1e9:8.3f} GB  {what}")
print(f"{ref_cost.hbm_bytes / 1e9:8.3f} GB  total; {ref_cost.flops / 1e12:.3f} TFLOP executed; "
      f"intensity {ref_cost.intensity:.1f} FLOP/B")

# %% [markdown]
# ### Bound and predicted time, 4k to 32k tokens (modelled, causal, bf16)
#
# For each implementation: the executed FLOPs over HBM bytes (intensity), the bound that applies on
# a v5e, the lower-bound time, and whether the live set fits in HBM. The Pallas kernel's blocks are
# its own defaults for the chip (`tpuattn.pallas.blocks.default_block_sizes`), splash's the tiles
# `impl="splash"` runs (`tpuattn.impl.splash.default_blocks`); both are printed with the table.

# %%
# The four generations the figures below draw (the table above lists every chip).
chip_specs = {name: roofline.chip_spec(name) for name in ("v4", "v5e", "v5p", "v6e")}
model_impls = list(roofline.models())
predictions = {}
for chip_name, chip in chip_specs.items():
    for impl in model_impls:
        for mode in MODES:
            for t in MODEL_SEQ_LENS:
                spec = roofline.problem(t, batch=MODEL_BATCH, heads=MODEL_HEADS, head_dim=MODEL_HEAD_DIM,
                                        dtype=MODEL_DTYPE, causal=True)
                predictions[chip_name, impl, mode, t] = roofline.predict(impl, spec, chip, mode)

print(f"TPU v5e, batch {MODEL_BATCH} x {MODEL_HEADS} heads x d {MODEL_HEAD_DIM}, {MODEL_DTYPE}, causal "
      "(modelled lower bounds)")
print(f"{'impl':<10} {'mode':<8} {'T':>6} {'FLOP/B':>7} {'bound':>8} {'time ms':>9} {'TFLOP/s*':>9} "
      f"{'fits HBM':>8}")
for impl in model_impls:
    for mode in MODES:
        for t in MODEL_SEQ_LENS:
            p = predictions["v5e", impl, mode, t]
            print(f"{impl:<10} {mode:<8} {t:>6} {p.cost.intensity:7.0f} {p.bound:>8} {p.time_s * 1e3:9.2f} "
                  f"{p.standard_tflops:9.1f} {'yes' if p.fits_hbm else 'NO':>8}")
print("* standard-count TFLOP/s at the predicted time: what a benchmark would report at best")
for impl in model_impls:
    if roofline.models()[impl] == "materialised":
        continue
    blocks = roofline.default_blocks(impl, roofline.problem(MODEL_SEQ_LENS[0]), chip_specs["v5e"])
    compute_bound = [t for t in MODEL_SEQ_LENS if predictions["v5e", impl, "fwd", t].bound == "compute"]
    print(f"{impl:<10} blocks {blocks[0]} x {blocks[1]} on v5e; forward compute bound from T = "
          f"{compute_bound[0] if compute_bound else 'none of these'}")
v5e_spec = chip_specs["v5e"]
longest = MODEL_SEQ_LENS[-1]
print(f"v5e ridge point {v5e_spec.ridge_point(MODEL_DTYPE):.0f} FLOP/byte; materialised (reference) "
      f"intensity {predictions['v5e', 'reference', 'fwd', longest].cost.intensity:.0f} FLOP/byte; "
      f"materialised forward stops fitting at "
      f"{roofline.materialise_crossover(v5e_spec, heads=MODEL_HEADS, head_dim=MODEL_HEAD_DIM):,} tokens")

# %% [markdown]
# The model says three things. The materialised schedules (`reference` and `xla`; `xla` keeps more
# alive) sit far left of the ridge (the intensity and ridge printed above): they
# are memory bound at every length, and past the printed length their scores no longer fit at all.
# The flash kernels, at the blocks printed above, re-read K/V rarely enough to turn compute bound
# from the length printed for each. At JAX's own splash default of 128 x 128 the intensity would be
# about $2 \cdot 128 / 2 = 128$ FLOP/byte (exercise 2), memory bound on a v5e, which is why this
# project (and production configs) raise the blocks. And the blockwise loop in pure JAX skips the
# same tiles, but once a step's score tiles or its running state outgrow the VMEM beside the
# kernels, they go through HBM and it is memory bound.

# %%
fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharey=True)
for ax, chip_name in zip(axes.flat, chip_specs, strict=True):
    for impl in model_impls:
        times = [predictions[chip_name, impl, "fwd", t].time_s * 1e3 for t in MODEL_SEQ_LENS]
        fits = [predictions[chip_name, impl, "fwd", t].fits_hbm for t in MODEL_SEQ_LENS]
        # xla has the reference's schedule: draw the reference wide and pale so both show.
        wide = {"lw": 6, "alpha": 0.35} if impl == "reference" else {}
        ax.plot(MODEL_SEQ_LENS, times, marker="o", label=impl, color=style.impl_colour(impl), **wide)
        for t, ms, ok in zip(MODEL_SEQ_LENS, times, fits, strict=True):
            if not ok:
                ax.plot(t, ms, "x", color=style.MISSING_COLOUR, markersize=10)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(MODEL_SEQ_LENS, [str(t) for t in MODEL_SEQ_LENS])
    ax.minorticks_off()
    ax.set_xlabel("sequence length")
    ax.set_title(style.labelled(f"causal fwd, {MODEL_DTYPE}", measured=False, chip=f"TPU {chip_name}"))
for ax in axes[:, 0]:
    ax.set_ylabel("predicted lower-bound time (ms)")
axes[0, 0].legend(title="black x: does not fit in HBM", fontsize="small")
fig.tight_layout()
style.save_figure(fig, "05_predicted_time")
plt.show()
style.close(fig)

# %% [markdown]
# ### The roofline against real runs
#
# A modelled point drawn on a roofline lands on the line by construction, so such a plot shows a
# schedule's *position* (left or right of the ridge), not how well anything runs. What a roofline is
# for is reading a **measurement** against it. This machine has no TPU, so the measurements here are
# runs published by others on real TPUs, each with its configuration and source (the test suite
# holds the model below every one of them, `tests/test_roofline.py`; none was used to fit it). For
# each: the schedule's intensity (modelled: executed FLOPs over the bytes the model counts), the
# FLOP/s the run reached (the same executed FLOPs over the **measured** time), and the fraction of
# the roofline bound it achieved. On a TPU runtime, section 4 adds your own runs.

# %%
# Published measurements on real TPUs, each with its configuration and source
# (tpuattn.model.published, the same table the test suite holds the model below); the v2 run is
# float32, so it is left out of these bf16 rooflines.
from tpuattn.model import published as published_runs

published = []  # (chip, label, intensity, reached FLOP/s, impl, fraction of the bound)
print(f"{'source':<21} {'chip':<4} {'schedule of':<10} {'T':>6} {'mode':<8} {'measured ms':>11} "
      f"{'bound ms':>9} {'FLOP/B':>7} {'TFLOP/s':>8} {'fraction':>8}")
for run in published_runs.bf16_runs():
    source, chip_name, impl, batch, heads, t, head_dim, run_dtype, causal, mode, block, precision, seconds = (
        run.label, run.chip, run.impl, run.batch, run.heads, run.seq_len, run.head_dim, run.dtype, run.causal,
        run.mode, run.block, run.precision, run.seconds)
    spec = roofline.problem(t, batch=batch, heads=heads, head_dim=head_dim, dtype=run_dtype, causal=causal)
    blocks = {} if block is None else {"q_block": block, "kv_block": block}
    p = roofline.predict(impl, spec, chip_name, mode, precision=precision, **blocks)
    reached = p.cost.flops / seconds
    published.append((chip_name, f"{impl} {mode} T={t} ({source})", p.cost.intensity, reached, impl,
                      p.time_s / seconds))
    print(f"{source:<21} {chip_name:<4} {impl:<10} {t:>6} {mode:<8} {seconds * 1e3:11.3f} "
          f"{p.time_s * 1e3:9.3f} {p.cost.intensity:7.0f} {reached / 1e12:8.1f} {p.time_s / seconds:8.2f}")
fractions = [row[-1] for row in published]
print(f"fraction of the roofline bound reached by the published runs: {min(fractions):.2f} to "
      f"{max(fractions):.2f} (median {np.median(fractions):.2f})")

# %%
# Every run above is bf16, or float32 at JAX's default precision (one bf16 pass): the bf16 roof applies.
published_chips = list(dict.fromkeys(row[0] for row in published))
fig, axes = plt.subplots(1, len(published_chips), figsize=(5.6 * len(published_chips), 4.8), squeeze=False)
for ax, chip_name in zip(axes[0], published_chips, strict=True):
    points = [(label, intensity, reached, impl) for c, label, intensity, reached, impl, _ in published
              if c == chip_name]
    bench_plots.plot_roofline(ax, roofline.chip_spec(chip_name), dtype="bfloat16", measured=points)
    for c, _, intensity, reached, _, fraction in published:
        if c == chip_name:  # the fraction of the bound each run reached, beside its star
            ax.annotate(f"{fraction:.2f}", (intensity, reached / 1e12), xytext=(5, -10),
                        textcoords="offset points", fontsize="x-small")
    ax.set_title(f"TPU {chip_name}: published runs (measured) against the roofline (modelled)\n"
                 "x: modelled intensity; y: executed FLOPs / measured time", fontsize="small")
    ax.legend(fontsize="xx-small", loc="lower right")
fig.tight_layout()
style.save_figure(fig, "05_roofline")
plt.show()
style.close(fig)

# %% [markdown]
# The stars sit below the roof by the fractions printed above (and beside each star); the dotted
# line from each star up to the roof is what that run left on the table. The gap has causes the
# model leaves out: the vector unit's other softmax work (the model times the exps, one per computed
# score at one float32 vector register a cycle, a rate derived from the compiled bundles and the clock
# the peak implies since no chip publishes one, but not the max, subtract and rescale around them),
# pipeline bubbles, launch overhead, and at small sizes a grid too short to fill the chip.

# %% [markdown]
# ### The compiler's own count: a static estimate
#
# The roofline is a bound. The TPU compiler says more: its final VLIW bundles, issued one a cycle,
# are the instructions each grid step costs, and its loops' exit tests give how often each runs.
# `tpuattn.measure.estimate` counts them (each branch of a Pallas grid weighed by how often the grid
# takes it, from the tile codes), at the chip's clock, and takes the longer of that and the HBM bytes
# over the bandwidth where copies dominate: a time labelled **compiled (static estimate, not run)**.
# Below, two of the published runs: the program each measured, compiled here for its chip, beside its
# measured time and the roofline. [A time from the compiler](../book/estimate.md) holds all twelve
# (9 within 0.67-1.5x of the measured time, the roofline 3) and explains each miss from the dump.
# The CPU timings of section 2 are another machine's: they stay in their own table.

# %%
from tpuattn.measure import aot
from tpuattn.measure import estimate as static_estimate
from tpuattn.model import validation

chosen_runs = [r for r in published_runs.RUNS
               if r.label in ("marin PR #6330", "Zhang 2026") and r.seq_len <= 8192]
if all(aot.compiler_problem(run.chip) is None for run in chosen_runs):
    print(f"{'run':<16} {'chip':<4} {'program':<22} {'measured ms':>11} {'estimate ms':>11} "
          f"{'roofline ms':>11}")
    for run in chosen_runs:
        row = validation.validate_run(run)  # a compile that fails leaves the estimate out, with why
        estimate_ms = f"{row.estimate_s * 1e3:11.3f}" if row.error is None else f"{'-':>11}"
        print(f"{run.label:<16} {run.chip:<4} {row.program:<22} {run.seconds * 1e3:11.3f} "
              f"{estimate_ms} {row.roofline_s * 1e3:11.3f}" + (f"  ({row.error})" if row.error else ""))
    print(f"measured: published, on the chip named; estimate: {static_estimate.LABEL}; "
          "roofline: modelled (lower bound)")
else:
    print("no TPU compiler here (libtpu): the static estimate needs it")

# %% [markdown]
# ### Crossover lengths
#
# * **HBM**: the sequence length at which the materialised schedule's live set (scores, probabilities
#   and, for training, $dP$ and $dS$) exceeds the chip's HBM, for this layer alone. Past it, the
#   reference and `xla` cannot run; every blocked schedule can.
# * **VMEM**: a fused kernel that kept a whole row block of scores `[q_block, T]` (plus all of K and
#   V for one head) in VMEM would not need the online softmax; this is the length at which that
#   stops fitting in one core's VMEM. The online softmax removes the limit: the flash kernel's VMEM
#   working set depends on its block sizes only.

# %%
print(f"batch {MODEL_BATCH} x {MODEL_HEADS} heads x d {MODEL_HEAD_DIM}, {MODEL_DTYPE} (modelled)")
print(f"{'chip':<5} {'HBM fwd':>8} {'HBM fwd+bwd':>12} {'VMEM q_block 128':>17} {'VMEM q_block 512':>17}")
for chip_name, chip in chip_specs.items():
    kwargs = dict(batch=MODEL_BATCH, heads=MODEL_HEADS, head_dim=MODEL_HEAD_DIM, dtype=MODEL_DTYPE)
    print(f"{chip_name:<5} {roofline.materialise_crossover(chip, **kwargs):>8} "
          f"{roofline.materialise_crossover(chip, mode='fwd+bwd', **kwargs):>12} "
          f"{roofline.vmem_crossover(chip, q_block=128, head_dim=MODEL_HEAD_DIM, dtype=MODEL_DTYPE):>17} "
          f"{roofline.vmem_crossover(chip, q_block=512, head_dim=MODEL_HEAD_DIM, dtype=MODEL_DTYPE):>17}")

# %% [markdown]
# ### The model against the compiler
#
# A model is only as good as what it is checked against. The TPU compiler runs without a TPU
# (notebook 03), so every number the roofline states about HBM can be set beside what XLA:TPU
# itself plans for the same program: its memory analysis (peak HBM), its cost analysis (bytes
# accessed) and its own time estimate (`optimal_seconds`). The package ships one compile report
# (`tpuattn.measure.aot.committed_report()`, made by the command it records); the test command
# holds the model's peak HBM within 10% of the compiler's on a whole grid (v5e and v6e, three lengths,
# four implementations, both modes; the few cells where it does not hold are named, with what the
# compiler did instead) and checks the out-of-memory length. For the
# Pallas kernels the compiler's cost analysis only repeats the kernel's own `CostEstimate`, so only
# their peak HBM is an independent check.

# %%
from tpuattn.measure import aot

report = aot.committed_report()
print(f"TPU v5e, {report['problem']}: {aot.LABEL} (JAX {report['jax_version']}, "
      f"libtpu {report['libtpu_version']}) beside modelled")
print(f"{'impl':<9} {'mode':<8} {'T':>6} {'peak HBM MiB':>13} {'model':>8} {'model/compiler':>14} "
      f"{'GB accessed':>12} {'model':>7} {'XLA est. ms':>11} {'bound ms':>9}")
for row in report["rows"]:
    if row["chip"] != "v5e" or row["status"] != "ok":
        continue
    spec = roofline.problem(row["seq_len"], batch=row["batch"], heads=row["heads"], head_dim=row["head_dim"],
                            dtype=row["dtype"], causal=row["causal"])
    p = roofline.predict(row["impl"], spec, "v5e", row["mode"])
    own = row["impl"] in ("reference", "xla")  # the Pallas rows' cost analysis is their CostEstimate
    accessed = f"{row['bytes_accessed'] / 1e9:12.2f}" if own else f"{'(echo)':>12}"
    estimate = f"{row['optimal_seconds'] * 1e3:11.3f}" if own and row["optimal_seconds"] else f"{'-':>11}"
    print(f"{row['impl']:<9} {row['mode']:<8} {row['seq_len']:>6} {row['peak_hbm_bytes'] / 2**20:13.0f} "
          f"{p.cost.peak_hbm_bytes / 2**20:8.0f} {p.cost.peak_hbm_bytes / row['peak_hbm_bytes']:14.2f} "
          f"{accessed} {p.cost.hbm_bytes / 1e9:7.2f} {estimate} {p.time_s * 1e3:9.3f}")
for row in report["rows"]:
    if row["chip"] == "v5e" and row["status"] == "out_of_memory":
        kwargs = dict(batch=row["batch"], heads=row["heads"], head_dim=row["head_dim"], dtype=row["dtype"])
        print(f"{row['impl']:<9} {row['mode']:<8} {row['seq_len']:>6}  compiler: out_of_memory; model: the "
              f"materialised {row['mode']} stops fitting from "
              f"{roofline.materialise_crossover('v5e', mode=row['mode'], **kwargs):,} tokens")

# %% [markdown]
# The model places each buffer where the compiler's buffer assignment puts it: a layout copy that
# is dead before the results are written shares a result's buffer; other temporaries stay in the
# VMEM the kernels' scoped limit leaves (112 MiB of v5e's 128) while they fit; the rest is in HBM.
# Every v5e row above then agrees with the compiler's peak within a few percent (the
# `model/compiler` column) but one: splash's forward at 32768 tokens (384 MiB modelled, 449
# compiled), where the compiler filled that VMEM with prefetched slices of splash's operands and
# left all three 64 MiB layout buffers in HBM. For traffic the model is optimistic: score buffers
# that stay on chip move no HBM bytes in it (a lower bound must not overcount). At 2048 tokens the
# reference's 128 MiB float32 $S$ does not fit what the scoped limit leaves, so its passes count
# (0.42 GB modelled, 0.47 accessed). The bytes
# accessed of the materialised path are XLA's count of every fusion's operands, on chip or not; the
# model's passes follow the same fusions (forward: $S$ written once in float32, read twice). XLA's
# own time estimate and the roofline's lower bound are two models
# of the same program; neither is a measurement.

# %% [markdown]
# ## 4. Measured against modelled
#
# On a TPU runtime, each compiled row of section 2 is divided into the roofline lower bound for the
# same shape on this chip: the **fraction of roofline** achieved (1.0 would be perfect; the published
# runs of section 3 reached the range printed there, attention's softmax also loading the vector
# unit, whose exps the model counts but cannot time). Off a TPU there is nothing to compare: the
# numbers above are measured on this machine and the roofline is modelled.

# %% tags=["nbval-ignore-output"]
chip = chips.from_device_kind(PLATFORM.device_kind)
chip_name = chip.name if chip is not None else None
if chip_name is None:
    print(f"On {PLATFORM.label()}: no TPU to compare with. Section 2 is measured on {PLATFORM.label()}; "
          "section 3 is modelled.")
else:
    chip = roofline.chip_spec(chip_name)
    measured_points = []
    print(f"{'impl':<10} {'mode':<8} {'T':>6} {'causal':<6} {'measured ms':>11} {'bound ms':>9} "
          f"{'fraction':>8}")
    for row in results.select(status="ok", timing_kind=bench.TIMING_COMPILED):
        if row["impl"] not in roofline.models():
            continue
        spec = roofline.problem(row["seq_len"], batch=row["batch"], heads=row["heads"],
                                kv_heads=row["kv_heads"], head_dim=row["head_dim"], dtype=row["dtype"],
                                causal=row["causal"])
        p = roofline.predict(row["impl"], spec, chip, row["mode"])
        print(f"{row['impl']:<10} {row['mode']:<8} {row['seq_len']:>6} {str(row['causal']):<6} "
              f"{row['median_s'] * 1e3:11.3f} {p.time_s * 1e3:9.3f} {p.time_s / row['median_s']:8.2f}")
        if row["mode"] == "fwd" and row["causal"]:
            measured_points.append((f"{row['impl']} T={row['seq_len']}", p.cost.intensity,
                                    p.cost.flops / row["median_s"], row["impl"]))
    fig, ax = plt.subplots(figsize=(7, 4.6))
    bench_plots.plot_roofline(ax, chip, dtype=dtype, measured=measured_points)
    ax.set_title(style.labelled(f"TPU {chip_name}: measured runs on the roofline", measured=True))
    style.save_figure(fig, "05_roofline_measured")
    plt.show()
    style.close(fig)

# %% [markdown]
# > **Takeaway.** Time compiled code only after compiling it separately, warm up, synchronise every
# > call with `block_until_ready`, and report a median with its spread. Label every number with the
# > machine that produced it; interpret-mode timings are never kernel speed.
#
# > **Takeaway.** The standard FLOP count ($4BHT_qT_kD$, half for causal, 3.5x for forward+backward)
# > is for comparing runs; the work a schedule executes, and the bytes it moves, are what bound it.
#
# > **Takeaway.** Materialised attention is memory bound on every TPU once its scores no longer fit
# > on chip (its intensity then sits far below every chip's ridge point) and, even for a single
# > 8-head layer at d 128, runs out of HBM at the crossover lengths above -- which the TPU compiler's
# > own out-of-memory confirms. A flash schedule is compute bound once its query block is large enough
# > that re-reading K/V per block stays above the ridge point: intensity
# > $\approx 2\,\text{block\_q}/\text{bytes per element}$.
#
# ## Exercises
#
# Each stub raises `NotImplementedError`; fill it in and re-run the check cell below them. Solutions
# are in the hidden cell at the end of the notebook (it runs the same checks). Difficulty from ★☆☆ to
# ★★★, with the time it takes at a workshop.
#
# 1. **Ridge** (★☆☆, 5 min). Return the ridge point (FLOP per HBM byte, bf16) of one TPU v6e device
#    from the numbers `tpuattn.chips` holds for it (`chips.get("v6e").per_device()`: JAX's own
#    table; Google Cloud's v6e page rounds differently).
# 2. **Re-reads** (★★☆, 10 min). For a non-causal flash forward in bf16, write the arithmetic
#    intensity as a function of `block_q` alone, counting only the K/V re-reads (they dominate at
#    long lengths).
# 3. **Block size** (★★☆, 10 min). Using your function, find the smallest `block_q` (a multiple of
#    128) that makes the flash forward compute bound on a v5e.
# 4. **A roofline bound by hand** (★★★, 20 min). Write `materialised_forward_bound(chip_name, batch,
#    heads, seq_len, head_dim)`: the roofline lower bound of the materialised forward (`reference`,
#    bf16, not causal) on one device, as `(seconds, "memory" or "compute")`, from the chip's numbers
#    in `tpuattn.chips` and the schedule of section 3 -- read Q, K, V and write O once, plus the bytes
#    per score of the breakdown printed there; executed FLOPs: the two matmuls over every score. No
#    `tpuattn.model.roofline` inside. The check compares with `roofline.predict` for shapes this notebook
#    never modelled (16 heads of 64 on a v6e, 32 heads of 128 on a v5e).
# 5. **When the scores stop fitting** (★★★, 15 min). Write `materialised_oom_length(chip_name, heads,
#    head_dim)`: the smallest sequence length (batch 1, bf16, forward) at which the materialised
#    schedule's live set -- the float32 scores plus Q, K, V and O -- exceeds one device's HBM. Solve
#    the quadratic, then step to the exact integer. The check compares with
#    `roofline.materialise_crossover` on three chips.


# %%
def v6e_ridge_point():
    raise NotImplementedError("FILL ME IN")


def flash_intensity(block_q, itemsize=2):
    raise NotImplementedError("FILL ME IN")


def smallest_compute_bound_block_q(flash_intensity):
    raise NotImplementedError("FILL ME IN")


def materialised_forward_bound(chip_name, batch, heads, seq_len, head_dim):
    raise NotImplementedError("FILL ME IN")


def materialised_oom_length(chip_name, heads, head_dim):
    raise NotImplementedError("FILL ME IN")


def check_bound(materialised_forward_bound):
    for chip_name, batch, heads, seq_len, head_dim in (("v6e", 2, 16, 8192, 64), ("v5e", 1, 32, 4096, 128)):
        seconds, bound = materialised_forward_bound(chip_name, batch, heads, seq_len, head_dim)
        spec = roofline.problem(seq_len, batch=batch, heads=heads, head_dim=head_dim, dtype="bfloat16")
        want = roofline.predict("reference", spec, chip_name, "fwd")
        np.testing.assert_allclose(seconds, want.time_s, rtol=1e-6, err_msg=f"{chip_name} {heads}x{head_dim}")
        assert bound == want.bound, (chip_name, bound, want.bound)


def check_oom(materialised_oom_length):
    for chip_name, heads, head_dim in (("v6e", 16, 64), ("v5p", 8, 128), ("v5e", 8, 128)):
        want = roofline.materialise_crossover(chip_name, heads=heads, head_dim=head_dim)
        assert materialised_oom_length(chip_name, heads, head_dim) == want, (chip_name, want)


def check_exercises(v6e_ridge_point, flash_intensity, smallest_compute_bound_block_q,
                    materialised_forward_bound, materialised_oom_length):
    long = roofline.problem(32768, heads=1, head_dim=128, dtype="bfloat16")
    run_checks({
        "1 ridge": lambda: np.testing.assert_allclose(
            v6e_ridge_point(), roofline.chip_spec("v6e").ridge_point(), rtol=1e-6),
        # The model also counts Q, O, the logsumexp and the wrapper's layout copies: a few percent.
        "2 re-reads": lambda: np.testing.assert_allclose(
            flash_intensity(256), roofline.cost("pallas", long, q_block=256, kv_block=512).intensity,
            rtol=0.06),
        "3 block size": lambda: np.testing.assert_equal(smallest_compute_bound_block_q(flash_intensity), 256),
        "4 roofline bound": lambda: check_bound(materialised_forward_bound),
        "5 out of memory": lambda: check_oom(materialised_oom_length),
    }, hint="see the exercise text above the stubs")


check_exercises(v6e_ridge_point, flash_intensity, smallest_compute_bound_block_q, materialised_forward_bound,
                materialised_oom_length)


# %% [markdown]
# ## References
#
# - S. Williams, A. Waterman, D. Patterson, "Roofline: an insightful visual performance model for
#   multicore architectures", Communications of the ACM 52(4), 2009.
# - T. Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness",
#   2022, arXiv:2205.14135; T. Dao, "FlashAttention-2", 2023, arXiv:2307.08691.
# - J. Austin et al., "How to Scale Your Model", 2025, https://jax-ml.github.io/scaling-book/ (the TPU
#   and roofline chapters).
# - JAX's chip table: `jax/_src/pallas/mosaic/tpu_info.py` (`pltpu.get_tpu_info_for_chip`, JAX >= 0.8.1);
#   Google Cloud's TPU pages, https://cloud.google.com/tpu/docs/system-architecture-tpu-vm.
# - Published TPU measurements the roofline is tested against (`tests/test_roofline.py`):
#   https://github.com/jax-ml/jax/issues/24633; apple/axlearn
#   `axlearn/common/flash_attention/tpu_attention_benchmark.py`; marin-community/marin's splash logbook
#   and PR #6330.
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
    def v6e_ridge_point_solution():
        device = chips.get("v6e").per_device()
        return device["bf16_flops"] / device["hbm_bandwidth"]          # FLOP per byte

    def flash_intensity_solution(block_q, itemsize=2):
        # Per (q block, kv block) tile: 4 * block_q * block_kv * D FLOPs, and 2 * block_kv * D * itemsize
        # bytes of K and V fetched for it: block_kv and D cancel.
        return 4 * block_q / (2 * itemsize)                            # = block_q FLOP/B in bf16

    def smallest_compute_bound_block_q_solution(flash_intensity):
        ridge = roofline.chip_spec("v5e").ridge_point()
        return next(b for b in range(128, 4097, 128) if flash_intensity(b) >= ridge)

    def materialised_forward_bound_solution(chip_name, batch, heads, seq_len, head_dim):
        device = chips.get(chip_name).per_device()
        scores = batch * heads * seq_len * seq_len
        flops = 4 * scores * head_dim                                  # Q K^T and P V over every score
        io_bytes = 4 * batch * seq_len * heads * head_dim * 2          # read Q, K, V; write O (bf16)
        score_bytes = 12 * scores                                      # write S (f32), read it twice
        compute_s = flops / device["bf16_flops"]
        memory_s = (io_bytes + score_bytes) / device["hbm_bandwidth"]
        return max(compute_s, memory_s), "compute" if compute_s >= memory_s else "memory"

    def materialised_oom_length_solution(chip_name, heads, head_dim):
        capacity = chips.get(chip_name).per_device()["hbm_bytes"]

        def live(t):                                                   # f32 scores + Q, K, V, O in bf16
            return 4 * heads * t * t + 4 * t * heads * head_dim * 2

        a, b = 4 * heads, 8 * heads * head_dim
        t = int((-b + math.sqrt(b * b + 4 * a * capacity)) / (2 * a))
        while live(t) > capacity:
            t -= 1
        while live(t) <= capacity:
            t += 1
        return t

    check_exercises(v6e_ridge_point_solution, flash_intensity_solution,
                    smallest_compute_bound_block_q_solution, materialised_forward_bound_solution,
                    materialised_oom_length_solution)
