"""The decode contract: :func:`attention` over a KV cache, :func:`implementations`, the ``auto`` rule.

The registry machinery is :class:`tpuattn.registry.Registry`, the attention contract's own
(:mod:`tpuattn.decode.registry` holds decode's records and declares its built-ins).
"""

from __future__ import annotations

from tpuattn.decode.registry import REGISTRY, DecodeImplementation
from tpuattn.decode.spec import DecodeSpec, validate
from tpuattn.options import option_descriptions
from tpuattn.registry import Choice, Subset
from tpuattn.spec import normalise_sinks


def known_implementations() -> tuple[str, ...]:
    """Every decode implementation, available here or not (imports nothing)."""
    return REGISTRY.known()


def implementations() -> tuple[str, ...]:
    """The decode implementations usable on this machine."""
    return REGISTRY.available()


def unavailable_implementations() -> dict[str, str]:
    """``{name: why}`` for the decode implementations that cannot run here."""
    return REGISTRY.unavailable()


def get_implementation(name: str) -> DecodeImplementation:
    """The registered record for ``name`` (importing its module on first use)."""
    return REGISTRY.get(name)


def options_of(impl: str) -> dict[str, str]:
    """``{option: what it is}`` for the decode implementation named ``impl`` (importing its module on
    first use), as :func:`tpuattn.options_of` does for the attention contract: the fields of its
    :mod:`tpuattn.options` record with their types and defaults (``pallas``:
    :class:`~tpuattn.options.DecodeKernelOptions`), or ``"declared by name"`` for each name of an
    implementation that declares plain names (JAX's kernels: ``interpret``). ``{}``: it takes none.

    ``tpuattn.decode.options_of("pallas")`` -> ``{"block_size": "int | None = None", "chunk_blocks": ...,
    "pages_per_step": ..., "q_block": ..., "interpret": "bool | None = None"}``.
    """
    return option_descriptions(REGISTRY.get(impl).options)


def choose(spec: DecodeSpec, backend: str | None = None) -> Choice:
    """``impl="auto"``, with its reason and refusals: the lowest ``auto_rank`` among the available
    implementations that support ``spec`` on ``backend`` (default: the target's, see
    :func:`tpuattn.chips.target`), ties to the lower priority. The ranks put the split-K kernel first on
    a TPU and the materialised reference elsewhere (the kernel only interprets off a TPU). The
    :class:`~tpuattn.registry.Choice` names the chosen one's options (``Choice.options``, as
    :func:`options_of` lists them, old spellings aside)."""
    return REGISTRY.choose(spec, backend)


# The decode implementations that take ``sinks`` (their record says so), ranked as for "auto".
TAKES_SINKS = Subset("takes sinks", lambda record: record.takes_sinks)


def resolve(impl: str, spec: DecodeSpec, backend: str | None = None, *, options=()) -> DecodeImplementation:
    """The record that will serve ``spec`` (by name, or ``"auto"``), refused with
    :class:`~tpuattn.errors.UnavailableImplementation` or :class:`~tpuattn.errors.UnsupportedInput`
    (also for ``"auto"`` when its choice takes none of the option names in ``options``)."""
    return REGISTRY.resolve(impl, spec, backend, options=options)


