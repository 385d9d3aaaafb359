"""WORKSHOP.md's plan fits its three hours: in every slot of both tracks (CPU, Colab TPU), the prose
read in the room (words at 200 per minute, counted in the notebooks' own markdown) plus the minutes of
the exercises and puzzles done in the room (read off their own "(★☆☆, N min)" labels) is at most the
slot's length, and every section and exercise the plan names exists.

The plan's tables have the columns ``time | notebook | read in the room | do in the room | ...``:

* ``time``: ``h:mm-h:mm``; the slots of a track run from 0:00 to 3:00 without gaps.
* ``notebook``: ``01`` .. ``NN`` (its ``notebooks/NN_*.py`` twin), ``README``, or ``-`` (a break, the
  wrap-up: nothing read or done).
* ``read in the room``: ``§0`` (the text before the first ``##`` heading), ``§3`` (the level-2
  section whose heading starts ``3.``, ``3 ·`` or ``Step 3 ·``), ``§0-3`` (a range), ``§5b``, or
  ``§Speed on a TPU`` (a heading by its start), separated by commas; ``-`` for nothing.
* ``do in the room``: exercise numbers of the notebook's ``## Exercises`` (``1, 2``, ``1-3``); in a
  puzzles notebook, puzzle numbers and find-the-bug letters (``1-4, B``), whose sections are then read
  too; ``-`` for nothing.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORDS_PER_MINUTE = 200
TRACKS = ("CPU track", "Colab TPU track")
WORD = re.compile(r"[A-Za-z0-9][\w'’.-]*")
MINUTES = re.compile(r"\(\s*[★☆]{3}\s*,\s*(\d+)\s*min\s*\)")
EXERCISE = re.compile(r"^(?:\*\*)?(\d{1,2})\.[ \t]*(?:\*\*)?", re.MULTILINE)


def _markdown(path: Path) -> str:
    """The markdown of a notebook's jupytext twin (comment lines of its markdown cells), or a .md file."""
    text = path.read_text()
    if path.suffix == ".md":
        return text
    lines = []
    for cell in re.split(r"^# %%", text, flags=re.MULTILINE):
        if cell.startswith(" [markdown]"):
            lines += [line[2:] if line.startswith("# ") else line.lstrip("#")
                      for line in cell.splitlines()[1:] if line.startswith("#")]
    return "\n".join(lines)


def _sections(markdown: str) -> dict[str, str]:
    """Level-2 heading -> its text (the text before the first heading under the key "")."""
    sections, current, lines = {}, "", []
    for line in markdown.splitlines():
        if line.startswith("## "):
            sections[current] = "\n".join(lines)
            current, lines = line[3:].strip(), []
        else:
            lines.append(line)
    sections[current] = "\n".join(lines)
    return sections


def _words(text: str) -> int:
    return len(WORD.findall(text))


def _source(notebook: str) -> Path:
    if notebook == "README":
        return ROOT / "README.md"
    found = sorted((ROOT / "notebooks").glob(f"{notebook}_*.py"))
    assert len(found) == 1, f"notebook {notebook!r}: expected one notebooks/{notebook}_*.py, found {found}"
    return found[0]


def _heading(sections: dict[str, str], token: str, where: str) -> str:
    if token == "0":
        return ""
    if re.fullmatch(r"\d+[a-z]?", token):
        pattern = re.compile(rf"^(?:Step |Puzzle )?{token}(?:\.| ·)")
        found = [h for h in sections if h and pattern.match(h)]
    else:
        found = [h for h in sections if h.startswith(token)]
    headings = [h for h in sections if h]
    assert len(found) == 1, f"{where}: section §{token} matches {found} (headings: {headings})"
    return found[0]


def _expand(field: str) -> list[str]:
    tokens = []
    for part in (p.strip() for p in field.split(",")):
        if not part or part == "-":
            continue
        part = part.removeprefix("§")
        span = re.fullmatch(r"(\d+)-(\d+)", part)
        tokens += [str(n) for n in range(int(span[1]), int(span[2]) + 1)] if span else [part]
    return tokens


