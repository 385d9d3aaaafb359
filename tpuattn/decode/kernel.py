"""``impl="pallas"``: a split-K (flash-decoding) Pallas TPU kernel over a contiguous or paged KV cache.

The cache of each sequence is cut into *blocks* (a page of a paged cache, ``block_size`` rows of a
contiguous one); a grid step reads ``pages_per_step`` blocks (1 for a contiguous cache) and a *chunk*
is ``chunk_steps`` steps (``chunk_blocks`` blocks rounded up to whole steps). Grid
``(batch, kv_head_group, chunk, step_in_chunk)``: the first three axes are independent (``parallel``,
so Mosaic may spread them over TensorCores: this is the split over the cache that keeps a chip busy
when ``batch x kv_heads`` is small); the last runs an online softmax over the chunk's blocks in VMEM
scratch (``arbitrary``). Each chunk writes a partial output and its row statistics ``(m, log l)``
(two lanes); :func:`partials` hands each chunk on as a :class:`tpuattn.softmax.Partial`, and
:func:`tpuattn.softmax.merge` combines them afterwards. A cache of one chunk (``chunk_blocks`` covers
it: at most 2048 positions by default) is finished in the kernel instead (:func:`finished`): the
sinks start each row's running max and sum, ``v_scale`` multiplies the result, and the output is
written once in q's dtype, so no float32 partial, no statistics and no merge move through HBM.

``lengths`` (and the flattened ``page_table``) are scalar-prefetched into SMEM
(``pltpu.PrefetchScalarGridSpec``), so the index maps and the kernel know each sequence's useful blocks
(:func:`block_range`: those holding a position some query can see). A block outside that range is

* not fetched: the K/V index maps clamp the block number into the range (:func:`kv_block`), so the
  step asks for the block the pipeline already holds (or is about to use) and no new DMA is issued;
* not computed: the body runs under ``pl.when(useful)``.

All query heads of a GQA group (``group x q_len`` rows) form one block against their kv head's K/V.
The kernel reads the cache in place, in the contract's own layout ``[..., rows, kv_heads, head_dim]``:
a K (or V) block is ``[block, heads_per_block, head_dim]`` of one page (or ``block`` rows of a contiguous
cache), all the kv heads or 8 of them (a sublane tile; :func:`kv_heads_per_block`), and the kernel
loops over the block's heads (``k_ref[:, h, :]``, a strided load in VMEM). The cache is not reshaped
outside the kernel: on a TPU an array's last two dimensions are stored in ``(8, 128)`` tiles, so
``[..., rows, kv_heads, head_dim] -> [..., rows, kv_heads * head_dim]`` is *not* a free reshape there
but a copy of the whole cache (an earlier version did this, and the compiled program read about 4.6x
the modelled bytes at notebook 07's serving shape; ``tests/test_aot_decode.py`` now checks the
optimised HLO holds no cache-sized op outside the kernel). One kv head is the exception: ``[..., rows,
1, head_dim]`` is viewed as ``[..., rows, head_dim]``, the same bytes in the TPU's default layout of a
unit axis, where Mosaic would otherwise have the cache copied to tiles of one row.

:func:`schedule` walks the same grid with the same :func:`kv_block` and :func:`block_range`, so the
fetched/skipped counts it reports are the kernel's own.

A paged cache is read ``pages_per_step`` pages per grid step, each page through its own K and V
BlockSpec (a page is not contiguous with the next), so small pages do not each pay the per-step
pipeline overhead (what JAX's ``paged_attention`` does with ``pages_per_compute_block`` and manual
DMAs). Not measured on a TPU yet (compiled only).

A ragged batch (``cu_q_lens``: prefill chunks beside single-token decodes) runs on a token-major
grid of its own (:func:`ragged_decode`), as engines' ragged kernels do. The flattened tokens are cut
into *token blocks* of ``T`` (the ``q_block`` option, default :data:`DEFAULT_TOKEN_BLOCK` = 256), and
:func:`visits` lists, outside the kernel, each block's sequences as *visits* ``(token block,
sequence)``, sorted by token block: at most ``ceil(total_tokens / T) + batch - 1`` of them (a static
bound; the ones past the last are empty), scalar-prefetched. Grid ``(kv_head_group, visit, kv_step)``:
a visit's q and output blocks are its token block's ``[T, heads of the group, d]`` in q's own layout
(no copy), so consecutive visits of a block keep its output and the float32 running max, sum and
accumulator in VMEM; they are initialised at the block's first visit (the running max with the sink
logit and the running sum with 1 when there are sinks), each visit adds only its sequence's rows (the
others are masked to ``-inf`` and stay unchanged), and the block is finalised at its last visit
(``v_scale`` applied) and written once in q's dtype: no float32 partials leave the kernel and nothing
is merged outside. A visit's K/V index maps clamp into its sequence's useful cache blocks (those its
queries in this block can see), so a step past them, and every step of an empty visit, asks for the
block already held and issues no DMA. The cost estimate is a static upper bound: every visit reading
its sequence's whole capacity once per kv head, q and the output once.

``T`` trades MXU work against cache re-reads: every visit computes all ``group x T`` rows of its block
against its sequence's blocks (a decode's visit: 1 useful token of 256), while a chunk of ``n``
tokens reads its cache about ``ceil(n / T)`` times and the visit bound counts ``ceil(total / T)``
blocks. At ``tpuattn.measure.aot``'s mixed batch (4 chunks of 256 beside 60 decodes, 16 pages of 64
rows, 32 query heads on 8 kv heads of 128) ``T = 256`` gives 68 visits for 64 sequences, and the
compiled program (v5e and v6e, every cache, compiled, not run) accesses 1.06x the decode model's
bytes (``book/decode-engine.md``), and its peak HBM is the arguments and the output plus 0.35 MB
(v5e) or 0.39 MB (v6e) of XLA temporaries around the visit table, that much above JAX's ragged
kernel's. Its FLOPs are the visits' full blocks, about 4x what the bfloat16 cache's bytes take at
v5e's peaks (modelled: 68 visits x 8 kv heads x 1024 rows x 1024 keys x 128 x 4 FLOPs,
0.29 TFLOP or 1.5 ms at 197 TFLOP/s, against 0.29 GB or 0.35 ms at 820 GB/s), so at that shape the
step is bound by the decodes' padded rows, not by HBM. A smaller ``T`` computes less and re-reads more
(``T = 128``: 72 visits, modelled 1.12x the model's bytes).

A quantized cache (int8, float8_e4m3fn) is read as stored, a byte per entry; each block is widened
to q's dtype in VMEM (exact), the logits are multiplied by the kv head's scalar-prefetched
``k_scale`` and the output by ``v_scale``. A one-byte block holds 32 kv heads or all of them
(:func:`kv_heads_per_block`). Compiled for v5e and v6e (not run) at notebook 07's serving shape (one
chunk) an int8 or fp8 cache is 17.8 MB accessed, 1.05x the decode model, against bfloat16's 34.6 MB,
1.03x (``tpuattn.measure.aot``'s decode engine rows; 19.8 and 36.6 MB while the one chunk's partial
was written out and merged).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpuattn import chips, softmax
from tpuattn._checks import positive_int
from tpuattn.decode.registry import register
from tpuattn.decode.spec import DecodeSpec, padded_rows
from tpuattn.numerics import apply_softcap, first_order_only, matmul_precision
from tpuattn.options import DecodeKernelOptions, scoped_vmem_limit
from tpuattn.options import resolve_interpret as _resolve_interpret
from tpuattn.pallas.layout import LANES, NT_DIMS
from tpuattn.sinks import sink_partial
from tpuattn.supports import low_precision_matmul_refused

# The kernel's options, one typed record (block_size=, chunk_blocks=, pages_per_step=, q_block=, interpret=;
# tpuattn.decode.options_of("pallas") lists them).
OPTIONS = DecodeKernelOptions
DEFAULT_BLOCK_SIZE = 512  # rows of a contiguous cache per block
DEFAULT_CHUNK_POSITIONS = 2048  # cache positions per chunk (split-K unit)
FORWARD_ONLY = ("tpuattn.decode.attention(impl='pallas') is forward only (decode is inference): the kernel "
                "defines no derivative. Use impl='reference' to differentiate.")


# ---------------------------------------------------------------------------- the schedule, shared
def _traced(*xs) -> bool:
    return any(isinstance(x, jax.Array) for x in xs)


def _max(a, b):
    return jnp.maximum(a, b) if _traced(a, b) else np.maximum(a, b)


def _min(a, b):
    return jnp.minimum(a, b) if _traced(a, b) else np.minimum(a, b)


def _div(a, b: int):
    """``a // b`` for ``a >= 0``: ``lax.div`` on traced values (Mosaic lowers ``floor_divide`` through
    ``sign``, which needs a local TPU), ``//`` on NumPy ones."""
    return jax.lax.div(a, jnp.asarray(b, a.dtype)) if _traced(a) else a // b


