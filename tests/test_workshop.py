"""WORKSHOP.md's plan fits its three hours, with room to spare: in every slot of both tracks (CPU, Colab
TPU), what the room reads, runs and does takes at most 90% of the slot:

* **reading**: the words of the notebooks' own markdown *and* of their visible code cells, at one rate
  (200 words a minute); hidden cells (solutions, tagged ``solution``/``hide-cell``/``hide-input`` or with
  ``jupyter.source_hidden``) are not read in the room;
* **running**: the seconds the slot's sections took in the run that made the committed outputs, read
  from ``notebooks/run_seconds.json`` (``python3 ci/notebooks.py --update`` records them per level-2
  section, with the machine and JAX; the committed .ipynb keeps no timings). Both tracks use these CPU
  seconds: the project has not run the notebooks on a TPU;
* **doing**: the minutes of the exercises and puzzles done in the room (their own "(★☆☆, N min)"
  labels), plus reading their text and code and running their checks.

Each slot's description (the last column) names only what the slot covers: every ``§N``, exercise and
puzzle it cites is in the slot, every word of it (4 letters or more) occurs in what the slot reads or
does, and a word of a heading the slot leaves out (that its own headings lack) appears only in a
clause (up to a ``;``) that cites a section of the slot whose text has it: "the memory figure" in a
slot without the memory section fails, "the tile rule (§2)" where §2 explains it passes. Every
section, exercise and puzzle the plan names exists, and the flash forward (08's puzzle 5) is written
in the room on both tracks.

The plan's tables have the columns ``time | notebook | read in the room | do in the room | what the room
does``:

* ``time``: ``h:mm-h:mm``; the slots of a track run from 0:00 to 3:00 without gaps.
* ``notebook``: ``01`` .. ``NN`` (its ``notebooks/NN_*.py`` twin), ``README``, or ``-`` (a break, the
  wrap-up: nothing read or done).
* ``read in the room``: ``§0`` (the text before the first ``##`` heading), ``§3`` (the level-2
  section whose heading starts ``3.``, ``3 ·`` or ``Step 3 ·``), ``§0-3`` (a range), ``§5b``, or
  ``§Speed on a TPU`` (a heading by its start), separated by commas; ``-`` for nothing.
* ``do in the room``: exercise numbers of the notebook's ``## Exercises`` (``1, 2``, ``1-3``); in a
  puzzles notebook, puzzle numbers and find-the-bug letters (``1-5, 6b, B``), whose sections are then
  read and run too; ``-`` for nothing.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORDS_PER_MINUTE = 200
FULLEST = 0.9  # a slot's load may fill at most this share of it
TRACKS = ("CPU track", "Colab TPU track")
FLASH_FORWARD = ("08", "5")  # the puzzle every track writes in the room: notebook 08's puzzle 5
WORD = re.compile(r"[A-Za-z0-9][\w'’.-]*")
MINUTES = re.compile(r"\(\s*[★☆]{3}\s*,\s*(\d+)\s*min\s*\)")
EXERCISE = re.compile(r"^(?:\*\*)?(\d{1,2})\.[ \t]*(?:\*\*)?", re.MULTILINE)
HIDDEN_TAGS = ("solution", "hide-cell", "hide-input")
# Words a description may use whatever the slot covers.
COMMON = {"advanced", "along", "against", "another", "both", "does", "each", "every", "from", "into", "many",
          "more", "only", "room", "that", "their", "them", "then", "there", "these", "this", "through",
          "what", "when", "where", "which", "with", "without", "write", "writes", "your", "puzzle", "puzzles",
          "exercise", "exercises", "section", "sections"}


@dataclass
class Section:
    """One level-2 section of a notebook: its heading, prose, visible code and run seconds."""

    heading: str
    prose: list[str] = field(default_factory=list)
    code: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def text(self) -> str:
        return "\n".join([self.heading, *self.prose, *self.code])

    def words(self) -> int:
        return _words("\n".join(self.prose)) + _words("\n".join(self.code))


def _words(text: str) -> int:
    return len(WORD.findall(text))


def _source(notebook: str) -> Path:
    if notebook == "README":
        return ROOT / "README.md"
    found = sorted((ROOT / "notebooks").glob(f"{notebook}_*.py"))
    assert len(found) == 1, f"notebook {notebook!r}: expected one notebooks/{notebook}_*.py, found {found}"
    return found[0]


def _cells(path: Path) -> list[tuple[str, str, bool]]:
    """(kind, text, hidden) per cell of a jupytext percent twin: markdown uncommented, code as is."""
    cells = []
    for cell in re.split(r"^(?=# %%)", path.read_text(), flags=re.MULTILINE):
        header, _, body = cell.partition("\n")
        if not header.startswith("# %%"):
            continue  # the YAML header
        if "[markdown]" in header:
            lines = [line[2:] if line.startswith("# ") else line.lstrip("#")
                     for line in body.splitlines() if line.startswith("#")]
            cells.append(("markdown", "\n".join(lines), False))
        else:
            hidden = '"source_hidden": true' in header or any(f'"{tag}"' in header for tag in HIDDEN_TAGS)
            cells.append(("code", body.strip("\n"), hidden))
    return cells


def sections(notebook: str) -> dict[str, Section]:
    """Level-2 heading -> Section (the text before the first heading under the key ""), with the
    seconds ``notebooks/run_seconds.json`` records for it."""
    path = _source(notebook)
    found = {"": Section("")}
    current = found[""]
    cells = [("markdown", path.read_text(), False)] if path.suffix == ".md" else _cells(path)
    for kind, text, hidden in cells:
        if kind == "code":
            if not hidden:
                current.code.append(text)
            continue
        for line in text.splitlines():
            if line.startswith("## "):
                current = found.setdefault(line[3:].strip(), Section(line[3:].strip()))
            else:
                current.prose.append(line)
    if path.suffix == ".py":
        recorded = run_seconds().get(path.stem)
        assert recorded, (f"notebooks/run_seconds.json has no {path.stem}: python3 ci/notebooks.py --update "
                          f"{notebook} records it")
        differ = sorted(set(recorded["sections"]) ^ set(found))
        assert not differ, (f"notebooks/run_seconds.json's sections of {path.stem} are not its headings "
                            f"(edited since its run? python3 ci/notebooks.py --update {notebook}): {differ}")
        for heading, section in found.items():
            section.seconds = recorded["sections"][heading]
    return found


def run_seconds() -> dict:
    path = ROOT / "notebooks" / "run_seconds.json"
    return json.loads(path.read_text())["notebooks"] if path.exists() else {}


def _names(token: str, heading: str) -> bool:
    """Whether the section token ``0``, ``3``, ``5b`` or ``Speed`` names ``heading``."""
    if token == "0" or not heading:
        return token == "0" and not heading
    if re.fullmatch(r"\d+[a-z]?", token):
        return bool(re.match(rf"^(?:Step |Puzzle )?{token}(?:\.| ·)", heading))
    return heading.startswith(token)


def _heading(found: dict[str, Section], token: str, where: str) -> str:
    if token == "0":
        return ""
    matches = [h for h in found if h and _names(token, h)]
    headings = [h for h in found if h]
    assert len(matches) == 1, f"{where}: section §{token} matches {matches} (headings: {headings})"
    return matches[0]


def _expand(field_text: str) -> list[str]:
    tokens = []
    for part in (p.strip() for p in field_text.split(",")):
        if not part or part == "-":
            continue
        part = part.removeprefix("§")
        span = re.fullmatch(r"(\d+)-(\d+)", part)
        tokens += [str(n) for n in range(int(span[1]), int(span[2]) + 1)] if span else [part]
    return tokens


def _exercise_items(found: dict[str, Section]) -> tuple[str, dict[int, str]]:
    """The Exercises section's introduction (before the first item) and its numbered items."""
    text = "\n".join(found["Exercises"].prose)
    starts = [(int(m[1]), m.start()) for m in EXERCISE.finditer(text)]
    ends = [start for _, start in starts[1:]] + [len(text)]
    intro = text[:starts[0][1]] if starts else text
    return intro, {n: text[start:end] for (n, start), end in zip(starts, ends, strict=True)}


