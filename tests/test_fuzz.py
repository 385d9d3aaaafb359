"""The fuzz harness: seeded random cases of the three contracts against the float64 oracles.

``tpuattn.attention`` (every implementation; also inside a user's own ``shard_map``, eager and
jitted, sinks replicated or split), ``tpuattn.parallel.attention`` (ring and all-gather on
CPU meshes of the 8 devices conftest.py asks for) and ``tpuattn.decode.attention`` (every
implementation, paged and contiguous). Cases come from tests/fuzz_cases.py; each one must match the
independent oracle (tests/oracle.py, tests/decode_oracle.py) within the suite's tolerances per dtype, or
be refused with a :class:`~tpuattn.errors.TpuattnError` that says why. Anything else fails: a NaN, a
wrong answer, a raw JAX error, a refusal without a message. A failure prints the seed, the case and
how to run it again; ``FUZZ_SEEDS=0-49`` widens the run locally (the default is a few cases that fit
the unit stage's budget, compile time dominating).
"""

from __future__ import annotations

import traceback

import fuzz_cases
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import FORWARD_TOL, GRAD_TOL
from decode_oracle import oracle_decode
from jax.sharding import Mesh
from oracle import oracle_attention, oracle_grads
from test_decode import BF16_INSIDE
from test_decode import TOL as DECODE_TOL

import tpuattn
from tpuattn import decode, parallel
from tpuattn.errors import TpuattnError

SEEDS = fuzz_cases.seeds()
# Cases per seed (widen with FUZZ_SEEDS, not these: a seed's case i is the same whatever the count).
# Each attention case runs every implementation but the interpreted kernels, and one of those in
# turn (HEAVY); compile time is what these numbers buy.
ATTENTION_CASES, PARALLEL_CASES, DECODE_CASES = 3, 1, 2
HEAVY = ("pallas", "splash")
# Parallel's local kernels here: the interpreted Pallas kernel under shard_map compiles for minutes.
PARALLEL_IMPLS = ("auto", "reference", "blockwise")
# At least this share of (case, implementation) pairs must run rather than be refused: the harness
# cannot pass by refusing everything.
MIN_RAN = 0.4


def _rerun(case) -> str:
    return f"FUZZ_SEEDS={case.seed} pytest tests/test_fuzz.py"


class Outcomes:
    """What a seed's cases did: ran, refused (with the reason) or failed (with the case)."""

    def __init__(self):
        self.ran, self.refused, self.failures = [], [], []

    def run(self, case, label: str, check) -> None:
        try:
            check()
        except TpuattnError as err:
            if not str(err).strip():
                self.failures.append(f"{label}: a refusal without a message\n  case={case!r}")
            else:
                self.refused.append((case, label, str(err)))
        except Exception as err:  # noqa: BLE001 - every other outcome is a failure, reported with its case
            where = "".join(traceback.format_exception_only(type(err), err)).strip()  # with its notes
            self.failures.append(f"{label} [{_rerun(case)}]: {where[:2000]}\n  case={case!r}")
        else:
            self.ran.append((case, label))

    def check(self, cases, must_run: str | None = None) -> None:
        assert not self.failures, f"{len(self.failures)} failure(s):\n" + "\n".join(self.failures)
        total = len(self.ran) + len(self.refused)
        assert total and len(self.ran) >= MIN_RAN * total, (
            f"only {len(self.ran)} of {total} checks ran; refused: "
            + "; ".join(f"{label}: {why[:120]}" for _, label, why in self.refused))
        if must_run is None:
            return
        ran_by = {(case.index, label.split()[0]) for case, label in self.ran}
        missing = [case.index for case in cases if (case.index, must_run) not in ran_by]
        assert not missing, f"{must_run!r} refused cases {missing} (it must serve every valid input)"


def _with_draw(draw: int, check, *args) -> None:
    """``check(*args)``, its failure noting which of the case's data draws it was."""
    try:
        check(*args)
    except TpuattnError:
        raise
    except Exception as err:
        err.add_note(f"(data draw {draw}: case.data({draw}) regenerates it)")
        raise


def _close(got, want, tol, what: str) -> None:
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(got)), f"{what}: non-finite values ({np.sum(~np.isfinite(got))} of {got.size})"
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol, err_msg=what)


# ---------------------------------------------------------------------------------------------- attention
def _attention_function(case, impl):
    """Output and (for a ``grad`` case) the gradients of ``sum(out * d_out)``: one compiled function per
    case and implementation, the segment ids its arguments; int64 ids (which a jit boundary would
    truncate without x64) run op by op, NumPy ids straight into the contract."""
    kw = case.kwargs()

    def both(q, k, v, d_out, segs):
        attend = lambda q, k, v: tpuattn.attention(q, k, v, impl=impl, segment_ids=segs, **kw)
        if not case.grad:
            return attend(q, k, v), None
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(d_out.astype(out.dtype))

    if case.segments is not None and case.segments.wide:
        return both
    return jax.jit(both)