def block_range(length, q_len: int, left: int | None, block: int):
    """First and last block holding a position some query of a sequence of ``length`` can see.

    The last is ``ceil(length / block) - 1`` (-1 for an empty sequence: no block is useful); the first
    is 0, or with a window the block of the earliest visible key, ``length - q_len - left``. Works on
    Python/NumPy integers and on traced int32 scalars alike (the kernel, its index maps and
    :func:`schedule` all call it).
    """
    last = _div(length + (block - 1), block) - 1
    first = length * 0 if left is None else _div(_max(length - (q_len + left), 0), block)
    return first, last


def kv_block(p, length, q_len: int, left: int | None, block: int):
    """The block the K/V index maps ask for at step ``p`` (a block number within the sequence): ``p``
    clamped into the useful range, so skipped steps repeat a block already fetched (no new DMA)."""
    first, last = block_range(length, q_len, left, block)
    return _min(_max(p, first), _max(last, first))


def is_useful(p, length, q_len: int, left: int | None, block: int):
    first, last = block_range(length, q_len, left, block)
    return (p >= first) & (p <= last)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The static shape of one kernel call."""

    block: int  # cache rows per block (page_size when paged)
    num_blocks: int  # blocks per sequence
    per_step: int  # blocks per grid step (pages, each its own BlockSpec; 1 for a contiguous cache)
    chunk_steps: int  # grid steps per split-K chunk
    heads_per_block: int  # kv heads in one K/V block (8 when kv_heads is a multiple of 8, else all)
    rows: int  # group x q_len, padded to a sublane tile

    @property
    def num_chunks(self) -> int:
        return -(-self.num_blocks // (self.per_step * self.chunk_steps))

    def step_blocks(self):
        """Block numbers ``[num_chunks * chunk_steps, per_step]`` of one (sequence, head group), in grid
        order: step ``s``'s ``j``-th K/V BlockSpec holds block ``s * per_step + j`` (before clamping)."""
        steps = self.num_chunks * self.chunk_steps
        return np.arange(steps)[:, None] * self.per_step + np.arange(self.per_step)[None, :]


