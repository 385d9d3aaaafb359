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
# # 06 · Scale out: attention sharded across a TPU slice, and ring attention
#
# Long contexts are where attention hurts, and exactly where one chip runs out: the K and V of a
# 128K-token sequence, its activations and their gradients do not fit one v5e's 16 GiB, and
# training runs on slices of 8 to thousands of chips. This notebook answers: **how do you split one
# attention call over many chips — by batch, by heads, and by the sequence itself — and what does
# each split cost in memory and communication?** Everything runs on JAX's own SPMD machinery
# (`jax.sharding.Mesh`, `jax.shard_map`, collectives), on 8 simulated CPU devices here and on the
# chips of a TPU runtime unchanged.
#
# **What you'll do**
# - meet meshes and `shard_map` in five minutes;
# - shard batch and heads (free: no communication at all);
# - shard the sequence two ways, all-gather and ring, and check both against one device, forward
#   and gradients;
# - see why a causal mask makes the plain split unfair, and fix it with the zigzag layout;
# - read what the TPU compiler does with the ring on a v5e-8 and a v5p-8 (compiled, not run), and
#   when the ring's transfers hide behind its compute (modelled);
# - write code: the merge of two partial results, and a ring of your own.
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/tpuattn/tpuattn/blob/main/notebooks/06_scale_out.ipynb)

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
# Eight devices. On a CPU, XLA can split the host into several devices; the flag must be set before
# JAX starts, so this cell comes before any `import jax`. On a TPU runtime the flag only affects the
# CPU backend and the notebook uses the TPU chips when there are enough of them: a path written for
# a TPU runtime and not yet run on one by the project.

# %% tags=["nbval-ignore-output"]
import os

FLAG = "--xla_force_host_platform_device_count=8"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FLAG}".strip()

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import tpuattn
from tpuattn import parallel, softmax
from tpuattn.exercises import run_checks
from tpuattn.measure import runtime

PLATFORM = runtime.info()
print(PLATFORM.summary())

# %% tags=["parameters"]
N_DEVICES = 8  # devices on the sequence axis
SEQ_LEN = 256  # divisible by 2 * N_DEVICES (the zigzag layout cuts 2 chunks per device)
BATCH, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 32
SLICE_SEQ_LEN = 131072  # the compiled slice rows shown in section 7 (from the committed report)
# The hidden solution cells run only when this is True, so Run All shows your own results alone.
# The project's CI sets it (TPUATTN_RUN_SOLUTIONS=1): the committed outputs include the solutions'.
RUN_SOLUTIONS = os.environ.get("TPUATTN_RUN_SOLUTIONS") == "1"

# %%
import matplotlib.pyplot as plt

from tpuattn.measure import slices
from tpuattn.model import comm
from tpuattn.viz import style

style.use_style()
DEVICES = jax.devices() if len(jax.devices()) >= N_DEVICES else jax.devices("cpu")
DEVICES = np.array(DEVICES[:N_DEVICES])
print(f"{len(DEVICES)} devices: {DEVICES[0].platform} ({DEVICES[0].device_kind})")

rng = np.random.default_rng(0)
q = jnp.asarray(rng.standard_normal((BATCH, SEQ_LEN, HEADS, HEAD_DIM)), jnp.float32)
k = jnp.asarray(rng.standard_normal((BATCH, SEQ_LEN, KV_HEADS, HEAD_DIM)), jnp.float32)
v = jnp.asarray(rng.standard_normal((BATCH, SEQ_LEN, KV_HEADS, HEAD_DIM)), jnp.float32)

# %% [markdown]
# ## 1 · Meshes and `shard_map` in five minutes
#
# A **mesh** names the axes of an array of devices; a `PartitionSpec` says which array dimension is
# split over which mesh axis (`None`: replicated). `jax.shard_map` runs a function once per device
# on its shard, and inside it the function may talk to the other devices with **collectives**
# (`lax.psum`, `lax.all_gather`, `lax.ppermute`, ...) named by mesh axis.

