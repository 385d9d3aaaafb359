"""The decode kernels JAX ships, translated to :func:`tpuattn.decode.attention`'s contract or refused.

* ``impl="jax_paged"``: ``jax.experimental.pallas.ops.tpu.paged_attention`` -- one query per sequence
  (``q_len == 1``), logit soft-cap, GQA; no window. It wants ``q [batch, heads, d]`` and pages
  ``[kv_heads, num_pages, page_size, d]`` and takes no scale, so the adapter folds ``scale`` into ``q``
  (rounded to q's dtype) and transposes the cache (a copy of the whole cache per call: a cost of the
  translation, not of the kernel). A contiguous cache is viewed as pages of a size dividing ``max_len``
  with an identity page table. It leaves the output of a sequence of length 0 unwritten; the adapter
  returns zeros there. It rounds K and V to bfloat16 inside the kernel whatever their dtype
  (``_maybe_dequantize(..., dtype=jnp.bfloat16)`` in JAX 0.10.2), so a float32 cache gets bfloat16
  accuracy (about 5e-3 here, against 1e-6 for ``pallas``).
* ``impl="jax_ragged"``: ``...ops.tpu.ragged_paged_attention`` -- mixed prefill/decode over a paged
  cache with K and V interleaved in one array ``[num_pages, page_size, 2 * kv_heads, d]`` (built by
  the adapter: a copy), any ``q_len``, ``sm_scale``, ``soft_cap`` and a left ``sliding_window``
  (``window=left`` is its ``sliding_window=left + 1``). It requires ``q_len <= length`` per sequence;
  rows before the first position (``lengths[b] < q_len``) get zeros from the adapter. A ragged batch
  (``cu_q_lens``, ``num_seqs``) is its own form and goes to it unchanged.

Neither takes per-call ``k_scale``/``v_scale`` (quantized caches): both refuse them by name.

Both read every position of the blocks they load and mask by a large negative logit, then multiply
the masked probabilities by V: a NaN or Inf stored where no query looks (past a sequence's length, in
an unused page row, before a window) can reach the rows of its block (``0 * NaN``). That is the one
exception to the decode contract's non-finite rule (:func:`tpuattn.decode.api.attention`), kept on
purpose: the adapters hand JAX's kernels the cache as it is, because a cleaned copy costs a pass over
the whole cache per step (compiled for v5e at notebook 07's serving shape it tripled ``jax_paged``'s
bytes accessed, 129 -> 403 MiB). Where unused cache slots may hold non-finite data, use ``reference``
or ``pallas``, which keep the rule at no extra traffic. At seen positions the kernels do their own
thing too (``jax_paged`` drops a key of ``-inf`` instead of making the row NaN).

Off a TPU ``jax_paged`` runs in Pallas interpret mode under ``pltpu.force_tpu_interpret_mode()`` (it
issues its own DMAs). ``jax_ragged`` is refused there: JAX's TPU interpreter cannot run it (0.7.2 and
0.10.2). It compiles for TPU v5e/v6e from a CPU machine with JAX 0.7.2, while JAX 0.10.2's lowering of
its kernel asks the local device for its TPU generation (``sign``), so there it compiles only on a TPU
host. Its translation is tested off a TPU through JAX's own reference, ``ref_ragged_paged_attention``,
which takes the same arguments (:func:`ragged_translation`).
"""

from __future__ import annotations

import contextlib
import functools

import jax.numpy as jnp
import numpy as np

from tpuattn import chips
from tpuattn.decode.registry import register
from tpuattn.decode.spec import DecodeSpec
from tpuattn.numerics import x64
from tpuattn.options import JaxPagedOptions, JaxRaggedOptions, resolve_interpret
from tpuattn.pallas import compat
from tpuattn.supports import low_precision_matmul_refused


def _interpreting(interpret, impl: str) -> contextlib.AbstractContextManager:
    """JAX's kernels take no ``interpret``: the one rule (:func:`tpuattn.options.resolve_interpret`)
    decides, and interpret mode is JAX's TPU interpreter around the call."""
    if resolve_interpret(interpret, impl):
        return compat.force_tpu_interpret_mode()
    return contextlib.nullcontext()


