"""The puzzle harness (tpuattn.puzzles.core) and every puzzle notebook's stubs and solutions."""

from __future__ import annotations

import importlib.util
import re
import warnings
from pathlib import Path

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
    assert [(name, verdict) for name, verdict, _ in core.RESULTS[-3:]] == [
        (puzzle.name, False), (puzzle.name, False), (puzzle.name, True)]


def test_check_reports_the_compilers_refusal(capsys):
    pytest.importorskip("libtpu")
    # (8, 64) blocks run in interpret mode, but a lane dimension of 64 is neither 128's multiple nor
    # the array's whole width: the TPU compiler refuses it.
    puzzle = _copy_puzzle(block=(8, 64))
    assert core.check(puzzle, _copy) is False
    out = capsys.readouterr().out
    assert out.startswith(f"FAIL {puzzle.name}: right in interpret mode, but the v5e compiler refused it")


def test_a_right_answer_passes_with_its_compile(capsys):
    """On whatever stack runs this (the test command's ``colab`` stage: Colab's JAX 0.7.2 with its
    libtpu 0.0.21.1), a right answer passes the whole check: interpret mode and the v5e compile."""
    from helpers import require_tpu_compiler

    require_tpu_compiler()
    puzzle = _copy_puzzle()
    assert core.check(puzzle, _copy) is True
    out = capsys.readouterr().out
    assert out.strip() == f"PASS {puzzle.name}: matches the float64 oracle (interpret mode), compiled for v5e"


def test_a_compiler_that_cannot_compile_anything_says_so(monkeypatch, capsys):
    """A refusal is the answer's fault only if the compiler compiles a one-tile copy kernel: with a
    broken installation the check passes a right answer in interpret mode and says why it did not
    compile; a wrong answer still fails on its values."""
    from tpuattn.measure import aot

    def refuse(*args, **kwargs):
        raise RuntimeError("INTERNAL: Failed to deserialize the Mosaic module")

    monkeypatch.setattr(aot, "tpu_available", lambda: True)
    monkeypatch.setattr(aot, "compile_for", refuse)
    monkeypatch.setattr(aot, "_COMPILER_PROBLEMS", {})
    monkeypatch.setattr(aot, "chip_known", lambda name: True)
    puzzle = _copy_puzzle()
    assert core.check(puzzle, _copy) is True
    out = capsys.readouterr().out.strip()
    assert out == (f"PASS {puzzle.name} in interpret mode; not compiled for v5e: this installation's TPU "
                   "compiler cannot be used here (it cannot compile even a one-tile copy kernel "
                   "(RuntimeError: INTERNAL: Failed to deserialize the Mosaic module))")
    assert core.check(puzzle, _off_by_one) is False
    assert "mismatch at index (0, 0)" in capsys.readouterr().out


def test_mosaic_version_refusal_is_read():
    from tpuattn.pallas import compat

    assert compat.mosaic_version_refused(
        "INTERNAL: Failed to deserialize the Mosaic module: INTERNAL: Unsupported version: expected <= 7 "
        "but got 8") == 7
    assert compat.mosaic_version_refused("INTERNAL: Mosaic failed to compile TPU kernel") is None


def test_compare_names_output_shape_and_tolerance():
    assert core.compare(np.ones(3), np.ones(3), 0, 0) is None
    assert core.compare(np.ones(3) * (1 + 1e-6), np.ones(3), 1e-5, 0) is None
    assert "shape: expected (3,), got (2,)" in core.compare(np.ones(2), np.ones(3), 0, 0)
    assert "output 1 mismatch at index (2,)" in core.compare(
        (np.ones(3), np.array([1.0, 1.0, 2.0])), (np.ones(3), np.ones(3)), 1e-3, 0)
    assert "expected 2 output(s), got 1" in core.compare(np.ones(3), (np.ones(3), np.ones(3)), 0, 0)
    assert "mismatch" in core.compare(np.array([np.nan]), np.array([1.0]), 1, 1)
    # Named outputs: the backward puzzles say dK and dV, not output 0 and output 1.
    assert core.compare((np.ones(3), np.zeros(3)), (np.ones(3), np.ones(3)), 0, 0, ("dK", "dV")) \
        .startswith("dV mismatch at index (0,)")
    with pytest.raises(ValueError, match="names: expected 2 output names"):
        core.compare((np.ones(3), np.ones(3)), (np.ones(3), np.ones(3)), 0, 0, ("dK",))


def test_registry_and_bad_fields_refused():
    puzzle = _copy_puzzle(block=(16, 128))
    assert core.register(puzzle) is puzzle and core.get(puzzle.name) is puzzle
    with pytest.raises(ValueError, match="already registered"):
        core.register(_copy_puzzle(block=(16, 128)))
    with pytest.raises(ValueError, match="puzzle: expected one of"):
        core.get("no such puzzle")
    with pytest.raises(ValueError, match="kind: expected one of"):
        core.Puzzle("x", None, None, None, 0, 0, kind="other")
    with pytest.raises(ValueError, match="outputs: expected a tuple of names"):
        core.Puzzle("x", None, None, None, 0, 0, outputs="dK")
    del core.REGISTRY[puzzle.name]