# %%
mesh = Mesh(DEVICES.reshape(2, 4), ("data", "seq"))
x = jax.device_put(jnp.arange(16.0).reshape(2, 8), NamedSharding(mesh, P("data", "seq")))
print("mesh:", dict(mesh.shape))
for shard in x.addressable_shards[:3]:
    print(f"device {shard.device.id}: rows/cols {shard.index} -> {np.asarray(shard.data).tolist()}")


def row_sums(block):  # runs on each device's [1, 2] block
    return jax.lax.psum(block.sum(axis=1, keepdims=True), "seq")  # add over the 4 devices of a row


print("row sums:", jax.shard_map(row_sums, mesh=mesh, in_specs=P("data", "seq"),
                                 out_specs=P("data", None))(x).ravel().tolist())

# %% [markdown]
# ## 2 · Batch and heads: sharded for free
#
# Attention never mixes batch rows, and heads only meet their own K/V head. Splitting either over
# devices therefore needs **no communication**: each device runs single-chip attention on its
# share. GQA adds one rule: a kv head must live with the query heads that read it, so the kv head
# count must divide by the head axis too (`tpuattn.parallel` refuses otherwise, saying so).
# The compiled program proves "free": it contains no collective at all.

# %%
mesh_bh = Mesh(DEVICES.reshape(2, 4)[:, :2], ("batch", "heads"))
attend_bh = jax.jit(lambda q, k, v: parallel.attention(q, k, v, mesh=mesh_bh, batch_axis="batch",
                                                       head_axis="heads", causal=True))
want = tpuattn.attention(q, k, v, causal=True, impl="reference")
print("max |sharded - one device|:", float(jnp.max(jnp.abs(attend_bh(q, k, v) - want))))
hlo = attend_bh.lower(q, k, v).compile().as_text()
print("collectives in the compiled program:",
      {op: hlo.count(op) for op in ("all-gather", "collective-permute", "all-reduce", "reduce-scatter")})

try:
    parallel.attention(q, k, v, mesh=Mesh(DEVICES[:4].reshape(1, 4), ("batch", "heads")), head_axis="heads")
except ValueError as error:
    print("refused:", error)

# %% [markdown]
# ## 3 · Why long contexts need the sequence sharded
#
# Batch and heads run out: a long-context run has a batch of one sequence per replica, and a model
# has only so many heads (Llama 3 8B has 8 kv heads: *The Llama 3 Herd of Models*, Table 3). What
# remains is the sequence. Sharding it is **context parallelism**: each device keeps `T / n`
# queries — but every query needs *every*
# key (or every earlier key, causally), so K and V must move. Two ways:
#
# - **all-gather** (MaxText's TPU context parallelism): every device gathers the whole K and V
#   once and holds all `T` of them; one all-gather each for K and V (their gradients: one
#   reduce-scatter).
# - **ring** (Ring Attention, Liu et al. 2023): each device passes the K/V block it holds to its
#   neighbour, `n - 1` times, and holds `T / n` of them (plus the block in flight); `n - 1`
#   permutes of K and of V.
#
# Both move the same bytes per device in the forward pass, `(n - 1) / n` of K and V; the ring
# never holds them all, and can overlap each transfer with the attention of the block it already
# has. Each device attends its queries to one block at a time and keeps the partial result as
# `(out, m, log l)`: the online softmax of notebook 02, with blocks that now live on other chips.

# %%
mesh_s = Mesh(DEVICES, ("seq",))
want = tpuattn.attention(q, k, v, causal=True, impl="reference")
for strategy in ("allgather", "ring"):
    fn = jax.jit(lambda q, k, v, s=strategy: parallel.attention(q, k, v, mesh=mesh_s, seq_axis="seq",
                                                                strategy=s, causal=True))
    out = fn(q, k, v)
    text = fn.lower(q, k, v).as_text()
    print(f"{strategy:>9}: max |sharded - one device| = {float(jnp.max(jnp.abs(out - want))):.1e}; "
          f"all_gather x{text.count('all_gather')}, collective_permute x{text.count('collective_permute')}")