def _page_view(k_cache, v_cache, page_table, spec: DecodeSpec):
    """A paged view ``(k_pages, v_pages [num_pages, page_size, kv_heads, d], page_table)`` of either cache."""
    if spec.paged:
        return k_cache, v_cache, page_table
    b, s, hk, d = k_cache.shape
    size = contiguous_page_size(s)
    n = s // size
    table = jnp.arange(b * n, dtype=jnp.int32).reshape(b, n)
    return k_cache.reshape(b * n, size, hk, d), v_cache.reshape(b * n, size, hk, d), table


def contiguous_page_size(max_len: int) -> int:
    """The page a contiguous cache of ``max_len`` rows is viewed as: the largest of 128, 64, 32, 16, 8
    dividing it (else the whole row)."""
    return next((p for p in (128, 64, 32, 16, 8) if max_len % p == 0), max_len)


def _compute_block(pages_per_sequence: int, page_size: int) -> int:
    """Pages per compute block: the largest divisor of ``pages_per_sequence`` spanning at most 512 rows."""
    best = 1
    for n in range(1, pages_per_sequence + 1):
        if pages_per_sequence % n == 0 and n * page_size <= 512:
            best = n
    return best


# ---------------------------------------------------------------------------- paged_attention
def _scales_refused(spec: DecodeSpec, impl: str) -> str | None:
    if spec.scales is None:
        return None
    what = f"a {spec.cache_dtype} cache" if spec.quantized else "scaled caches"
    return (f"k_scale, v_scale: impl='{impl}' is JAX's kernel wrapped unchanged and takes no per-call "
            f"scales ({what}); use impl='pallas' or 'reference'")


def jax_paged_supports(spec: DecodeSpec, backend: str | None = None) -> str | None:
    if spec.ragged:
        return ("cu_q_lens: JAX's paged_attention takes one query per sequence, not a ragged batch; use "
                "impl='jax_ragged', 'pallas' or 'reference'")
    if spec.scales is not None:
        return _scales_refused(spec, "jax_paged")
    if spec.q_len != 1:
        return (f"JAX's paged_attention takes one query per sequence (q_len 1), got q_len {spec.q_len}; "
                "use impl='jax_ragged', 'pallas' or 'reference'")
    if spec.windowed:
        return "JAX's paged_attention has no window (sliding-window) option; use impl='pallas' or 'reference'"
    if jnp.dtype(spec.dtype) == jnp.float16:
        return "JAX's paged_attention on float16: TPUs have no float16 compute; use bfloat16 or float32"
    return low_precision_matmul_refused(spec.attention, backend, "jax_paged")


def jax_paged_decode(q, k_cache, v_cache, lengths, page_table, spec: DecodeSpec, **options):
    chosen = JaxPagedOptions.parse(options)
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    k_pages, v_pages, table = _page_view(k_cache, v_cache, page_table, spec)
    k_pages, v_pages = (x.transpose(2, 0, 1, 3) for x in (k_pages, v_pages))  # [hk, pages, size, d]
    q1 = (q[:, 0].astype(jnp.float32) * spec.scale).astype(q.dtype)
    block = _compute_block(table.shape[1], k_pages.shape[2])
    with _interpreting(chosen.interpret, "jax_paged"), x64(False):
        out = paged_attention(q1, k_pages, v_pages, lengths, table, attn_logits_soft_cap=spec.softcap,
                              pages_per_compute_block=block)
    out = jnp.where((lengths > 0)[:, None, None], out, 0).astype(q.dtype)
    return out[:, None]


# ---------------------------------------------------------------------------- ragged_paged_attention
def jax_ragged_supports(spec: DecodeSpec, backend: str | None = None) -> str | None:
    if spec.scales is not None:
        return _scales_refused(spec, "jax_ragged")
    if not spec.paged:
        return ("JAX's ragged_paged_attention reads a paged cache only (K and V interleaved per page), got a "
                "contiguous cache; pass a page_table, or use impl='pallas' or 'reference'")
    if jnp.dtype(spec.dtype) == jnp.float16:
        return ("JAX's ragged_paged_attention on float16: TPUs have no float16 compute; "
                "use bfloat16 or float32")
    if (backend or chips.target_backend()) != "tpu":
        return ("JAX's ragged_paged_attention does not run off a TPU: JAX's TPU interpreter fails on its "
                "reshaped VMEM refs (JAX 0.7.2 and 0.10.2: \"object has no attribute 'indices'\"); "
                "use impl='pallas' or 'reference' here")
    if spec.head_dim % 128:
        return (f"JAX's ragged_paged_attention needs head_dim a multiple of 128 (its lane tiling), got "
                f"{spec.head_dim}; use impl='pallas' or 'reference'")
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel

    try:
        kernel.get_min_heads_per_blk(spec.num_q_heads, 2 * spec.num_kv_heads, spec.dtype, spec.dtype)
    except ValueError as error:
        return (f"JAX's ragged_paged_attention cannot tile {spec.num_kv_heads} kv heads of {spec.dtype} "
                f"({error}); use impl='pallas' or 'reference'")
    return low_precision_matmul_refused(spec.attention, backend, "jax_ragged")


