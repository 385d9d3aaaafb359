"""Every Python code block of the README and of the book's Markdown pages runs.

The pages: README.md, the repository pages the book includes (GLOSSARY.md, WORKSHOP.md,
ARCHITECTURE.md: ``ci/book.py``'s ``DOCS``) and every ``book/*.md``. Each page's ```` ```python ````
blocks run in order in one namespace of the page's own, as a reader pasting them into one notebook
would run them. All pages run in one child process (one start of JAX, ``JAX_PLATFORMS=cpu``, in a
temporary folder): an implementation a page registers stays out of this process's registry, and
nothing is written into the checkout. The pages share that child's registry, so two pages must not
register the same name. A block that raises
fails the test, with the page and line in the traceback. A block that cannot run off a TPU is not
written as ``python``: the page shows it as ``text`` and says why."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = ("python", "py", "python3")     # info strings of blocks that run
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)")


def pages() -> list[Path]:
    """README.md, the repository pages the book includes (ci/book.py's DOCS), book/*.md."""
    spec = importlib.util.spec_from_file_location("tpuattn_ci_book_pages", ROOT / "ci" / "book.py")
    book = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(book)
    return [ROOT / "README.md", *(ROOT / doc for doc in book.DOCS), *sorted((ROOT / "book").glob("*.md"))]


def code_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line of the opening fence, info string, body) of every fenced block, in order (CommonMark:
    a block closes at a fence of the same character at least as long, and at the end of the page)."""
    blocks, opened = [], None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if opened is None:
            if match:
                opened, body = (number, match.group(1), match.group(2).lower()), []
            continue
        start, fence, info = opened
        closing = match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence)
        if closing and not match.group(2):
            blocks.append((start, info, "\n".join(body)))
            opened = None
        else:
            body.append(line)
    if opened is not None:
        blocks.append((opened[0], opened[2], "\n".join(body)))
    return blocks


def python_blocks(path: Path) -> list[tuple[int, str]]:
    return [(line, body) for line, info, body in code_blocks(path.read_text())
            if info.removeprefix("{").removesuffix("}") in PYTHON]


# The child process: each page in a namespace of its own, each block compiled under "<page>:<line>"
# so that a traceback names where it is; a page that raises is reported and the next one runs.
RUNNER = """
import sys, traceback
failed = []
for page, blocks in PAGES:
    namespace = {"__name__": "__main__"}
    for name, source in blocks:
        print(f"[doc block] {name}", flush=True)
        try:
            exec(compile(source, name, "exec"), namespace)
        except BaseException:
            traceback.print_exc()
            print(f"[doc page failed] {page} at {name}", file=sys.stderr, flush=True)
            failed.append(page)
            break
    else:
        print(f"[doc page ok] {page}", flush=True)
sys.exit(1 if failed else 0)
"""


def run_pages(paths: list[Path], cwd: Path, root: Path = ROOT) -> subprocess.CompletedProcess:
    """Run each page's Python blocks in order in one namespace per page, in one child process (one
    start of JAX for all of them) started in ``cwd``."""
    pages = []
    for path in paths:
        relative = path.relative_to(root).as_posix()
        # Blank lines before each block keep the traceback's line numbers those of the page.
        blocks = [(f"{relative}:{line}", "\n" * line + body) for line, body in python_blocks(path)]
        pages.append((relative, blocks))
    script = f"PAGES = {pages!r}\n{RUNNER}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
           "MPLBACKEND": "Agg", "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)


PAGES_WITH_CODE = [p for p in pages() if python_blocks(p)]


def test_every_python_block_runs(tmp_path):
    done = run_pages(PAGES_WITH_CODE, tmp_path)
    failed = [line for line in done.stderr.splitlines() if line.startswith("[doc page failed]")]
    assert done.returncode == 0 and not failed, (
        "\n".join(failed) + f"\n\n{done.stdout[-3000:]}\n{done.stderr[-8000:]}")
    ok = {line.removeprefix("[doc page ok] ") for line in done.stdout.splitlines()
          if line.startswith("[doc page ok]")}
    assert ok == {p.relative_to(ROOT).as_posix() for p in PAGES_WITH_CODE}, done.stdout
    assert done.stdout.count("[doc block] ") == sum(len(python_blocks(p)) for p in PAGES_WITH_CODE)


def test_the_pages_are_found_and_have_code():
    names = {p.relative_to(ROOT).as_posix() for p in pages()}
    assert {"README.md", "ARCHITECTURE.md", "GLOSSARY.md", "WORKSHOP.md", "book/index.md"} <= names
    assert {"README.md", "book/contract.md"} <= {p.relative_to(ROOT).as_posix() for p in PAGES_WITH_CODE}


def test_blocks_are_parsed_as_commonmark_fences():
    text = "\n".join([
        "```python", "a = 1", "```",
        "````markdown", "```python", "not a block of its own", "```", "````",
        "~~~py", "b = 2", "~~~",
        "```bash", "echo", "```",
        "```{python}", "c = 3", "```",
    ])
    blocks = code_blocks(text)
    assert [(info, body) for _, info, body in blocks] == [
        ("python", "a = 1"), ("markdown", "```python\nnot a block of its own\n```"), ("py", "b = 2"),
        ("bash", "echo"), ("{python}", "c = 3")]
    assert [line for line, *_ in blocks] == [1, 4, 9, 12, 15]


def test_a_block_that_raises_fails_naming_its_page_and_line(tmp_path):
    first, second = tmp_path / "first.md", tmp_path / "second.md"
    first.write_text("# A page\n\n```python\nx = 1\n```\n\ntext\n\n```python\nassert x == 2, 'x is 1'\n```\n")
    second.write_text("```python\nassert 'x' not in globals(), 'a page of its own'\n```\n")
    assert [line for line, _ in python_blocks(first)] == [3, 9]
    done = run_pages([first, second], tmp_path, root=tmp_path)
    assert done.returncode != 0
    assert 'File "first.md:9", line 10' in done.stderr and "x is 1" in done.stderr, done.stderr
    assert "[doc page failed] first.md at first.md:9" in done.stderr
    assert "[doc page ok] second.md" in done.stdout, done.stderr
