"""The fuzz harness's case generator (tests/test_fuzz.py runs the cases): plain seeded NumPy, no
dependency, bounded.

Every case is a frozen dataclass drawn from ``numpy.random.default_rng([contract, seed, index])``; its
``repr`` is the whole case, and its data (q, k, v, caches, segment ids, lengths, page tables) is drawn
again from ``(seed, index, draw)``, so a failure's message (seed, index, case) reproduces it:
``FUZZ_SEEDS=<seed> pytest tests/test_fuzz.py``.

Compile time dominates on CPU (the Pallas and splash kernels interpret), so shapes come from a small
menu (jit caches hit across cases) while masks, windows, soft-caps, scales and segment ids vary freely;
a case's data draws share one compiled function (segment ids, lengths and page tables are arguments).

``FUZZ_SEEDS`` widens the run locally: ``FUZZ_SEEDS=0-49`` (a range) or ``FUZZ_SEEDS=3,17``.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

# The default seeds (a few cases each, tests/test_fuzz.py's counts); the CI's two unit stages draw one
# each (ci/test.py's UNIT_FUZZ_SEEDS). Seed 1 draws int32 ids beside uint32 ones and int64 beside
# uint8/uint32 with aliased bits: a plain cast of the ids to one width fails it.
DEFAULT_SEEDS = (0, 1)

# Contract tags, the first word of every case's random stream.
ATTENTION, PARALLEL, DECODE, USER_SHARD_MAP = 1, 2, 3, 4


def seeds() -> tuple[int, ...]:
    """``FUZZ_SEEDS`` (``"0-9"``, ``"3,17"`` or both, comma-separated) or :data:`DEFAULT_SEEDS`."""
    text = os.environ.get("FUZZ_SEEDS", "").strip()
    if not text:
        return DEFAULT_SEEDS
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        out.extend(range(int(lo), int(hi) + 1) if hi else [int(lo)])
    return tuple(out)


def _pick(rng, options, p=None):
    """One element of ``options`` (any objects; ``p`` optional weights)."""
    return options[int(rng.choice(len(options), p=None if p is None else np.asarray(p) / np.sum(p)))]


# ---------------------------------------------------------------------------------------------- segment ids
ID_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint32")


def _special_values(dtype: str) -> list[int]:
    """Small ids and ids at and next to the dtype's limits."""
    info = np.iinfo(dtype)
    values = {0, 1, 2, 3, int(info.max), int(info.max) - 1, int(info.min)}
    if info.min < 0:
        values |= {-1, -2, int(info.min) + 1}
    if dtype == "int64":
        values |= {2**32, 2**32 + 1, 2**31, -(2**32)}  # equal to 0, 1, ... after a cast to 32 bits
    return sorted(values)


def _wrap(value: int, dtype: str) -> int:
    """``value``'s bits read as ``dtype`` (what a plain cast does): the ids a cast would collide."""
    info = np.iinfo(dtype)
    bits = 8 * np.dtype(dtype).itemsize
    wrapped = value % (1 << bits)
    return wrapped - (1 << bits) if wrapped > info.max else wrapped


def _id_candidates(own: str, other: str) -> list[int]:
    """Ids of dtype ``own`` worth drawing beside ids of dtype ``other``: both dtypes' special values
    that ``own`` holds, and the casts of ``other``'s to ``own`` and to int32 (equal bits, different
    values: a cast that loses the value makes them collide)."""
    info = np.iinfo(own)
    pool = set(_special_values(own))
    for value in _special_values(other):
        for candidate in (value, _wrap(value, own), _wrap(value, "int32")):
            if info.min <= candidate <= info.max:
                pool.add(candidate)
    return sorted(pool)


def draw_ids(rng, batch: int, length: int, dtype: str, candidates: list[int], pattern: str) -> np.ndarray:
    """``[batch, length]`` ids of ``dtype``: ``runs`` (sorted packed documents) or ``random`` (any order)."""
    out = np.empty((batch, length), object)
    for b in range(batch):
        chosen = [candidates[i] for i in rng.choice(len(candidates), size=min(4, len(candidates)),
                                                     replace=False)]
        if pattern == "runs":
            cuts = np.sort(rng.integers(0, length + 1, size=len(chosen) - 1))
            out[b] = [chosen[int(np.searchsorted(cuts, j, side="right"))] for j in range(length)]
        else:
            out[b] = [chosen[i] for i in rng.integers(0, len(chosen), size=length)]
    return out.astype(dtype)


