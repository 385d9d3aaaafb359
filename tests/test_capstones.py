"""The capstones (tpuattn.puzzles.capstones): a stub is "not written yet", a whole-kernel answer passes
(interpret mode against the float64 oracle, the audits, the v5e compile), and each near miss -- one
plausible slip away from the answer -- fails with the message that names the slip.

The answers here are written apart from notebook 12's solution cells, with switches for the slips;
tests/test_puzzles.py runs the notebook's own stubs and solutions. The ring needs four CPU devices
(conftest.py gives the process eight).
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from tpuattn.puzzles import capstones as cap  # noqa: E402
from tpuattn.puzzles import core  # noqa: E402

BLOCK, SCALE = cap.BLOCK, cap.SCALE


def _qk(a, b):
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _tn(a, b):
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _params(*semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics)


def _check(puzzle, answer, capsys) -> tuple[bool | None, str]:
    verdict = core.check(puzzle, answer)
    return verdict, capsys.readouterr().out.strip()


def _compiles() -> bool:
    from tpuattn.measure import aot

    return aot.compiler_problem("v5e") is None


def _assert_pass(puzzle, answer, capsys):
    verdict, out = _check(puzzle, answer, capsys)
    assert verdict is True, out
    if _compiles():
        assert out == f"PASS {puzzle.name}: matches the float64 oracle (interpret mode), compiled for v5e"


# ---------------------------------------------------------------------------------------------------
# F. the forward, with switches for its near misses.

def causal_schedule(seq, block, *, skip_diagonal=False):
    """Query block i visits K/V blocks 0..i; each row padded with its last block (no copy)."""
    n = seq // block
    last = np.arange(n) - (1 if skip_diagonal else 0)
    table = np.stack([np.minimum(np.arange(n), max(int(last[i]), 0)) for i in range(n)]).astype(np.int32)
    return table, np.maximum(last + 1, 1).astype(np.int32)


def _forward_kernel(*, lse_with_max=True):
    def kernel(table_ref, counts_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref):
        i, j = pl.program_id(1), pl.program_id(2)
        kv = table_ref[i, j]

        @pl.when(j == 0)
        def _init():
            m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        @pl.when(j < counts_ref[i])
        def _step():
            s = _qk(q_ref[...], k_ref[...]) * SCALE
            rows = i * BLOCK + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
            cols = kv * BLOCK + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
            s = jnp.where(cols <= rows, s, -jnp.inf)
            m_old = m_ref[...]
            m_new = jnp.maximum(m_old, s.max(axis=1, keepdims=True))
            p = jnp.exp(s - m_new)
            alpha = jnp.exp(m_old - m_new)
            l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
            acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p.astype(v_ref.dtype), v_ref[...],
                                                          preferred_element_type=jnp.float32)
            m_ref[...] = m_new

        @pl.when(j == pl.num_programs(2) - 1)
        def _finish():
            o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)
            log_l = jnp.log(l_ref[...])
            lse_ref[...] = m_ref[...] + log_l if lse_with_max else log_l
    return kernel


def forward_answer(*, skip_diagonal=False, lse_with_max=True, kv_semantics="arbitrary",
                   kv_head="group", use_table=True):
    def flash_forward(q, k, v, *, interpret):
        heads, seq, d = q.shape
        group = heads // k.shape[0]
        table, counts = causal_schedule(seq, BLOCK, skip_diagonal=skip_diagonal)

        def kv_map(h, i, j, table, counts):
            head = jax.lax.div(h, group) if kv_head == "group" else h
            return head, table[i, j] if use_table else j, 0

        q_spec = pl.BlockSpec((None, BLOCK, d), lambda h, i, j, table, counts: (h, i, 0))
        kv_spec = pl.BlockSpec((None, BLOCK, d), kv_map)
        lse_spec = pl.BlockSpec((None, BLOCK, 1), lambda h, i, j, table, counts: (h, i, 0))
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(heads, seq // BLOCK, table.shape[1]),
            in_specs=[q_spec, kv_spec, kv_spec], out_specs=[q_spec, lse_spec],
            scratch_shapes=[pltpu.VMEM((BLOCK, 1), jnp.float32), pltpu.VMEM((BLOCK, 1), jnp.float32),
                            pltpu.VMEM((BLOCK, d), jnp.float32)])
        return cap.pallas_call(
            _forward_kernel(lse_with_max=lse_with_max), grid_spec=grid_spec,
            out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                       jax.ShapeDtypeStruct((heads, seq, 1), jnp.float32)],
            compiler_params=_params("parallel", "parallel", kv_semantics), interpret=interpret,
            in_names=("q", "k", "v"), out_names=("out", "lse"),
        )(jnp.asarray(table), jnp.asarray(counts), q, k, v)
    return flash_forward


def _not_written(*args, **kwargs):
    raise NotImplementedError("write the whole kernel")


@pytest.mark.parametrize("puzzle", cap.PUZZLES, ids=lambda p: p.name.split(":")[0] + p.name[-8:])
def test_a_stub_is_not_written_yet(puzzle, capsys):
    verdict, out = _check(puzzle, _not_written, capsys)
    assert verdict is False and out == f"{puzzle.name}: not written yet"


def test_the_forward_passes_in_float32_and_bfloat16(capsys):
    _assert_pass(cap.FORWARD, forward_answer(), capsys)
    _assert_pass(cap.FORWARD_BF16, forward_answer(), capsys)


@pytest.mark.parametrize("slip, message", [
    ({"skip_diagonal": True}, "out mismatch at index (0, 128, 0)"),
    ({"lse_with_max": False}, "lse mismatch at index (0, 0, 0)"),
    ({"kv_semantics": "parallel"}, 'differ along grid axis 2, marked "parallel"'),
    ({"kv_head": "query"},
     "the k index map asks for block (2, 0, 0) at grid step (2, 0, 0); k has 2 x 4 x 1 blocks"),
    ({"use_table": False},
     "at grid step (0, 0, 1) of the launch that writes out, lse the q and k index maps name query block 0 "
     "and K/V block 1, which the causal mask keeps apart"),
], ids=["schedule skips the diagonal", "lse without the max", "kv axis parallel",
        "GQA map by query head", "hidden blocks named"])
def test_forward_near_misses_fail_with_their_message(slip, message, capsys):
    verdict, out = _check(cap.FORWARD, forward_answer(**slip), capsys)
    assert verdict is False and out.startswith(f"FAIL {cap.FORWARD.name}: "), out
    assert message in out, out


# ---------------------------------------------------------------------------------------------------
# G. the backward and its custom VJP.

def backward_schedule(seq, block):
    """K/V block j is seen by query blocks j..n-1; each row padded with its last block."""
    n = seq // block
    table = np.stack([np.minimum(np.arange(n) + j, n - 1) for j in range(n)]).astype(np.int32)
    return table, (n - np.arange(n)).astype(np.int32)


def _probabilities(q, k, lse, i, j):
    s = _qk(q, k) * SCALE
    rows = i * BLOCK + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
    cols = j * BLOCK + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    return jnp.where(cols <= rows, jnp.exp(s - lse), 0.0)


def _dq_kernel(*, with_delta):
    def kernel(table_ref, counts_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, acc_ref):
        i, t = pl.program_id(1), pl.program_id(2)

        @pl.when(t == 0)
        def _init():
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        @pl.when(t < counts_ref[i])
        def _step():
            k = k_ref[...]
            p = _probabilities(q_ref[...], k, lse_ref[...], i, table_ref[i, t])
            dp = _qk(do_ref[...], v_ref[...])
            ds = p * (dp - delta_ref[...]) if with_delta else p * dp
            acc_ref[...] += jnp.dot(ds, k, preferred_element_type=jnp.float32) * SCALE

        @pl.when(t == pl.num_programs(2) - 1)
        def _write():
            dq_ref[...] = acc_ref[...].astype(dq_ref.dtype)
    return kernel


def _dkv_kernel(table_ref, counts_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref,
                dk_acc, dv_acc):
    j, g, t = pl.program_id(1), pl.program_id(2), pl.program_id(3)

    @pl.when((g == 0) & (t == 0))
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    @pl.when(t < counts_ref[j])
    def _step():
        q, do = q_ref[...], do_ref[...]
        p = _probabilities(q, k_ref[...], lse_ref[...], table_ref[j, t], j)
        ds = p * (_qk(do, v_ref[...]) - delta_ref[...])
        dv_acc[...] += _tn(p, do)
        dk_acc[...] += _tn(ds, q) * SCALE

    @pl.when((g == pl.num_programs(2) - 1) & (t == pl.num_programs(3) - 1))
    def _write():
        dk_ref[...] = dk_acc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def backward_answer(*, forward=None, with_delta=True, whole_group=True, swapped=False,
                    group_semantics="arbitrary"):
    forward = forward or forward_answer()
    names = {"in_names": ("q", "k", "v", "do", "lse", "delta")}

    def flash_backward(q, k, v, out, lse, do, *, interpret):
        heads, seq, d = q.shape
        kv_heads = k.shape[0]
        group = heads // kv_heads
        delta = jnp.sum(out.astype(jnp.float32) * do, axis=-1, keepdims=True)
        n = seq // BLOCK
        table, counts = causal_schedule(seq, BLOCK)
        row = pl.BlockSpec((None, BLOCK, d), lambda h, i, t, table, counts: (h, i, 0))
        stat = pl.BlockSpec((None, BLOCK, 1), lambda h, i, t, table, counts: (h, i, 0))
        kv = pl.BlockSpec((None, BLOCK, d),
                          lambda h, i, t, table, counts: (jax.lax.div(h, group), table[i, t], 0))
        dq = cap.pallas_call(
            _dq_kernel(with_delta=with_delta), grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=2, grid=(heads, n, n), in_specs=[row, kv, kv, row, stat, stat],
                out_specs=row, scratch_shapes=[pltpu.VMEM((BLOCK, d), jnp.float32)]),
            out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
            compiler_params=_params("parallel", "parallel", "arbitrary"), interpret=interpret,
            out_names=("dq",), **names)(jnp.asarray(table), jnp.asarray(counts), q, k, v, do, lse, delta)
        table, counts = backward_schedule(seq, BLOCK)
        served = group if whole_group else 1  # the query heads of a group one kv head's grid serves

        def q_map(hk, j, g, t, table, counts):
            return hk * group + g, table[j, t], 0

        row = pl.BlockSpec((None, BLOCK, d), q_map)
        stat = pl.BlockSpec((None, BLOCK, 1), q_map)
        kv = pl.BlockSpec((None, BLOCK, d), lambda hk, j, g, t, table, counts: (hk, j, 0))
        dk, dv = cap.pallas_call(
            _dkv_kernel, grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=2, grid=(kv_heads, n, served, n),
                in_specs=[row, kv, kv, row, stat, stat], out_specs=[kv, kv],
                scratch_shapes=[pltpu.VMEM((BLOCK, d), jnp.float32)] * 2),
            out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
            compiler_params=_params("parallel", "parallel", group_semantics, "arbitrary"),
            interpret=interpret, out_names=("dk", "dv"), **names,
        )(jnp.asarray(table), jnp.asarray(counts), q, k, v, do, lse, delta)
        return (dq, dv, dk) if swapped else (dq, dk, dv)

    def flash_attention(q, k, v, *, interpret):
        @jax.custom_vjp
        def attention(q, k, v):
            return forward(q, k, v, interpret=interpret)[0]

        def attention_forward(q, k, v):
            out, lse = forward(q, k, v, interpret=interpret)
            return out, (q, k, v, out, lse)

        def attention_backward(residuals, do):
            return flash_backward(*residuals, do, interpret=interpret)

        attention.defvjp(attention_forward, attention_backward)
        return attention(q, k, v)
    return flash_attention


def test_the_backward_passes(capsys):
    _assert_pass(cap.BACKWARD, backward_answer(), capsys)


def test_the_backward_passes_on_the_packages_forward(capsys):
    """A learner who skipped F joins the package's Pallas forward (capstones.package_forward) to their
    backward: the check needs no forward launch of theirs."""
    _assert_pass(cap.BACKWARD, backward_answer(forward=cap.package_forward), capsys)


@pytest.mark.parametrize("slip, message", [
    ({"with_delta": False}, "dQ mismatch at index"),
    ({"whole_group": False}, "dK mismatch at index"),
    ({"swapped": True}, "dK mismatch at index"),
    ({"group_semantics": "parallel"},
     'the dk index map names block (0, 0, 0) at grid steps (0, 0, 0, 0) and (0, 0, 1, 0), which differ '
     'along grid axis 2, marked "parallel"'),
], ids=["dS without delta", "dK/dV of one head per group", "dK and dV swapped", "group axis parallel"])
def test_backward_near_misses_fail_with_their_message(slip, message, capsys):
    verdict, out = _check(cap.BACKWARD, backward_answer(**slip), capsys)
    assert verdict is False and out.startswith(f"FAIL {cap.BACKWARD.name}: "), out
    assert message in out, out


def test_the_backward_names_a_missing_launch(capsys):
    """A backward that never launches a dK/dV kernel (here: jax's own VJP of a plain-JAX attention
    for everything) fails the audit by name."""
    def plain(q, k, v, *, interpret):
        k, v = (jnp.repeat(a, cap.GROUP, axis=0) for a in (k, v))
        s = jnp.einsum("hqd,hkd->hqk", q, k) * SCALE
        s = jnp.where(jnp.asarray(cap.causal_visible(q.shape[1])), s, -jnp.inf)
        return jnp.einsum("hqk,hkd->hqd", jax.nn.softmax(s, axis=-1), v)

    verdict, out = _check(cap.BACKWARD, plain, capsys)
    assert verdict is False
    assert "the check saw no launch: build each kernel with capstones.pallas_call" in out, out


# ---------------------------------------------------------------------------------------------------
# H. decode, pages copied by hand.

PAGE = cap.PAGE_SIZE


def _decode_kernel(*, slots=2, wait=True, past_end=False):
    def kernel(table_ref, lengths_ref, q_ref, k_hbm, v_hbm, o_ref, k_buf, v_buf, sems):
        b = pl.program_id(0)
        length = lengths_ref[b]
        num_pages = cap.PAGES_PER_SEQ if past_end else jax.lax.div(length + PAGE - 1, PAGE)

        def copies(p, slot):
            page = table_ref[b, p]
            return (pltpu.make_async_copy(k_hbm.at[page], k_buf.at[slot], sems.at[0, slot]),
                    pltpu.make_async_copy(v_hbm.at[page], v_buf.at[slot], sems.at[1, slot]))

        for copy in copies(0, 0):
            copy.start()
        q = q_ref[...]

        def step(p, state):
            m, l_sum, acc = state
            slot = jax.lax.rem(p, 2) if slots == 2 else 0
            if wait:
                for copy in copies(p, slot):
                    copy.wait()

            @pl.when(p + 1 < num_pages)
            def _prefetch():
                for copy in copies(p + 1, 1 - slot if slots == 2 else slot):
                    copy.start()

            s = _qk(q, k_buf[slot]) * SCALE
            tokens = p * PAGE + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
            s = jnp.where(tokens < length, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
            alpha, pr = jnp.exp(m - m_new), jnp.exp(s - m_new)
            acc = alpha * acc + jnp.dot(pr, v_buf[slot], preferred_element_type=jnp.float32)
            return m_new, alpha * l_sum + pr.sum(axis=1, keepdims=True), acc

        heads, d = q.shape
        state = (jnp.full((heads, 1), -jnp.inf, jnp.float32), jnp.zeros((heads, 1), jnp.float32),
                 jnp.zeros((heads, d), jnp.float32))
        _, l_sum, acc = jax.lax.fori_loop(0, num_pages, step, state)
        o_ref[...] = (acc / l_sum).astype(o_ref.dtype)
    return kernel


def decode_answer(*, slots=2, wait=True, past_end=False):
    def decode_step(q, k_pages, v_pages, page_table, lengths, *, interpret):
        batch, heads, d = q.shape
        row = pl.BlockSpec((None, heads, d), lambda b, table, lengths: (b, 0, 0))
        hbm = pl.BlockSpec(memory_space=pl.ANY)
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(batch,), in_specs=[row, hbm, hbm], out_specs=row,
            scratch_shapes=[pltpu.VMEM((slots, PAGE, d), k_pages.dtype),
                            pltpu.VMEM((slots, PAGE, d), v_pages.dtype), pltpu.SemaphoreType.DMA((2, 2))])
        return cap.pallas_call(
            _decode_kernel(slots=slots, wait=wait, past_end=past_end), grid_spec=grid_spec,
            out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), compiler_params=_params("parallel"),
            interpret=interpret, in_names=("q", "k_pages", "v_pages"), out_names=("out",),
        )(page_table, lengths, q, k_pages, v_pages)
    return decode_step


def _paged_by_the_pipeline(q, k_pages, v_pages, page_table, lengths, *, interpret):
    """Right values, but the pages come through BlockSpecs (puzzle 12's way), not copied by hand."""
    batch, heads, d = q.shape

    def kernel(table_ref, lengths_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref):
        b, p = pl.program_id(0), pl.program_id(1)

        @pl.when(p == 0)
        def _init():
            m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        @pl.when(p * PAGE < lengths_ref[b])
        def _step():
            s = _qk(q_ref[...], k_ref[...]) * SCALE
            tokens = p * PAGE + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
            s = jnp.where(tokens < lengths_ref[b], s, -jnp.inf)
            m_new = jnp.maximum(m_ref[...], s.max(axis=1, keepdims=True))
            alpha, pr = jnp.exp(m_ref[...] - m_new), jnp.exp(s - m_new)
            l_ref[...] = alpha * l_ref[...] + pr.sum(axis=1, keepdims=True)
            acc_ref[...] = alpha * acc_ref[...] + jnp.dot(pr, v_ref[...], preferred_element_type=jnp.float32)
            m_ref[...] = m_new

        @pl.when(p == pl.num_programs(1) - 1)
        def _write():
            o_ref[...] = acc_ref[...] / l_ref[...]

    def page_map(b, p, table, lengths):
        last = jax.lax.div(lengths[b] - 1, PAGE)
        return table[b, jnp.minimum(p, last)], 0, 0

    row = pl.BlockSpec((None, heads, d), lambda b, p, table, lengths: (b, 0, 0))
    page = pl.BlockSpec((None, PAGE, d), page_map)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(batch, cap.PAGES_PER_SEQ), in_specs=[row, page, page], out_specs=row,
        scratch_shapes=[pltpu.VMEM((heads, 1), jnp.float32), pltpu.VMEM((heads, 1), jnp.float32),
                        pltpu.VMEM((heads, d), jnp.float32)])
    return cap.pallas_call(kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
                           compiler_params=_params("parallel", "arbitrary"), interpret=interpret,
                           in_names=("q", "k_pages", "v_pages"), out_names=("out",),
                           )(page_table, lengths, q, k_pages, v_pages)