# %% [markdown]
# The merge that makes the ring work is exactly the one of notebook 02, written for partial
# results over disjoint key sets: each part weighs in with its own row sum, rescaled to the largest
# of the maxima, so nothing overflows and a part that saw no key weighs zero. A partial result is a
# `tpuattn.softmax.Partial` `(out, m, log_l)` and `tpuattn.softmax.merge` merges any number of them:
# the same merge serves the ring here and the split-K decode of notebook 07 (exercise 2 asks you to
# write it for two parts).

# %% [markdown]
# ## 4 · The causal imbalance, and the zigzag fix
#
# Split a causal sequence into `n` contiguous chunks and device `d` holds queries that see chunks
# `0..d`: the first device computes one half-visible diagonal block, the last that and `n - 1` full
# blocks, close to `2n - 1` times as much (the counts are printed below). Each ring step lasts as long
# as its busiest device, so most devices idle. **Zigzag** (Llama 3's context
# parallelism; Striped Attention, Brandon et al. 2023, stripes single tokens instead) cuts the
# sequence into `2n` chunks and gives device `d` chunks `d` and `2n - 1 - d`: one early and one
# late, the same work everywhere. Users permute their batch once at data loading
# (`parallel.to_zigzag`) and keep it that way; `layout="zigzag"` says so. The counts come from the
# schedule the ring runs (`parallel.ring_plan`), not from a formula.

# %%
spec = tpuattn.spec_from_shapes(SEQ_LEN, num_q_heads=1, head_dim=HEAD_DIM, causal=True)
plans = {layout: parallel.ring_plan(spec, N_DEVICES, layout) for layout in parallel.LAYOUTS}
fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), sharey=True)
top = max(int(plan.work.max()) for plan in plans.values())  # one colour scale for both panels
for ax, (layout, plan) in zip(axes, plans.items(), strict=True):
    image = ax.imshow(plan.work.T, cmap="Blues", aspect="auto", origin="lower", vmin=0, vmax=top)
    ax.set_xlabel("device")
    per_device = plan.work.sum(axis=1)
    ax.set_title(f"{layout}: busiest device / mean = {per_device.max() / per_device.mean():.2f}", fontsize=9)
fig.colorbar(image, ax=axes, label="visible scores computed")
fig.suptitle(f"Causal work per device and ring step, T = {SEQ_LEN}, {N_DEVICES} devices "
             "(counted from the schedule)", fontsize=10)
style.save_figure(fig, "06_zigzag")
plt.show()
for layout, plan in plans.items():
    per_device = plan.work.sum(axis=1)
    print(f"{layout:>8}: work per device {per_device.tolist()}; slowest / mean = "
          f"{per_device.max() / per_device.mean():.2f}; the ring's critical path "
          f"(sum over steps of the busiest device) = {int(plan.work.max(axis=0).sum())}")

# %%
n = N_DEVICES
zig = lambda x: parallel.to_zigzag(x, n)
out_zig = jax.jit(lambda q, k, v: parallel.attention(q, k, v, mesh=mesh_s, seq_axis="seq", layout="zigzag",
                                                     causal=True))(zig(q), zig(k), zig(v))
print("zigzag ring, back in natural order: max |error| =",
      f"{float(jnp.max(jnp.abs(parallel.from_zigzag(out_zig, n) - want))):.1e}")

# %% [markdown]
# ## 5 · The backward ring
#
# The gradient needs every (query, key) pair again. The forward saved only the local shards and
# two floats per query row, the `(m, log l)` of the whole row. The backward runs **two rings**:
#
# 1. K/V travel again while each device sums its queries' `delta = rowsum(P ∘ dP)` over the blocks
#    (the row-sum pass of notebook 03's kernels, for the same reason: nearly one-hot rows);
# 2. K/V travel a third time *with their gradient accumulators*: each device adds its blocks'
#    `dK, dV` into the accumulators of the block it holds and its own `dQ` at home; after the last
#    step the accumulators are sent straight home.
#
# Blocks a mask hides are skipped in all three rings (a `lax.switch` on a table indexed by the
# device's own index: the program is the same on every device), and a sliding window stops the
# ring after the steps that can matter.

