"""Attention over a device mesh: batch and heads sharded for free, the sequence by all-gather or ring.

Everything runs inside one ``jax.shard_map``; the local work is an implementation's
:class:`~tpuattn.registry.PartialOps` on *blocks* of the whole problem (a chunk of queries against a
chunk of keys, with the whole problem's masks: :func:`tpuattn.spec.block_spec`).

**All-gather** (the approach MaxText uses for TPU context parallelism): every device gathers the
whole K and V over the sequence axis and attends its own query chunks to them. Memory per device:
the whole K/V; one collective, which autodiff turns into a reduce-scatter of dK/dV.

**Ring** (Ring Attention, Liu et al. 2023): K/V (and their segment ids) travel around the ring with
``lax.ppermute`` while each device attends its queries to the block it holds; the partial results
(:class:`tpuattn.softmax.Partial`) are merged by their logsumexp (:func:`tpuattn.softmax.merge`).
The backward runs two rings: the first sums each row's ``delta = rowsum(P * dP)`` over the blocks
(as the single-chip kernels do, for accuracy on nearly one-hot rows), the second accumulates dQ at
home while dK/dV travel with their K/V and arrive home after the last step. Memory per device: one
block of K/V (two, with the one in flight) whatever the sequence length. Each step's permute is
issued before its compute, so the compiler may overlap the transfer with the work.

Blocks a mask hides entirely are skipped (a ``lax.switch`` branch that returns the empty state);
with disjoint segment ids the skip is decided at run time; steps that no device needs are not
run at all, so a sliding window stops the ring early.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tpuattn import sinks as attention_sinks
from tpuattn import softmax
from tpuattn.parallel.schedule import RingPlan, allgather_plan, ring_plan
from tpuattn.parallel.zigzag import from_zigzag
from tpuattn.registry import PartialOps
from tpuattn.sharding import mark_varying, varying_axes
from tpuattn.spec import AttentionSpec


# --------------------------------------------------------------------------- the running state
def _empty_like(q):
    """The partial result of ``q`` attending to no key, typed varying like ``q`` inside the shard_map
    (a loop's carry must keep one type across its iterations)."""
    b, t, h, d = q.shape
    axes = varying_axes(q)
    return softmax.Partial(*(mark_varying(x, axes) for x in softmax.empty(b, t, h, d)))


def _start(q, sinks):
    """A row's state before its first key: empty, or with ``sinks`` the sink's partial result (one more
    part of the softmax, merged first instead of last: the merge does not depend on order)."""
    if sinks is None:
        return _empty_like(q)
    b, t, _, d = q.shape
    axes = varying_axes(q)
    return softmax.Partial(*(mark_varying(x, axes) for x in attention_sinks.sink_partial(sinks, b, t, d)))


# --------------------------------------------------------------------------- the static configuration
@dataclasses.dataclass(frozen=True)
class _Ring:
    plan: RingPlan
    ops: PartialOps
    axis: str
    options: tuple
    has_segments: bool

    @property
    def kwargs(self):
        return dict(self.options)


def _split(x, parts: int, axis: int):
    return [x] if parts == 1 else jnp.split(x, parts, axis=axis)


def _join(xs, axis: int):
    return xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=axis)


def _segments_meet(q_ids, kv_ids):
    """Does any query of any batch row share a segment id with any key of the row? (sorted search,
    ``O((Tq + Tk) log Tq)``, no ``Tq x Tk`` comparison)."""

    def row(qs, ks):
        qs = jnp.sort(qs)
        pos = jnp.clip(jnp.searchsorted(qs, ks), 0, qs.shape[0] - 1)
        return jnp.any(qs[pos] == ks)

    return jnp.any(jax.vmap(row)(q_ids, kv_ids))


def _branch_index(cfg: _Ring, table, s, i, j, q_seg, kv_seg):
    idx = table[s, i, j]
    if cfg.has_segments:
        idx = jnp.where(_segments_meet(q_seg, kv_seg), idx, cfg.plan.skip)
    return idx


def _ppermute(tree, axis: str, n: int, shift: int):
    perm = [(i, (i + shift) % n) for i in range(n)]
    return jax.tree_util.tree_map(lambda x: lax.ppermute(x, axis, perm), tree)


def _segs(q_seg, kv_seg):
    return None if q_seg is None else (q_seg, kv_seg)


def _ring_loop(cfg: _Ring, step, carry, held, after=None):
    """``carry = step(s, carry, held)`` for every ring step ``s``, the held K/V block passed on to the
    next device between steps.

    A loop, not ``plan.steps`` unrolled copies: unrolled, the compiler is free to issue every send
    at the start (it did: the compiled program then held every device's K/V at once, the memory the
    ring exists to avoid); in a loop only the block being used and the one in flight are live. Each
    iteration issues its send before its work, which does not depend on it, so the two can overlap.
    ``after(carry)`` runs at the end of every step but the last (the backward sends its gradient
    accumulators on there). The last step runs after the loop: nothing is sent after it.
    """

    def body(s, state):
        carry, held = state
        upcoming = _ppermute(held, cfg.axis, cfg.plan.n, 1)
        carry = step(s, carry, held)
        return (after(carry) if after else carry), upcoming

    carry, held = lax.fori_loop(0, cfg.plan.steps - 1, body, (carry, held))
    return step(cfg.plan.steps - 1, carry, held)


