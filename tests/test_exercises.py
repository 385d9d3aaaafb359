import re
from pathlib import Path

import pytest

from tpuattn.exercises import run_checks


def _stub():
    raise NotImplementedError("FILL ME IN")


def test_unfinished_stubs_are_reported_and_finished_ones_checked(capsys):
    done = run_checks({"1": _stub, "2": lambda: None})
    assert done == {"1": False, "2": True}
    out = capsys.readouterr().out
    assert "exercise 1: not done yet" in out and "exercise 2: correct" in out


def test_a_wrong_answer_still_fails():
    def wrong():
        assert 1 + 1 == 3, "wrong answer"

    with pytest.raises(AssertionError, match="wrong answer"):
        run_checks({"1": wrong})


# ---------------------------------------------------------------------------- the notebooks' exercises
# Every committed notebook closes with exercises whose checks go through run_checks, and with one hidden
# code cell (tags "solution", jupyter.source_hidden) that runs the same checks on the solutions. The
# exercise names are read off each notebook's own check output, so a new notebook is covered as is.
# The puzzle notebooks (NN_puzzles*, NN_capstones) follow their own convention, one solution per
# puzzle, checked by tests/test_puzzles.py.
_ALL_NOTEBOOKS = (Path(__file__).resolve().parent.parent / "notebooks").glob("[0-9][0-9]_*.ipynb")
NOTEBOOKS = sorted(p for p in _ALL_NOTEBOOKS if "_puzzles" not in p.stem and "_capstones" not in p.stem)
REPORT = re.compile(r"^exercise (?P<name>.+?): (?P<state>correct|not done yet)\b", re.MULTILINE)
DIFFICULTY = re.compile(r"\(\s*[★☆]{3}\s*,\s*\d+\s*min\b")
# The start of one exercise in the Exercises markdown: "1. **Ridge**", "**1. Ridge.**", "### 1. Ridge",
# "**Exercise 1**" ...
# (At most two digits and a "." or ":" then a space or "**", so a wrapped line that starts "128) ..." is
# not taken for an exercise.)
ITEM = re.compile(r"^[ \t]*(?:#+[ \t]*|[-*][ \t]+)?(?:\*\*)?(?:Exercise[ \t]+)?(\d{1,2})[.:](?=[ \t]|\*\*)",
                  re.MULTILINE)


def _text_outputs(cell) -> str:
    parts = []
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream":
            parts.append(output.get("text", ""))
        elif "data" in output:
            parts.append(output["data"].get("text/plain", ""))
        elif output.get("output_type") == "error":
            parts.append(f"{output.get('ename')}: {output.get('evalue')}")
    return "".join(parts)


def _is_solution(cell) -> bool:
    return cell.cell_type == "code" and "solution" in cell.metadata.get("tags", [])


def _exercises_markdown(nb) -> str:
    """The markdown from the "## Exercises" heading up to the next level-2 heading."""
    text, inside = [], False
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        for line in cell.source.splitlines():
            if re.match(r"^##\s+Exercises\b", line):
                inside = True
                continue
            if inside and re.match(r"^##\s", line):
                return "\n".join(text)
            if inside:
                text.append(line)
    return "\n".join(text)