def _check_attention(case, impl, fn, draw):
    q, k, v, d_out, segs, oracle_segs = case.data(draw)
    cast = [jnp.asarray(x, case.dtype) for x in (q, k, v)]
    out, grads = fn(*cast, jnp.asarray(d_out), segs)
    assert out.shape == q.shape and out.dtype == jnp.dtype(case.dtype), (out.shape, out.dtype)
    inputs64 = [np.asarray(x.astype(jnp.float32), np.float64) for x in cast]  # what the kernel saw
    kw = dict(case.oracle_kwargs(), segment_ids=oracle_segs)
    _close(out, oracle_attention(*inputs64, **kw), FORWARD_TOL[case.dtype], "forward")
    if grads is not None:
        want = oracle_grads(*inputs64, d_out.astype(np.float64), **kw)
        for name, got, expected in zip("qkv", grads, want, strict=True):
            _close(got, expected, GRAD_TOL, f"d{name}")


@pytest.mark.parametrize("seed", SEEDS)
def test_attention_fuzz(seed):
    """Shapes from a menu (GQA, MQA, q_len above and below kv_len), f32/bf16/f16, causal, windows in
    every accepted form, soft-cap, scale, segment ids of mixed integer widths near their limits; every
    implementation forward, gradients for half the float32 cases."""
    cases = fuzz_cases.attention_cases(seed, ATTENTION_CASES, tpuattn.implementations(), HEAVY)
    outcomes = Outcomes()
    for case in cases:
        for impl in case.impls:
            fn = _attention_function(case, impl)

            def check(case=case, impl=impl, fn=fn):
                for draw in range(case.draws):
                    _with_draw(draw, _check_attention, case, impl, fn, draw)

            outcomes.run(case, f"{impl} seed={seed} index={case.index}", check)
    outcomes.check(cases, must_run="reference")


# ---------------------------------------------------------------------------------------------- parallel
def _mesh(axes) -> Mesh:
    shape = tuple(size for _, size in axes)
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, tuple(name for name, _ in axes))


def _check_parallel(case):
    q, k, v, d_out, segs, oracle_segs = case.data()
    n = case.seq_devices
    zig = case.layout == "zigzag"
    to = (lambda x: parallel.to_zigzag(x, n)) if zig else (lambda x: x)
    back = (lambda x: parallel.from_zigzag(np.asarray(x), n)) if zig else np.asarray
    if segs is not None:  # NumPy ids as constants: no jit argument truncates int64
        segs = tuple(to(s) for s in segs) if isinstance(segs, tuple) else to(segs)
    mesh = _mesh(case.mesh_axes)

    def loss(q, k, v):
        out = parallel.attention(q, k, v, mesh=mesh, strategy=case.strategy, layout=case.layout,
                                 impl=case.impl, segment_ids=segs, **dict(case.call), **case.kwargs())
        return jnp.sum(out * to(d_out)), out

    kw = dict(case.oracle_kwargs(), segment_ids=oracle_segs)
    if case.grad:
        both = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
        (_, out), grads = both(to(q), to(k), to(v))
    else:
        out, grads = jax.jit(lambda q, k, v: loss(q, k, v)[1])(to(q), to(k), to(v)), None
    assert out.shape == q.shape and out.dtype == jnp.float32, (out.shape, out.dtype)
    _close(back(out), oracle_attention(q, k, v, **kw), FORWARD_TOL["float32"], "forward")
    if grads is not None:
        want = oracle_grads(q, k, v, d_out, **kw)
        for name, got, expected in zip("qkv", grads, want, strict=True):
            _close(back(got), expected, GRAD_TOL, f"d{name}")


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 CPU devices (tests/conftest.py sets XLA_FLAGS "
                    "--xla_force_host_platform_device_count=8 before JAX starts)")
@pytest.mark.parametrize("seed", SEEDS)
def test_parallel_fuzz(seed):
    """Meshes of 2 to 8 devices (the sequence over 2 or 4, beside batch or heads), ring and all-gather
    in turn, natural and zigzag layouts, q_len above and below kv_len, every mask option and mixed-width
    segment ids; float32 forward, gradients for about half."""
    cases = fuzz_cases.parallel_cases(seed, PARALLEL_CASES, PARALLEL_IMPLS)
    outcomes = Outcomes()
    for case in cases:
        outcomes.run(case, f"{case.impl} {case.strategy} seed={seed} index={case.index}",
                     lambda case=case: _check_parallel(case))
    outcomes.check(cases)
    # Every case is divisible by its mesh and its local kernel serves every mask: none may be refused.
    assert len(outcomes.ran) == len(cases), outcomes.refused