def attention(q, k_cache, v_cache, lengths, *, page_table=None, cu_q_lens=None, num_seqs=None,
              k_scale=None, v_scale=None, scale=None, window=None, softcap=None, sinks=None, impl="auto",
              **options):
    """Attention of a few new queries per sequence over a KV cache (one decode step), forward only.

    Args:
      q: ``[batch, q_len, heads, head_dim]``; ``q_len`` is small (1 for plain decode; more for
        speculative decoding or chunked prefill). With ``cu_q_lens`` (a ragged batch): ``[total_tokens,
        heads, head_dim]``, each sequence's new tokens one after the other.
      k_cache, v_cache: contiguous ``[batch, max_len, kv_heads, head_dim]``, or with ``page_table``
        paged ``[num_pages, page_size, kv_heads, head_dim]``. ``heads`` must be a multiple of
        ``kv_heads`` (GQA): query head ``h`` reads kv head ``h // (heads // kv_heads)``. Of q's dtype,
        or quantized: ``int8`` or ``float8_e4m3fn`` with ``k_scale`` and ``v_scale``.
      lengths: int ``[batch]``: valid positions per sequence, in ``[0, capacity]``. The queries are the
        last ``q_len`` of them: query ``t`` sits at position ``lengths[b] - q_len + t`` and sees keys
        ``j <= `` its position (bottom-right causal); positions ``>= lengths[b]`` never contribute. A
        query row at a negative position (``lengths[b] < q_len``) and every row of a sequence of
        length 0 return zeros.
      page_table: int32 ``[batch, pages_per_sequence]``: sequence ``b``'s position ``j`` is row
        ``j % page_size`` of page ``page_table[b, j // page_size]``. Entries past a sequence's last used
        page are never read.
      cu_q_lens: int32 ``[batch + 1]`` (a ragged batch, as JAX's ``ragged_paged_attention`` and TPU
        engines take it): sequence ``i``'s new tokens are rows ``cu_q_lens[i] .. cu_q_lens[i + 1] - 1``
        of ``q``; ``cu_q_lens[0] == 0``, non-decreasing, at most ``total_tokens``; a sequence may have
        no new token (prefill chunks of any length beside single-token decodes). They are the last
        ``cu_q_lens[i + 1] - cu_q_lens[i]`` of its ``lengths[i]`` positions, with the causal rule
        above; rows of ``q`` past ``cu_q_lens[num_seqs]`` are padding and return zeros.
      num_seqs: with ``cu_q_lens``: how many sequences are live (an int or int32 ``[1]``, default
        ``batch``); the others have no queries and their entries are not read.
      k_scale, v_scale: float32 ``[]`` (per tensor) or ``[kv_heads]`` (per kv head), both or neither;
        required for a quantized cache: the key (value) at a cache entry is ``entry * k_scale[kv head]``
        (``v_scale``), in float32. :func:`tpuattn.decode.quantize` makes entries and scales and
        :func:`tpuattn.decode.write` stores new keys or values into pages, quantizing them. Accuracy
        (measured, ``pytest tests/test_decode_quant.py -k accuracy -s``, JAX 0.10.2 on a CPU, inputs
        ~N(0, 1), float32 queries): ``reference`` and ``pallas`` are within 1e-6 of the float64 oracle
        on the dequantized values (4e-7 to 8e-7, the test allows 2e-5), for both dtypes; quantizing
        itself moves the output by 2.0e-2 to 2.8e-2 (int8) and 1.4e-1 to 1.6e-1 (fp8 e4m3) against the
        full-width cache (max abs, per kv head to per tensor).
      scale: logits are ``scale * q.k``; default ``1 / sqrt(head_dim)``.
      window: an int ``w`` or ``(left, right)`` as in :func:`tpuattn.attention`, relative to each
        query's position (with the causal mask only ``left`` narrows anything).
      softcap: logits ``s`` become ``softcap * tanh(s / softcap)``.
      sinks: ``[heads]`` floats, as in :func:`tpuattn.attention`: one logit per query head in each
        row's softmax denominator, with no value (taken by ``reference`` and ``pallas``; JAX's kernels,
        wrapped unchanged, refuse them). A row that sees no key stays zeros.
      impl: ``"auto"`` (see :func:`choose`) or a name from :func:`implementations` (the list is in
        :mod:`tpuattn.decode`'s docstring).
      **options: for the implementation, listed by :func:`options_of` (the split-K kernel's, its record
        :class:`~tpuattn.options.DecodeKernelOptions`: ``block_size``, ``chunk_blocks``,
        ``pages_per_step``, ``q_block``, ``interpret``; a name it does not take, or a value that is not
        None or a positive int, refused naming the option and the value).

    Who takes what: ``reference`` and ``pallas`` take every form (ragged, quantized, sinks);
    ``jax_ragged`` takes the ragged form natively (it is that kernel) and refuses quantized caches;
    ``jax_paged`` refuses both. A refusal names the argument (an
    :class:`~tpuattn.errors.UnsupportedInput`).

    Non-finite values in the cache (the rule of every decode implementation): a NaN or Inf reaches
    exactly the output rows that see its position. One at a position a row does not see (past the
    sequence's length, in an unused page row, before the row's window, after the row's own position)
    changes nothing in that row; one in ``k`` at a position a row sees makes the whole row NaN (so does
    a logit that overflows to Inf: it is made NaN before the mask and the soft-cap, which would turn it
    into a finite number); one in ``v`` makes that row NaN in the value's column. Rows that see no key
    stay zeros. This is the main contract's rule for keys applied to values too: the materialised
    softmax there multiplies a hidden value by a probability of 0, and ``0 * NaN`` spreads it to every
    row, which a kernel that skips hidden blocks cannot reproduce; row by row, every implementation
    here gives the same answer whatever its blocks and chunks (``reference`` and ``pallas`` read
    non-finite values as 0 and put the NaNs back where the rule says). The exception: JAX's kernels
    (``jax_paged``, ``jax_ragged``), wrapped unchanged, are outside the rule: a non-finite value where
    no query looks can reach the rows of the block that holds it, and one that is seen does what the
    kernel does; cleaning the cache for them would cost a pass over it per step (see
    :mod:`tpuattn.decode.native`).

    Bad shapes, dtypes, lengths outside ``[0, capacity]`` and page ids in use outside
    ``[0, num_pages)`` raise ``ValueError``/``TypeError``; the value checks need concrete arrays (under
    ``jax.jit`` lengths are clamped into range and page ids into ``[0, num_pages)`` instead, see
    :mod:`tpuattn.decode.spec`). Decode is inference: the Pallas kernels define no backward pass
    (differentiating them fails inside ``pallas_call``); the materialised reference is plain JAX.

    Returns:
      An array of q's shape and dtype.
    """
    x = validate(q, k_cache, v_cache, lengths, page_table, cu_q_lens=cu_q_lens, num_seqs=num_seqs,
                 k_scale=k_scale, v_scale=v_scale, scale=scale, window=window, softcap=softcap)
    spec, extra = x.spec, {}
    if sinks is not None:
        extra["sinks"] = normalise_sinks(sinks, spec.num_q_heads)
    if spec.ragged:
        extra.update(cu_q_lens=x.cu_q_lens, num_seqs=x.num_seqs)
    if spec.scales is not None:
        extra.update(k_scale=x.k_scale, v_scale=x.v_scale)
    if not extra:
        record = resolve(impl, spec, options=options)
    else:
        subset = _takes(sinks is not None, spec.ragged, spec.scales is not None)
        record = REGISTRY.resolve(impl, spec, subset=subset, options=options)
    return record.fn(x.q, x.k_cache, x.v_cache, x.lengths, x.page_table, spec, **extra, **options)


def _takes(sinks: bool, ragged: bool, scales: bool) -> Subset:
    """The implementations whose record takes the extra arguments of this call."""
    if sinks and not (ragged or scales):
        return TAKES_SINKS
    what = [w for w, on in (("sinks", sinks), ("a ragged batch (cu_q_lens)", ragged),
                            ("scales (k_scale, v_scale)", scales)) if on]
    return Subset("takes " + " and ".join(what),
                  lambda r: (not sinks or r.takes_sinks) and (not ragged or r.takes_ragged)
                  and (not scales or r.takes_scales))