# %%
d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
loss_one = lambda q, k, v: jnp.sum(tpuattn.attention(q, k, v, causal=True, impl="reference") * d_out)
loss_ring = lambda q, k, v: jnp.sum(parallel.attention(q, k, v, mesh=mesh_s, seq_axis="seq",
                                                       causal=True) * d_out)
grads_one = jax.grad(loss_one, argnums=(0, 1, 2))(q, k, v)
grads_ring = jax.jit(jax.grad(loss_ring, argnums=(0, 1, 2)))(q, k, v)
for name, a, b in zip(("dq", "dk", "dv"), grads_ring, grads_one, strict=True):
    print(f"{name}: max |ring - one device| = {float(jnp.max(jnp.abs(a - b))):.1e}")
windowed = parallel.ring_plan(tpuattn.spec_from_shapes(SEQ_LEN, num_q_heads=1, head_dim=HEAD_DIM,
                                                       causal=True, window=(SEQ_LEN // N_DEVICES, 0)),
                              N_DEVICES, "natural")
print(f"causal window of {SEQ_LEN // N_DEVICES} tokens: the ring runs {windowed.steps} of {N_DEVICES} steps")

# %% [markdown]
# ## 6 · What the compiler does with it on a v5e-8 and a v5p-8 (compiled, not run)
#
# The TPU compiler runs on this machine without a TPU (notebook 05 and `python -m tpuattn.aot`):
# `jax.experimental.topologies` describes a whole slice, `v5e:2x4` (eight v5e chips) or `v5p:2x2x2`
# (eight v5p chips), and `slices.slice_row` compiles `parallel.attention` for it with the sequence
# sharded over all eight chips. From the compiled program of one device we read its memory and its
# collectives, and, for each asynchronous permute (a `collective-permute-start`/`-done` pair),
# whether the compiler scheduled compute between its start and its done (the `overlap` column):
# only such a send can hide behind the ring's attention. The package ships that report, made by the
# command it records.

# %%
import shlex

report = slices.committed()
print("made by:", shlex.join(report["command"]))
print("with:", ", ".join(f"{name} {version}" for name, version in report["versions"].items()))
rows = report["rows"]
print(slices.table(rows))

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), sharey=True)
for ax, topology in zip(axes, slices.SLICES, strict=True):
    chip = tpuattn.chips.get(slices.SLICES[topology])
    for strategy, marker in (("allgather", "o"), ("ring", "s")):
        pts = sorted((r["seq_len"], r["peak_hbm_bytes"] / 2**30) for r in rows if r["topology"] == topology
                     and r["strategy"] == strategy and r["mode"] == "fwd" and r["status"] == "ok")
        if pts:
            ax.plot(*zip(*pts, strict=True), marker=marker, label=strategy)
    ax.axhline(chip.hbm_bytes / 2**30, color=style.ROOF_COLOUR, linestyle="--", linewidth=1)
    ax.text(1.1e5, chip.hbm_bytes / 2**30 * 1.1, f"{chip.name} HBM per chip", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T (whole slice)")
    ax.set_title(f"{topology}: forward", fontsize=9)
    ax.legend()
axes[0].set_ylabel("peak HBM per device (GiB)")
fig.suptitle("Per-device memory, sequence sharded over 8 chips, bf16, 8 heads x 128, causal "
             "(compiled for TPU, not run)", fontsize=10)
style.save_figure(fig, "06_slice_memory")
plt.show()


def longest_fit(topology, strategy):
    """The largest compiled length that fits one device, the first that did not (None: none in the
    report), and the length where a straight line through the two longest compiled points reaches
    the chip's HBM (peak memory per device grows linearly with T for both strategies)."""
    mine = [r for r in rows if r["topology"] == topology and r["strategy"] == strategy and r["mode"] == "fwd"]
    ok = sorted((r["seq_len"], r["peak_hbm_bytes"]) for r in mine if r["status"] == "ok")
    failed = sorted((r["seq_len"], r["status"], r["error"]) for r in mine if r["status"] != "ok")
    hbm = tpuattn.chips.get(slices.SLICES[topology]).per_device()["hbm_bytes"]
    (t0, m0), (t1, m1) = ok[-2], ok[-1]
    slope = (m1 - m0) / (t1 - t0)
    return ok[-1][0], failed[0] if failed else None, t1 + (hbm - m1) / slope


for topology in slices.SLICES:
    for strategy in ("allgather", "ring"):
        fits, first_failure, line = longest_fit(topology, strategy)
        print(f"{topology} {strategy:>9}: longest compiled T {fits:,}; the compiled points' line reaches "
              f"HBM at T = {line:,.0f} (extrapolated)")
        if first_failure:
            why = first_failure[2].split("error.")[-1].strip()[:100]
            print(f"{'':>21}first failure at T = {first_failure[0]:,}: {first_failure[1]} ({why})")

# %% [markdown]
# Where a length fails to compile, the loop above prints the compiler's reason under it. The
# all-gather runs the Pallas kernel once per device over its queries against *all* keys. Its
# schedule (notebook 03: which key block each query block visits) could be a table scalar-prefetched
# into SMEM, but such a table grows with (queries / block) x (keys / block), and on long calls it
# outgrows SMEM long before the arrays outgrow HBM. For positions alone the package computes the
# schedule from the block indices instead, so nothing on the chip grows with the length but the
# arrays: the all-gather compiles as far as the ring, and what it pays is memory, every device
# holding all of K and V (the extrapolated lines above).
#
# Doubling the chips at a fixed length: the ring's memory per device should halve (each holds `T / n`
# of everything), the all-gather's should not (every device holds all of K and V). Compiled for a
# 4-chip and an 8-chip v5e slice:

# %%
per_n = {(r["devices"], r["strategy"]): r["peak_hbm_bytes"] for r in rows if r["chip"] == "v5e"
         and r["seq_len"] == SLICE_SEQ_LEN and r["mode"] == "fwd" and r["status"] == "ok"}
for strategy in ("ring", "allgather"):
    four, eight = per_n[4, strategy], per_n[8, strategy]
    print(f"v5e {strategy:>9}, T = {SLICE_SEQ_LEN:,}: {four / 2**20:7.1f} MiB per device on 4 chips, "
          f"{eight / 2**20:7.1f} MiB on 8 chips ({eight / four:.2f}x) (compiled)")

# %% [markdown]
# ## 7 · When does the ring hide its communication? (modelled)
#
# Per step a device sends one K/V block (`2 c Hk D s` bytes for `c = T / n` tokens) over one ICI
# link and computes a block of attention (`4 c² H D` FLOPs). Compute grows with `c²`, the transfer
# with `c`, so above some block length `c*` the compute takes longer and a well-scheduled ring's
# transfers are free (`tpuattn.model.comm`). ICI figures: Google Cloud's per-chip bidirectional
# bandwidth over `2 x` its ports (v5e: 400 GB/s, 4 ports; v5p: 1200 GB/s, 6 ports; cited in
# `tpuattn/chips.py`).
#
# One link per step assumes ring neighbours are physical neighbours. A v5e 2x4 or v5p 2x2x2 slice
# has no wraparound links: they exist only on full axes (16 chips on v5e; on v5p, multiples of a
# 4x4x4 cube) -- "How to Scale Your Model", the TPU chapter,
# https://jax-ml.github.io/scaling-book/tpus/. A ring over such a slice keeps every hop, the closing
# one included, to one link in a snake (boustrophedon) order: along one row, back along the next, so
# the last device sits next to the first. `Mesh(devices, ...)` keeps the order it is given (section
# 6's compiled rows use the topology's device order), and `jax.experimental.mesh_utils.
# create_device_mesh` orders devices from their physical coordinates (for eight v5e chips, a fixed
# ring order: `_V5E_TRAY_RING_ORDER` in JAX's `jax/_src/mesh_utils.py`). On a real slice, check
# that consecutive devices of the ring differ by one in one coordinate of `device.coords`.

# %%
for chip_name in ("v5e", "v5p"):
    hide = comm.hiding_length(chip_name, heads=8)
    print(f"{chip_name}: one link {tpuattn.chips.get(chip_name).ici_link_bandwidth / 1e9:.0f} GB/s one way; "
          f"the ring hides its transfers from c* = {hide:,.0f} tokens per device (MHA, bf16) "
          f"= T of {8 * hide:,.0f} on 8 chips ({comm.LABEL})")
    for c in (1024, 4096, 16384):
        step = comm.ring_step(chip_name, c, heads=8)
        print(f"   c = {c:>6}: transfer {step.transfer_s * 1e6:8.1f} us, "
              f"compute {step.compute_s * 1e6:8.1f} us"
              f" -> {'hidden' if step.hidden else 'ICI-bound'}")
for r in rows:
    if r["strategy"] == "ring" and r["status"] == "ok" and r["seq_len"] == SLICE_SEQ_LEN:
        print(f"compiled {r['topology']} ring T={r['seq_len']} ({r['mode']}): "
              f"{r['overlapped_collectives']} of "
              f"{r['async_collectives']} asynchronous permutes have compute scheduled inside them")

# %% [markdown]
# ## 8 · The same code on a multi-host slice (documented, not run here)
#
# A v5e-8 is one host; bigger slices span several hosts, each driving its local chips. The code
# above does not change: every host runs the same program, calls `jax.distributed.initialize()`
# first (on Cloud TPU it finds the other hosts itself), and builds the mesh over **all** devices of
# all processes. Each host feeds only its addressable shards.
#
# ```python
# import jax
# jax.distributed.initialize()                       # once per process, before anything else
# mesh = jax.make_mesh((jax.device_count(),), ("seq",))  # every chip of every host
# sharding = jax.sharding.NamedSharding(mesh, P(None, "seq", None, None))
# q = jax.make_array_from_process_local_data(sharding, local_q)  # this host's rows of the sequence
# out = jax.jit(lambda q, k, v: parallel.attention(q, k, v, mesh=mesh, seq_axis="seq",
#                                                  layout="zigzag", causal=True))(q, k, v)
# ```
#
# The project tests exactly this on one machine: `tests/test_multiprocess.py` (run by the test
# command) starts two JAX processes on localhost, each with 4 CPU devices, joins them with
# `jax.distributed.initialize(coordinator_address=..., num_processes=2, process_id=...)` and CPU
# collectives (gloo), builds one 8-device mesh over both, feeds each process only its own shards,
# and checks ring and all-gather attention, with and without segment ids, forward and gradients,
# against the float64 oracle.
#
# Keep the sequence axis inside the ICI domain of a slice: across slices (multislice) devices talk
# over the data-centre network, about 190 times slower per chip (v5p: 50 Gbps, 6.25 GB/s, of DCN
# against 1200 GB/s of ICI, per Google Cloud's v5p page).

# %% [markdown]
# ## Takeaways
#
# > **Takeaway.** Batch and heads shard for free; the sequence does not. Context parallelism moves
# > K and V: all-gather holds them all on every device, the ring holds one block and passes it on.
#
# > **Takeaway.** Partial results over disjoint keys merge exactly by their `(m, log l)` — the online
# > softmax again, now across chips. The backward needs the whole row's statistics, so it runs its
# > own rings.
#
# > **Takeaway.** Causal masks make a plain split unfair; zigzag makes every device's work equal,
# > and a window stops the ring early. Whether the ring's transfers are free is a question of block
# > length against ICI bandwidth, of physically adjacent ring neighbours, and of whether the
# > compiler schedules compute inside each send. Its schedule shows that without a TPU: section 7's
# > last lines count, per compiled ring, how many of its asynchronous permutes have compute inside
# > them -- not always all of them.
#
# ## Exercises
#
# Each stub raises `NotImplementedError`; fill it in and re-run its cell. Solutions are at the end.
#
# 1. **Ring length** (★☆☆, 5 min). `ring_steps(seq_len, n, window)`: with the natural layout and a
#    causal left window of `window` tokens, how many ring steps does some device still need?
#    Checked against `parallel.ring_plan(...).steps`.
# 2. **Merge two partial results** (★★☆, 15 min). `merge_two(a, b)` takes two `softmax.Partial`s
#    `(out, m, log_l)` of disjoint key sets (`out [b, T, H, D]` normalised by its own row sum; `m`,
#    `log_l` `[b, H, T]`; `m = -inf`, `log_l = 0` where a part saw nothing) and returns
#    `(out, m, log_l)` for their union. Checked against attention over all keys and against
#    `tpuattn.softmax.merge`, including rows that see nothing in one part.
# 3. **A ring of your own** (★★★, 25 min). `ring_all_gather(x, axis, n)`, called inside
#    `shard_map`, returns the concatenation of every device's block along axis 1 using only
#    `lax.ppermute` (`n - 1` sends) — the ring that carries K/V, without the attention. Checked
#    against `lax.all_gather(..., tiled=True)` on the 8 devices.


# %%
def ring_steps(seq_len, n, window):
    raise NotImplementedError("FILL ME IN")


def merge_two(a, b):
    raise NotImplementedError("FILL ME IN")


def ring_all_gather(x, axis, n):
    raise NotImplementedError("FILL ME IN")


def _parts(q, k, v, split):
    """Partial results of q against keys [0, split) and [split, T), causal (the merge's inputs)."""
    from tpuattn import api
    from tpuattn.spec import block_spec

    full = tpuattn.make_spec(q, k, v, causal=True)[-1]
    ops = api.get_implementation("reference").partial
    return [ops.forward(q, k[:, a:b], v[:, a:b], None,
                        block_spec(full, q_start=0, q_len=q.shape[1], kv_start=a, kv_len=b - a))
            for a, b in ((0, split), (split, k.shape[1]))]


def check_exercises(ring_steps, merge_two, ring_all_gather):
    def check_steps():
        for seq_len, n, window in ((256, 8, 32), (256, 8, 31), (256, 8, 100), (512, 4, 0), (64, 8, 63)):
            spec = tpuattn.spec_from_shapes(seq_len, num_q_heads=1, head_dim=8, causal=True,
                                            window=(window, 0))
            want = parallel.ring_plan(spec, n, "natural").steps
            assert ring_steps(seq_len, n, window) == want, (seq_len, n, window, want)

    def check_merge():
        want = tpuattn.attention(q, k, v, causal=True, impl="reference")
        for split in (SEQ_LEN // 2, SEQ_LEN // 8):  # the second leaves early rows empty in part 2
            parts = _parts(q, k, v, split)
            out, m, log_l = merge_two(*parts)
            np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5, err_msg=f"split {split}")
            # The row statistics too: the logsumexp m + log_l of the union, as the package's merge.
            package = softmax.merge(*parts)
            np.testing.assert_allclose(out, package.out, atol=1e-5, rtol=1e-5, err_msg=f"out, split {split}")
            mine = softmax.to_lse(softmax.Partial(out, m, log_l))
            np.testing.assert_allclose(mine, softmax.to_lse(package), atol=1e-5, rtol=1e-5,
                                       err_msg=f"m + log_l, split {split}")

    def check_ring():
        x = jnp.arange(N_DEVICES * 2 * 3, dtype=jnp.float32).reshape(1, N_DEVICES * 2, 3)
        spec_ = P(None, "seq", None)
        mine = jax.shard_map(lambda b: ring_all_gather(b, "seq", N_DEVICES), mesh=mesh_s, in_specs=spec_,
                             out_specs=P(None, None, None), check_vma=False)(x)
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(x))

    run_checks({"1 ring length": check_steps, "2 merge": check_merge, "3 ring all-gather": check_ring})