def check_notebook_exercises(nb, path) -> None:
    """Raise AssertionError unless ``nb`` follows the exercise convention (see the comment above)."""
    solutions = [cell for cell in nb.cells if _is_solution(cell)]
    assert len(solutions) == 1, f"{path.name}: expected one code cell tagged 'solution', got {len(solutions)}"
    solution = solutions[0]
    assert solution.metadata.get("jupyter", {}).get("source_hidden") is True, \
        f"{path.name}: the solution cell needs jupyter.source_hidden"
    index = nb.cells.index(solution)
    assert any(cell.cell_type == "markdown" and re.search(r"^##\s+Solutions\b", cell.source, re.MULTILINE)
               for cell in nb.cells[:index]), f"{path.name}: a '## Solutions' heading must precede the cell"

    # The exercise names: what the notebook's own check cells report, stubs and all.
    names = []
    for cell in nb.cells:
        if cell.cell_type == "code" and not _is_solution(cell):
            names += [m["name"] for m in REPORT.finditer(_text_outputs(cell)) if m["name"] not in names]
    assert names, f"{path.name}: no exercise check output ('exercise N: not done yet') outside the solutions"

    solved = _text_outputs(solution)
    assert "not done yet" not in solved, f"{path.name}: the solution cell reports an unsolved exercise"
    correct = {m["name"] for m in REPORT.finditer(solved) if m["state"] == "correct"}
    missing = [name for name in names if name not in correct]
    assert not missing, f"{path.name}: the solution cell's stored output does not say 'correct' for {missing}"

    markdown = _exercises_markdown(nb)
    assert markdown, f"{path.name}: no '## Exercises' section"
    starts = list(ITEM.finditer(markdown))
    items = {}
    for start, end in zip(starts, starts[1:] + [None], strict=True):
        items.setdefault(start[1], markdown[start.start():end.start() if end else len(markdown)])
    assert items, f"{path.name}: no numbered exercise in the Exercises section"
    undated = [number for number, item in items.items() if not DIFFICULTY.search(item)]
    assert not undated, f"{path.name}: exercises {undated} need a difficulty and a time, e.g. (★★☆, 15 min)"
    for name in names:
        number = re.match(r"\d+", name)
        assert number and number[0] in items, f"{path.name}: checked exercise {name!r} has no numbered text"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_exercises_have_checked_hidden_solutions(path):
    nbformat = pytest.importorskip("nbformat", reason="the notebooks extra")
    check_notebook_exercises(nbformat.read(path, as_version=4), path)


def _notebook(nbformat, *, solved="exercise 1 ridge: correct\nexercise 2 sink: correct\n",
              exercises="1. **Ridge** (★☆☆, 5 min). ...\n2. **Sink** (★★☆, 10 min). ...", hidden=True):
    v4 = nbformat.v4

    def code(text, tags=(), **metadata):
        cell = v4.new_code_cell("...", metadata={"tags": list(tags), **metadata})
        cell.outputs = [v4.new_output("stream", name="stdout", text=text)]
        return cell

    return v4.new_notebook(cells=[
        v4.new_markdown_cell("## Exercises\n\n" + exercises),
        code("exercise 1 ridge: not done yet (hint: ...)\nexercise 2 sink: not done yet (hint: ...)\n"),
        v4.new_markdown_cell("## References\n\n- ..."),
        v4.new_markdown_cell("## Solutions"),
        code(solved, tags=("solution", "hide-input"), jupyter={"source_hidden": True} if hidden else {}),
    ])


def test_the_notebook_check_accepts_the_convention_and_names_what_breaks_it():
    nbformat = pytest.importorskip("nbformat", reason="the notebooks extra")
    path = Path("notebooks/99_example.ipynb")
    check_notebook_exercises(_notebook(nbformat), path)
    with pytest.raises(AssertionError, match=r"does not say 'correct' for \['2 sink'\]"):
        check_notebook_exercises(_notebook(nbformat, solved="exercise 1 ridge: correct\n"), path)
    with pytest.raises(AssertionError, match="unsolved"):
        check_notebook_exercises(_notebook(nbformat, solved="exercise 1 ridge: correct\n"
                                                            "exercise 2 sink: not done yet\n"), path)
    with pytest.raises(AssertionError, match=r"exercises \['2'\] need a difficulty"):
        check_notebook_exercises(_notebook(nbformat, exercises="1. **Ridge** (★☆☆, 5 min).\n2. **Sink**."),
                                 path)
    with pytest.raises(AssertionError, match="source_hidden"):
        check_notebook_exercises(_notebook(nbformat, hidden=False), path)


def test_a_check_that_cannot_run_here_says_why(capsys):
    from tpuattn.exercises import NotCheckable

    def unavailable():
        raise NotCheckable("needs JAX >= 0.8")

    assert run_checks({"1": unavailable}) == {"1": None}
    assert "exercise 1: cannot be checked on this installation (needs JAX >= 0.8)" in capsys.readouterr().out