def _exercise_minutes(sections: dict[str, str], token: str, where: str) -> tuple[int, int]:
    """(minutes, words) of one exercise or puzzle done in the room."""
    if "Exercises" in sections and token.isdigit():
        text = sections["Exercises"]
        starts = [(int(m[1]), m.start()) for m in EXERCISE.finditer(text)]
        ends = [start for _, start in starts[1:]] + [len(text)]
        spans = {n: text[start:end] for (n, start), end in zip(starts, ends, strict=True)}
        assert int(token) in spans, f"{where}: no exercise {token} (found {sorted(spans)})"
        item = spans[int(token)]
    else:
        pattern = (rf"^Puzzle {token} ·" if token.isdigit() else rf"^Find the bug {token} ·")
        found = [h for h in sections if re.match(pattern, h)]
        assert len(found) == 1, f"{where}: no puzzle {token!r} (headings: {[h for h in sections if h]})"
        item = found[0] + "\n" + sections[found[0]]  # the label may be in the heading
    label = MINUTES.search(item)
    assert label, f"{where}: exercise {token} has no '(★☆☆, N min)' label"
    return int(label[1]), _words(item)


def _clock(text: str) -> int:
    hours, minutes = text.split(":")
    return 60 * int(hours) + int(minutes)


def plan(track: str) -> list[dict]:
    """The rows of one track's table in WORKSHOP.md, with the load of each slot."""
    text = (ROOT / "WORKSHOP.md").read_text()
    match = re.search(rf"^### {re.escape(track)}\n(.*?)(?=^#|\Z)", text, flags=re.MULTILINE | re.DOTALL)
    assert match, f"WORKSHOP.md: no '### {track}' table"
    rows = []
    for line in match[1].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or not re.fullmatch(r"\d:\d\d-\d:\d\d", cells[0].strip("*")):
            continue
        start, end = (_clock(t) for t in cells[0].strip("*").split("-"))
        notebook, read, do = cells[1].strip("*"), cells[2], cells[3]
        where = f"{track} {cells[0]} {notebook}"
        words, minutes = 0, 0
        if notebook != "-":
            sections = _sections(_markdown(_source(notebook)))
            words = sum(_words(sections[_heading(sections, t, where)]) for t in _expand(read))
            for token in _expand(do):
                m, w = _exercise_minutes(sections, token, where)
                minutes, words = minutes + m, words + w
        rows.append(dict(start=start, end=end, notebook=notebook, where=where, words=words,
                         exercise_min=minutes, load=words / WORDS_PER_MINUTE + minutes))
    return rows


@pytest.mark.parametrize("track", TRACKS)
def test_every_slot_fits(track):
    rows = plan(track)
    assert rows, f"{track}: no slots"
    assert rows[0]["start"] == 0 and rows[-1]["end"] == 180, f"{track}: the day is 0:00-3:00"
    for before, after in zip(rows, rows[1:], strict=False):
        assert before["end"] == after["start"], f"{track}: a gap or overlap at {after['where']}"
    over = [f"{r['where']}: {r['words']} words ({r['words'] / WORDS_PER_MINUTE:.1f} min) + "
            f"{r['exercise_min']} min of exercises > {r['end'] - r['start']} min"
            for r in rows if r["load"] > r["end"] - r["start"]]
    assert not over, "\n".join(over)


def test_the_core_is_in_both_tracks_and_the_room_writes_kernels():
    for track in TRACKS:
        rows = plan(track)
        notebooks = {r["notebook"] for r in rows}
        assert {"01", "02", "03", "04", "05"} <= notebooks, track
        puzzles = [r for r in rows if r["notebook"] in ("08", "09")]
        assert sum(r["exercise_min"] for r in puzzles) >= 20, f"{track}: fewer than 20 minutes of puzzles"


def test_the_checker_refuses_what_does_not_fit(tmp_path, monkeypatch):
    # The same plan with one slot's reading made too long fails: the check can fail.
    text = (ROOT / "WORKSHOP.md").read_text()
    row = next(line for line in text.splitlines() if re.match(r"^\| 0:\d\d-\d:\d\d \| 0[1-5] \|", line))
    cells = row.split("|")
    cells[4] = " 1-5 "  # every exercise of the notebook in one slot
    (tmp_path / "WORKSHOP.md").write_text(text.replace(row, "|".join(cells)))
    (tmp_path / "notebooks").symlink_to(ROOT / "notebooks")
    (tmp_path / "README.md").symlink_to(ROOT / "README.md")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError, match=r"0:\d\d 0[1-5]: \d+ words .* min of exercises > \d+ min"):
        test_every_slot_fits(TRACKS[0])