def _plan(block: int, num_blocks: int, chunk_blocks, per_step) -> tuple[int, int]:
    """``(per_step, chunk_steps)``: the defaults (pages per step: 128 rows' worth; chunk: 2048 positions).
    ``chunk_blocks`` and ``per_step`` are read through :class:`~tpuattn.options.DecodeKernelOptions`
    (None or a positive int)."""
    sizes = DecodeKernelOptions(chunk_blocks=chunk_blocks, pages_per_step=per_step)
    per_step = max(1, min(num_blocks, 128 // block)) if sizes.pages_per_step is None else sizes.pages_per_step
    per_step = min(per_step, num_blocks)
    chunk_blocks = (max(1, DEFAULT_CHUNK_POSITIONS // block) if sizes.chunk_blocks is None
                    else sizes.chunk_blocks)
    chunk_steps = min(-(-chunk_blocks // per_step), -(-num_blocks // per_step))
    return per_step, chunk_steps


SUBLANES = 8  # a K/V block's kv heads lie on sublanes: all of them, or a multiple of 8


def kv_heads_per_block(num_kv_heads: int, itemsize: int = 2) -> int:
    """kv heads in one K/V block: 8 (one sublane tile) when ``num_kv_heads`` is a multiple of 8, so a
    block stays small in VMEM and the head groups are a parallel grid axis; otherwise all of them (a
    block's last two dimensions must be multiples of ``(8, 128)`` or the array's whole dimensions).
    A one-byte (quantized) cache packs 32 rows per tile: 32 heads, or all of them."""
    tile = 32 if itemsize == 1 else SUBLANES
    return tile if num_kv_heads % tile == 0 else num_kv_heads


def geometry(spec: DecodeSpec, block_size=None, chunk_blocks=None, pages_per_step=None) -> Geometry:
    """The kernel's static shape for ``spec`` and its options (each None or a positive int, read through
    :class:`~tpuattn.options.DecodeKernelOptions`; None: the defaults). What needs the spec is checked
    here: a paged cache's block is its page (``block_size`` refused), a contiguous cache has no pages
    (``pages_per_step`` refused)."""
    sizes = DecodeKernelOptions(block_size=block_size, chunk_blocks=chunk_blocks,
                                pages_per_step=pages_per_step)
    block_size, chunk_blocks, pages_per_step = sizes.block_size, sizes.chunk_blocks, sizes.pages_per_step
    if spec.paged:
        if block_size is not None:
            raise ValueError("block_size: a paged cache's block is its page; expected None, "
                             f"got {block_size!r}")
        block, num_blocks = spec.page_size, spec.pages_per_sequence
    else:
        if pages_per_step is not None:
            raise ValueError("pages_per_step: a contiguous cache has no pages (set block_size); expected "
                             f"None, got {pages_per_step!r}")
        block = min(spec.capacity, DEFAULT_BLOCK_SIZE) if block_size is None else block_size
        block = min(block, spec.capacity)
        num_blocks = -(-spec.capacity // block)
        pages_per_step = 1
    per_step, chunk_steps = _plan(block, num_blocks, chunk_blocks, pages_per_step)
    heads = kv_heads_per_block(spec.num_kv_heads, spec.kv_dtype.itemsize)
    return Geometry(block, num_blocks, per_step, chunk_steps, heads,
                    padded_rows(spec.group_size * spec.q_len, spec.dtype))


def schedule(lengths, block_size: int, *, q_len: int = 1, window=None, capacity: int | None = None,
             chunk_blocks: int | None = None, pages_per_step: int | None = None, paged: bool = True,
             num_kv_heads: int = 1, heads_per_block: int | None = None) -> dict:
    """What the kernel fetches and computes for ``lengths`` (one entry per sequence), counted on its grid.

    ``block_size``: the page size (``paged``) or the block of a contiguous cache; ``capacity``: the
    positions a sequence can hold (default: the largest length rounded up to a block); ``window`` as in
    :func:`tpuattn.decode.attention`; ``chunk_blocks``, ``pages_per_step`` as the kernel's options (same
    defaults); ``heads_per_block``: kv heads in one K/V block (default: the kernel's,
    :func:`kv_heads_per_block` of ``num_kv_heads``), each head group its own blocks. Walks the grid
    ``(batch, kv_head_group, chunk, step)`` in the kernel's order with the kernel's own
    :meth:`Geometry.step_blocks`, :func:`kv_block` and :func:`is_useful`. Each of a step's ``per_step``
    K (and V) BlockSpecs fetches when the block its index map asks for differs from the one it asked for
    at the previous step (the Pallas pipeline's rule). Returns, per K/V operand: ``steps`` (grid steps),
    ``blocks`` (block slots: steps x per_step), ``computed``, ``skipped`` (``blocks - computed``),
    ``fetched``, ``not_fetched`` (``blocks - fetched``), and the geometry.
    """
    lengths = np.asarray(lengths, np.int64).reshape(-1)
    block = positive_int("block_size", block_size)
    capacity = int(-(-max(int(lengths.max(initial=0)), 1) // block) * block) if capacity is None else capacity
    num_blocks = -(-capacity // block)
    if not paged:
        pages_per_step = 1
    per_step, chunk_steps = _plan(block, num_blocks, chunk_blocks, pages_per_step)
    hb = kv_heads_per_block(num_kv_heads) if heads_per_block is None else positive_int(
        "heads_per_block", heads_per_block)
    if num_kv_heads % hb:
        raise ValueError(f"heads_per_block: expected a divisor of num_kv_heads ({num_kv_heads}), got {hb}")
    geo = Geometry(block, num_blocks, per_step, chunk_steps, hb, 0)
    from tpuattn.spec import normalise_window

    window = normalise_window(window, q_len, capacity)
    left = None if window is None else window[0]
    groups = num_kv_heads // hb
    p = geo.step_blocks()
    computed = fetched = 0
    previous = [None] * per_step
    for b, length in enumerate(lengths):
        asked = kv_block(p, int(length), q_len, left, block)
        useful = is_useful(p, int(length), q_len, left, block)
        for g in range(groups):
            for j in range(per_step):
                ids = [(b, int(x), g) for x in asked[:, j]]
                fetched += sum(1 for k, x in enumerate(ids) if x != (ids[k - 1] if k else previous[j]))
                previous[j] = ids[-1]
            computed += int(useful.sum())
    steps = len(lengths) * groups * p.shape[0]
    blocks = steps * per_step
    return dict(steps=steps, blocks=blocks, computed=computed, skipped=blocks - computed, fetched=fetched,
                not_fetched=blocks - fetched, block=block, num_blocks=num_blocks, per_step=per_step,
                chunk_steps=chunk_steps, num_chunks=geo.num_chunks, head_groups=groups)


# ---------------------------------------------------------------------------- the kernel
def _row_position(rows: int, cols: int, q_len: int):
    """``t`` of each query row ``r = g * q_len + t``, as ``[rows, cols]`` int32: ``r mod q_len`` computed
    in float32 (exact for these small integers), since Mosaic has no vector integer remainder."""
    if q_len == 1:
        return jnp.zeros((rows, cols), jnp.int32)
    r = jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 0).astype(jnp.float32)
    return (r - q_len * jnp.floor((r + 0.5) / q_len)).astype(jnp.int32)


def _head(ref, h: int):
    """kv head ``h`` of a K/V block ``[block, heads, d]`` (``[block, d]``: the cache's one kv head), a
    ref or a value."""
    return ref[...] if len(ref.shape) == 2 else ref[:, h, :]


def _widen(x, dtype):
    """A quantized block ``[block, heads, d]`` (or ``[block, d]``) in ``dtype``, converted whole before
    a head is sliced out (converting one strided head of int8 aborts the v6e compiler of libtpu for
    JAX 0.10.2, in ``tpu_itofp_rule``)."""
    return x.astype(jnp.float32).astype(dtype)


def _kernel_refs(refs, num_prefetch: int, paged: bool, k_scaled: bool, v_scaled: bool, with_sinks: bool,
                 per_step: int):
    """Both grids' kernel arguments, in their order: the scalar-prefetched ``(table, k_scale, v_scale,
    sinks)`` (the lengths or the visit table first, then the page table when paged; a scalar not passed
    is None), the ``(q, K blocks, V blocks)`` inputs, and the rest (outputs, then scratch)."""
    scalars = list(refs[1 + paged:num_prefetch])
    ks_ref = scalars.pop(0) if k_scaled else None
    vs_ref = scalars.pop(0) if v_scaled else None
    sinks_ref = scalars.pop(0) if with_sinks else None
    inputs = refs[num_prefetch:]
    q_ref, k_refs, v_refs = inputs[0], inputs[1:1 + per_step], inputs[1 + per_step:1 + 2 * per_step]
    return (refs[0], ks_ref, vs_ref, sinks_ref), (q_ref, k_refs, v_refs), inputs[1 + 2 * per_step:]


def _online_update(h: int, s, v, bad, m_ref, l_ref, acc_ref, precision):
    """Both grids' online-softmax step for head ``h`` of a block: logits ``s`` (-inf where hidden), values
    ``v`` (non-finite entries read as 0), ``bad`` (how many non-finite values each row sees: its
    accumulator becomes NaN) into the running max, sum and accumulator."""
    m_prev, l_prev = m_ref[h], l_ref[h]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    shift = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # -inf - -inf: a row that saw nothing
    e = jnp.exp(s - shift[:, :1])
    alpha = jnp.exp(m_prev - shift)
    l_ref[h] = alpha * l_prev + jnp.sum(e, axis=1, keepdims=True)
    m_ref[h] = m_next
    pv = jnp.dot(e.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
    acc_ref[h] = acc_ref[h] * alpha[:, :1] + jnp.where(bad > 0, jnp.nan, pv)


def _start_rows(m_ref, l_ref, acc_ref, sinks_ref, hg, heads: int, group: int, per_head: int):
    """Both grids' running state at the start of a block's rows (row ``r = g * per_head + t``: query head
    ``g`` of the kv head's group): max -inf, sum 0 and accumulator 0; with sinks (``sinks_ref`` not
    None) each row's sink is one more logit of value 0 (running max the sink, running sum 1)."""
    if sinks_ref is not None:
        r = jax.lax.broadcasted_iota(jnp.int32, m_ref.shape[1:], 0)
        for h in range(heads):
            z = jnp.full(m_ref.shape[1:], sinks_ref[(hg * heads + h) * group], jnp.float32)
            for g in range(1, group):
                z = jnp.where(r >= g * per_head, sinks_ref[(hg * heads + h) * group + g], z)
            m_ref[h] = z
        l_ref[...] = jnp.ones(l_ref.shape, jnp.float32)
    else:
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def _decode_kernel(*refs, num_prefetch, paged, k_scaled, finish, v_scaled, with_sinks, group, q_len, left,
                   block, per_step, chunk_steps, heads, scale, softcap, precision):
    (lengths_ref, ks_ref, vs_ref, sinks_ref), (q_ref, k_refs, v_refs), rest = _kernel_refs(
        refs, num_prefetch, paged, k_scaled, v_scaled, with_sinks, per_step)
    if finish:
        o_ref, m_ref, l_ref, acc_ref = rest
    else:
        o_ref, stats_ref, m_ref, l_ref, acc_ref = rest
    b, hg, c, i = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    length = lengths_ref[b]

    pl.when(i == 0)(functools.partial(_start_rows, m_ref, l_ref, acc_ref, sinks_ref, hg, heads, group, q_len))

    def update(p, k_ref, v_ref):
        rows = q_ref.shape[1]
        key = p * block + jax.lax.broadcasted_iota(jnp.int32, (rows, block), 1)
        query = length - q_len + _row_position(rows, block, q_len)
        keep = (key < length) & (key <= query)
        if left is not None:
            keep &= key >= query - left
        dtype = q_ref.dtype  # the compute dtype: a quantized cache's entries are cast to it (exactly)
        sees = jnp.where(keep, 1.0, 0.0).astype(dtype)  # [rows, block]
        if k_ref.dtype != dtype:  # int8 / fp8 entries, widened a block at a time (exact in bf16 and f32)
            k_ref, v_ref = _widen(k_ref[...], dtype), _widen(v_ref[...], dtype)
        for h in range(heads):
            q, k, v = q_ref[h], _head(k_ref, h), _head(v_ref, h)  # [rows, d], [block, d], [block, d]
            # The contract's rule for non-finite values: they reach exactly the rows that see them.
            # A block's rows past the length, or outside a row's window, hold whatever the cache holds
            # (other data, NaN). A logit that is not finite (NaN or Inf in k) is NaN before the mask and
            # the soft-cap, so the mask replaces it in the rows that cannot see it. V's non-finite
            # entries are read as 0 (0 * NaN would reach every row of the block through e @ v) and put
            # back as NaN, per column, in the rows that see them (`bad`: how many such entries a row sees).
            # (Checked in float32: Mosaic cannot relayout a bf16 comparison's mask of 64 columns.)
            v32 = v.astype(jnp.float32)
            finite = jnp.abs(v32) < jnp.inf
            bad = jax.lax.dot(sees, jnp.where(finite, 0.0, 1.0).astype(dtype),
                              preferred_element_type=jnp.float32)
            v = jnp.where(finite, v32, 0.0).astype(dtype)
            s = jax.lax.dot_general(q, k, NT_DIMS, precision=precision, preferred_element_type=jnp.float32)
            s = s * (scale * ks_ref[hg * heads + h] if k_scaled else scale)  # a key is entry * k_scale
            s = apply_softcap(jnp.where(jnp.abs(s) < jnp.inf, s, jnp.nan), softcap)
            _online_update(h, jnp.where(keep, s, -jnp.inf), v, bad, m_ref, l_ref, acc_ref, precision)

    for j in range(per_step):  # the step's pages, each computed only if useful
        p = (c * chunk_steps + i) * per_step + j
        pl.when(is_useful(p, length, q_len, left, block))(
            functools.partial(update, p, k_refs[j], v_refs[j]))

    def _finished():  # one chunk: the output itself, in q's dtype (no partials, no merge outside)
        for h in range(heads):
            l_sum = l_ref[h]
            seen = l_sum != 0
            out = jnp.where(seen[:, :1], acc_ref[h] / jnp.where(seen, l_sum, 1.0)[:, :1], 0.0)
            if v_scaled:  # a value is entry * v_scale
                out = out * vs_ref[hg * heads + h]
            o_ref[h] = out.astype(o_ref.dtype)

    def _partial():  # one chunk of several: its partial result, merged outside (softmax.merge)
        m, l_sum = m_ref[...], l_ref[...]
        seen = l_sum != 0
        o_ref[...] = jnp.where(seen[..., :1], acc_ref[...] / jnp.where(seen, l_sum, 1.0)[..., :1], 0.0)
        # The row statistics as two terms (lane 0: m, lane 1: log l), the convention of
        # tpuattn.softmax.Partial: a row that saw nothing is m = -inf (never raised), log l = 0. Their
        # float32 sum would lose the low bits of log l for logits near 1e4.
        lane = jax.lax.broadcasted_iota(jnp.int32, m.shape, 2)
        stats_ref[...] = jnp.where(lane == 0, jnp.where(seen, m, -jnp.inf),
                                   jnp.log(jnp.where(seen, l_sum, 1.0)))

    pl.when(i == chunk_steps - 1)(_finished if finish else _partial)


def _cache_block_index(seq, p, hg, refs, *, paged: bool, pps: int, one_head: bool):
    """A K/V BlockSpec's block index (both grids): block ``p`` of sequence ``seq``, kv head group ``hg``;
    for a paged cache the page the scalar-prefetched page table (``refs[0]``, flattened) names, for a
    contiguous one the sequence's row; ``[..., rows, d]`` when there is one kv head."""
    if paged:
        seq, p = refs[0][seq * pps + p], 0
    return (seq, p, 0) if one_head else (seq, p, hg, 0)


def vmem_need_bytes(geo: Geometry, head_dim: int, itemsize: int) -> int:
    """The kernel's VMEM, modelled: K and V blocks (double-buffered), q, the partial outputs and the
    scratch, and per kv head of a block the body's temporaries (``[block, d]``: v in float32, its
    finite mask, v cleaned and its non-finite indicator; ``[rows, block]``: logits, weights, masks).
    A rough model, above the compiler's own count where it was checked: at 512-row pages of 8 kv heads
    of 256 the v5e compiler asked 18.75 MiB (bf16) and 16.16 MiB (f32); this model says 21.8 and 29.9."""
    kv = 2 * 2 * geo.per_step * geo.block * geo.heads_per_block * head_dim * itemsize
    io = 2 * geo.heads_per_block * geo.rows * (head_dim * itemsize + 4 * (head_dim + LANES))
    scratch = 4 * geo.heads_per_block * geo.rows * (2 * LANES + head_dim)
    temporaries = geo.heads_per_block * geo.per_step * geo.block * (12 * head_dim + 16 * geo.rows)
    return kv + io + scratch + temporaries


VMEM_MARGIN = 1.5  # the decode kernels' vmem_limit_bytes: this times their modelled need (scoped_vmem_limit)


def vmem_limit_bytes(geo: Geometry, head_dim: int, itemsize: int) -> int | None:
    """``vmem_limit_bytes`` for the target chip, by the package's one rule
    (:func:`tpuattn.options.scoped_vmem_limit`): None (the compiler's default scoped limit) while
    :data:`VMEM_MARGIN` times the modelled need fits in it, else that, at most the chip's VMEM (large
    pages of many wide kv heads: a block holds 8 kv heads of a page). None off a known chip."""
    return scoped_vmem_limit(vmem_need_bytes(geo, head_dim, itemsize), VMEM_MARGIN, chips.target_chip())


def resolve_interpret(interpret):
    """``None``: compiled for a TPU (the local one or ``chips.target``'s), interpret mode elsewhere;
    ``False`` off a TPU refused (:func:`tpuattn.options.resolve_interpret`, the one rule)."""
    return _resolve_interpret(interpret, "pallas")


def partials(q, k_cache, v_cache, lengths, page_table, spec: DecodeSpec, geo: Geometry,
             interpret, *, k_scale=None) -> list[softmax.Partial]:
    """Run the kernel: one :class:`tpuattn.softmax.Partial` per split-K chunk (attention over the
    chunk's keys; ``out [batch, q_len, heads, d]`` float32, ``m, log_l [batch, heads, q_len]``).

    ``k_scale`` (float32 ``[kv_heads]``, scalar-prefetched): logits of kv head ``h`` are multiplied by
    ``k_scale[h]`` (keys ``entry * k_scale``; values' scales are the caller's, after the merge)."""
    return _split_k(q, k_cache, v_cache, lengths, page_table, spec, geo, interpret, k_scale=k_scale)


def finished(q, k_cache, v_cache, lengths, page_table, spec: DecodeSpec, geo: Geometry, interpret, *,
             k_scale=None, v_scale=None, sinks=None):
    """Run the kernel over a cache of one split-K chunk (``geo.num_chunks == 1``): the output itself,
    ``[batch, q_len, heads, d]`` in q's dtype, finished in the kernel (the sinks start each row's
    running max and sum, ``v_scale`` multiplies the result), so no float32 partial or its statistics
    leave it and nothing is merged outside."""
    assert geo.num_chunks == 1, geo
    return _split_k(q, k_cache, v_cache, lengths, page_table, spec, geo, interpret, k_scale=k_scale,
                    finish=True, v_scale=v_scale, sinks=sinks)


def _split_k(q, k_cache, v_cache, lengths, page_table, spec: DecodeSpec, geo: Geometry, interpret, *,
             k_scale=None, finish=False, v_scale=None, sinks=None):
    b, tq, h, d = q.shape
    hk, g = spec.num_kv_heads, spec.group_size
    rows, hb = geo.rows, geo.heads_per_block
    qk = q.reshape(b, tq, hk, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hk, g * tq, d)
    qk = jnp.pad(qk, ((0, 0), (0, 0), (0, rows - g * tq), (0, 0)))
    # The caches go to the kernel as they are ([..., rows, kv_heads, d]): a reshape here is in general a
    # copy of the whole cache on a TPU (its tiled layout), see the module docstring. One kv head is the
    # exception: the TPU's default layout of [..., rows, 1, d] keeps the unit axis out of the tiles, so
    # [..., rows, d] is the same bytes (a bitcast), while Mosaic would have [..., rows, 1, d] copied to
    # tiles of one row.
    one_head = hk == 1
    if one_head:
        k_cache, v_cache = (c.reshape(*c.shape[:2], d) for c in (k_cache, v_cache))
    left, block, cs, n, pps = spec.left, geo.block, geo.chunk_steps, geo.per_step, geo.num_blocks

    # One K and one V BlockSpec per page of a step: spec j of step (c, i) holds block (c*cs + i)*n + j,
    # clamped into the sequence's useful range (kv_block) so that skipped slots ask for a block already
    # held and issue no DMA.
    # Scalar-prefetched: lengths, then the flattened page table (paged), then the keys' scales, and
    # (finishing) the values' scales and the sinks.
    prefetch = [lengths]
    if spec.paged:
        prefetch.append(page_table.reshape(-1))
    for x in (k_scale, v_scale, sinks):
        if x is not None:
            prefetch.append(jnp.asarray(x, jnp.float32).reshape(-1))

    def kv_map(j):
        def index(bi, hg, c, i, lengths_ref, *refs):
            p = kv_block((c * cs + i) * n + j, lengths_ref[bi], tq, left, block)
            return _cache_block_index(bi, p, hg, refs, paged=spec.paged, pps=pps, one_head=one_head)
        return index

    def fixed(bi, hg, c, i, *refs):
        return bi, hg, 0, 0

    def out_map(bi, hg, c, i, *refs):
        return c, bi, hg, 0, 0

    kv_block_shape = (None, block, d) if one_head else (None, block, hb, d)
    kv_specs = [pl.BlockSpec(kv_block_shape, kv_map(j)) for j in range(n)]
    grid = (b, hk // hb, geo.num_chunks, cs)
    nc = geo.num_chunks
    if finish:
        out_specs = pl.BlockSpec((None, hb, rows, d), fixed)
        out_shape = jax.ShapeDtypeStruct((b, hk, rows, d), q.dtype)
        out_bytes = jnp.dtype(q.dtype).itemsize * b * hk * rows * d
    else:
        out_specs = [pl.BlockSpec((None, None, hb, rows, d), out_map),
                     pl.BlockSpec((None, None, hb, rows, LANES), out_map)]
        out_shape = [jax.ShapeDtypeStruct((nc, b, hk, rows, d), jnp.float32),
                     jax.ShapeDtypeStruct((nc, b, hk, rows, LANES), jnp.float32)]
        out_bytes = 4 * nc * b * hk * rows * (d + LANES)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch),
        grid=grid,
        in_specs=[pl.BlockSpec((None, hb, rows, d), fixed), *kv_specs, *kv_specs],
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((hb, rows, LANES), jnp.float32),  # running max
                        pltpu.VMEM((hb, rows, LANES), jnp.float32),  # running sum
                        pltpu.VMEM((hb, rows, d), jnp.float32)],  # output accumulator
    )
    kernel = functools.partial(
        _decode_kernel, num_prefetch=len(prefetch), paged=spec.paged, k_scaled=k_scale is not None,
        finish=finish, v_scaled=v_scale is not None, with_sinks=sinks is not None, group=g, q_len=tq,
        left=left, block=block, per_step=n, chunk_steps=cs,
        heads=hb, scale=spec.scale, softcap=spec.softcap, precision=matmul_precision(q.dtype))
    itemsize = jnp.dtype(k_cache.dtype).itemsize
    positions = b * geo.num_blocks * block  # every block of every sequence: the compiler's upper bound
    cost = pl.CostEstimate(flops=4 * hk * rows * positions * d, transcendentals=hk * rows * positions,
                           bytes_accessed=jnp.dtype(q.dtype).itemsize * qk.size
                           + itemsize * 2 * positions * hk * d + out_bytes)
    results = pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=None if interpret else vmem_limit_bytes(geo, d, jnp.dtype(q.dtype).itemsize)),
        interpret=interpret, cost_estimate=cost, name="tpuattn_decode_split_k",
    )(*prefetch, qk, *[k_cache] * n, *[v_cache] * n)
    # The kernel's edge: [chunks, b, kv_heads, rows, ...] (rows r = g * q_len + t, padded) to the
    # contract's layout, query head kv_head * group + g.
    if finish:
        return results[:, :, : g * tq].reshape(b, hk, g, tq, d).transpose(0, 3, 1, 2, 4).reshape(b, tq, h, d)
    out, stats = results
    out = out[:, :, :, : g * tq].reshape(nc, b, hk, g, tq, d).transpose(0, 1, 4, 2, 3, 5).reshape(
        nc, b, tq, h, d)
    row_stats = lambda lane: stats[:, :, :, : g * tq, lane].reshape(nc, b, h, tq)
    m, log_l = row_stats(0), row_stats(1)
    return [softmax.Partial(out[c], m[c], log_l[c]) for c in range(nc)]


def pallas_decode(q, k_cache, v_cache, lengths, page_table, spec: DecodeSpec, *, sinks=None, cu_q_lens=None,
                  num_seqs=None, k_scale=None, v_scale=None, **options):
    """The ``impl="pallas"`` entry point. Options (the record :class:`~tpuattn.options.DecodeKernelOptions`:
    a name it does not take or a value that is not None or a positive int refused before anything is
    traced): ``block_size`` (contiguous cache rows per block, default 512; refused for a paged cache),
    ``pages_per_step`` (paged cache: pages per grid step, each its own BlockSpec; default 128 rows'
    worth; refused for a contiguous cache), ``chunk_blocks`` (blocks per split-K chunk, rounded up to
    whole steps; default 2048 positions' worth; refused for a ragged batch, which has no chunks),
    ``q_block`` (a ragged batch: tokens per token block, default :data:`DEFAULT_TOKEN_BLOCK`, rounded
    up to q's sublane tile; refused for a dense q), ``interpret`` (None: compiled on TPU, interpret
    mode elsewhere).

    A quantized cache is read as it is stored (one byte an entry): the kernel casts each block's
    entries to q's dtype (exact for int8 and fp8 e4m3) and multiplies the logits by ``k_scale``; the
    values' ``v_scale`` multiplies the output (a value is ``entry * v_scale``, and attention is linear
    in the values): in the kernel for a cache of one chunk (:func:`finished`), after the merge of
    several. A ragged batch runs on the token-major grid (:func:`ragged_decode`)."""
    chosen = DecodeKernelOptions.parse(options)
    interpret = resolve_interpret(chosen.interpret)
    if spec.ragged:
        return ragged_decode(q, k_cache, v_cache, lengths, page_table, spec, cu_q_lens, chosen, interpret,
                             sinks=sinks, k_scale=k_scale, v_scale=v_scale)
    if chosen.q_block is not None:
        raise ValueError(f"q_block: tokens per token block of a ragged batch (cu_q_lens); expected None "
                         f"for a dense q, got {chosen.q_block!r}")
    geo = geometry(spec, chosen.block_size, chosen.chunk_blocks, chosen.pages_per_step)
    if geo.num_chunks == 1:  # the whole cache in one chunk: finished in the kernel, nothing to merge
        def run(q, k_cache, v_cache, lengths, page_table, k_scale, v_scale, sinks):
            return finished(q, k_cache, v_cache, lengths, page_table, spec, geo, interpret, k_scale=k_scale,
                            v_scale=v_scale, sinks=sinks)

        return first_order_only(run, FORWARD_ONLY)(q, k_cache, v_cache, lengths, page_table, k_scale, v_scale,
                                                   sinks)
    run = functools.partial(partials, spec=spec, geo=geo, interpret=interpret, k_scale=k_scale)
    chunks = first_order_only(run, FORWARD_ONLY)(q, k_cache, v_cache, lengths, page_table)
    if sinks is not None:  # the sinks are one more part of the split-K merge (tpuattn.sinks)
        b, tq, _, d = q.shape
        chunks = [*chunks, sink_partial(sinks, b, tq, d)]
    out = softmax.merge(*chunks).out
    if v_scale is not None:  # [kv_heads] -> each query head of its group
        out = out * jnp.repeat(v_scale.astype(jnp.float32), spec.group_size)[:, None]
    return out.astype(q.dtype)


# ---------------------------------------------------------------------------- a ragged batch, token-major
DEFAULT_TOKEN_BLOCK = 256  # flattened tokens per token block of a ragged batch (the q_block option)
# The fields of a visit (one row each of the scalar-prefetched table [VISIT_FIELDS, visits]).
VISIT_FIELDS = ("block", "seq", "lo", "hi", "pos", "kv_first", "kv_last", "first", "last", "use")
_F = {name: i for i, name in enumerate(VISIT_FIELDS)}


def token_block(q_block, total: int, dtype) -> int:
    """Tokens per token block: ``q_block`` (default :data:`DEFAULT_TOKEN_BLOCK`), at most the tokens of
    the call, rounded up to q's sublane tile (8 rows of float32, 16 of a 2-byte dtype) so that the
    group's query heads stack into one ``[group * T, head_dim]`` operand along whole tiles."""
    tokens = DEFAULT_TOKEN_BLOCK if q_block is None else q_block
    return padded_rows(max(1, min(tokens, total)), dtype)


def visits(cu_q_lens, lengths, total: int, tokens: int, block: int, capacity: int, left: int | None = None):
    """The ragged batch's *visits* ``(token block, sequence)``, sorted by token block: ``[fields, V]``
    int32 (rows named by :data:`VISIT_FIELDS`), ``V = ceil(total / tokens) + batch - 1``, a static bound.

    Token block ``i`` holds the flattened tokens ``i * tokens .. (i + 1) * tokens - 1`` and is visited
    once for each sequence with a token in it (a block holding no live token once, to write its zeros);
    the visits past the last are empty. Per visit: ``block``; ``seq`` (the cache row of the page table
    it reads); ``lo``, ``hi`` (the block's rows of that sequence, ``lo <= t < hi``); ``pos`` (row ``t``
    is the query at position ``t + pos``); ``kv_first``, ``kv_last`` (the cache blocks of ``block``
    rows some of those queries see; the K/V index maps clamp into them); ``first``, ``last`` (the
    token block's first and last visit: initialise, finalise); ``use`` (anything to compute). A visit
    with nothing to compute holds the previous useful visit's sequence and last cache block, so its
    steps ask for the block the pipeline already holds (no DMA). Works on NumPy and traced arrays."""
    cu = jnp.asarray(cu_q_lens, jnp.int32)
    lengths = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, capacity)
    batch = lengths.shape[0]
    num_blocks = -(-total // tokens)
    num = num_blocks + batch - 1
    # Counting comparisons rather than searchsorted (its loops leave buffers of their own in HBM).
    below = lambda edges, x: jnp.sum(edges[None, :] <= x[:, None], axis=1, dtype=jnp.int32)
    # x[i] as a one-hot sum: XLA's gathers here left ~0.3-1 MB of buffers of their own in HBM (v5e).
    take = lambda x, i: jnp.sum(jnp.where(i[:, None] == jnp.arange(x.shape[0])[None, :], x[None, :], 0),
                                axis=1, dtype=x.dtype)
    end = cu[-1]
    starts = jnp.arange(num_blocks, dtype=jnp.int32) * tokens
    live = starts < end
    first_seq = below(cu[1:], starts)  # the sequence holding the block's first token
    count = jnp.where(live, below(cu[1:], jnp.minimum(starts + tokens, end) - 1) - first_seq + 1, 1)
    cum = jnp.sum(jnp.where(starts[None, :] <= starts[:, None], count[None, :], 0), axis=1)  # cumsum
    v = jnp.arange(num, dtype=jnp.int32)
    blk = jnp.minimum(below(cum, v), num_blocks - 1)
    k = v - take(cum - count, blk)
    # The visits in use: below the sum of counts, the inclusive sum's last entry. Not jnp.sum(count):
    # its s32[] result was the one value of the table XLA placed in HBM (the rest live in VMEM), and
    # with it the compiler counted 0.35 MB (v5e) or 0.39 MB (v6e) of temporaries (libtpu 0.0.42.1).
    real = v < cum[-1]
    seq = jnp.clip(take(first_seq, blk) + k, 0, batch - 1)
    base = blk * tokens
    qs, qe = take(cu, seq), take(cu, seq + 1)
    lo, hi = jnp.clip(qs - base, 0, tokens), jnp.clip(qe - base, 0, tokens)
    pos = take(lengths, seq) - (qe - qs) + base - qs
    latest = pos + hi - 1  # the position of the visit's last query (its keys: 0 .. latest)
    use = real & take(live, blk) & (hi > lo) & (latest >= 0)
    kv_last = jnp.maximum(latest, 0) // block
    kv_first = (jnp.zeros_like(kv_last) if left is None
                else jnp.minimum(jnp.maximum(pos + lo - left, 0) // block, kv_last))
    # The last useful visit so far (-1: none yet).
    held = jnp.max(jnp.where(use[None, :] & (v[None, :] <= v[:, None]), v[None, :], -1), axis=1)
    prev = jnp.maximum(held, 0)
    keep = lambda x, idle: jnp.where(use, x, jnp.where(held >= 0, idle, 0))
    seq_k, last_k = keep(seq, take(seq, prev)), keep(kv_last, take(kv_last, prev))
    fields = dict(block=blk, seq=seq_k, lo=jnp.where(use, lo, 0), hi=jnp.where(use, hi, 0), pos=pos,
                  kv_first=keep(kv_first, take(kv_last, prev)), kv_last=last_k, first=real & (k == 0),
                  last=real & (k == take(count, blk) - 1), use=use)
    return jnp.stack([fields[name].astype(jnp.int32) for name in VISIT_FIELDS])


def _ragged_kernel(*refs, num_visits, num_prefetch, paged, k_scaled, v_scaled, with_sinks, tokens, group,
                   left, block, per_step, steps, heads, scale, softcap, precision):
    (visits_ref, ks_ref, vs_ref, sinks_ref), (q_ref, k_refs, v_refs), rest = _kernel_refs(
        refs, num_prefetch, paged, k_scaled, v_scaled, with_sinks, per_step)
    o_ref, m_ref, l_ref, acc_ref = rest
    hg, vi, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    field = lambda name: visits_ref[_F[name] * num_visits + vi]
    rows = group * tokens  # row r = g * tokens + t: query head g of the group, token t of the block

    @pl.when((s == 0) & (field("first") == 1))
    def _init():
        _start_rows(m_ref, l_ref, acc_ref, sinks_ref, hg, heads, group, tokens)

    def update(p, k_ref, v_ref):
        key = p * block + jax.lax.broadcasted_iota(jnp.int32, (rows, block), 1)
        t = _row_position(rows, block, tokens)
        query = t + field("pos")
        # Only this visit's sequence's rows; the block's other rows (other sequences, padding) see
        # nothing here: their logits are -inf, and a row that has seen nothing yet stays m = -inf.
        keep = (t >= field("lo")) & (t < field("hi")) & (key <= query)
        if left is not None:
            keep &= key >= query - left
        dtype = q_ref.dtype
        sees = jnp.where(keep, 1.0, 0.0).astype(dtype)
        if k_ref.dtype != dtype:
            k_ref, v_ref = _widen(k_ref[...], dtype), _widen(v_ref[...], dtype)
        for h in range(heads):
            # The group's query heads stacked on rows (strided loads of the token-major q block).
            q = jnp.concatenate([q_ref[:, h * group + g, :] for g in range(group)], axis=0)
            k, v = _head(k_ref, h), _head(v_ref, h)
            v32 = v.astype(jnp.float32)  # non-finite values: as the dense kernel (_decode_kernel)
            finite = jnp.abs(v32) < jnp.inf
            bad = jax.lax.dot(sees, jnp.where(finite, 0.0, 1.0).astype(dtype),
                              preferred_element_type=jnp.float32)
            v = jnp.where(finite, v32, 0.0).astype(dtype)
            sc = jax.lax.dot_general(q, k, NT_DIMS, precision=precision, preferred_element_type=jnp.float32)
            sc = sc * (scale * ks_ref[hg * heads + h] if k_scaled else scale)
            sc = apply_softcap(jnp.where(jnp.abs(sc) < jnp.inf, sc, jnp.nan), softcap)
            _online_update(h, jnp.where(keep, sc, -jnp.inf), v, bad, m_ref, l_ref, acc_ref, precision)

    for j in range(per_step):
        p = s * per_step + j
        pl.when((field("use") == 1) & (p >= field("kv_first")) & (p <= field("kv_last")))(
            functools.partial(update, p, k_refs[j], v_refs[j]))

    @pl.when((s == steps - 1) & (field("last") == 1))
    def _finish():  # the token block's output, finished, in q's dtype (no partials leave the kernel)
        for h in range(heads):
            for g in range(group):
                rows = pl.ds(g * tokens, tokens)
                l_sum = l_ref[h, rows, :]
                seen = l_sum != 0
                out = jnp.where(seen[:, :1], acc_ref[h, rows, :] / jnp.where(seen, l_sum, 1.0)[:, :1], 0.0)
                if v_scaled:  # a value is entry * v_scale
                    out = out * vs_ref[hg * heads + h]
                # One head of the block, [T, 1, d], made by a float32 broadcast: JAX 0.7.2's Mosaic cannot
                # reshape a bfloat16 [T, d] to [T, 1, d] (what o_ref[:, j, :] = x lowers to).
                out = jnp.broadcast_to(out[:, None, :], (tokens, 1, out.shape[-1]))
                o_ref[:, pl.ds(h * group + g, 1), :] = out.astype(o_ref.dtype)


def ragged_vmem_need_bytes(geo: Geometry, tokens: int, group: int, head_dim: int, q_itemsize: int,
                           kv_itemsize: int) -> int:
    """The token-major kernel's VMEM, modelled as :func:`vmem_need_bytes`: K and V blocks and the q and
    output blocks (double-buffered), the float32 scratch (running max and sum at 128 lanes, the
    accumulator) and one kv head's temporaries (``[rows, block]`` logits, weights, masks; the stacked
    q and the float32 update of ``[rows, d]``)."""
    rows = group * tokens
    kv = 2 * 2 * geo.per_step * geo.block * geo.heads_per_block * head_dim * kv_itemsize
    io = 2 * 2 * tokens * geo.heads_per_block * group * head_dim * q_itemsize
    scratch = 4 * geo.heads_per_block * rows * (2 * LANES + head_dim)
    temporaries = geo.per_step * (geo.heads_per_block * geo.block * 12 * head_dim
                                  + rows * (16 * geo.block + 12 * head_dim))
    return kv + io + scratch + temporaries


def ragged_decode(q, k_cache, v_cache, lengths, page_table, spec: DecodeSpec, cu_q_lens,
                  chosen: DecodeKernelOptions, interpret, *, sinks=None, k_scale=None, v_scale=None):
    """A ragged batch on a token-major grid ``(kv_head_group, visit, kv_step)``.

    The flattened tokens are cut into token blocks of ``T`` (:func:`token_block`); :func:`visits` lists
    each block's sequences (scalar-prefetched). A visit's q and output blocks are its token block's
    ``[T, heads of the group, d]`` (q's own layout: no copy), so the visits of one block keep its
    output and the running max / sum / accumulator in VMEM: initialised at its first visit (with the
    sink, if any), each visit adding its sequence's rows over that sequence's useful cache blocks,
    finalised at its last visit (``v_scale`` applied) and written once, in q's dtype."""
    if chosen.chunk_blocks is not None:
        raise ValueError("chunk_blocks: a ragged batch (cu_q_lens) has no split-K chunks (each visit walks "
                         f"its sequence's cache); expected None, got {chosen.chunk_blocks!r}")
    total, h, d = q.shape
    if total == 0:
        return jnp.zeros(q.shape, q.dtype)
    hk, group = spec.num_kv_heads, spec.group_size
    tokens = token_block(chosen.q_block, total, q.dtype)
    geo = geometry(spec, chosen.block_size, None, chosen.pages_per_step)
    block, per_step, hb, pps = geo.block, geo.per_step, geo.heads_per_block, geo.num_blocks
    steps = -(-geo.num_blocks // per_step)
    table = visits(cu_q_lens, lengths, total, tokens, block, spec.capacity, spec.left)
    num = table.shape[1]
    prefetch = [table.reshape(-1)]
    if spec.paged:
        prefetch.append(page_table.reshape(-1).astype(jnp.int32))
    for x in (k_scale, v_scale, sinks):
        if x is not None:
            prefetch.append(jnp.asarray(x, jnp.float32).reshape(-1))
    one_head = hk == 1
    if one_head:  # as in partials: [..., rows, 1, d] viewed as [..., rows, d] (a bitcast on a TPU)
        k_cache, v_cache = (c.reshape(*c.shape[:2], d) for c in (k_cache, v_cache))
    at = lambda name: _F[name] * num

    def kv_map(j):
        def index(hg, vi, s, visits_ref, *refs):
            p = jnp.minimum(jnp.maximum(s * per_step + j, visits_ref[at("kv_first") + vi]),
                            visits_ref[at("kv_last") + vi])
            seq = visits_ref[at("seq") + vi]
            return _cache_block_index(seq, p, hg, refs, paged=spec.paged, pps=pps, one_head=one_head)
        return index

    def token_map(hg, vi, s, visits_ref, *refs):
        return visits_ref[at("block") + vi], hg, 0

    kv_block_shape = (None, block, d) if one_head else (None, block, hb, d)
    kv_specs = [pl.BlockSpec(kv_block_shape, kv_map(j)) for j in range(per_step)]
    qo_spec = pl.BlockSpec((tokens, hb * group, d), token_map)
    rows = group * tokens
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch), grid=(hk // hb, num, steps),
        in_specs=[qo_spec, *kv_specs, *kv_specs], out_specs=qo_spec,
        scratch_shapes=[pltpu.VMEM((hb, rows, LANES), jnp.float32),  # running max
                        pltpu.VMEM((hb, rows, LANES), jnp.float32),  # running sum
                        pltpu.VMEM((hb, rows, d), jnp.float32)])  # output accumulator
    kernel = functools.partial(
        _ragged_kernel, num_visits=num, num_prefetch=len(prefetch), paged=spec.paged,
        k_scaled=k_scale is not None, v_scaled=v_scale is not None, with_sinks=sinks is not None,
        tokens=tokens, group=group, left=spec.left, block=block, per_step=per_step, steps=steps, heads=hb,
        scale=spec.scale, softcap=spec.softcap, precision=matmul_precision(q.dtype))
    # An upper bound: every visit reads its sequence's whole capacity once per kv head; q and the
    # output move once (a token block's visits are consecutive: its blocks stay in VMEM).
    kv_itemsize, q_itemsize = jnp.dtype(k_cache.dtype).itemsize, jnp.dtype(q.dtype).itemsize
    positions = num * steps * per_step * block
    cost = pl.CostEstimate(flops=4 * hk * rows * positions * d, transcendentals=hk * rows * positions,
                           bytes_accessed=2 * q_itemsize * q.size + kv_itemsize * 2 * positions * hk * d)
    need = ragged_vmem_need_bytes(geo, tokens, group, d, q_itemsize, kv_itemsize)
    vmem = None if interpret else scoped_vmem_limit(need, VMEM_MARGIN, chips.target_chip())

    def run(q, k_cache, v_cache, *prefetch):
        return pl.pallas_call(
            kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary"),
                                                 vmem_limit_bytes=vmem),
            interpret=interpret, cost_estimate=cost, name="tpuattn_decode_ragged",
        )(*prefetch, q, *[k_cache] * per_step, *[v_cache] * per_step)

    return first_order_only(run, FORWARD_ONLY)(q, k_cache, v_cache, *prefetch)


def pallas_supports(spec: DecodeSpec, backend: str | None = None) -> str | None:
    return low_precision_matmul_refused(spec.attention, backend, "pallas")


register("pallas", pallas_decode,
         description="Pallas TPU kernel: split-K (flash-decoding) for a dense q, token-major for a ragged "
                     "batch; scalar-prefetched lengths/page table",
         supports=pallas_supports, auto_rank=lambda spec, backend: 0.0 if backend == "tpu" else None,
         interpreted_off_tpu=True, options=OPTIONS, takes_sinks=True, takes_ragged=True, takes_scales=True)