# --------------------------------------------------------------------------- ring: forward
def _ring_forward(cfg: _Ring, q, k, v, q_seg, kv_seg, sinks):
    plan, ops, c = cfg.plan, cfg.ops, cfg.plan.chunks
    table = jnp.asarray(plan.branch)[lax.axis_index(cfg.axis)]  # [n, c, c] for this device
    qs, q_segs = _split(q, c, 1), (_split(q_seg, c, 1) if cfg.has_segments else [None] * c)
    states = [_start(x, sinks) for x in qs]

    # Each branch merges its block into the running state itself: a conditional's result is the new
    # state, so the old one dies there (merged outside, XLA may fuse the merges of all unrolled
    # steps into one and keep every step's partial result alive at once).
    def compute(spec):
        return lambda state, q, k, v, segs: softmax.merge(state, ops.forward(q, k, v, segs, spec,
                                                                             **cfg.kwargs))

    branches = [compute(spec) for spec in plan.specs] + [lambda state, q, k, v, segs: state]
    def step(s, states, held):
        ks, vs = _split(held[0], c, 1), _split(held[1], c, 1)
        kv_segs = _split(held[2], c, 1) if cfg.has_segments else [None] * c
        states = list(states)
        for i in range(c):
            for j in range(c):
                idx = _branch_index(cfg, table, s, i, j, q_segs[i], kv_segs[j])
                states[i] = lax.switch(idx, branches, states[i], qs[i], ks[j], vs[j],
                                       _segs(q_segs[i], kv_segs[j]))
        return states

    states = _ring_loop(cfg, step, states, (k, v, kv_seg))
    return softmax.Partial(_join([st.out for st in states], 1), _join([st.m for st in states], 2),
                           _join([st.log_l for st in states], 2))


# --------------------------------------------------------------------------- ring: backward
def _ring_backward(cfg: _Ring, residuals, d_out):
    q, k, v, q_seg, kv_seg, sinks, m, log_l = residuals
    plan, ops, c, n = cfg.plan, cfg.ops, cfg.plan.chunks, cfg.plan.n
    table = jnp.asarray(plan.branch)[lax.axis_index(cfg.axis)]
    qs, dos = _split(q, c, 1), _split(d_out, c, 1)
    ms, logs = _split(m, c, 2), _split(log_l, c, 2)
    q_segs = _split(q_seg, c, 1) if cfg.has_segments else [None] * c
    axes = varying_axes(q, k, v)
    zeros = lambda shape: mark_varying(jnp.zeros(shape, jnp.float32), axes)

    def held_chunks(held):
        kv_segs = _split(held[2], c, 1) if cfg.has_segments else [None] * c
        return _split(held[0], c, 1), _split(held[1], c, 1), kv_segs

    # Ring 1: delta = rowsum(P * dP), summed over every block of the row.
    # As in the forward, each branch adds its share into the running sums itself.
    def row_sums(spec):
        return lambda acc, q, k, v, segs, m, log_l, do: acc + ops.row_sums(q, k, v, segs, spec, m, log_l, do,
                                                                          **cfg.kwargs)

    skip_rows = lambda acc, q, k, v, segs, m, log_l, do: acc
    branches = [row_sums(spec) for spec in plan.specs] + [skip_rows]
    def delta_step(s, deltas, held, branches=branches):
        ks, vs, kv_segs = held_chunks(held)
        deltas = list(deltas)
        for i in range(c):
            for j in range(c):
                idx = _branch_index(cfg, table, s, i, j, q_segs[i], kv_segs[j])
                deltas[i] = lax.switch(idx, branches, deltas[i], qs[i], ks[j], vs[j],
                                       _segs(q_segs[i], kv_segs[j]), ms[i], logs[i], dos[i])
        return deltas

    def ring_row_sums():
        deltas = _ring_loop(cfg, delta_step, [zeros(x.shape) for x in ms], (k, v, kv_seg))
        return _join(deltas, 2)

    # Ring 2: dQ stays home; dK/dV travel with their K/V and are sent home after the last step.
    def grads(spec):
        def add(acc, q, k, v, segs, m, log_l, do, delta):
            parts = ops.backward(q, k, v, segs, spec, m, log_l, do, delta, **cfg.kwargs)
            return tuple(a + p for a, p in zip(acc, parts, strict=True))

        return add

    def ring_gradients(delta):
        deltas = _split(delta, c, 2)
        branches = [grads(spec) for spec in plan.specs] + [lambda acc, *_: acc]

        def grad_step(s, carry, held):
            dqs, (dk_acc, dv_acc) = list(carry[0]), carry[1]
            ks, vs, kv_segs = held_chunks(held)
            dks, dvs = _split(dk_acc, c, 1), _split(dv_acc, c, 1)
            for i in range(c):
                for j in range(c):
                    idx = _branch_index(cfg, table, s, i, j, q_segs[i], kv_segs[j])
                    acc = (dqs[i], dks[j], dvs[j])
                    dqs[i], dks[j], dvs[j] = lax.switch(idx, branches, acc, qs[i], ks[j], vs[j],
                                                        _segs(q_segs[i], kv_segs[j]), ms[i], logs[i], dos[i],
                                                        deltas[i])
            return dqs, (_join(dks, 1), _join(dvs, 1))

        # The accumulators follow their K/V to the next device after every step but the last; after it
        # they are ``steps - 1`` devices downstream, and go straight home.
        send_on = lambda carry: (carry[0], _ppermute(carry[1], cfg.axis, n, 1))
        dqs, (dk_acc, dv_acc) = _ring_loop(cfg, grad_step, ([zeros(x.shape) for x in qs],
                                                             (zeros(k.shape), zeros(v.shape))),
                                           (k, v, kv_seg), after=send_on)
        if (plan.steps - 1) % n:
            dk_acc, dv_acc = _ppermute((dk_acc, dv_acc), cfg.axis, n, -(plan.steps - 1))
        return _join(dqs, 1), dk_acc, dv_acc

    # The backward every partial-result attention shares (tpuattn.sinks): delta summed over the ring,
    # then the gradients summed over it, and the sinks' gradient apart (-sum p_sink * delta over this
    # device's rows; shard_map's transpose sums it over the devices the sinks were marked varying across).
    dq, dk, dv, d_sinks = attention_sinks.partial_backward(sinks, m, log_l, ring_row_sums, ring_gradients)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_sinks


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg, q, k, v, q_seg, kv_seg, sinks):
    return _ring_forward(cfg, q, k, v, q_seg, kv_seg, sinks)[0].astype(q.dtype)