@dataclass
class Slot:
    start: int
    end: int
    notebook: str
    where: str
    description: str
    read: list[str] = field(default_factory=list)      # the headings read
    done: list[str] = field(default_factory=list)      # the exercise and puzzle tokens done
    words: int = 0
    seconds: float = 0.0
    exercise_min: int = 0
    covered: list[str] = field(default_factory=list)   # the text of everything read or done
    headings: list[str] = field(default_factory=list)  # the headings of what is read or done
    left_out: list[str] = field(default_factory=list)  # the notebook's other headings

    @property
    def minutes(self) -> int:
        return self.end - self.start

    @property
    def load(self) -> float:
        return self.words / WORDS_PER_MINUTE + self.seconds / 60 + self.exercise_min


def _do(slot: Slot, found: dict[str, Section], token: str) -> None:
    """Add one exercise or puzzle done in the room to ``slot``."""
    puzzle = [h for h in found if re.match(rf"^(?:Puzzle {token}|Find the bug {token}) ·", h)]
    if "Exercises" in found and token.isdigit() and not puzzle:
        intro, items = _exercise_items(found)
        assert int(token) in items, f"{slot.where}: no exercise {token} (found {sorted(items)})"
        item = items[int(token)]
        if "Exercises" not in slot.headings:  # the introduction, the stubs and the checks, once
            section = found["Exercises"]
            slot.words += _words(intro) + _words("\n".join(section.code))
            slot.seconds += section.seconds
            slot.covered += [intro, *section.code]
            slot.headings.append("Exercises")
        slot.words += _words(item)
        slot.covered.append(item)
    else:
        assert len(puzzle) == 1, f"{slot.where}: no puzzle {token!r} (headings: {[h for h in found if h]})"
        section = found[puzzle[0]]
        item = section.text()  # the label may be in the heading
        if puzzle[0] not in slot.headings:
            slot.words += section.words()
            slot.seconds += section.seconds
            slot.headings.append(puzzle[0])
        slot.covered.append(item)
    label = MINUTES.search(item)
    assert label, f"{slot.where}: exercise {token} has no '(★☆☆, N min)' label"
    slot.exercise_min += int(label[1])
    slot.done.append(token)


