"""Build the collection as a static site from the committed notebook outputs -> out/book/.

    python3 ci/book.py            # build out/book/ (Sphinx + MyST-NB + sphinx-book-theme; no execution)
    python3 ci/book.py --check    # then open every page in headless chromium (ci/browser_check.py)
    python3 ci/book.py --out out/x    # build into out/x/ (its staged sources, doctrees and warnings
                                      # beside it: out/x-src/, out/.x-doctrees/, out/x-warnings.txt)

Any Sphinx warning fails the build (``sphinx-build -W --keep-going``: every warning is reported, then
the exit status is non-zero): a docstring that is not valid reStructuredText (the API page renders the
package's Google-style docstrings through napoleon), a broken reference, a notebook MyST-NB cannot
render.

Like ci/notebooks.py it builds ``.venv`` on first use and re-runs itself inside it. The notebooks are
not executed: their committed outputs are rendered. Sphinx reads a staged copy of the sources in
``out/book-src/`` laid out as in the repository (``notebooks/NN_*.ipynb``, ``WORKSHOP.md``, ...), so
relative links keep working; the committed files are never modified. Staging is where the static
page gets what a live notebook has and a web page cannot:

* ipywidgets outputs (a slider needs a kernel) become a note with the Colab link, plus the figures the
  cell names (``figures/NN_*.png``) as the static fallback;
* cells tagged ``solution`` are collapsed like ``hide-input`` (code: MyST-NB's ``hide-cell``;
  markdown: a ``<details>`` block), long text outputs are collapsed (``hide-output``);
* every figure gets alt text (its saved name, its title, the section it belongs to) unless the cell
  sets ``mystnb.image.alt`` itself;
* the Colab badge image is served from the site (no request leaves it), links to repository files
  that are not pages point at the repository, and each notebook page links to Colab.

MathJax is vendored into the site from the npm registry (``npm pack mathjax@3.2.2``, integrity
checked, cached in ``out/.cache/``). Without npm the build still succeeds and says so: formulas are
then shown as their TeX source.
"""

from __future__ import annotations

import argparse
import base64
import copy
import hashlib
import html
import json
import os
import posixpath
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _venv  # noqa: E402
import install_cell  # noqa: E402

ROOT = _venv.ROOT
NOTEBOOKS = ROOT / "notebooks"
FIGURES = ROOT / "figures"
BOOK = ROOT / "book"                       # conf.py, the landing page, static assets
OUT = ROOT / "out" / "book"                # the built site
SOURCE = ROOT / "out" / "book-src"         # the staged sources Sphinx reads (rebuilt each time)
CACHE = ROOT / "out" / ".cache"            # vendored MathJax

# The one place the repository is named: launch buttons, Colab links, links to repository files.
# The repository and git ref come from pyproject.toml, as for the notebooks' badges (ci/install_cell.py).
REPOSITORY_URL, BRANCH = install_cell.source()
REPOSITORY = REPOSITORY_URL.removeprefix("https://github.com/")
COLAB_BADGE_URL = "https://colab.research.google.com/assets/colab-badge.svg"
LOCAL_BADGE = "_assets/colab-badge.svg"    # inside the staged sources; a copy of book/_static's

DOCS = ("WORKSHOP.md", "GLOSSARY.md", "ARCHITECTURE.md")   # repository pages the site includes
BOOK_ROOT_PAGES = ("index.md", "api.md")   # book/ pages staged at the site's root: the landing page, the API
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
HIDDEN_TAGS = ("solution", "hide-input", "hide-cell")       # collapsed until clicked
LONG_OUTPUT_LINES = 30                                       # text outputs longer than this collapse

MATHJAX_VERSION = "3.2.2"
MATHJAX_INTEGRITY = ("sha512-Bt+SSVU8eBG27zChVewOicYs7Xsdt40qm4+UpHyX7k0/O9NliPc+x77k1/FEsPsjKPZGJvtRZM1v"
                     "O+geW0OhGw==")