def test_audit_runs_after_the_values_match(capsys):
    calls = []

    def audit(answer):
        calls.append(answer)
        return "the rule is broken"

    base = _copy_puzzle(block=(8, 128))
    puzzle = core.Puzzle(base.name, base.build, base.inputs, base.oracle, 0, 0, audit=audit)
    assert core.check(puzzle, _off_by_one) is False and calls == []  # values first
    assert core.check(puzzle, _copy) is False and calls == [_copy]
    assert "the values match, but the rule is broken" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------
# Every puzzle notebook: each stub's check fails, each solution's check passes (interpret mode against
# the oracle, and the compile for the chip).

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
PUZZLE_NOTEBOOKS = sorted([*NOTEBOOKS.glob("[0-9][0-9]_puzzles*.py"),
                           *NOTEBOOKS.glob("[0-9][0-9]_capstones*.py")])
_HEADER = re.compile(r"^# %%(?P<rest>.*)$")


def notebook_cells(path: Path) -> list[dict]:
    """The code cells of a jupytext percent notebook: ``{"source", "tags", "line"}`` in order."""
    cells, current = [], None
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        header = _HEADER.match(line)
        if header:
            rest = header.group("rest")
            tags = re.search(r"tags=\[([^\]]*)\]", rest)
            current = {"source": [], "line": number, "markdown": "[markdown]" in rest,
                       "tags": re.findall(r'"([^"]+)"', tags.group(1)) if tags else []}
            cells.append(current)
        elif current is not None:
            current["source"].append(line)
    return [dict(c, source="\n".join(c["source"])) for c in cells if not c["markdown"]]


def test_notebook_cells_are_read_with_their_tags(tmp_path):
    path = tmp_path / "99_puzzles_x.py"
    path.write_text('# header\n# %% [markdown]\n# text\n\n# %% tags=["puzzle"]\nx = 1\n\n# %%\ny = 2\n'
                    '# %% tags=["solution", "hide-cell"]\nx = 3\n')
    cells = notebook_cells(path)
    assert [(c["tags"], c["source"].strip()) for c in cells] == [
        (["puzzle"], "x = 1"), ([], "y = 2"), (["solution", "hide-cell"], "x = 3")]


def test_there_are_puzzle_notebooks():
    assert any(p.name.startswith("08_puzzles") for p in PUZZLE_NOTEBOOKS), PUZZLE_NOTEBOOKS


@pytest.mark.parametrize("path", PUZZLE_NOTEBOOKS, ids=lambda p: p.stem)
def test_stubs_fail_and_solutions_pass(path, monkeypatch, capsys):
    # The hidden solutions run only where the notebook's RUN_SOLUTIONS is true, as in CI's runs.
    monkeypatch.setenv("TPUATTN_RUN_SOLUTIONS", "1")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.chdir(NOTEBOOKS)  # as ci/notebooks.py runs them (figures: ../out/figures unless set)
    compiles = importlib.util.find_spec("libtpu") is not None
    namespace = {"__name__": f"notebook_{path.stem}"}
    stub = None  # the open puzzle: {"line", "results"}
    solved = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*non-interactive.*")  # plt.show() under Agg
        for cell in notebook_cells(path):
            before = len(core.RESULTS)
            exec(compile(cell["source"], f"{path.name}:{cell['line']}", "exec"), namespace)  # noqa: S102
            plt.close("all")
            results = core.RESULTS[before:]
            where = f"{path.name} cell at line {cell['line']}"
            if "puzzle" in cell["tags"]:
                assert stub is None, f"{where}: a puzzle cell before the last one's solution"
                stub = {"line": cell["line"], "results": list(results)}
            elif "solution" in cell["tags"]:
                assert stub is not None, f"{where}: a solution cell without a puzzle cell before it"
                assert stub["results"], f"{where}: the stub at line {stub['line']} was never checked"
                assert all(verdict is not True for _, verdict, _ in stub["results"]), (where, stub["results"])
                assert results, f"{where}: the solution cell does not call check"
                for name, verdict, message in results:
                    if verdict is None and "cannot be checked" in message:
                        continue  # this JAX lacks what the check needs, and the check said so
                    assert verdict is True, (where, message)
                    assert message.startswith(f"PASS {name}"), (where, message)
                    if compiles:  # and compiled: not "passed in interpret mode; not compiled for ..."
                        assert "), compiled for" in message, (where, message)
                assert {r[0] for r in results} == {r[0] for r in stub["results"]}, (where, results)
                solved.extend(name for name, _, _ in results)
                stub = None
            elif stub is not None:
                stub["results"].extend(results)
    assert stub is None, f"{path.name}: the puzzle at line {stub['line']} has no solution cell"
    assert solved, f"{path.name} has no puzzles"
    if path.stem == "08_puzzles_forward":
        from tpuattn.puzzles import forward_puzzles

        assert {p.name for p in forward_puzzles.PUZZLES} <= set(solved)
    if path.stem == "09_puzzles_backward":
        from tpuattn.puzzles import backward_puzzles

        assert {p.name for p in backward_puzzles.PUZZLES} <= set(solved)
    if path.stem == "12_capstones":
        from tpuattn.puzzles import capstones

        assert {p.name for p in capstones.PUZZLES} <= set(solved)
    capsys.readouterr()