@dataclasses.dataclass(frozen=True)
class Segments:
    """How a case's segment ids are drawn: one array (q_len == kv_len) or a pair of any two dtypes."""

    form: str  # "single" or "pair"
    q_dtype: str
    kv_dtype: str
    pattern: str  # "runs" or "random"
    shared_values: bool  # the kv ids drawn from the q ids' values (most rows see keys)

    def draw(self, rng, batch: int, q_len: int, kv_len: int):
        """The contract's ``segment_ids`` (NumPy) and the same ids as int64 for the oracle (exact for
        every dtype here, so the oracle compares values, not bits)."""
        if self.form == "single":
            ids = draw_ids(rng, batch, q_len, self.q_dtype, _special_values(self.q_dtype), self.pattern)
            return ids, ids.astype(np.int64)
        q_cand = _id_candidates(self.q_dtype, self.kv_dtype)
        q_ids = draw_ids(rng, batch, q_len, self.q_dtype, q_cand, self.pattern)
        if self.shared_values:
            # Mostly the q ids' own values (where kv's dtype holds them), plus kv's aliases of them.
            info = np.iinfo(self.kv_dtype)
            kv_cand = sorted({int(x) for x in q_ids.ravel() if info.min <= int(x) <= info.max}
                             | set(_id_candidates(self.kv_dtype, self.q_dtype)[:2]))
        else:
            kv_cand = _id_candidates(self.kv_dtype, self.q_dtype)
        kv_ids = draw_ids(rng, batch, kv_len, self.kv_dtype, kv_cand, self.pattern)
        return (q_ids, kv_ids), (q_ids.astype(np.int64), kv_ids.astype(np.int64))

    @property
    def wide(self) -> bool:
        """int64 ids: JAX without x64 truncates them to int32 at a ``jax.jit`` boundary (JAX's rule,
        with a warning), so such ids are passed to the contract as NumPy, outside any jit argument."""
        return "int64" in (self.q_dtype, self.kv_dtype)


def draw_segments(rng, equal_lengths: bool, p_none: float = 0.3) -> Segments | None:
    if rng.random() < p_none:
        return None
    form = "single" if equal_lengths and rng.random() < 0.3 else "pair"
    q_dtype = _pick(rng, ID_DTYPES)
    kv_dtype = q_dtype if form == "single" else _pick(rng, ID_DTYPES)
    return Segments(form, q_dtype, kv_dtype, _pick(rng, ("runs", "random")), bool(rng.random() < 0.7))


# ---------------------------------------------------------------------------------------------- masks
def draw_window(rng, q_len: int, kv_len: int):
    """``None``, an int (Python or NumPy), or a pair (tuple or list) with ``None`` sides, small, zero,
    or past the sequence (``2**40``: the same as unbounded)."""
    def side():
        return _pick(rng, (None, 0, 1, int(rng.integers(2, q_len + kv_len)), q_len + kv_len + 3, 2**40),
                     p=(2, 1, 1, 4, 1, 1))

    kind = _pick(rng, ("none", "int", "numpy-int", "tuple", "list"), p=(3, 2, 1, 4, 1))
    if kind == "none":
        return None
    if kind in ("int", "numpy-int"):
        w = _pick(rng, (0, 1, int(rng.integers(2, kv_len + 1)), 2**40), p=(1, 1, 4, 1))
        return np.int32(min(w, 2**31 - 1)) if kind == "numpy-int" else w
    pair = (side(), side())
    return list(pair) if kind == "list" else pair


def oracle_window(window):
    """The window as the oracles read it (Python ints; a NumPy int or a list is the same window)."""
    if window is None:
        return None
    if isinstance(window, int | np.integer):
        return int(window)
    return tuple(None if w is None else int(w) for w in window)