def _clock(text: str) -> int:
    hours, minutes = text.split(":")
    return 60 * int(hours) + int(minutes)


def plan(track: str) -> list[Slot]:
    """The slots of one track's table in WORKSHOP.md, each with its load."""
    text = (ROOT / "WORKSHOP.md").read_text()
    match = re.search(rf"^### {re.escape(track)}\n(.*?)(?=^#|\Z)", text, flags=re.MULTILINE | re.DOTALL)
    assert match, f"WORKSHOP.md: no '### {track}' table"
    slots = []
    for line in match[1].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or not re.fullmatch(r"\d:\d\d-\d:\d\d", cells[0].strip("*")):
            continue
        start, end = (_clock(t) for t in cells[0].strip("*").split("-"))
        notebook = cells[1].strip("*")
        description = cells[4] if len(cells) > 4 else ""
        slot = Slot(start, end, notebook, f"{track} {cells[0]} {notebook}", description)
        if notebook != "-":
            found = sections(notebook)
            for token in _expand(cells[2]):
                heading = _heading(found, token, slot.where)
                section = found[heading]
                slot.read.append(heading)
                slot.headings.append(heading)
                slot.words += section.words()
                slot.seconds += section.seconds
                slot.covered.append(section.text())
            for token in _expand(cells[3]):
                _do(slot, found, token)
            slot.left_out = [h for h in found if h and h not in slot.headings]
        slots.append(slot)
    return slots


def _text_words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower().replace("’", "'")))


def description_problems(slot: Slot) -> list[str]:
    """What the slot's description names that the slot does not cover."""
    if slot.notebook == "-":
        return []
    problems = []
    text = slot.description.replace("**", "").replace("`", "")
    for token in re.findall(r"§\s*([\w.-]+)", text):
        if not all(any(_names(t, h) for h in slot.read) for t in _expand(token.rstrip(".,;:"))):
            problems.append(f"cites §{token}, which the slot does not read")
    for kind, numbers in re.findall(r"\b(puzzles?|exercises?)\s+([\dA-Z][\d, a-zA-Z-]*)", text):
        for number in _expand(numbers.replace(" and ", ",")):
            if number.strip() and number.strip() not in slot.done:
                problems.append(f"cites {kind} {number.strip()}, which the slot does not do")
    covered = _text_words("\n".join(slot.covered + slot.headings))
    words = {w for w in _text_words(text) if len(w) >= 4 and w not in COMMON}

    def known(word: str) -> bool:
        stems = {word, word.rstrip("s"), word + "s", word.removesuffix("es"), word.removesuffix("ed"),
                 word.removesuffix("ing")}
        return bool(stems & covered)

    problems += [f"names '{w}', which nothing the slot reads or does contains" for w in sorted(words)
                 if not known(w)]
    # A word of a heading the slot leaves out (and its own headings lack) names that section, unless
    # its clause (up to a ";") cites a section of the slot whose text has the word.
    elsewhere = _text_words(" ".join(slot.left_out)) - _text_words(" ".join(slot.headings))
    for clause in text.split(";"):
        tokens = [t for token in re.findall(r"§\s*([\w.-]+)", clause) for t in _expand(token.rstrip(".,;:"))]
        cited = [text for h, text in zip(slot.read, slot.covered, strict=False)
                 if any(_names(t, h) for t in tokens)]
        backed = _text_words("\n".join(cited))
        problems += [f"names '{w}', a heading word of a section the slot leaves out" for w in
                     sorted(_text_words(clause) & words & elsewhere) if w not in backed]
    return problems


