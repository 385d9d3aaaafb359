"""Every bad input is rejected before any implementation runs, with a message that names the
argument, says what was expected and what was given."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest

import tpuattn
from tpuattn import api, registry


def arrays(q_shape=(2, 6, 4, 8), kv_shape=(2, 6, 2, 8), dtype=jnp.float32):
    q = jnp.zeros(q_shape, dtype)
    k = jnp.zeros(kv_shape, dtype)
    return q, k, jnp.zeros(kv_shape, dtype)


def call(q=None, k=None, v=None, **kwargs):
    dq, dk, dv = arrays()
    return tpuattn.attention(dq if q is None else q, dk if k is None else k, dv if v is None else v,
                             impl="reference", **kwargs)


def test_valid_call_passes():
    """The baseline every bad case below departs from is itself accepted."""
    out = call(causal=True, window=(2, 0), softcap=30.0, scale=0.5,
               segment_ids=jnp.zeros((2, 6), jnp.int32))
    assert out.shape == (2, 6, 4, 8) and out.dtype == jnp.float32


# ------------------------------------------------------------------ shapes
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_wrong_rank(name):
    bad = jnp.zeros((2, 6, 8))
    with pytest.raises(ValueError, match=rf"^{name}: expected rank 4 \[batch, seq, heads, head_dim\], "
                                         r"got shape \(2, 6, 8\)"):
        call(**{name: bad})


def test_batch_mismatch():
    _, k, v = arrays(kv_shape=(3, 6, 2, 8))
    with pytest.raises(ValueError, match=r"^k: expected batch 2 \(q's batch\), got 3$"):
        call(k=k, v=v)


def test_head_dim_mismatch():
    _, k, v = arrays(kv_shape=(2, 6, 2, 16))
    with pytest.raises(ValueError, match=r"^k: expected head_dim 8 \(q's head_dim\), got 16$"):
        call(k=k, v=v)


def test_heads_not_divisible():
    _, k, v = arrays(kv_shape=(2, 6, 3, 8))
    with pytest.raises(ValueError, match=r"^q: expected a number of heads divisible by k's 3 heads .*got 4$"):
        call(k=k, v=v)


def test_k_v_shape_mismatch():
    _, k, _ = arrays()
    v = jnp.zeros((2, 7, 2, 8))
    with pytest.raises(ValueError, match=r"^k and v: expected the same shape, got k \(2, 6, 2, 8\) "
                                         r"and v \(2, 7, 2, 8\)$"):
        call(k=k, v=v)


def test_empty_sequence():
    q = jnp.zeros((2, 0, 4, 8))
    with pytest.raises(ValueError, match=r"^q: expected a sequence length of at least 1, got 0$"):
        call(q=q)


def test_not_an_array():
    with pytest.raises(TypeError, match=r"^q: expected an array, got list$"):
        call(q=[[1.0]])


# ------------------------------------------------------------------ dtypes
def test_mixed_dtypes():
    q = jnp.zeros((2, 6, 4, 8), jnp.bfloat16)
    with pytest.raises(TypeError,
                       match=r"^q, k, v: expected one dtype, got q bfloat16, k float32, v float32$"):
        call(q=q)


@pytest.mark.parametrize("dtype", [np.int32, np.float64])
def test_unsupported_dtype(dtype):
    # NumPy arrays: jax would silently turn float64 into float32 without jax_enable_x64.
    q, k, v = (np.zeros(s, dtype) for s in ((2, 6, 4, 8), (2, 6, 2, 8), (2, 6, 2, 8)))
    expected = re.escape(str(np.dtype(dtype)))
    with pytest.raises(TypeError, match=r"^q, k, v: expected a dtype in "
                                        rf"\['float32', 'bfloat16', 'float16'\], got {expected}$"):
        tpuattn.attention(q, k, v, impl="reference")


# ------------------------------------------------------------------ segment ids
def test_non_integer_segment_ids():
    with pytest.raises(ValueError, match=r"^segment_ids \(q_segment_ids\): expected an integer dtype, "
                                         r"got float32$"):
        call(segment_ids=jnp.zeros((2, 6), jnp.float32))


@pytest.mark.parametrize("shape", [(2, 5), (1, 6), (2, 6, 1)])
def test_misshaped_segment_ids(shape):
    with pytest.raises(ValueError, match=rf"^segment_ids \(q_segment_ids\): expected shape \(2, 6\), "
                                         rf"got {re.escape(str(shape))}$"):
        call(segment_ids=jnp.zeros(shape, jnp.int32))


def test_misshaped_kv_segment_ids_in_pair():
    pair = (jnp.zeros((2, 6), jnp.int32), jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match=r"^segment_ids \(kv_segment_ids\): expected shape \(2, 6\), "
                                         r"got \(2, 4\)$"):
        call(segment_ids=pair)


def test_segment_pair_of_wrong_length():
    triple = (jnp.zeros((2, 6), jnp.int32),) * 3
    with pytest.raises(ValueError, match=r"^segment_ids: expected an array \[batch, seq\] or a pair .*"
                                         r"got a sequence of length 3$"):
        call(segment_ids=triple)


def test_single_segment_array_needs_equal_lengths():
    _, k, v = arrays(kv_shape=(2, 9, 2, 8))
    with pytest.raises(ValueError, match=r"^segment_ids: a single array needs q_len == kv_len; .*"
                                         r"for q_len=6, kv_len=9$"):
        call(k=k, v=v, segment_ids=jnp.zeros((2, 6), jnp.int32))


# ------------------------------------------------------------------ window, softcap, scale, causal
@pytest.mark.parametrize("window, side, value",
                         [(-1, "left", -1), ((3, -2), "right", -2), ((-5, None), "left", -5)])
def test_negative_window(window, side, value):
    with pytest.raises(ValueError, match=rf"^window: expected a non-negative {side} extent, got {value}$"):
        call(window=window)


@pytest.mark.parametrize("window", [1.5, "2", (1, 2, 3), True])
def test_window_not_int_or_pair(window):
    with pytest.raises(ValueError, match=r"^window: expected an int or a pair \(left, right\) of ints "
                                         rf"or None, got {re.escape(repr(window))}$"):
        call(window=window)


def test_window_side_not_int():
    with pytest.raises(ValueError,
                       match=r"^window: expected the right extent to be an int or None, got 2\.0$"):
        call(window=(1, 2.0))


@pytest.mark.parametrize("name", ["softcap", "scale"])
@pytest.mark.parametrize("value, shown", [(0.0, "0.0"), (-1.0, "-1.0"), (float("nan"), "nan"),
                                          (float("inf"), "inf")])
def test_non_positive_or_non_finite_number(name, value, shown):
    with pytest.raises(ValueError, match=rf"^{name}: expected a positive finite number, got {shown}$"):
        call(**{name: value})


@pytest.mark.parametrize("name", ["softcap", "scale"])
def test_number_of_wrong_type(name):
    with pytest.raises(ValueError, match=rf"^{name}: expected a positive Python number or None, got '1'$"):
        call(**{name: "1"})


def test_causal_not_bool():
    with pytest.raises(ValueError, match=r"^causal: expected a bool, got 'yes'$"):
        call(causal="yes")


# ------------------------------------------------------------------ implementations
def test_unknown_impl_lists_known_ones():
    q, k, v = arrays()
    known = tpuattn.known_implementations()
    expected = r"^impl: expected one of \[.*'reference'.*'auto'\], got 'nope'$"
    with pytest.raises(ValueError, match=expected) as info:
        tpuattn.attention(q, k, v, impl="nope")
    for name in known:
        assert repr(name) in str(info.value)


def test_impl_not_a_string():
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"^impl: expected a string, got 3$"):
        tpuattn.attention(q, k, v, impl=3)


@pytest.fixture
def fake_implementations():
    """Register two throwaway implementations; remove them afterwards."""
    calls = []

    def fn(q, k, v, segment_ids, spec, **options):
        calls.append(spec)
        return q

    api._load()
    api.register("_test_unavailable", fn, description="never available", available=lambda: False)
    api.register("_test_picky", fn, description="rejects causal",
                 supports=lambda spec, backend: "causal masks are not implemented" if spec.causal else None)
    yield calls
    for name in ("_test_unavailable", "_test_picky"):
        registry.unregister(name)


def test_unavailable_impl(fake_implementations):
    q, k, v = arrays()
    assert "_test_unavailable" in tpuattn.known_implementations()
    assert "_test_unavailable" not in tpuattn.implementations()
    with pytest.raises(ValueError, match=r"^impl: '_test_unavailable' is not available on backend '\w+'; "
                                         r"available here: \[.*'reference'.*\]$"):
        tpuattn.attention(q, k, v, impl="_test_unavailable")
    assert fake_implementations == []


def test_unsupported_input(fake_implementations):
    q, k, v = arrays()
    with pytest.raises(ValueError, match=r"^impl: '_test_picky' does not support this input: "
                                         r"causal masks are not implemented$"):
        tpuattn.attention(q, k, v, causal=True, impl="_test_picky")
    assert fake_implementations == []
    tpuattn.attention(q, k, v, causal=False, impl="_test_picky")
    assert len(fake_implementations) == 1 and fake_implementations[0].group_size == 2


def test_unknown_option_named():
    with pytest.raises(ValueError,
                       match=r"^reference: unknown option\(s\) \['q_block'\]; expected a subset of \[\]$"):
        call(q_block=128)


def test_auto_refuses_an_option_its_choice_does_not_take_naming_the_choice_and_the_takers():
    """Options are one implementation's knobs and never steer impl="auto". Before, the refusal came from
    the chosen implementation and named it alone: "xla: unknown option(s) ['backward']"."""
    q, k, v = arrays()
    spec = tpuattn.make_spec(q, k, v)[-1]
    chosen = api.choose(spec)
    if "pallas" not in tpuattn.implementations() or "backward" in api.get_implementation(chosen.impl).options:
        pytest.skip("needs an auto choice without backward= and pallas available")
    with pytest.raises(tpuattn.UnsupportedInput,
                       match=rf"^impl: 'auto' chose '{chosen.impl}' for this input on {chosen.backend} "
                             rf"\(lowest auto rank .*\), and '{chosen.impl}' takes no option \['backward'\] "
                             r"\(its options: \[.*\]\); 'pallas' takes it: pass impl='pallas'\. impl='auto' "
                             r"chooses by the input alone, never by the options$"):
        tpuattn.attention(q, k, v, impl="auto", backward="fast")
    with pytest.raises(tpuattn.UnsupportedInput, match=r"takes no option \['nope'\] .*; no available "
                                                       r"implementation takes it\."):
        tpuattn.attention(q, k, v, impl="auto", nope=1)


@pytest.mark.parametrize("impl", ["pallas", "splash"])
def test_compiling_a_pallas_kernel_off_a_tpu_is_refused_by_name(impl):
    """Before: Pallas's raw "Only interpret mode is supported on CPU backend"."""
    if impl not in tpuattn.implementations():
        pytest.skip(f"{impl} not available")
    from tpuattn import chips

    if chips.target_backend() == "tpu":
        pytest.skip("on a TPU interpret=False compiles")
    q, k, v = arrays(q_shape=(1, 128, 2, 64), kv_shape=(1, 128, 2, 64))
    with pytest.raises(tpuattn.UnsupportedInput,
                       match=rf"^interpret: expected True or None \(interpret mode\) for impl='{impl}' on "
                             rf"backend '{chips.target_backend()}': False compiles the Pallas kernel for a "
                             r"TPU, which this target is not \(compile for one inside "
                             r"tpuattn\.chips\.target\(\.\.\.\)\); got False$"):
        tpuattn.attention(q, k, v, impl=impl, interpret=False)