def hashable(value):
    """``value`` with lists as tuples, for jit cache keys."""
    return tuple(value) if isinstance(value, list) else value


def draw_scale(rng):
    return _pick(rng, (None, 0.25, np.float32(0.5), 1.0), p=(4, 1, 1, 1))


def draw_softcap(rng):
    return _pick(rng, (None, 1.0, np.float64(5.0), 30.0), p=(5, 1, 1, 1))


# ---------------------------------------------------------------------------------------------- attention
# (batch, q_len, kv_len, q_heads, kv_heads, head_dim): q_len < kv_len with GQA 2, equal lengths with
# MQA, q_len > kv_len (rows that see nothing under the causal mask) with MHA.
ATTENTION_SHAPES = ((2, 24, 40, 4, 2, 16), (1, 32, 32, 4, 1, 32), (2, 40, 17, 2, 2, 8))
ATTENTION_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    seed: int
    index: int
    batch: int
    q_len: int
    kv_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    causal: bool
    window: object
    softcap: object
    scale: object
    segments: Segments | None
    impls: tuple[str, ...]  # the implementations this case runs
    grad: bool  # gradients too (float32 cases only)
    draws: int  # data draws sharing one compiled function per implementation
    q_gain: float  # q is N(0, 1) times this: sharper softmaxes

    def kwargs(self) -> dict:
        """The static keyword arguments of the contract (segment ids are data)."""
        return dict(causal=self.causal, window=self.window, softcap=self.softcap, scale=self.scale)

    def oracle_kwargs(self) -> dict:
        return dict(causal=self.causal, window=oracle_window(self.window),
                    softcap=None if self.softcap is None else float(self.softcap),
                    scale=None if self.scale is None else float(self.scale))

    def data(self, draw: int):
        """``q, k, v`` (float32 NumPy, to be cast to the dtype), ``d_out``, the segment ids for the
        contract and for the oracle (or Nones)."""
        rng = np.random.default_rng([ATTENTION, self.seed, self.index, draw])
        q = rng.standard_normal((self.batch, self.q_len, self.q_heads, self.head_dim)) * self.q_gain
        k = rng.standard_normal((self.batch, self.kv_len, self.kv_heads, self.head_dim))
        v = rng.standard_normal((self.batch, self.kv_len, self.kv_heads, self.head_dim))
        d_out = rng.standard_normal(q.shape)
        segs = oracle_segs = None
        if self.segments is not None:
            segs, oracle_segs = self.segments.draw(rng, self.batch, self.q_len, self.kv_len)
        return *(x.astype(np.float32) for x in (q, k, v, d_out)), segs, oracle_segs


def attention_cases(seed: int, count: int, impls: tuple[str, ...],
                    heavy: tuple[str, ...]) -> list[AttentionCase]:
    """``count`` cases: each runs every implementation not in ``heavy`` and one of ``heavy`` in turn
    (the interpreted kernels: each of their compiles costs seconds), so a seed covers them all."""
    cases = []
    for index in range(count):
        rng = np.random.default_rng([ATTENTION, seed, index, 10**6])
        batch, q_len, kv_len, q_heads, kv_heads, head_dim = _pick(rng, ATTENTION_SHAPES)
        dtype = _pick(rng, ATTENTION_DTYPES, p=(6, 3, 1))
        segments = draw_segments(rng, q_len == kv_len)
        # int64 ids run op by op (see Segments.wide): forward only, one draw (the ids reach the
        # implementations as the same int32 pair whatever their dtype, so gradients gain nothing).
        wide = segments is not None and segments.wide
        chosen = tuple(i for i in impls if i not in heavy)
        if heavy:
            chosen += (heavy[(seed + index) % len(heavy)],)
        cases.append(AttentionCase(
            seed=seed, index=index, batch=batch, q_len=q_len, kv_len=kv_len, q_heads=q_heads,
            kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, causal=bool(rng.random() < 0.5),
            window=draw_window(rng, q_len, kv_len), softcap=draw_softcap(rng), scale=draw_scale(rng),
            segments=segments, impls=chosen,
            grad=dtype == "float32" and not wide and bool(rng.random() < 0.5),
            draws=1 if wide else 2,
            q_gain=_pick(rng, (1.0, 3.0), p=(3, 1))))
    return cases