def test_race_summary_reads_the_detectors_report():
    report = ("RACE DETECTED\n  write of ('vmem', 103, 0, 0)[(0, slice(0, 8, 1))] from 101, 0, "
              "/tmp/ipykernel_1/2009.py:9:4 (double_kernel)\n  clock: [5 7]\n"
              "  read of ('vmem', 103, 0, 0)[(0, slice(0, 8, 1))] from 0, 0, /tmp/ipykernel_1/2009.py:10:35 "
              "(double_kernel)\n  clock: [2 0]\n")
    assert core.race_summary(report) == (
        ": a write (double_kernel line 9) and a read (double_kernel line 10) of one buffer")
    assert core.race_summary("something else") == ""


def test_a_race_puzzle_says_so_where_this_jax_has_no_race_detector(monkeypatch, capsys):
    from jax.experimental.pallas import tpu as pltpu

    base = _copy_puzzle()
    puzzle = core.Puzzle(base.name, base.build, base.inputs, base.oracle, 0, 0, detect_races=True)
    monkeypatch.delattr(pltpu, "InterpretParams")
    assert core.check(puzzle, _copy) is None
    assert "cannot be checked here: this JAX has no pltpu.InterpretParams" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------
# What interpret mode cannot show: each answer below gives the right values there (it clamps a block
# index outside its array, and runs the grid in order on one core), and its check must still fail,
# naming the slip.

def _add_specs(bias_map):
    def specs():
        tile = pl.BlockSpec((8, 128), lambda i, j: (i, j))
        return tile, pl.BlockSpec((1, 128), bias_map), tile
    return specs


def _gqa_specs(q_map):
    from tpuattn.puzzles import forward_puzzles as fw

    def specs():
        q_spec = pl.BlockSpec((None, fw.GQA_GROUP, fw.GQA_BLOCK_Q, fw.HEAD_DIM), q_map)
        kv_spec = pl.BlockSpec((None, fw.GQA_KV, fw.HEAD_DIM), lambda h, i: (h, 0, 0))
        return q_spec, kv_spec, q_spec
    return specs


def test_an_index_map_outside_its_array_fails_naming_the_step_and_the_block(capsys):
    from tpuattn.puzzles import forward_puzzles as fw

    # Puzzle 2: the bias is one row of blocks; naming its row block i asks for row block 1 at i = 1,
    # which interpret mode clamps to row block 0, the right one.
    assert core.check(fw.ADD, _add_specs(lambda i, j: (i, j))) is False
    out = capsys.readouterr().out
    assert ("the values match, but the bias index map asks for block (1, 0) at grid step (1, 0); "
            "bias has 1 x 4 blocks") in out, out
    # Puzzle 8: query head h * group is the unfolded index; the folded q has one block per kv head,
    # so kv head 1 asks for block 2, clamped to block 1, the right one.
    assert core.check(fw.GQA, _gqa_specs(lambda h, i: (h * fw.GQA_GROUP, 0, i, 0))) is False
    out = capsys.readouterr().out
    assert ("the values match, but the q index map asks for block (2, 0, 0, 0) at grid step (1, 0); "
            "q has 2 x 1 x 2 x 1 blocks") in out, out
    assert core.check(fw.ADD, _add_specs(lambda i, j: (0, j))) is True
    assert core.check(fw.GQA, _gqa_specs(lambda h, i: (h, 0, i, 0))) is True


def _matmul_zeroed_once(x_ref, y_ref, o_ref, acc_ref):
    """Zero the accumulator at the first grid step only, and again after each write: right when the
    grid runs in order, but the first step a second TensorCore runs finds no zeroed accumulator."""
    i, j, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when((i == 0) & (j == 0) & (k == 0))
    def _init():
        acc_ref[...] = jax.numpy.zeros(acc_ref.shape, np.float32)

    acc_ref[...] += jax.numpy.dot(x_ref[...], y_ref[...], preferred_element_type=np.float32)

    @pl.when(k == pl.num_programs(2) - 1)
    def _write():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)
        acc_ref[...] = jax.numpy.zeros(acc_ref.shape, np.float32)