# ---------------------------------------------------------------------------------------------- decode
def _decode_function(case, impl):
    """One function per case and implementation: op by op with concrete lengths and table (``eager``),
    or compiled with both traced (``jit``) or the lengths traced beside a NumPy table (``jit-lengths``:
    the table is a constant, so each draw compiles)."""
    options = dict(case.pallas_options) if impl == "pallas" else {}
    kw = case.kwargs()

    def attend(q, k, v, lengths, table):
        return decode.attention(q, k, v, lengths, page_table=table, impl=impl, **kw, **options)

    if case.mode == "eager":
        return attend
    if case.mode == "jit":
        return jax.jit(attend)
    return lambda q, k, v, lengths, table: jax.jit(lambda q, k, v, lengths: attend(q, k, v, lengths, table))(
        q, k, v, lengths)


def _check_decode(case, impl, fn, draw):
    poison = impl in ("reference", "pallas")  # the natives read masked rows as data (decode/native.py)
    q, k, v, lengths, table = case.data(draw, poison)
    cast = [jnp.asarray(x, case.dtype) for x in (q, k, v)]
    out = fn(*cast, lengths, table)
    assert out.shape == q.shape and out.dtype == jnp.dtype(case.dtype), (out.shape, out.dtype)
    inputs64 = [np.asarray(x.astype(jnp.float32), np.float64) for x in cast]
    want = oracle_decode(*inputs64, lengths.astype(np.int64), page_table=table, **case.oracle_kwargs())
    _close(out, want, DECODE_TOL["bfloat16" if impl in BF16_INSIDE else case.dtype], "forward")


@pytest.mark.parametrize("seed", SEEDS)
def test_decode_fuzz(seed):
    """Paged caches (random page permutations, ``-1`` in every unused entry, spare pages) and contiguous
    ones, ragged lengths with 0, full and shorter than q_len in every draw, lengths of five integer
    dtypes, concrete or traced under jit, q_len 1 to 4, GQA, windows, soft-cap, scale, the split-K
    kernel's block options; every implementation, poisoned rows where the contract says so."""
    cases = fuzz_cases.decode_cases(seed, DECODE_CASES)
    outcomes = Outcomes()
    for case in cases:
        for impl in decode.implementations():
            fn = _decode_function(case, impl)

            def check(case=case, impl=impl, fn=fn):
                for draw in range(case.draws):
                    _with_draw(draw, _check_decode, case, impl, fn, draw)

            outcomes.run(case, f"{impl} seed={seed} index={case.index}", check)
    outcomes.check(cases, must_run="reference")


# ------------------------------------------------------------------------------------ a user's shard_map
# One case a seed (eager shard_maps with gradients cost 25-80 s of a core each); the implementations
# whose shard_map bugs were found first lead the rotation, so the unit stage's seeds reach them.
USER_SHARD_MAP_CASES = 1


def _user_shard_map(fn, mesh, in_specs, out_specs):
    """The user's ``shard_map`` with its default checks: ``jax.shard_map`` (JAX 0.10) or
    ``jax.experimental.shard_map`` (0.7)."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    from jax.experimental.shard_map import shard_map

    return shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def _check_user_shard_map(case):
    from jax.sharding import PartitionSpec as P

    q, k, v, d_out = case.data()
    mesh = _mesh((("x", case.devices),))
    split = P("x") if case.split == "batch" else P(None, None, "x")
    sink_spec = P() if case.split == "batch" else P("x")  # replicated, or one logit per local head
    sinks = None if case.sinks is None else jnp.asarray(case.sinks, jnp.float32)
    attend = lambda q, k, v, z: tpuattn.attention(q, k, v, sinks=z, impl=case.impl, **case.kwargs())
    if sinks is None:
        sharded = _user_shard_map(lambda q, k, v: attend(q, k, v, None), mesh, (split,) * 3, split)
        args, argnums = (q, k, v), (0, 1, 2)
    else:
        sharded = _user_shard_map(attend, mesh, (split,) * 3 + (sink_spec,), split)
        args, argnums = (q, k, v, sinks), (0, 1, 2, 3)
    loss = lambda *a: jnp.sum(sharded(*a) * d_out)
    both = jax.value_and_grad(lambda *a: (loss(*a), sharded(*a)), argnums=argnums, has_aux=True)
    if case.mode == "jit":
        both = jax.jit(both)
    (_, out), grads = both(*args)
    kw = case.oracle_kwargs()
    _close(out, oracle_attention(q, k, v, **kw), FORWARD_TOL["float32"], "forward")
    want = oracle_grads(q, k, v, d_out, **kw)
    for name, got, expected in zip(("dq", "dk", "dv", "dsinks"), grads, want, strict=False):
        _close(got, expected, GRAD_TOL, f"{name} (the sinks' gradient is the sum of every device's share)")
    if case.mode == "eager":  # the same call outside any shard_map: no cache may keep the trace
        _close(tpuattn.attention(q, k, v, sinks=sinks, impl=case.impl, **case.kwargs()),
               oracle_attention(q, k, v, **kw), FORWARD_TOL["float32"], "forward after the shard_map")


@pytest.mark.parametrize("seed", SEEDS)
def test_users_shard_map_fuzz(seed):
    """The contract inside a user's own ``shard_map``: batch or heads split over 2 or 4 devices, sinks
    replicated or split with the heads (none, ordinary, or a large one beside ``-inf``), causal,
    windows and soft-caps; gradients eager or under jit, the sinks' the sum over the devices."""
    first = tuple(i for i in ("splash", "blockwise") if i in tpuattn.implementations())
    impls = first + tuple(i for i in tpuattn.implementations() if i not in first + ("pallas",)) + ("pallas",)
    cases = fuzz_cases.user_shard_map_cases(seed, USER_SHARD_MAP_CASES, impls)
    outcomes = Outcomes()
    for case in cases:
        outcomes.run(case, f"{case.impl} {case.mode} seed={seed} index={case.index}",
                     lambda case=case: _check_user_shard_map(case))
    outcomes.check(cases)