def jax_ragged_decode(q, k_cache, v_cache, lengths, page_table, spec: DecodeSpec, *, cu_q_lens=None,
                      num_seqs=None, **options):
    chosen = JaxRaggedOptions.parse(options)
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    blocks = dict(num_kv_pages_per_block=_compute_block(page_table.shape[1], k_cache.shape[1]),
                  num_queries_per_block=8)
    with _interpreting(chosen.interpret, "jax_ragged"):
        return ragged_translation(functools.partial(ragged_paged_attention, **blocks), q, k_cache, v_cache,
                                  lengths, page_table, spec, cu_q_lens=cu_q_lens, num_seqs=num_seqs)


def ragged_translation(kernel, q, k_cache, v_cache, lengths, page_table, spec: DecodeSpec, *, cu_q_lens=None,
                       num_seqs=None):
    """The contract's arguments -> ``kernel(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
    sm_scale=, sliding_window=, soft_cap=)`` (JAX's kernel, or its reference ``ref_ragged_paged_attention``,
    which takes the same arguments: the tests check this translation through it) -> the contract's output.

    A ragged batch (``cu_q_lens``) goes to the kernel as it is (the kernel's own form); a dense one as
    ``batch`` sequences of ``q_len`` tokens. Rows at a negative position (a query length above the
    sequence's length, which JAX's kernel does not allow) and padding rows are made zeros."""
    p, size, hk, d = k_cache.shape
    kv = jnp.stack([k_cache, v_cache], axis=3).reshape(p, size, 2 * hk, d)  # K at even heads, V at odd
    window = None if not spec.windowed else spec.left + 1
    if cu_q_lens is None:
        b, tq, h, _ = q.shape
        cu_q_lens = np.arange(b + 1, dtype=np.int32) * tq  # static (NumPy): the reference loops over them
        out = kernel(q.reshape(b * tq, h, d), kv, lengths, page_table, cu_q_lens, np.array([b], np.int32),
                     sm_scale=spec.scale, sliding_window=window, soft_cap=spec.softcap)
        out = out.reshape(b, tq, h, d)
        sees = jnp.arange(tq)[None, :] >= tq - lengths[:, None]  # rows at a position >= 0
        return jnp.where(sees[:, :, None, None], out, 0).astype(q.dtype)
    from tpuattn.decode.reference import token_positions

    if not _is_tracer(cu_q_lens):  # JAX's reference loops over concrete values
        cu_q_lens, num_seqs = np.asarray(cu_q_lens, np.int32), np.asarray(num_seqs, np.int32)
    out = kernel(q, kv, lengths, page_table, cu_q_lens, num_seqs, sm_scale=spec.scale,
                 sliding_window=window, soft_cap=spec.softcap)
    if out.shape[0] < q.shape[0]:  # JAX's reference returns the live tokens only
        out = jnp.pad(out, ((0, q.shape[0] - out.shape[0]), (0, 0), (0, 0)))
    _, position, live = token_positions(jnp.asarray(cu_q_lens), lengths, q.shape[0])
    return jnp.where((live & (position >= 0))[:, None, None], out, 0).astype(q.dtype)


def _is_tracer(x) -> bool:
    import jax

    return isinstance(x, jax.core.Tracer)


register("jax_paged", jax_paged_decode,
         description="JAX's paged_attention TPU kernel (q_len 1, no window), translated",
         available=lambda: compat.has_module("jax.experimental.pallas.ops.tpu.paged_attention")
         and compat.has_interpret_mode(),
         supports=jax_paged_supports, interpreted_off_tpu=True, options=JaxPagedOptions)
register("jax_ragged", jax_ragged_decode,
         description="JAX's ragged_paged_attention TPU kernel (paged cache only), translated",
         available=lambda: compat.has_module("jax.experimental.pallas.ops.tpu.ragged_paged_attention")
         and compat.has_interpret_mode(),
         supports=jax_ragged_supports, interpreted_off_tpu=True, options=JaxRaggedOptions,
         takes_ragged=True)