# What tex-chtml.js loads on demand (TeX extensions, fonts, the menu and its accessibility parts).
MATHJAX_FILES = ("tex-chtml.js", "input/tex/extensions/", "output/chtml/fonts/woff-v2/", "a11y/", "ui/")


def colab_url(stem: str) -> str:
    return f"https://colab.research.google.com/github/{REPOSITORY}/blob/{BRANCH}/notebooks/{stem}.ipynb"


def blob_url(path: str) -> str:
    return f"{REPOSITORY_URL}/blob/{BRANCH}/{path}"


def notebook_stems() -> list[str]:
    """``NN_name`` of every committed notebook, in walk order (06, 07, ... appear on their own)."""
    return sorted(p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


# --------------------------------------------------------------------------------------------------
# Text helpers


def source_of(cell) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def plain_text(markdown: str) -> str:
    """Markdown reduced to one line of readable text (for alt text and the walk table)."""
    text = re.sub(r"<[^>]+>", " ", markdown)
    text = re.sub(r"!\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"^#+\s*", "", text, flags=re.M)
    text = text.replace("**", "").replace("`", "").replace("$", "")
    text = re.sub(r"\\(mathbb|mathrm|operatorname|text)\{([^}]*)\}", r"\2", text)
    text = re.sub(r"\\([a-zA-Z]+)", r"\1", text).replace("{", "").replace("}", "")   # \propto -> propto
    return " ".join(text.split())


def first_sentence(text: str, limit: int = 200) -> str:
    match = re.match(r"(.+?[.?!])(\s|$)", text)
    sentence = match.group(1) if match else text
    return sentence if len(sentence) <= limit else sentence[: limit - 1].rstrip() + "…"


def notebook_title(nb) -> tuple[str, str]:
    """(full H1 title, short title before a colon) of a notebook, from its first heading."""
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            match = re.search(r"^#\s+(.+)$", source_of(cell), flags=re.M)
            if match:
                full = match.group(1).strip()
                return full, full.split(":")[0].strip()
    return "", ""


def notebook_question(nb) -> str:
    """The question a notebook answers: the bold sentence ending in '?' of its opening, else its
    first sentence after the title."""
    opening = next((source_of(c) for c in nb["cells"] if c["cell_type"] == "markdown"), "")
    body = re.sub(r"^#.*$", "", opening, flags=re.M)
    for bold in re.findall(r"\*\*(.+?)\*\*", body, flags=re.S):
        if "?" in bold:
            question = " ".join(bold.split())
            return question[0].upper() + question[1:]
    return first_sentence(plain_text(body.split("\n\n")[0] if body.strip() else ""))


# --------------------------------------------------------------------------------------------------
# Links


LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")


def rewrite_links(markdown: str, doc_path: str, pages: set[str]) -> str:
    """Point links to repository files that are not pages of the site at the repository.

    ``doc_path`` is the document's path in the repository (``notebooks/01_x.ipynb``); ``pages`` are
    the repository paths the site has as pages. The staged sources mirror the repository's layout,
    so a link to a page keeps its relative path; an image link is left alone."""
    base = posixpath.dirname(doc_path)

    def replace(match: re.Match) -> str:
        bang, text, target = match.groups()
        if bang or re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target, flags=re.I):
            return match.group(0)
        path, _, anchor = target.partition("#")
        resolved = posixpath.normpath(posixpath.join(base, path)) if path else doc_path
        if resolved in pages or resolved.startswith(".."):
            return match.group(0)
        url = blob_url(resolved) + (f"#{anchor}" if anchor else "")
        return f"[{text}]({url})"

    return LINK.sub(replace, markdown)


CODE = re.compile(r"(```.*?```|~~~.*?~~~|`[^`\n]*`|\$\$.*?\$\$|\$[^$\n]*\$)", flags=re.S)
BARE_URL = re.compile(r"(?<![<\[\"'=/+])(?<!\]\()\bhttps?://[^\s<>()\[\]`\"']+")


def linkify(markdown: str) -> str:
    """Bare URLs (as in the References sections) become links; code and math are left alone."""
    def wrap(match: re.Match) -> str:
        url = match.group(0)
        stripped = url.rstrip(".,;:")
        return f"<{stripped}>{url[len(stripped):]}"

    parts = CODE.split(markdown)
    return "".join(part if i % 2 else BARE_URL.sub(wrap, part) for i, part in enumerate(parts))


def localise_badges(markdown: str, doc_path: str) -> str:
    """Serve the Colab badge from the site (offline pages must not load images from elsewhere)."""
    depth = doc_path.count("/")
    return markdown.replace(COLAB_BADGE_URL, "../" * depth + LOCAL_BADGE)


# --------------------------------------------------------------------------------------------------
# Notebooks


def widget_fallback(cell, stem: str, figures_dir: Path = FIGURES) -> list[dict]:
    """The outputs that replace an ipywidgets view: a note with the Colab link, then the figures the
    cell names (``figures/NN_*.png``), embedded, as the static version."""
    shown = ""
    for output in cell.get("outputs", []):
        if WIDGET_VIEW in output.get("data", {}):
            shown = "".join(output["data"].get("text/plain", ""))
    names = sorted(set(re.findall(r"figures/([\w.-]+\.png)", source_of(cell))))
    present = [name for name in names if (figures_dir / name).exists()]
    fallback = (" The figure below is its static version (" + ", ".join(f"<code>figures/{n}</code>"
                                                                      for n in present) + ")."
                if present else " The figures above are its static version.")
    note = (f'<div class="admonition note widget-fallback"><p class="admonition-title">Interactive widget'
            f'</p><p>In a running notebook this cell shows sliders that redraw the figure. A static page '
            f'cannot run a kernel: <a href="{html.escape(colab_url(stem))}">open this notebook in '
            f'Colab</a>, or run it locally in JupyterLab (see the landing page).{fallback}</p></div>')
    outputs = [{"output_type": "display_data", "metadata": {},
                "data": {"text/html": note, "text/plain": f"[interactive widget: {shown}]"}}]
    for name in present:
        data = base64.b64encode((figures_dir / name).read_bytes()).decode()
        outputs.append({"output_type": "display_data", "metadata": {},
                        "data": {"image/png": data, "text/plain": f"<static figure {name}>"}})
    return outputs


def output_lines(cell) -> tuple[int, bool]:
    """(text lines, whether there is an image) of a code cell's outputs."""
    lines, image = 0, False
    for output in cell.get("outputs", []):
        if output["output_type"] == "stream":
            lines += "".join(output.get("text", "")).count("\n")
        elif output["output_type"] == "error":
            lines += len(output.get("traceback", []))
        else:
            data = output.get("data", {})
            if any(m.startswith("image/") for m in data):
                image = True
            elif "text/html" not in data and "text/plain" in data:
                lines += "".join(data["text/plain"]).count("\n") + 1
    return lines, image


def alt_text(cells: list, index: int) -> str:
    """Alt text for the figures of ``cells[index]``: the saved figure name, the title the code gives
    it, and the section it belongs to."""
    source = source_of(cells[index])
    parts = []
    saved = re.search(r"save_figure\(\s*\w+\s*,\s*[\"']([\w.-]+)[\"']", source)
    title = re.search(r"suptitle\(\s*(?:f?[\"'])([^\"']+)[\"']", source)
    heading, sentence = "", ""
    for cell in reversed(cells[:index]):
        if cell["cell_type"] != "markdown":
            continue
        text = source_of(cell)
        if not sentence:
            paragraphs = [p for p in re.split(r"\n\s*\n", text)
                          if p.strip() and not p.lstrip().startswith("#")]
            sentence = first_sentence(plain_text(paragraphs[-1])) if paragraphs else ""
        found = re.findall(r"^#{1,3}\s+(.+)$", text, flags=re.M)
        if found:
            heading = plain_text(found[-1])
            break
    parts.append(f"Figure {saved.group(1)}:" if saved else "Figure:")
    if title:
        parts.append(plain_text(title.group(1)).rstrip(".") + ".")
    if heading:
        parts.append(f"Section: {heading}.")
    if sentence and not title:
        parts.append(sentence)
    return " ".join(parts)


def collapse_markdown(markdown: str, summary: str) -> str:
    """A markdown cell hidden until clicked (MyST-NB collapses only code cells)."""
    if markdown.lstrip().startswith("<details"):
        return markdown
    return f'<details class="hidden-cell"><summary>{summary}</summary>\n\n{markdown}\n\n</details>'


def prepare_notebook(nb: dict, stem: str, pages: set[str], figures_dir: Path = FIGURES) -> dict:
    """The notebook as the site shows it (a copy; see the module docstring)."""
    nb = copy.deepcopy(nb)
    nb.get("metadata", {}).pop("widgets", None)
    doc_path = f"notebooks/{stem}.ipynb"
    cells = nb["cells"]
    for index, cell in enumerate(cells):
        metadata = cell.setdefault("metadata", {})
        tags = list(metadata.get("tags", []))
        if cell["cell_type"] == "markdown":
            text = localise_badges(linkify(rewrite_links(source_of(cell), doc_path, pages)), doc_path)
            if any(tag in tags for tag in HIDDEN_TAGS):
                text = collapse_markdown(text, "Solution" if "solution" in tags else "Show")
            cell["source"] = text
            continue
        if cell["cell_type"] != "code":
            continue
        if any(WIDGET_VIEW in output.get("data", {}) for output in cell.get("outputs", [])):
            fallback = widget_fallback(cell, stem, figures_dir)
            cell["outputs"] = [o for o in cell["outputs"] if WIDGET_VIEW not in o.get("data", {})] + fallback
        if "solution" in tags and "hide-cell" not in tags:
            tags.append("hide-cell")
        lines, image = output_lines(cell)
        if lines > LONG_OUTPUT_LINES and not image and "hide-output" not in tags:
            tags.append("hide-output")
        if image:
            options = metadata.setdefault("mystnb", {}).setdefault("image", {})
            options.setdefault("alt", alt_text(cells, index))
        metadata["tags"] = tags
    # Every notebook page links to Colab, even one whose opening has no badge.
    if not any(colab_url(stem) in source_of(c) for c in cells if c["cell_type"] == "markdown"):
        first = next((i for i, c in enumerate(cells) if c["cell_type"] == "markdown"), -1)
        badge = localise_badges(f"[![Open In Colab]({COLAB_BADGE_URL})]({colab_url(stem)})", doc_path)
        cell = {"cell_type": "markdown", "metadata": {}, "source": badge}
        if nb.get("nbformat_minor", 0) >= 5:   # cell ids from nbformat 4.5 on
            cell["id"] = f"colab-{stem}"[:64]
        cells.insert(first + 1, cell)
    return nb


# --------------------------------------------------------------------------------------------------
# Generated pages


def walk_table(notebooks: dict[str, dict]) -> str:
    rows = ["| notebook | the question it answers | |", "|---|---|---|"]
    for stem, nb in notebooks.items():
        _, short = notebook_title(nb)
        badge = f"[![Open In Colab]({LOCAL_BADGE})]({colab_url(stem)})"
        question = notebook_question(nb).replace("|", "\\|")
        rows.append(f"| [{short or stem}](notebooks/{stem}.ipynb) | {question} | {badge} |")
    return "\n".join(rows)


def references_page(notebooks: dict[str, dict], pages: set[str]) -> str:
    """Every notebook's References section, one after the other."""
    parts = ["# References", "",
             "The sources each notebook cites, gathered from their *References* sections. Terms: "
             "[the glossary](GLOSSARY.md).", ""]
    for stem, nb in notebooks.items():
        full, _ = notebook_title(nb)
        for cell in nb["cells"]:
            text = source_of(cell)
            if cell["cell_type"] == "markdown" and re.match(r"^#{1,4}\s+References\s*$", text.split("\n")[0]):
                body = text.split("\n", 1)[1] if "\n" in text else ""
                body = linkify(rewrite_links(body, "references.md", pages))
                parts += [f"## [{full or stem}](notebooks/{stem}.ipynb)", "", body.strip(), ""]
    return "\n".join(parts)


def book_pages() -> tuple[str, ...]:
    """The book's own Markdown pages (``book/*.md`` but the landing and API pages) by repository path.
    They are staged at that path, so their relative links (``../GLOSSARY.md``) work in the site as on
    GitHub; the landing page lists them in a toctree."""
    return tuple(f"book/{p.name}" for p in sorted(BOOK.glob("*.md")) if p.name not in BOOK_ROOT_PAGES)


def stage(source: Path = SOURCE) -> dict[str, dict]:
    """Write the sources Sphinx reads into ``source``; return the prepared notebooks by stem."""
    if source.exists():
        shutil.rmtree(source)
    (source / "notebooks").mkdir(parents=True)
    (source / "_assets").mkdir()
    shutil.copyfile(BOOK / "_static" / "colab-badge.svg", source / LOCAL_BADGE)
    stems = notebook_stems()
    docs = DOCS + book_pages()
    pages = {f"notebooks/{s}.ipynb" for s in stems} | set(docs) | {"references.md", "api.md"}
    committed = {s: json.loads((NOTEBOOKS / f"{s}.ipynb").read_text()) for s in stems}
    for stem, nb in committed.items():
        prepared = prepare_notebook(nb, stem, pages)
        (source / "notebooks" / f"{stem}.ipynb").write_text(json.dumps(prepared, indent=1))
    for doc in docs:
        text = (ROOT / doc).read_text()
        (source / doc).parent.mkdir(parents=True, exist_ok=True)
        (source / doc).write_text(localise_badges(linkify(rewrite_links(text, doc, pages)), doc))
    (source / "references.md").write_text(references_page(committed, pages))
    shutil.copyfile(BOOK / "api.md", source / "api.md")
    landing = (BOOK / "index.md").read_text()
    landing = landing.replace("{{ walk_table }}", walk_table(committed))
    landing = landing.replace("{{ repository_url }}", REPOSITORY_URL)
    (source / "index.md").write_text(localise_badges(landing, "index.md"))
    return committed


# --------------------------------------------------------------------------------------------------
# MathJax


def vendor_mathjax(cache: Path = CACHE) -> Path | None:
    """A folder holding ``mathjax/tex-chtml.js`` and what it loads, from the npm registry (cached);
    None (formulas shown as TeX source) when npm is missing or the download fails."""
    target = cache / f"mathjax-{MATHJAX_VERSION}"
    if (target / "mathjax" / "tex-chtml.js").exists():
        return target
    npm = shutil.which("npm")
    if npm is None:
        print("[book] npm not found: MathJax not vendored, formulas are shown as TeX source "
              "(apt-get install npm)", flush=True)
        return None
    with tempfile.TemporaryDirectory(prefix="tpuattn-mathjax-") as tmp:
        try:
            result = subprocess.run([npm, "pack", f"mathjax@{MATHJAX_VERSION}", "--silent"], cwd=tmp,
                                    capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            result = None
        tarballs = list(Path(tmp).glob("mathjax-*.tgz"))
        if result is None or result.returncode != 0 or not tarballs:
            detail = "timed out" if result is None else (result.stderr.strip().splitlines() or ["?"])[-1]
            print(f"[book] npm pack mathjax@{MATHJAX_VERSION} failed ({detail}): formulas are shown as "
                  "TeX source", flush=True)
            return None
        data = tarballs[0].read_bytes()
        integrity = "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()
        if integrity != MATHJAX_INTEGRITY:
            sys.exit(f"[book] mathjax@{MATHJAX_VERSION} from npm has integrity {integrity}, "
                     f"expected {MATHJAX_INTEGRITY}")
        partial = cache / f"mathjax-{MATHJAX_VERSION}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        with tarfile.open(tarballs[0]) as archive:
            for member in archive.getmembers():
                name = member.name.removeprefix("package/")
                inner = name.removeprefix("es5/")
                wanted = (name == "LICENSE" or (name.startswith("es5/") and inner.startswith(MATHJAX_FILES)))
                if member.isfile() and wanted:
                    destination = partial / "mathjax" / inner
                    destination.parent.mkdir(parents=True, exist_ok=True)
                    destination.write_bytes(archive.extractfile(member).read())
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
    print(f"[book] vendored MathJax {MATHJAX_VERSION} from npm into {os.path.relpath(target, ROOT)}",
          flush=True)
    return target


# --------------------------------------------------------------------------------------------------


def show_warnings(lines: list[str]) -> None:
    """Sphinx's warnings in full, paths relative to the repository (a docstring's warning names its
    file, line and object: ``tpuattn/api.py:docstring of tpuattn.api.attention:6: ERROR: ...``)."""
    for line in lines:
        if line.strip():
            print("  " + line.replace(str(ROOT) + "/", ""), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="then run ci/browser_check.py on the site")
    parser.add_argument("--out", default=str(OUT.relative_to(ROOT)), help="output folder")
    args = parser.parse_args()

    _venv.reexec_in(_venv.MAIN)
    for name, value in _venv.CPU_WITH_TPU_COMPILER.items():   # autodoc imports tpuattn (and JAX)
        os.environ.setdefault(name, value)
    start = time.perf_counter()
    out = (ROOT / args.out).resolve()
    # The staged sources, doctrees and warnings sit beside the site and are named after it (for
    # out/book: out/book-src, out/.book-doctrees, out/book-warnings.txt), so builds into different
    # folders never share a file.
    source = out.with_name(f"{out.name}-src")
    doctrees = out.with_name(f".{out.name}-doctrees")
    warnings_file = out.with_name(f"{out.name}-warnings.txt")
    notebooks = stage(source)
    mathjax = vendor_mathjax()
    os.environ["TPUATTN_BOOK_MATHJAX"] = str(mathjax) if mathjax else ""
    if out.exists():
        shutil.rmtree(out)
    shutil.rmtree(doctrees, ignore_errors=True)
    warnings_file.unlink(missing_ok=True)
    # -W: a warning is an error, so the build fails on one (a docstring that is not valid
    # reStructuredText, a broken cross-reference, a notebook MyST cannot render); --keep-going reports
    # them all before failing.
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-c", str(BOOK), "-d", str(doctrees), "-q",
           "-W", "--keep-going", "-w", str(warnings_file), str(source), str(out)]
    print(f"[book] {len(notebooks)} notebooks: sphinx-build -> {os.path.relpath(out, ROOT)}/", flush=True)
    # Warnings go to the file and are shown below; anything else on stderr is shown as is.
    result = subprocess.run(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    code = result.returncode
    for line in result.stderr.splitlines():
        if not re.search(r"(WARNING|ERROR|CRITICAL):", line) and line.strip():
            print("  " + line, flush=True)
    warnings = warnings_file.read_text().splitlines() if warnings_file.exists() else []
    show_warnings(warnings)
    seconds = time.perf_counter() - start
    print(f"[book] {'built' if code == 0 else 'FAILED'} in {seconds:.0f} s: "
          f"{len(list(out.rglob('*.html')))} pages, {len(warnings)} warning line(s) (warnings are errors)"
          f"{' (' + os.path.relpath(warnings_file, ROOT) + ')' if warnings else ''}; "
          f"MathJax {'vendored' if mathjax else 'NOT vendored (TeX source shown)'}", flush=True)
    print(f"[book] open {os.path.relpath(out / 'index.html', ROOT)}", flush=True)
    if code != 0:
        return code
    if args.check:
        return subprocess.run([sys.executable, str(ROOT / "ci" / "browser_check.py"), "--site", str(out)],
                              cwd=ROOT).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
