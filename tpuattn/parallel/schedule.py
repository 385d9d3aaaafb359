"""Which chunk of keys each device holds at each ring step, and what it must compute there.

A sequence sharded over ``n`` devices is cut into chunks of equal length:

* ``layout="natural"``: ``n`` chunks, device ``d`` holds chunk ``d``;
* ``layout="zigzag"``: ``2n`` chunks, device ``d`` holds chunks ``d`` and ``2n - 1 - d`` (in that order,
  as one contiguous shard of the permuted sequence: :func:`tpuattn.parallel.to_zigzag`). Under a
  causal mask every device then does the same work at every step, where the natural split gives
  the last device ``n`` times the first's.

At ring step ``s`` device ``d`` holds the keys and values of device ``(d - s) mod n``. Each pair (its
query chunk, a held key chunk) is a *block* of the whole problem with a static spec
(:func:`tpuattn.spec.block_spec`): the mask classifies it EMPTY (skipped: neither computed nor, past
the last useful step, sent), FULL (no mask arithmetic) or PARTIAL. The program is the same on every
device, so it holds a table ``branch[d, s, i, j]`` of which static spec each device uses, indexed
with the device's own index at run time (``lax.switch``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tpuattn.spec import EMPTY, FULL, AttentionSpec, block_spec

LAYOUTS = ("natural", "zigzag")


def chunks_per_device(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


def device_chunks(n: int, layout: str) -> np.ndarray:
    """``[n, c]``: the chunk ids device ``d`` holds, in order."""
    if layout == "zigzag":
        return np.stack([np.arange(n), 2 * n - 1 - np.arange(n)], axis=1)
    return np.arange(n)[:, None]


@dataclasses.dataclass(frozen=True)
class RingPlan:
    """The static schedule of a sequence-sharded problem (see the module docstring).

    Attributes:
      n: devices on the sequence axis; ``chunks``: chunks per device (1 or 2).
      q_chunk, kv_chunk: chunk lengths.
      specs: the distinct non-empty block specs (``lax.switch`` branches 0..len-1); the branch index
        ``len(specs)`` means "skip".
      branch: int32 ``[n, n, chunks, chunks]`` (device, step, query chunk, key chunk) -> branch.
      steps: ring steps that do any work on some device (the ring stops after them).
      work: int64 ``[n, steps]``: visible scores each device computes at each step (its load).
      kv_origin: int ``[n, steps]``: whose keys device ``d`` holds at step ``s``.
    """

    n: int
    chunks: int
    q_chunk: int
    kv_chunk: int
    specs: tuple[AttentionSpec, ...]
    branch: np.ndarray
    steps: int
    work: np.ndarray
    kv_origin: np.ndarray

    @property
    def skip(self) -> int:
        return len(self.specs)

    # Hashable and comparable by value (it is a static argument of the ring's custom VJP); the numpy
    # tables compare by content. ``work`` and ``kv_origin`` follow from the rest.
    def _key(self):
        return (self.n, self.chunks, self.q_chunk, self.kv_chunk, self.specs, self.steps,
                self.branch.tobytes())

    def __hash__(self):
        return hash(self._key())

    def __eq__(self, other):
        return isinstance(other, RingPlan) and self._key() == other._key()


def _visible_count(spec: AttentionSpec) -> int:
    lo, hi = spec.mask.row_bounds()
    return int(np.sum(hi - lo))


def ring_plan(spec: AttentionSpec, n: int, layout: str = "natural", *, batch: int | None = None,
              num_q_heads: int | None = None, num_kv_heads: int | None = None) -> RingPlan:
    """The schedule of ``spec`` (the whole problem) sharded over ``n`` devices (lengths must divide;
    :func:`tpuattn.parallel.attention` checks). ``batch`` and the head counts: one device's share."""
    c = chunks_per_device(layout)
    q_chunk, kv_chunk = spec.q_len // (n * c), spec.kv_len // (n * c)
    held = device_chunks(n, layout)
    specs: list[AttentionSpec] = []
    index: dict[AttentionSpec, int] = {}
    branch = np.zeros((n, n, c, c), np.int32)
    work = np.zeros((n, n), np.int64)
    origin = np.zeros((n, n), np.int64)
    for d in range(n):
        for s in range(n):
            src = (d - s) % n
            origin[d, s] = src
            for i, qc in enumerate(held[d]):
                for j, kc in enumerate(held[src]):
                    block = block_spec(spec, q_start=int(qc) * q_chunk, q_len=q_chunk,
                                       kv_start=int(kc) * kv_chunk, kv_len=kv_chunk, batch=batch,
                                       num_q_heads=num_q_heads, num_kv_heads=num_kv_heads)
                    code = int(block.mask.block_map(q_chunk, kv_chunk)[0, 0])
                    if code == EMPTY:
                        branch[d, s, i, j] = -1
                        continue
                    if code == FULL:
                        # Every key visible to every row: the same computation wherever the block sits.
                        block = block_spec(dataclasses.replace(spec, mask=dataclasses.replace(
                            spec.mask, causal=False, window=None)), q_start=0, q_len=q_chunk, kv_start=0,
                            kv_len=kv_chunk, batch=batch, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads)
                    if block not in index:
                        index[block] = len(specs)
                        specs.append(block)
                    branch[d, s, i, j] = index[block]
                    work[d, s] += _visible_count(block)
    branch[branch < 0] = len(specs)
    useful = np.nonzero((branch != len(specs)).any(axis=(0, 2, 3)))[0]
    steps = int(useful.max()) + 1 if useful.size else 1
    return RingPlan(n=n, chunks=c, q_chunk=q_chunk, kv_chunk=kv_chunk, specs=tuple(specs), branch=branch,
                    steps=steps, work=work[:, :steps], kv_origin=origin[:, :steps])


def allgather_plan(spec: AttentionSpec, n: int, layout: str = "natural", **shares) -> tuple[
        tuple[AttentionSpec, ...], np.ndarray]:
    """For the all-gather strategy: the block spec of each device's query chunks against the whole
    (gathered, natural-order) keys: ``(specs, index [n, chunks])`` (distinct specs, deduplicated)."""
    c = chunks_per_device(layout)
    q_chunk = spec.q_len // (n * c)
    held = device_chunks(n, layout)
    specs: list[AttentionSpec] = []
    table = np.zeros((n, c), np.int32)
    for d in range(n):
        for i, qc in enumerate(held[d]):
            block = block_spec(spec, q_start=int(qc) * q_chunk, q_len=q_chunk, kv_start=0,
                               kv_len=spec.kv_len, **shares)
            if block not in specs:
                specs.append(block)
            table[d, i] = specs.index(block)
    return tuple(specs), table
