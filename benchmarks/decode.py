"""Benchmark: one decode step over a KV cache on this machine, implementations side by side as ratios.

Not a test. In one run it prints, for a batch of 8 sequences, 8 query heads on 2 kv heads (group 4),
head_dim 128, float32, one new query per sequence, cache capacities 1024..16384, full and ragged
lengths (ragged: uniform in [1, capacity], fixed seed):

* measured wall time (median of repeats, compile excluded) on this machine's backend of
  ``reference`` (gather pages + materialised float32 softmax, paged cache) and of a straightforward
  ``jax.numpy`` decode over a contiguous cache (mask + softmax over every slot), both compiled by XLA,
  and their ratio;
* the Pallas kernel's blocks fetched/computed/skipped (``tpuattn.decode.schedule``: the kernel's own
  index maps), and the modelled time of the same step on TPU v5e and v6e (``tpuattn.model.decode_roofline``);
* separately, at the smallest capacity only, the Pallas kernel in **interpret mode** off a TPU: a
  simulation of the kernel on the CPU, *not kernel speed*, never compared with the rows above.

    python benchmarks/decode.py            # ~1-2 minutes on 2 CPU cores
    python benchmarks/decode.py --quick    # capacities 1024 and 2048 only
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from tpuattn import decode
from tpuattn.decode import plain_decode
from tpuattn.measure.timing import time_jitted
from tpuattn.model import decode_roofline as roofline

BATCH, HEADS, KV_HEADS, HEAD_DIM, PAGE = 8, 8, 2, 128, 64


def median_time(fn, *args, repeats=7):
    return time_jitted(fn, *args, repeats=repeats).median_s  # compile excluded


def inputs(capacity, ragged, rng):
    pps = capacity // PAGE
    lengths = (rng.integers(1, capacity + 1, BATCH) if ragged else np.full(BATCH, capacity)).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((BATCH, 1, HEADS, HEAD_DIM)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((BATCH, capacity, KV_HEADS, HEAD_DIM)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((BATCH, capacity, KV_HEADS, HEAD_DIM)), jnp.float32)
    order = rng.permutation(BATCH * pps).astype(np.int32)  # pages in a random order
    table = order.reshape(BATCH, pps)
    inverse = np.argsort(order)  # page id -> (sequence, page) it holds
    k_pages = k.reshape(BATCH * pps, PAGE, KV_HEADS, HEAD_DIM)[inverse]
    v_pages = v.reshape(BATCH * pps, PAGE, KV_HEADS, HEAD_DIM)[inverse]
    return q, k, v, k_pages, v_pages, jnp.asarray(lengths), jnp.asarray(table)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    capacities = (1024, 2048) if args.quick else (1024, 4096, 16384)
    backend = jax.default_backend()
    rng = np.random.default_rng(0)
    reference = jax.jit(lambda q, k, v, lengths, table: decode.attention(
        q, k, v, lengths, page_table=table, impl="reference"))
    plain = jax.jit(plain_decode)
    print(f"decode step: batch {BATCH}, heads {HEADS}/{KV_HEADS} (group {HEADS // KV_HEADS}), head_dim "
          f"{HEAD_DIM}, float32, q_len 1, pages of {PAGE}; JAX {jax.__version__}")
    print(f"measured on {backend} (median wall time, compile excluded) | pallas kernel schedule (its own "
          "index maps) | modelled TPU time (roofline, bf16-peak chip facts)")
    header = (f"{'capacity':>8} {'lengths':>7} {'reference ms':>13} {'jnp ms':>8} {'ref/jnp':>8} "
              f"{'blocks computed/skipped':>24} {'v5e us':>8} {'v6e us':>8}")
    print(header)
    print("-" * len(header))
    small = None
    for capacity in capacities:
        for ragged in (False, True):
            q, k, v, kp, vp, lengths, table = inputs(capacity, ragged, rng)
            ref_ = np.asarray(reference(q, kp, vp, lengths, table))
            np.testing.assert_allclose(np.asarray(plain(q, k, v, lengths)), ref_, atol=1e-4, rtol=1e-4)
            t_ref = median_time(reference, q, kp, vp, lengths, table)
            t_jnp = median_time(plain, q, k, v, lengths)
            sched = decode.schedule(np.asarray(lengths), PAGE, capacity=capacity, num_kv_heads=KV_HEADS)
            model = {chip: roofline.decode_roofline(np.asarray(lengths), heads=HEADS, kv_heads=KV_HEADS,
                                                    head_dim=HEAD_DIM, dtype="float32", chip=chip).time_s
                     for chip in ("v5e", "v6e")}
            kind = "ragged" if ragged else "full"
            print(f"{capacity:>8} {kind:>7} {t_ref * 1e3:>13.2f} {t_jnp * 1e3:>8.2f} {t_ref / t_jnp:>8.2f} "
                  f"{sched['computed']:>11}/{sched['skipped']:<12} {model['v5e'] * 1e6:>8.1f} "
                  f"{model['v6e'] * 1e6:>8.1f}")
            if small is None and ragged:
                small = (capacity, q, kp, vp, lengths, table, t_ref)
    print("labels: 'reference ms', 'jnp ms', 'ref/jnp': measured on", backend,
          "| 'blocks': counted from the kernel's index maps | 'v5e us', 'v6e us': modelled, not measured")

    capacity, q, kp, vp, lengths, table, t_ref = small
    pallas = jax.jit(lambda q, k, v, lengths, table: decode.attention(
        q, k, v, lengths, page_table=table, impl="pallas"))
    if backend != "tpu":
        np.testing.assert_allclose(np.asarray(pallas(q, kp, vp, lengths, table)),
                                   np.asarray(reference(q, kp, vp, lengths, table)), atol=1e-4, rtol=1e-4)
        t_interp = median_time(pallas, q, kp, vp, lengths, table, repeats=3)
        print(f"\npallas in INTERPRET MODE on {backend} (a simulation: interpret mode, not kernel speed), "
              f"capacity {capacity}, ragged: {t_interp * 1e3:.0f} ms measured; "
              "not comparable to the rows above")
    else:
        t_pallas = median_time(pallas, q, kp, vp, lengths, table)
        print(f"\npallas compiled on tpu, capacity {capacity}, ragged: {t_pallas * 1e3:.3f} ms measured "
              f"(reference {t_ref * 1e3:.3f} ms)")


if __name__ == "__main__":
    main()