check_exercises(ring_steps, merge_two, ring_all_gather)

# %% [markdown]
# ## References
#
# - H. Liu, M. Zaharia, P. Abbeel, *Ring Attention with Blockwise Transformers for Near-Infinite
#   Context* (2023), https://arxiv.org/abs/2310.01889, and its JAX code,
#   https://github.com/haoliuhl/ringattention.
# - W. Brandon et al., *Striped Attention: Faster Ring Attention for Causal Transformers* (2023),
#   https://arxiv.org/abs/2311.09431.
# - Llama Team, *The Llama 3 Herd of Models* (2024), §3.3.2 context parallelism (the two-chunks-per-rank
#   load balancing), https://arxiv.org/abs/2407.21783.
# - MaxText's context parallelism (all-gather of K/V over the context axis),
#   https://github.com/AI-Hypercomputer/maxtext.
# - JAX: *Distributed arrays and automatic parallelization* and *Manual parallelism with shard_map*,
#   https://docs.jax.dev/en/latest/notebooks/shard_map.html; multi-process:
#   https://docs.jax.dev/en/latest/multi_process.html.
# - J. Austin et al., *How to Scale Your Model* (2025), chapters on sharding and collectives,
#   https://jax-ml.github.io/scaling-book/.
# - Google Cloud TPU system architecture: https://cloud.google.com/tpu/docs/v5e,
#   https://cloud.google.com/tpu/docs/v5p (ICI and DCN bandwidths).
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
    def ring_steps_solution(seq_len, n, window):
        chunk = seq_len // n
        # Device d at step s holds chunk d - s, whose last key is (d - s + 1) * chunk - 1; its first
        # query d * chunk reaches back to d * chunk - window: needed while that key is not before it.
        reach = (window + chunk - 1) // chunk  # chunks behind the diagonal a window touches
        return min(n, reach + 1)

    def merge_two_solution(a, b):
        (out_a, m_a, log_a), (out_b, m_b, log_b) = a, b
        m = jnp.maximum(m_a, m_b)
        m0 = jnp.where(m == -jnp.inf, 0.0, m)
        w_a = jnp.where(m_a == -jnp.inf, 0.0, jnp.exp(m_a - m0 + log_a))  # each part's row sum, rescaled
        w_b = jnp.where(m_b == -jnp.inf, 0.0, jnp.exp(m_b - m0 + log_b))
        total = w_a + w_b
        col = lambda w: jnp.swapaxes(w, 1, 2)[..., None]  # [b, H, T] -> [b, T, H, 1]
        out = (col(w_a) * out_a + col(w_b) * out_b) / col(jnp.where(total > 0, total, 1.0))
        return out, jnp.where(total > 0, m, -jnp.inf), jnp.log(jnp.where(total > 0, total, 1.0))

    def ring_all_gather_solution(x, axis, n):
        me = jax.lax.axis_index(axis)
        blocks, held = [x], x
        for _ in range(n - 1):
            held = jax.lax.ppermute(held, axis, [(i, (i + 1) % n) for i in range(n)])
            blocks.append(held)  # at step s we hold the block of device me - s
        # Put block of device j at position j: blocks[s] came from device (me - s) mod n.
        order = [(me - s) % n for s in range(n)]
        stacked = jnp.stack(blocks)[jnp.argsort(jnp.asarray(order))]  # stacked[j]: device j's block
        return jnp.concatenate([stacked[j] for j in range(n)], axis=1)

    check_exercises(ring_steps_solution, merge_two_solution, ring_all_gather_solution)