# ---------------------------------------------------------------------------------------------- parallel
# (mesh axes, call keywords): a ring or all-gather over 4 devices, with batch or heads sharded beside it.
MESHES = (
    ((("s", 4),), dict(seq_axis="s")),
    ((("b", 2), ("s", 4)), dict(seq_axis="s", batch_axis="b")),
    ((("h", 2), ("s", 4)), dict(seq_axis="s", head_axis="h")),
    ((("s", 2),), dict(seq_axis="s")),
)
# (batch, q_len, kv_len, q_heads, kv_heads, head_dim): every length divisible by 2 * 4 (zigzag).
PARALLEL_SHAPES = ((2, 16, 16, 4, 2, 8), (2, 16, 32, 2, 2, 8), (2, 32, 16, 2, 2, 8))


@dataclasses.dataclass(frozen=True)
class ParallelCase:
    seed: int
    index: int
    mesh_axes: tuple
    call: tuple  # (key, value) pairs of parallel.attention's mesh keywords
    strategy: str
    layout: str
    impl: str
    batch: int
    q_len: int
    kv_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    window: object
    softcap: object
    scale: object
    segments: Segments | None
    grad: bool

    @property
    def seq_devices(self) -> int:
        return dict(self.mesh_axes)["s"]

    def kwargs(self) -> dict:
        return dict(causal=self.causal, window=self.window, softcap=self.softcap, scale=self.scale)

    def oracle_kwargs(self) -> dict:
        return dict(causal=self.causal, window=oracle_window(self.window),
                    softcap=None if self.softcap is None else float(self.softcap),
                    scale=None if self.scale is None else float(self.scale))

    def data(self):
        rng = np.random.default_rng([PARALLEL, self.seed, self.index])
        q = rng.standard_normal((self.batch, self.q_len, self.q_heads, self.head_dim))
        k = rng.standard_normal((self.batch, self.kv_len, self.kv_heads, self.head_dim))
        v = rng.standard_normal((self.batch, self.kv_len, self.kv_heads, self.head_dim))
        d_out = rng.standard_normal(q.shape)
        segs = oracle_segs = None
        if self.segments is not None:
            segs, oracle_segs = self.segments.draw(rng, self.batch, self.q_len, self.kv_len)
        return *(x.astype(np.float32) for x in (q, k, v, d_out)), segs, oracle_segs


def parallel_cases(seed: int, count: int, impls: tuple[str, ...]) -> list[ParallelCase]:
    cases = []
    for index in range(count):
        rng = np.random.default_rng([PARALLEL, seed, index, 10**6])
        axes, call = _pick(rng, MESHES)
        batch, q_len, kv_len, q_heads, kv_heads, head_dim = _pick(rng, PARALLEL_SHAPES)
        cases.append(ParallelCase(
            seed=seed, index=index, mesh_axes=axes, call=tuple(sorted(call.items())),
            strategy=("ring", "allgather")[(seed + index) % 2], layout=_pick(rng, ("natural", "zigzag")),
            impl=_pick(rng, impls), batch=batch, q_len=q_len, kv_len=kv_len, q_heads=q_heads,
            kv_heads=kv_heads, head_dim=head_dim, causal=bool(rng.random() < 0.6),
            window=draw_window(rng, q_len, kv_len), softcap=draw_softcap(rng), scale=draw_scale(rng),
            segments=draw_segments(rng, q_len == kv_len, p_none=0.4), grad=bool(rng.random() < 0.5)))
    return cases


# ------------------------------------------------------------------------------------ a user's shard_map
# (devices, batch, q_len, kv_len, q_heads, kv_heads, head_dim): the batch or the heads split over the
# user's mesh axis, every split even.
USER_SHARD_MAP_SHAPES = ((4, 4, 16, 16, 4, 2, 8), (2, 2, 24, 16, 4, 2, 16), (2, 2, 16, 24, 4, 4, 8))