def _ring_fwd(cfg, q, k, v, q_seg, kv_seg, sinks):
    out, m, log_l = _ring_forward(cfg, q, k, v, q_seg, kv_seg, sinks)
    # Residuals: the local shards and two floats per query row; no output, no scores.
    return out.astype(q.dtype), (q, k, v, q_seg, kv_seg, sinks, m, log_l)


def _ring_bwd(cfg, residuals, d_out):
    dq, dk, dv, d_sinks = _ring_backward(cfg, residuals, d_out)
    return dq, dk, dv, None, None, d_sinks


_ring.defvjp(_ring_fwd, _ring_bwd)


# --------------------------------------------------------------------------- the local programs
def ring_local(spec: AttentionSpec, n: int, layout: str, axis: str, ops: PartialOps, options: dict,
               shares: dict):
    """The per-device function of the ring strategy (``q, k, v, q_seg, kv_seg, sinks=None -> out``;
    ``sinks``, if given, typed varying like ``q``)."""
    cfg = _Ring(plan=ring_plan(spec, n, layout, **shares), ops=ops, axis=axis,
                options=tuple(sorted(options.items())), has_segments=spec.has_segments)
    return lambda q, k, v, q_seg, kv_seg, sinks=None: _ring(cfg, q, k, v, q_seg, kv_seg, sinks)


def allgather_local(spec: AttentionSpec, n: int, layout: str, axis: str, fn, options: dict, shares: dict):
    """The per-device function of the all-gather strategy: gather K/V (natural order), then attend
    each local query chunk with its block spec (one ``lax.switch`` branch per distinct spec).
    ``local(q, k, v, q_seg, kv_seg, *extra)`` calls ``fn(q, k, v, segs, spec, *extra, **options)``
    (``extra``: the sinks, when given)."""
    specs, table = allgather_plan(spec, n, layout, **shares)
    c = table.shape[1]

    def local(q, k, v, q_seg, kv_seg, *extra):
        gather = lambda x: lax.all_gather(x, axis, axis=1, tiled=True)
        k_all, v_all = gather(k), gather(v)
        kv_all = gather(kv_seg) if kv_seg is not None else None
        if layout == "zigzag":
            k_all, v_all = from_zigzag(k_all, n), from_zigzag(v_all, n)
            kv_all = from_zigzag(kv_all, n) if kv_all is not None else None
        row = jnp.asarray(table)[lax.axis_index(axis)]
        qs = _split(q, c, 1)
        q_segs = _split(q_seg, c, 1) if q_seg is not None else [None] * c
        branches = [functools.partial(lambda q, segs, spec: fn(q, k_all, v_all, segs, spec, *extra,
                                                                          **options),
                                      spec=spec) for spec in specs]
        outs = [lax.switch(row[i], branches, qs[i], _segs(q_segs[i], kv_all)) for i in range(c)]
        return _join(outs, 1)

    return local


def work_per_step(spec: AttentionSpec, n: int, layout: str) -> np.ndarray:
    """``[n, steps]`` visible scores each device computes at each ring step (from the schedule)."""
    return ring_plan(spec, n, layout).work
