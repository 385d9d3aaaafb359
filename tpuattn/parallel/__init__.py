"""Attention across a device mesh: the contract of :func:`tpuattn.attention` on sharded arrays.

::

    tpuattn.parallel.attention(q, k, v, *, mesh, seq_axis=None, head_axis=None, batch_axis=None,
                               strategy="ring", layout="natural", impl="auto", causal=False,
                               scale=None, segment_ids=None, window=None, softcap=None, sinks=None)

* ``batch_axis`` / ``head_axis`` name mesh axes that shard the batch and the heads: no
  communication at all (kv heads split with their query groups, so GQA needs ``num_kv_heads``
  divisible by the head axis' size).
* ``seq_axis`` shards the sequence (context parallelism) by ``strategy`` ``"allgather"`` or
  ``"ring"`` (see :mod:`tpuattn.parallel.ring`).
* ``layout="zigzag"`` says q, k, v (and segment ids) are in zigzag order along the sequence
  (:func:`to_zigzag`, applied once at data loading), which balances causal work over the devices;
  the result comes back in the same order. ``"natural"`` takes and returns natural order.
* ``impl``: the local kernel, any implementation with :class:`~tpuattn.registry.PartialOps`
  (:func:`local_implementations`); ``"auto"`` is :func:`tpuattn.api.choose` among those, ranked by
  their ``partial_rank`` (the Pallas kernel on a TPU, the blockwise XLA loop elsewhere).
* ``sinks``: one logit per query head (:mod:`tpuattn.sinks`), sharded with the heads; the ring starts
  every row's running state from the sink's partial result, the other strategies attend with it
  locally (each device holds whole rows); its gradient is summed over the devices.

Results equal the single-device call on the global arrays up to float error, forward and
gradients, under ``jax.jit``.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tpuattn import api, chips
from tpuattn import sinks as attention_sinks
from tpuattn.errors import TpuattnError
from tpuattn.options import Options
from tpuattn.parallel.ring import allgather_local, ring_local, work_per_step
from tpuattn.parallel.schedule import LAYOUTS, RingPlan, allgather_plan, chunks_per_device, ring_plan
from tpuattn.parallel.zigzag import from_zigzag, to_zigzag, zigzag_order
from tpuattn.sharding import mark_varying, varying_axes
from tpuattn.spec import block_spec, make_spec, normalise_sinks

STRATEGIES = ("ring", "allgather")

__all__ = [
    "LAYOUTS", "STRATEGIES", "RingPlan", "allgather_plan", "attention", "from_zigzag",
    "local_implementations", "ring_plan", "to_zigzag", "work_per_step", "zigzag_order",
]


def local_implementations() -> list[str]:
    """Implementations that can serve as the local kernel (they offer partial results)."""
    return list(api.implementations(api.RETURNS_PARTIALS))


def _axis(mesh: Mesh, name: str, value, used: list) -> int:
    if value is None:
        return 1
    if not isinstance(value, str) or value not in mesh.axis_names:
        raise ValueError(f"{name}: expected None or one of the mesh's axis names {list(mesh.axis_names)}, "
                         f"got {value!r}")
    if value in used:
        raise ValueError(f"{name}: expected a mesh axis not already used by another argument, got {value!r}")
    used.append(value)
    return int(mesh.shape[value])


def _divides(name: str, what: str, size: int, parts: int, axis_name: str, extra: str = "") -> None:
    if size % parts:
        raise ValueError(f"{name}: expected {what} divisible by {parts} (the size of mesh axis "
                         f"{axis_name!r}{extra}), got {size}")


def _local_impl(impl: str, spec, backend: str, options=()):
    """The local kernel's record: by name, or ``"auto"`` by ``partial_rank`` (the contract's machinery;
    ``options`` the kernel would not take are refused there, naming the kernels that take them)."""
    return api.resolve(impl, spec, backend, subset=api.RETURNS_PARTIALS, options=options)


def _local_options(record, options: dict) -> dict:
    """The options the local kernel declares, read through its record type
    (:class:`tpuattn.options.Options`) before anything is traced: a name it does not take, or a value
    it would refuse, is refused here by name; what goes on is the record's own spelling (old
    spellings mapped: ``block_q=`` reaches ``pallas`` as ``blocks=Blocks(block_q=...)``)."""
    declared = record.options
    if isinstance(declared, type) and issubclass(declared, Options):
        return declared.parse(options).kwargs()
    unknown = sorted(set(options) - set(declared))
    if unknown:
        raise TpuattnError(f"{record.name}: unknown option(s) {unknown}; expected a subset of "
                           f"{sorted(declared)}")
    return dict(options)


def attention(q, k, v, *, mesh, seq_axis=None, head_axis=None, batch_axis=None, strategy="ring",
              layout="natural", impl="auto", causal=False, scale=None, segment_ids=None, window=None,
              softcap=None, sinks=None, **options):
    """Attention of the global arrays ``q [B, Tq, H, D]``, ``k, v [B, Tk, Hk, D]`` sharded over
    ``mesh`` (see the module docstring). ``options`` go to the local kernel, only those it declares
    (:func:`tpuattn.options_of`; e.g. ``blocks=Blocks(block_q=256)`` for ``blockwise`` or ``pallas``),
    each checked before anything is traced.

    Requirements (each refused with a message naming the argument): the batch divisible by the
    batch axis' size; ``H`` and ``Hk`` by the head axis' size; ``Tq`` and ``Tk`` by the sequence
    axis' size (twice it for ``layout="zigzag"``, two chunks per device).
    """
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: expected one of {list(STRATEGIES)}, got {strategy!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {list(LAYOUTS)}, got {layout!r}")
    q, k, v, segs, spec = make_spec(q, k, v, causal=causal, scale=scale, segment_ids=segment_ids,
                                    window=window, softcap=softcap)
    sinks = normalise_sinks(sinks, spec.num_q_heads)
    used: list = []
    nb = _axis(mesh, "batch_axis", batch_axis, used)
    nh = _axis(mesh, "head_axis", head_axis, used)
    ns = _axis(mesh, "seq_axis", seq_axis, used)
    if layout == "zigzag" and seq_axis is None:
        raise ValueError("layout: expected 'natural' when seq_axis is None (zigzag orders a sharded "
                         "sequence), got 'zigzag'")
    _divides("q", "a batch", spec.batch, nb, batch_axis)
    _divides("q", "a number of heads", spec.num_q_heads, nh, head_axis)
    _divides("k", "a number of kv heads", spec.num_kv_heads, nh, head_axis,
             ": kv heads are split with their query groups")
    c = chunks_per_device(layout)
    per = f", times {c} chunks per device for layout='zigzag'" if c > 1 else ""
    _divides("q", "a sequence length", spec.q_len, ns * c, seq_axis, per)
    _divides("k", "a sequence length", spec.kv_len, ns * c, seq_axis, per)

    backend = chips.target_backend()
    record = _local_impl(impl, spec, backend, options)
    options = _local_options(record, options)
    # Every local kernel returns partial results, so each takes sinks (tpuattn.sinks) as the contract does.
    attend = record.fn if sinks is None else functools.partial(attention_sinks.attention, record.partial)
    shares = dict(batch=spec.batch // nb, num_q_heads=spec.num_q_heads // nh,
                  num_kv_heads=spec.num_kv_heads // nh)
    if seq_axis is None:
        local_spec = block_spec(spec, q_start=0, q_len=spec.q_len, kv_start=0, kv_len=spec.kv_len, **shares)

        def local(q, k, v, q_seg, kv_seg, *extra):
            segs = None if q_seg is None else (q_seg, kv_seg)
            return attend(q, k, v, segs, local_spec, *extra, **options)
    elif strategy == "ring":
        local = ring_local(spec, ns, layout, seq_axis, record.partial, options, shares)
    else:
        local = allgather_local(spec, ns, layout, seq_axis, attend, options, shares)

    x_spec = P(batch_axis, seq_axis, head_axis, None)
    seg_spec = P(batch_axis, seq_axis)
    q_seg, kv_seg = segs if segs is not None else (None, None)
    seg_specs = (seg_spec, seg_spec) if segs is not None else (None, None)
    if sinks is None:
        mapped = jax.shard_map(local, mesh=mesh, in_specs=(x_spec, x_spec, x_spec, *seg_specs),
                               out_specs=x_spec)
        return mapped(q, k, v, q_seg, kv_seg)

    def local_with_sinks(q, k, v, q_seg, kv_seg, z):
        # Typed varying like q (over the batch and sequence axes too), so that the sinks' gradient,
        # one per device, is summed over the devices by shard_map's transpose.
        return local(q, k, v, q_seg, kv_seg, mark_varying(z, varying_axes(q)))

    mapped = jax.shard_map(local_with_sinks, mesh=mesh,
                           in_specs=(x_spec, x_spec, x_spec, *seg_specs, P(head_axis)), out_specs=x_spec)
    return mapped(q, k, v, q_seg, kv_seg, sinks)