def draw_sinks(rng, q_heads: int):
    """None, or one float32 logit per query head: ordinary, large (the sink takes most of the mass) or
    ``-inf`` (no sink) mixed in one draw."""
    form = _pick(rng, ("none", "ordinary", "mixed"), p=(1, 2, 2))
    if form == "none":
        return None
    sinks = rng.standard_normal(q_heads) * 2
    if form == "mixed":
        sinks[rng.integers(q_heads)] = -np.inf
        sinks[rng.integers(q_heads)] = rng.uniform(6, 12)
    return tuple(float(x) for x in sinks.astype(np.float32))


@dataclasses.dataclass(frozen=True)
class UserShardMapCase:
    """The contract called inside the user's own ``jax.shard_map`` (its default checks): inputs split
    over the batch or the heads, the sinks replicated (``P()``), differentiated eagerly or under jit;
    after an eager case the same call outside any shard_map (a kernel cache must not keep the trace)."""
    seed: int
    index: int
    devices: int
    split: str  # "batch" or "heads"
    batch: int
    q_len: int
    kv_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    window: object
    softcap: object
    sinks: tuple | None
    mode: str  # "jit" or "eager"
    impl: str

    def kwargs(self) -> dict:
        return dict(causal=self.causal, window=self.window, softcap=self.softcap)

    def oracle_kwargs(self) -> dict:
        return dict(causal=self.causal, window=oracle_window(self.window),
                    softcap=None if self.softcap is None else float(self.softcap),
                    sinks=None if self.sinks is None else np.asarray(self.sinks, np.float64))

    def data(self):
        rng = np.random.default_rng([USER_SHARD_MAP, self.seed, self.index])
        q = rng.standard_normal((self.batch, self.q_len, self.q_heads, self.head_dim))
        k = rng.standard_normal((self.batch, self.kv_len, self.kv_heads, self.head_dim))
        v = rng.standard_normal((self.batch, self.kv_len, self.kv_heads, self.head_dim))
        d_out = rng.standard_normal(q.shape)
        return tuple(x.astype(np.float32) for x in (q, k, v, d_out))


def user_shard_map_cases(seed: int, count: int, impls: tuple[str, ...]) -> list[UserShardMapCase]:
    """``count`` cases, the implementations taken in turn (seed and index), so a few seeds reach all."""
    cases = []
    for index in range(count):
        rng = np.random.default_rng([USER_SHARD_MAP, seed, index, 10**6])
        devices, batch, q_len, kv_len, q_heads, kv_heads, head_dim = _pick(rng, USER_SHARD_MAP_SHAPES)
        cases.append(UserShardMapCase(
            seed=seed, index=index, devices=devices,
            split="batch" if kv_heads % devices else _pick(rng, ("batch", "heads"), p=(2, 1)),
            batch=batch, q_len=q_len, kv_len=kv_len, q_heads=q_heads, kv_heads=kv_heads,
            head_dim=head_dim, causal=bool(rng.random() < 0.6), window=draw_window(rng, q_len, kv_len),
            softcap=draw_softcap(rng), sinks=draw_sinks(rng, q_heads), mode=_pick(rng, ("jit", "eager")),
            impl=impls[(seed * count + index) % len(impls)]))
    return cases