def test_decode_passes(capsys):
    _assert_pass(cap.DECODE, decode_answer(), capsys)


@pytest.mark.parametrize("answer, message", [
    (decode_answer(slots=1), "race detected by the interpreter's race detector"),
    (decode_answer(past_end=True), "out mismatch at index (0, 0, 0): got nan"),
    (decode_answer(wait=False), "out mismatch at index (0, 0, 0): got nan"),
    (_paged_by_the_pipeline, "k_pages has a BlockSpec with an index map, so the pipeline copies its pages"),
], ids=["one slot", "pages past the end", "no wait", "pages by BlockSpec"])
def test_decode_near_misses_fail_with_their_message(answer, message, capsys):
    verdict, out = _check(cap.DECODE, answer, capsys)
    assert verdict is False and out.startswith(f"FAIL {cap.DECODE.name}: "), out
    assert message in out, out


def test_decode_tables_poison_only_what_no_sequence_owns():
    table, lengths = cap.decode_tables()
    owned = [table[b, :-(-int(n) // PAGE)] for b, n in enumerate(lengths)]
    assert all(cap.POISON_PAGE not in pages for pages in owned)
    assert len(set(np.concatenate(owned).tolist())) == sum(len(p) for p in owned)  # no page shared
    assert all((table[b, len(p):] == cap.POISON_PAGE).all() for b, p in enumerate(owned))
    q, k_pages, v_pages, *_ = cap.DECODE.inputs()
    assert np.isnan(k_pages[cap.POISON_PAGE]).all()
    assert np.isfinite(np.delete(k_pages, cap.POISON_PAGE, axis=0)).all()
    assert np.isfinite(cap.decode64(q, k_pages, v_pages, table, lengths)).all()


# ---------------------------------------------------------------------------------------------------
# I. ring attention with remote copies.

N, ROWS, AXIS = cap.RING_DEVICES, cap.RING_ROWS, cap.RING_AXIS


def _ring_kernel(*, direction=1, handshake=True, slots=2):
    def kernel(q_ref, k_ref, v_ref, o_ref, k_buf, v_buf, m_ref, l_ref, acc_ref, send_sems, recv_sems,
               free_sem):
        d = jax.lax.axis_index(AXIS)
        right, left = jax.lax.rem(d + N + direction, N), jax.lax.rem(d + N - direction, N)
        k_buf[0] = k_ref[...]
        v_buf[0] = v_ref[...]
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        for s in range(N):
            cur = s % 2 if slots == 2 else 0
            nxt = (s + 1) % 2 if slots == 2 else 0
            if s < N - 1:
                if s > 0 and handshake:
                    pl.semaphore_wait(free_sem, 1)
                sends = [pltpu.make_async_remote_copy(
                    src_ref=buf.at[cur], dst_ref=buf.at[nxt], send_sem=send_sems.at[x],
                    recv_sem=recv_sems.at[x], device_id=(right,), device_id_type=pl.DeviceIdType.MESH)
                    for x, buf in enumerate((k_buf, v_buf))]
                for send in sends:
                    send.start()
            kv_block = jax.lax.rem(d + N - s, N)  # the block the ring's schedule says this device holds

            @pl.when(kv_block <= d)
            def _attend(cur=cur, kv_block=kv_block):  # bound now: the loop moves on
                sc = _qk(q_ref[...], k_buf[cur]) * SCALE
                rows = d * ROWS + jax.lax.broadcasted_iota(jnp.int32, sc.shape, 0)
                cols = kv_block * ROWS + jax.lax.broadcasted_iota(jnp.int32, sc.shape, 1)
                sc = jnp.where(cols <= rows, sc, -jnp.inf)
                m_old = m_ref[...]
                m_new = jnp.maximum(m_old, sc.max(axis=1, keepdims=True))
                alpha, p = jnp.exp(m_old - m_new), jnp.exp(sc - m_new)
                l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
                pv = jnp.dot(p, v_buf[cur], preferred_element_type=jnp.float32)
                acc_ref[...] = alpha * acc_ref[...] + pv
                m_ref[...] = m_new

            if s < N - 1:
                for send in sends:
                    send.wait()
                if s < N - 2 and handshake:
                    pl.semaphore_signal(free_sem, 1, device_id=(left,), device_id_type=pl.DeviceIdType.MESH)
        o_ref[...] = acc_ref[...] / l_ref[...]
    return kernel


def ring_answer(**slip):
    def ring_attention(q, k, v, *, interpret):
        rows, d = q.shape
        vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
        return cap.pallas_call(
            _ring_kernel(**slip), out_shape=jax.ShapeDtypeStruct(q.shape, jnp.float32), in_specs=[vmem] * 3,
            out_specs=vmem,
            scratch_shapes=[pltpu.VMEM((2, rows, d), k.dtype), pltpu.VMEM((2, rows, d), v.dtype),
                            pltpu.VMEM((rows, 1), jnp.float32), pltpu.VMEM((rows, 1), jnp.float32),
                            pltpu.VMEM((rows, d), jnp.float32), pltpu.SemaphoreType.DMA((2,)),
                            pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.REGULAR],
            interpret=interpret, in_names=("q", "k", "v"), out_names=("out",))(q, k, v)
    return ring_attention


def test_the_ring_passes(capsys):
    _assert_pass(cap.RING, ring_answer(), capsys)


@pytest.mark.parametrize("slip, message", [
    ({"direction": -1}, "out mismatch at index (1, 0, 0)"),
    ({"handshake": False}, "race detected by the interpreter's race detector"),
    ({"slots": 1}, "race detected by the interpreter's race detector"),
], ids=["K/V sent to d - 1", "no free-slot handshake", "one slot"])
def test_ring_near_misses_fail_with_their_message(slip, message, capsys):
    verdict, out = _check(cap.RING, ring_answer(**slip), capsys)
    assert verdict is False and out.startswith(f"FAIL {cap.RING.name}: "), out
    assert message in out, out


# ---------------------------------------------------------------------------------------------------
# The oracles, from the formulas: the gradients agree with finite differences of the forward.

def test_the_gradient_oracle_agrees_with_finite_differences():
    rng = np.random.default_rng(0)
    shapes = [(4, 8, 128), (2, 8, 128), (2, 8, 128), (4, 8, 128)]
    q, k, v, do = (rng.standard_normal(shape) for shape in shapes)
    grads = cap.gradients64(q, k, v, do)
    eps = 1e-6
    for n, array in enumerate((q, k, v)):
        for index in [(0, 3, 5), (1, 7, 100)]:
            if index[0] >= array.shape[0]:
                continue
            up, down = [a.copy() for a in (q, k, v)], [a.copy() for a in (q, k, v)]
            up[n][index] += eps
            down[n][index] -= eps
            numeric = ((cap.attention64(*up)[0] - cap.attention64(*down)[0]) * do).sum() / (2 * eps)
            assert numeric == pytest.approx(grads[n][index], rel=1e-6, abs=1e-9)


def test_the_forward_oracle_has_the_logsumexp_of_each_row():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal(shape) for shape in [(4, 16, 128), (2, 16, 128), (2, 16, 128)])
    out, lse = cap.attention64(q, k, v)
    s = q[3] @ k[1].T * SCALE  # query head 3 uses kv head 1
    row = 5  # sees keys 0..5
    assert lse[3, row, 0] == pytest.approx(np.log(np.exp(s[row, :row + 1]).sum()))
    assert np.allclose(out[3, row], np.exp(s[row, :row + 1] - lse[3, row, 0]) @ v[1, :row + 1])
