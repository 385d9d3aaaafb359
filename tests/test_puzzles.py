"""The puzzle harness (tpuattn.puzzles.core) and every puzzle notebook's stubs and solutions."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from jax.experimental import pallas as pl  # noqa: E402

from tpuattn.puzzles import core  # noqa: E402


def _copy_puzzle(block=(8, 128)):
    def build(body, *, interpret):
        def fn(x):
            spec = pl.BlockSpec(block, lambda i, j: (i, j))
            grid = (x.shape[0] // block[0], x.shape[1] // block[1])
            return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=grid,
                                  in_specs=[spec], out_specs=spec, interpret=interpret)(x)
        return fn

    def inputs():
        return (np.arange(16 * 128, dtype=np.float32).reshape(16, 128),)

    return core.Puzzle(f"test copy {block}", build, inputs, lambda x: x.astype(np.float64), rtol=0, atol=0)


def _stub(x_ref, o_ref):
    raise NotImplementedError


def _copy(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def _off_by_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1


def test_check_reports_stub_mismatch_and_pass(capsys):
    puzzle = _copy_puzzle()
    assert core.check(puzzle, _stub) is False
    assert capsys.readouterr().out.strip() == f"{puzzle.name}: not written yet"
    assert core.check(puzzle, _off_by_one) is False
    out = capsys.readouterr().out
    assert "mismatch at index (0, 0): got 1, expected 0" in out and out.count("\n") == 1
    assert core.check(puzzle, _copy) is True
    assert capsys.readouterr().out.startswith(f"PASS {puzzle.name}")
    assert core.RESULTS[-3:] == [(puzzle.name, False), (puzzle.name, False), (puzzle.name, True)]


def test_check_reports_the_compilers_refusal(capsys):
    pytest.importorskip("libtpu")
    # (8, 64) blocks run in interpret mode, but a lane dimension of 64 is neither 128's multiple nor
    # the array's whole width: the TPU compiler refuses it.
    puzzle = _copy_puzzle(block=(8, 64))
    assert core.check(puzzle, _copy) is False
    out = capsys.readouterr().out
    assert out.startswith(f"FAIL {puzzle.name}: right in interpret mode, but the v5e compiler refused it")


def test_compare_names_output_shape_and_tolerance():
    assert core.compare(np.ones(3), np.ones(3), 0, 0) is None
    assert core.compare(np.ones(3) * (1 + 1e-6), np.ones(3), 1e-5, 0) is None
    assert "shape: expected (3,), got (2,)" in core.compare(np.ones(2), np.ones(3), 0, 0)
    assert "output 1 mismatch at index (2,)" in core.compare(
        (np.ones(3), np.array([1.0, 1.0, 2.0])), (np.ones(3), np.ones(3)), 1e-3, 0)
    assert "expected 2 output(s), got 1" in core.compare(np.ones(3), (np.ones(3), np.ones(3)), 0, 0)
    assert "mismatch" in core.compare(np.array([np.nan]), np.array([1.0]), 1, 1)


def test_registry_and_bad_fields_refused():
    puzzle = _copy_puzzle(block=(16, 128))
    assert core.register(puzzle) is puzzle and core.get(puzzle.name) is puzzle
    with pytest.raises(ValueError, match="already registered"):
        core.register(_copy_puzzle(block=(16, 128)))
    with pytest.raises(ValueError, match="puzzle: expected one of"):
        core.get("no such puzzle")
    with pytest.raises(ValueError, match="kind: expected one of"):
        core.Puzzle("x", None, None, None, 0, 0, kind="other")
    del core.REGISTRY[puzzle.name]