# ---------------------------------------------------------------------------------------------- decode
LENGTH_DTYPES = ("int32", "int64", "int16", "uint8", "uint32")
# (batch, heads, kv_heads, head_dim, page_size, pages_per_sequence, contiguous max_len)
DECODE_SHAPES = ((4, 4, 2, 16, 8, 3, 24), (3, 8, 1, 32, 4, 5, 20))


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    seed: int
    index: int
    dtype: str
    batch: int
    q_len: int
    heads: int
    kv_heads: int
    head_dim: int
    paged: bool
    page_size: int
    pages_per_sequence: int
    spare_pages: int
    max_len: int
    window: object
    softcap: object
    scale: object
    lengths_dtype: str
    mode: str  # "eager" (concrete lengths and table), "jit" (both traced), "jit-lengths" (table NumPy)
    pallas_options: tuple
    draws: int

    @property
    def capacity(self) -> int:
        return self.page_size * self.pages_per_sequence if self.paged else self.max_len

    def kwargs(self) -> dict:
        return dict(window=self.window, softcap=self.softcap, scale=self.scale)

    def oracle_kwargs(self) -> dict:
        return dict(window=oracle_window(self.window),
                    softcap=None if self.softcap is None else float(self.softcap),
                    scale=None if self.scale is None else float(self.scale))

    def data(self, draw: int, poison: bool):
        """q, caches (float32 NumPy), lengths (``lengths_dtype``), page table (int32, ``-1`` in every
        entry past a sequence's last page) or None. With ``poison`` every cache row no sequence holds
        (past its length, unused pages) is NaN: the contract says those never contribute."""
        rng = np.random.default_rng([DECODE, self.seed, self.index, draw])
        cap = self.capacity
        lengths = rng.integers(0, cap + 1, size=self.batch)
        order = rng.permutation(self.batch)
        lengths[order[:2]] = (0, cap)  # an empty sequence and a full one
        if rng.random() < 0.5:
            lengths[order[2]] = rng.integers(1, self.q_len + 1)  # shorter than q_len
        q = rng.standard_normal((self.batch, self.q_len, self.heads, self.head_dim))
        if self.paged:
            num_pages = self.batch * self.pages_per_sequence + self.spare_pages
            k = rng.standard_normal((num_pages, self.page_size, self.kv_heads, self.head_dim))
            v = rng.standard_normal(k.shape)
            table = rng.permutation(num_pages)[: self.batch * self.pages_per_sequence]
            table = table.reshape(self.batch, self.pages_per_sequence).astype(np.int32)
            used = np.arange(self.pages_per_sequence)[None, :] < -(-lengths[:, None] // self.page_size)
            table = np.where(used, table, -1).astype(np.int32)
            if poison:
                valid = np.zeros(k.shape[:2], bool)
                for b in range(self.batch):
                    for j in range(int(lengths[b])):
                        valid[table[b, j // self.page_size], j % self.page_size] = True
                k[~valid], v[~valid] = np.nan, np.nan
        else:
            k = rng.standard_normal((self.batch, self.max_len, self.kv_heads, self.head_dim))
            v = rng.standard_normal(k.shape)
            table = None
            if poison:
                past = np.arange(self.max_len)[None, :] >= lengths[:, None]
                k[past], v[past] = np.nan, np.nan
        cast = (lambda x: x.astype(np.float32))
        return cast(q), cast(k), cast(v), lengths.astype(self.lengths_dtype), table


def decode_cases(seed: int, count: int) -> list[DecodeCase]:
    cases = []
    for index in range(count):
        rng = np.random.default_rng([DECODE, seed, index, 10**6])
        batch, heads, kv_heads, head_dim, page_size, pps, max_len = _pick(rng, DECODE_SHAPES)
        paged = bool(rng.random() < 0.7)
        q_len = int(rng.integers(1, 5))
        capacity = page_size * pps if paged else max_len
        lengths_dtype = _pick(rng, LENGTH_DTYPES)
        if lengths_dtype == "uint8":
            assert capacity <= 255
        mode = _pick(rng, ("eager", "jit", "jit-lengths"), p=(2, 2, 1))
        if paged:
            options = _pick(rng, ((), (("pages_per_step", 1), ("chunk_blocks", 1)), (("pages_per_step", 2),)))
        else:
            options = _pick(rng, ((), (("block_size", 8), ("chunk_blocks", 1)), (("block_size", 16),)))
        cases.append(DecodeCase(
            seed=seed, index=index, dtype=_pick(rng, ("float32", "bfloat16"), p=(2, 1)), batch=batch,
            q_len=q_len, heads=heads, kv_heads=kv_heads, head_dim=head_dim, paged=paged,
            page_size=page_size, pages_per_sequence=pps, spare_pages=int(rng.integers(0, 3)),
            max_len=max_len, window=_pick(rng, (None, draw_window(rng, q_len, capacity))),
            softcap=draw_softcap(rng), scale=draw_scale(rng), lengths_dtype=lengths_dtype, mode=mode,
            pallas_options=options, draws=2 if mode == "jit" else 1))
    return cases