# ---------------------------------------------------------------------------------------------- the generator
def test_generator_is_seeded_and_covers_the_space():
    """Same seed, same cases; and across the seeds 0-19 the generator reaches every option it claims."""
    impls = ("reference", "xla", "blockwise", "pallas", "splash")
    assert fuzz_cases.attention_cases(3, 4, impls, HEAVY) == fuzz_cases.attention_cases(3, 4, impls, HEAVY)
    attn = [c for s in range(20) for c in fuzz_cases.attention_cases(s, ATTENTION_CASES, impls, HEAVY)]
    segs = [c.segments for c in attn if c.segments is not None]
    assert {s.q_dtype for s in segs} | {s.kv_dtype for s in segs} == set(fuzz_cases.ID_DTYPES)
    assert any(s.q_dtype != s.kv_dtype for s in segs) and {s.form for s in segs} == {"single", "pair"}
    windows = [c.window for c in attn]
    assert {type(w) for w in windows} >= {type(None), int, np.int32, tuple, list}
    assert {c.dtype for c in attn} == set(fuzz_cases.ATTENTION_DTYPES) and any(c.grad for c in attn)
    assert {i for c in attn for i in c.impls} == set(impls)
    assert {c.softcap is None for c in attn} == {True, False} and {c.causal for c in attn} == {True, False}
    dec = [c for s in range(20) for c in fuzz_cases.decode_cases(s, DECODE_CASES)]
    assert {c.mode for c in dec} == {"eager", "jit", "jit-lengths"}
    assert {c.paged for c in dec} == {True, False} and {c.q_len for c in dec} == {1, 2, 3, 4}
    assert {c.lengths_dtype for c in dec} == set(fuzz_cases.LENGTH_DTYPES)
    par = [c for s in range(20) for c in fuzz_cases.parallel_cases(s, PARALLEL_CASES, PARALLEL_IMPLS)]
    assert {c.strategy for c in par} == {"ring", "allgather"}
    assert {c.layout for c in par} == {"natural", "zigzag"}
    user = [c for s in range(20) for c in fuzz_cases.user_shard_map_cases(s, USER_SHARD_MAP_CASES, impls)]
    assert {c.impl for c in user} == set(impls) and {c.mode for c in user} == {"jit", "eager"}
    assert {c.split for c in user} == {"batch", "heads"} and {c.devices for c in user} == {2, 4}
    assert any(c.sinks is None for c in user) and any(c.sinks and -np.inf in c.sinks for c in user)
    # Every draw of a case's data: the ids hold their dtype's limits, lengths reach 0 and the capacity,
    # unused page-table entries are -1.
    at_limits = 0
    for c in (c for c in attn if c.segments is not None and c.segments.form == "pair"):
        segs, oracle = c.data(0)[4:]
        assert (segs[0].dtype.name, segs[1].dtype.name) == (c.segments.q_dtype, c.segments.kv_dtype)
        assert all(np.array_equal(s.astype(np.int64), o) for s, o in zip(segs, oracle, strict=True))
        at_limits += any(np.isin([np.iinfo(s.dtype).min, np.iinfo(s.dtype).max], s).any() for s in segs)
    assert at_limits >= 10, at_limits
    case = next(c for c in dec if c.paged)
    _, _, _, lengths, table = case.data(0, poison=False)
    assert 0 in lengths and case.capacity in lengths and (table == -1).any()