@pytest.mark.parametrize("track", TRACKS)
def test_every_slot_fits(track):
    slots = plan(track)
    assert slots, f"{track}: no slots"
    assert slots[0].start == 0 and slots[-1].end == 180, f"{track}: the day is 0:00-3:00"
    for before, after in zip(slots, slots[1:], strict=False):
        assert before.end == after.start, f"{track}: a gap or overlap at {after.where}"
    over = [f"{s.where}: {s.words} words ({s.words / WORDS_PER_MINUTE:.1f} min) + {s.seconds:.0f} s run + "
            f"{s.exercise_min} min of exercises = {s.load:.1f} min > {FULLEST:.0%} of {s.minutes} min"
            for s in slots if s.load > FULLEST * s.minutes]
    assert not over, "\n".join(over)


@pytest.mark.parametrize("track", TRACKS)
def test_each_description_names_only_what_its_slot_covers(track):
    problems = [f"{s.where}: {problem}" for s in plan(track) for problem in description_problems(s)]
    assert not problems, "\n".join(problems)


def test_the_core_is_in_both_tracks_and_the_room_writes_kernels():
    for track in TRACKS:
        slots = plan(track)
        notebooks = {s.notebook for s in slots}
        assert {"01", "02", "03", "04", "05"} <= notebooks, track
        puzzles = [s for s in slots if s.notebook in ("08", "09")]
        assert sum(s.exercise_min for s in puzzles) >= 20, f"{track}: fewer than 20 minutes of puzzles"
        notebook, puzzle = FLASH_FORWARD
        assert any(s.notebook == notebook and puzzle in s.done for s in slots), (
            f"{track}: the flash forward (notebook {notebook}, puzzle {puzzle}) is not written in the room")


def test_the_run_seconds_say_where_they_were_measured():
    table = run_seconds()
    assert table, "notebooks/run_seconds.json: no notebooks (python3 ci/notebooks.py --update records them)"
    for stem, entry in table.items():
        assert entry["machine"] and entry["jax"], stem
        rounding = 0.1 * (len(entry["sections"]) + 1)  # each section's seconds rounded to 0.1
        assert abs(sum(entry["sections"].values()) - entry["total_s"]) < rounding, stem


def test_reading_counts_visible_code_and_skips_hidden_cells(tmp_path, monkeypatch):
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "99_x.py").write_text(
        '# %% [markdown]\n# intro words here\n#\n# ## 1. First\n#\n# one two three\n\n'
        '# %%\nalpha = beta + gamma\n\n'
        '# %% jupyter={"source_hidden": true} tags=["solution"]\nhidden = secret + words + here\n')
    (tmp_path / "notebooks" / "run_seconds.json").write_text(json.dumps(
        {"notebooks": {"99_x": {"machine": "m", "jax": "j", "total_s": 3.0,
                                "sections": {"": 1.0, "1. First": 2.0}}}}))
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = sections("99")
    assert found[""].words() == 3 and found["1. First"].words() == 3 + 3
    assert found["1. First"].seconds == 2.0


def test_the_checker_refuses_what_does_not_fit(tmp_path, monkeypatch):
    # The same plan with one slot's exercises made too many fails: the check can fail.
    text = (ROOT / "WORKSHOP.md").read_text()
    row = next(line for line in text.splitlines() if re.match(r"^\| \d:\d\d-\d:\d\d \| 0[1-5] \|", line))
    cells = row.split("|")
    cells[4] = " 1-5 "  # every exercise of the notebook in one slot
    (tmp_path / "WORKSHOP.md").write_text(text.replace(row, "|".join(cells)))
    for name in ("notebooks", "README.md"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError, match=r"\d:\d\d 0[1-5]: \d+ words .* min of exercises = .* > 90% of"):
        test_every_slot_fits(TRACKS[0])


def test_the_description_check_refuses_what_a_slot_leaves_out():
    slot = next(s for s in plan(TRACKS[0]) if s.notebook == "01")
    assert not description_problems(slot), description_problems(slot)
    left_out = next(h for h in slot.left_out if re.match(r"\d+\.", h))
    word = max(_text_words(left_out) - _text_words(" ".join(slot.headings)), key=len)
    slot.description += f"; the {word} section"
    assert any(f"'{word}'" in problem for problem in description_problems(slot)), description_problems(slot)
    slot.description += " (§9)"
    assert any("§9" in problem for problem in description_problems(slot))