def test_scratch_carried_across_a_parallel_axis_fails(capsys):
    from tpuattn.puzzles import forward_puzzles as fw

    x, y = fw.MATMUL.inputs()  # right in order: the values cannot show it
    got = fw.MATMUL.build(_matmul_zeroed_once, interpret=True)(x, y)
    assert core.compare(got, fw.MATMUL.oracle(x, y), fw.MATMUL.rtol, fw.MATMUL.atol) is None
    assert core.check(fw.MATMUL, _matmul_zeroed_once) is False
    out = capsys.readouterr().out
    assert ("the values match when the grid runs in order on one core, but scratch carries over from "
            "one index of grid axis 0 to the next, and that axis is marked \"parallel\"") in out, out
    assert "mismatch at index (16, 0): got nan" in out, out


def _row_sum_puzzle():
    """out [16, 1] = the row sums of x [16, 256], in (8, 128) blocks, accumulated into the output block
    over the column blocks. The answer: ``(dimension semantics, grid order)``, ``"rows first"`` (grid
    (row block, column block)) or ``"columns first"``."""
    def build(answer, *, interpret):
        semantics, order = answer
        rows_first = order == "rows first"

        def body(x_ref, o_ref):
            @pl.when(pl.program_id(1 if rows_first else 0) == 0)
            def _init():
                o_ref[...] = jax.numpy.zeros(o_ref.shape, o_ref.dtype)

            o_ref[...] += x_ref[...].sum(axis=1, keepdims=True)

        def fn(x):
            from jax.experimental.pallas import tpu as pltpu

            def swap(f):
                return f if rows_first else (lambda j, i: f(i, j))
            grid = (2, 2)
            return core.pallas_call(
                body, out_shape=jax.ShapeDtypeStruct((16, 1), x.dtype), grid=grid,
                in_specs=[pl.BlockSpec((8, 128), swap(lambda i, j: (i, j)))],
                out_specs=pl.BlockSpec((8, 1), swap(lambda i, j: (i, 0))),
                compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
                interpret=interpret, in_names=("x",), out_names=("out",))(x)
        return fn

    def inputs():
        return (np.random.default_rng(0).standard_normal((16, 256)).astype(np.float32),)

    return core.Puzzle("test row sums", build, inputs,
                       lambda x: x.astype(np.float64).sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-5)


def test_an_output_block_two_parallel_steps_share_fails(capsys):
    puzzle = _row_sum_puzzle()
    # The reduction axis marked "parallel": two TensorCores would each add half the columns into one
    # output block at once. In order on one core, the values are right.
    assert core.check(puzzle, (("parallel", "parallel"), "rows first")) is False
    out = capsys.readouterr().out
    assert ("the values match, but the out index map names block (0, 0) at grid steps (0, 0) and "
            "(0, 1), which differ along grid axis 1, marked \"parallel\"") in out, out
    assert core.check(puzzle, (("parallel", "arbitrary"), "rows first")) is True


def test_an_output_block_the_grid_returns_to_fails(capsys):
    puzzle = _row_sum_puzzle()
    # The reduction axis outside: each output block is left and come back to, which interpret mode
    # (it reads the block back) forgives and a TPU (it writes a block back and never reads it) does not.
    assert core.check(puzzle, (("arbitrary", "arbitrary"), "columns first")) is False
    out = capsys.readouterr().out
    assert ("the values match, but the out index map leaves block (0, 0) after grid step (0, 0) and "
            "comes back to it at grid step (1, 0)") in out, out



@pytest.mark.parametrize("path", PUZZLE_NOTEBOOKS, ids=lambda p: p.stem)
def test_a_learners_run_all_shows_no_solution(path, monkeypatch, capsys):
    """Without the CI's flag a notebook's solution cells run nothing: every check a learner's Run All
    prints comes from a stub (and says "not written yet" or fails), never a solution's PASS."""
    monkeypatch.delenv("TPUATTN_RUN_SOLUTIONS", raising=False)
    monkeypatch.chdir(NOTEBOOKS)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    namespace = {"__name__": f"notebook_{path.stem}"}
    before = len(core.RESULTS)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*non-interactive.*")
        for cell in notebook_cells(path):
            during = len(core.RESULTS)
            exec(compile(cell["source"], f"{path.name}:{cell['line']}", "exec"), namespace)  # noqa: S102
            plt.close("all")
            if "solution" in cell["tags"]:
                assert len(core.RESULTS) == during, f"{path.name}:{cell['line']}: a solution ran its check"
    assert namespace.get("RUN_SOLUTIONS") is False
    assert all(verdict is not True for _, verdict, _ in core.RESULTS[before:]), core.RESULTS[before:]
    capsys.readouterr()
