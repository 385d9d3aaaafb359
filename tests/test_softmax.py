"""The one partial-softmax seam: tpuattn.softmax's Partial, empty, merge and the lse conversions,
against a float64 NumPy oracle; and every implementation's partial forward speaks it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_qkv

import tpuattn
from tpuattn import api, softmax
from tpuattn.spec import block_spec

B, T, H, D, S = 2, 5, 3, 4, 24  # batch, queries, heads, head_dim, keys


# ---------------------------------------------------------------------------- the float64 oracle
def oracle(s, v, allowed):
    """Attention of logits ``s [b, H, T, S]`` (float64) over the ``allowed [b, H, T, S]`` keys of
    ``v [b, S, H, D]``: ``(out [b, T, H, D], lse [b, H, T])``, zeros and ``-inf`` for a row with none."""
    masked = np.where(allowed, s, -np.inf)
    top = masked.max(-1, keepdims=True) if s.shape[-1] else np.full(s.shape[:-1] + (1,), -np.inf)
    top0 = np.where(np.isfinite(top), top, 0.0)
    w = np.where(allowed, np.exp(masked - top0), 0.0)
    total = w.sum(-1, keepdims=True)
    p = w / np.where(total > 0, total, 1.0)
    with np.errstate(divide="ignore"):
        lse = (top0 + np.log(total))[..., 0]
    return np.einsum("bhts,bshd->bthd", p, v), np.where(total[..., 0] > 0, lse, -np.inf)


def oracle_part(s, v, allowed):
    """A part as the kernels hand it over: ``m`` the row max (exactly representable in float32) and
    ``log_l`` relative to it, both from float64."""
    out, lse = oracle(s, v, allowed)
    m = np.where(allowed, s, -np.inf).max(-1)
    m32 = m.astype(np.float32).astype(np.float64)
    with np.errstate(invalid="ignore"):
        log_l = np.where(np.isfinite(m32), lse - m32, 0.0)
    return softmax.Partial(jnp.asarray(out, jnp.float32), jnp.asarray(m32, jnp.float32),
                           jnp.asarray(log_l, jnp.float32))


def problem(scale, seed=0):
    """Logits, values and a visibility with: row (0, 0, 1) seeing no key at all, every key of part 1
    (of 3) hidden from row (1, 2, 3), and random gaps elsewhere."""
    rng = np.random.default_rng(seed)
    s = scale * rng.standard_normal((B, H, T, S))
    v = rng.standard_normal((B, S, H, D))
    allowed = rng.random((B, H, T, S)) < 0.7
    allowed[0, 0, 1] = False
    allowed[1, 2, 3, 8:16] = False
    return s, v, allowed


def split(s, v, allowed, n):
    """The keys cut into ``n`` disjoint sets (interleaved, not contiguous: a merge must not care)."""
    owner = np.arange(S) % n if n != 3 else np.arange(S) // 8
    return [oracle_part(s, v, allowed & (owner == i)) for i in range(n)]


# ---------------------------------------------------------------------------- merge
@pytest.mark.parametrize("scale", [1.0, 1e4], ids=["logits~1", "logits~1e4"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_merge_matches_the_float64_oracle(n, scale):
    s, v, allowed = problem(scale)
    merged = softmax.merge(*split(s, v, allowed, n))
    want_out, want_lse = oracle(s, v, allowed)
    out, m, log_l = (np.asarray(x, np.float64) for x in merged)
    assert merged.out.dtype == merged.m.dtype == merged.log_l.dtype == jnp.float32
    assert out.shape == (B, T, H, D) and m.shape == log_l.shape == (B, H, T)
    # Nothing overflows, and a row no part saw is the empty state exactly.
    assert np.isfinite(out).all() and np.isfinite(log_l).all()
    np.testing.assert_array_equal(out[0, 1, 0], 0.0)
    assert m[0, 0, 1] == -np.inf and log_l[0, 0, 1] == 0.0
    np.testing.assert_allclose(out, want_out, atol=2e-6, rtol=2e-6)
    # The two terms stay separate: m is a part's float32 max, exact; log_l relative to it keeps the
    # precision that m + log_l in float32 (ulp 1e-3 at 1e4) would lose.
    seen = np.isfinite(want_lse)
    np.testing.assert_array_equal(m[seen], np.where(allowed, s, -np.inf).max(-1).astype(np.float32)[seen])
    np.testing.assert_allclose(log_l[seen], want_lse[seen] - m[seen], atol=2e-6, rtol=2e-6)
    np.testing.assert_allclose(np.asarray(softmax.to_lse(merged))[seen], want_lse[seen], rtol=1e-6)


def test_merge_is_associative_and_order_free_and_jits():
    parts = split(*problem(3.0, seed=1), 3)
    whole = softmax.merge(*parts)
    for other in (softmax.merge(softmax.merge(parts[0], parts[1]), parts[2]),
                  softmax.merge(parts[2], softmax.merge(parts[1], parts[0])),
                  jax.jit(softmax.merge)(*parts)):
        for a, b in zip(whole, other, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-6)


def test_empty_is_the_identity_and_merges_of_nothing_are_empty():
    part = split(*problem(2.0, seed=2), 1)[0]
    e = softmax.empty(B, T, H, D)
    assert e.out.shape == (B, T, H, D) and e.m.shape == (B, H, T)
    for got in (softmax.merge(e, part), softmax.merge(part, e, e)):
        for a, b in zip(got, part, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    nothing = softmax.merge(e, e, e)
    np.testing.assert_array_equal(np.asarray(nothing.out), 0.0)
    assert np.all(np.asarray(nothing.m) == -np.inf) and np.all(np.asarray(nothing.log_l) == 0.0)


def test_lse_round_trip():
    s, v, allowed = problem(1e4, seed=3)
    parts = split(s, v, allowed, 2)
    via_lse = [softmax.from_lse(p.out, softmax.to_lse(p)) for p in parts]
    want_out, want_lse = oracle(s, v, allowed)
    got = softmax.merge(*via_lse)
    np.testing.assert_allclose(np.asarray(got.out), want_out, atol=2e-6, rtol=2e-6)
    lse = np.asarray(softmax.to_lse(got))
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    # from_lse zeroes the output of a row that saw nothing, whatever the caller left there.
    fixed = softmax.from_lse(jnp.full((1, 2, 1, 3), 7.0), jnp.asarray([[[0.5, -jnp.inf]]]))
    np.testing.assert_array_equal(np.asarray(fixed.out)[0, 1], 0.0)
    np.testing.assert_array_equal(np.asarray(fixed.out)[0, 0], 7.0)


@pytest.mark.parametrize("scale", [1.0, 1e4], ids=["logits~1", "logits~1e4"])
def test_merge_gradients_match_the_float64_oracle(scale):
    # d out / d out_i = a_i, d out / d(m_i or log_l_i) = a_i (out_i - out), a_i = exp(lse_i - lse).
    s, v, allowed = problem(scale, seed=4)
    parts = split(s, v, allowed, 3)
    rng = np.random.default_rng(5)
    ct = rng.standard_normal((B, T, H, D))
    loss = lambda parts: jnp.sum(softmax.merge(*parts).out * ct)
    grads = jax.grad(loss)(parts)
    # Each part's lse relative to the whole's, in float64 from the two terms (m + log_l in float32
    # would carry an error of 1e-3 at logits of 1e4).
    total = oracle(s, v, allowed)[1]
    total0 = np.where(np.isfinite(total), total, 0.0)
    as64 = lambda x: np.asarray(x, np.float64)
    with np.errstate(invalid="ignore"):
        a = np.stack([np.where(np.isfinite(as64(p.m)), np.exp((as64(p.m) - total0) + as64(p.log_l)), 0.0)
                      for p in parts])  # [n, b, H, T]
    a = np.swapaxes(a, -1, -2)[..., None]  # [n, b, T, H, 1]
    merged = np.asarray(softmax.merge(*parts).out, np.float64)
    for i, (g, p) in enumerate(zip(grads, parts, strict=True)):
        assert all(np.isfinite(np.asarray(x)).all() for x in g), f"part {i}: NaN/inf gradient"
        np.testing.assert_allclose(np.asarray(g.out), a[i] * ct, atol=1e-5, rtol=1e-5)
        d_stats = np.swapaxes(np.sum(ct * a[i] * (np.asarray(p.out, np.float64) - merged), -1), -1, -2)
        np.testing.assert_allclose(np.asarray(g.m), d_stats, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(g.log_l), d_stats, atol=1e-5, rtol=1e-5)


def test_bad_parts_are_refused_by_name():
    e = softmax.empty(1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"^parts: expected at least one softmax.Partial, got none$"):
        softmax.merge()
    with pytest.raises(ValueError, match=r"^parts\[1\]: expected a softmax.Partial \(out, m, log_l\), got "
                                         r"ndarray$"):
        softmax.merge(e, np.zeros(3))
    with pytest.raises(ValueError, match=r"^parts\[1\].out: expected the shape of parts\[0\].out"):
        softmax.merge(e, softmax.empty(1, 2, 3, 5))
    with pytest.raises(ValueError, match=r"^parts\[0\].m and .log_l: expected shape \[batch, heads, q_len\]"):
        softmax.merge(softmax.Partial(e.out, e.m[..., :1], e.log_l))


# ---------------------------------------------------------------------------- the implementations' edge
@pytest.mark.parametrize("impl", ["reference", "blockwise", "pallas"])
def test_partial_forward_is_a_float32_partial_finer_than_bf16(impl):
    # bf16 inputs; a causal block whose first half of query rows sees none of its keys. The output
    # must come back in float32, not rounded to bf16 before the merge: its error against the float64
    # oracle (of the same bf16 values) stays well below bf16's rounding of the output itself. q = 0
    # makes every logit 0, so the probabilities the kernels round to bf16 for P @ V are exactly 1
    # and the output (the mean of each row's visible values) is the only thing bf16 could round.
    rng = np.random.default_rng(6)
    q, k, v = random_qkv(rng, 256, 256, batch=1, q_heads=2, kv_heads=1, head_dim=64, dtype=jnp.bfloat16)
    q = np.zeros_like(q)
    v = (v.astype(jnp.float32) + 8.0).astype(jnp.bfloat16)  # outputs near 8: bf16's ulp there is 1/16
    spec = tpuattn.make_spec(q, k, v, causal=True)[-1]
    block = block_spec(spec, q_start=0, q_len=256, kv_start=128, kv_len=128)
    part = api.get_implementation(impl).partial.forward(q, k[:, 128:], v[:, 128:], None, block)
    assert isinstance(part, softmax.Partial)
    assert part.out.dtype == part.m.dtype == part.log_l.dtype == jnp.float32
    # Oracle: the same block, in float64 (rows see keys 128..t).
    q64, k64, v64 = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k[:, 128:], v[:, 128:]))
    s = np.einsum("bthd,bshd->bhts", q64, np.repeat(k64, 2, axis=2)) * spec.scale
    allowed = np.broadcast_to((np.arange(128)[None, :] + 128 <= np.arange(256)[:, None]), s.shape)
    want_out, want_lse = oracle(s, np.repeat(v64, 2, axis=2), allowed)
    out = np.asarray(part.out, np.float64)
    np.testing.assert_array_equal(out[:, :128], 0.0)
    assert np.all(np.asarray(part.m)[..., :128] == -np.inf) and np.all(np.asarray(part.log_l)[..., :128] == 0)
    err = np.max(np.abs(out - want_out))
    bf16_rounding = np.max(np.abs(np.asarray(jnp.asarray(want_out, jnp.bfloat16).astype(jnp.float32))
                                  - want_out))
    assert bf16_rounding > 0.01  # the outputs sit where bf16 cannot hold them
    assert err < bf16_rounding / 4, (err, bf16_rounding)
    np.testing.assert_allclose(np.asarray(softmax.to_lse(part))[..., 128:], want_lse[..., 128:],
                               atol=2e-3, rtol=2e-3)
