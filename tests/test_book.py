"""ci/book.py's notebook preparation and ci/browser_check.py's link checker, on tiny synthetic inputs
(no Sphinx, no browser)."""

import base64
import importlib.util
import json
import sys
from pathlib import Path

import pytest

CI = Path(__file__).resolve().parent.parent / "ci"


def load(name):
    spec = importlib.util.spec_from_file_location(f"tpuattn_ci_{name}", CI / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


book = load("book")
browser_check = load("browser_check")

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"0" * 16).decode()
PAGES = {"notebooks/01_x.ipynb", "GLOSSARY.md"}


def markdown(text, tags=()):
    return {"cell_type": "markdown", "metadata": {"tags": list(tags)}, "source": text}


def code(source, outputs=(), tags=()):
    return {"cell_type": "code", "metadata": {"tags": list(tags)}, "source": source,
            "execution_count": 1, "outputs": list(outputs)}


def notebook(*cells):
    return {"cells": list(cells), "metadata": {"widgets": {"state": {}}}, "nbformat": 4, "nbformat_minor": 5}


WIDGET = {"output_type": "display_data", "metadata": {},
          "data": {book.WIDGET_VIEW: {"model_id": "abc", "version_major": 2, "version_minor": 0},
                   "text/plain": "VBox(children=(IntSlider(value=1024),))"}}


def test_widget_view_becomes_note_with_colab_link_and_named_figure(tmp_path):
    (tmp_path / "01_grid.png").write_bytes(b"png bytes")
    nb = notebook(markdown("# 01 · X\n\nIt answers: **what?**"),
                  code('display(w)  # fallback: figures/01_grid.png', [WIDGET]))
    out = book.prepare_notebook(nb, "01_x", PAGES, figures_dir=tmp_path)
    outputs = out["cells"][-1]["outputs"]
    assert not any(book.WIDGET_VIEW in o.get("data", {}) for o in outputs)
    assert book.colab_url("01_x") in outputs[0]["data"]["text/html"]
    assert "figures/01_grid.png" in outputs[0]["data"]["text/html"]
    assert base64.b64decode(outputs[1]["data"]["image/png"]) == b"png bytes"
    assert "widgets" not in out["metadata"]
    assert book.WIDGET_VIEW in nb["cells"][-1]["outputs"][0]["data"], "the input is not modified"


def test_widget_without_named_figure_points_to_figures_above(tmp_path):
    out = book.prepare_notebook(notebook(code("interact(f)", [WIDGET])), "01_x", PAGES, figures_dir=tmp_path)
    (note,) = out["cells"][-1]["outputs"]
    assert "figures above" in note["data"]["text/html"]


def test_solutions_hidden_long_outputs_collapsed_figures_get_alt_text():
    long = {"output_type": "stream", "name": "stdout", "text": "line\n" * (book.LONG_OUTPUT_LINES + 1)}
    figure = {"output_type": "display_data", "metadata": {},
              "data": {"image/png": PNG, "text/plain": "<Figure>"}}
    nb = notebook(markdown("## 3. Masks\n\nA mask says which keys a query may see. More."),
                  code('fig.suptitle("Which keys each query sees")\nsave_figure(fig, "01_masks")', [figure]),
                  code("print(big)", [long]),
                  code("answer = 42", tags=["solution"]),
                  markdown("The answer is 42.", tags=["solution"]))
    cells = book.prepare_notebook(nb, "01_x", PAGES)["cells"]
    assert book.colab_url("01_x") in cells[1]["source"]      # added after the opening cell
    alt = cells[2]["metadata"]["mystnb"]["image"]["alt"]
    assert "01_masks" in alt and "Which keys each query sees" in alt and "3. Masks" in alt
    assert "hide-output" in cells[3]["metadata"]["tags"]
    assert "hide-cell" in cells[4]["metadata"]["tags"]
    assert cells[5]["source"].startswith("<details") and "The answer is 42." in cells[5]["source"]


def test_alt_text_set_by_the_author_is_kept():
    figure = {"output_type": "display_data", "metadata": {}, "data": {"image/png": PNG}}
    cell = code("plot()", [figure])
    cell["metadata"]["mystnb"] = {"image": {"alt": "mine"}}
    out = book.prepare_notebook(notebook(cell), "01_x", PAGES)
    assert out["cells"][-1]["metadata"]["mystnb"]["image"]["alt"] == "mine"


def test_colab_link_added_once_and_badge_served_locally():
    badge = f"[![Open In Colab]({book.COLAB_BADGE_URL})]({book.colab_url('01_x')})"
    with_badge = book.prepare_notebook(notebook(markdown(f"# T\n\n{badge}")), "01_x", PAGES)
    assert len(with_badge["cells"]) == 1
    assert book.COLAB_BADGE_URL not in with_badge["cells"][0]["source"]
    assert f"../{book.LOCAL_BADGE}" in with_badge["cells"][0]["source"]
    without = book.prepare_notebook(notebook(markdown("# T"), code("x = 1")), "01_x", PAGES)
    assert book.colab_url("01_x") in without["cells"][1]["source"]


@pytest.mark.parametrize(("link", "expected"), [
    ("[g](../GLOSSARY.md#mxu)", "[g](../GLOSSARY.md#mxu)"),                  # a page of the site
    ("[r](../README.md)", f"[r]({book.REPOSITORY_URL}/blob/main/README.md)"),   # a repository file
    ("[t](../tests/oracle.py#L3)", f"[t]({book.REPOSITORY_URL}/blob/main/tests/oracle.py#L3)"),
    ("[w](https://example.org/a.md)", "[w](https://example.org/a.md)"),
    ("[s](#section)", "[s](#section)"),
])
def test_rewrite_links(link, expected):
    assert book.rewrite_links(link, "notebooks/01_x.ipynb", PAGES) == expected


def test_book_pages_are_staged_at_their_repository_path_and_listed(tmp_path):
    """book/*.md (but the landing and API pages) are staged where they sit in the repository, so a
    link to a page of the site stays relative and one to a repository file points at the repository;
    the landing page's toctree and the README list every one."""
    pages = book.book_pages()
    assert "book/contract.md" in pages and not {"book/index.md", "book/api.md"} & set(pages)
    book.stage(tmp_path / "src")
    for page in pages:
        assert (tmp_path / "src" / page).read_text().startswith("# "), page
    staged = (tmp_path / "src" / "book" / "contract.md").read_text()
    assert "](../GLOSSARY.md)" in staged and f"]({book.REPOSITORY_URL}/blob/main/tpuattn/api.py)" in staged
    toctree = (book.BOOK / "index.md").read_text().splitlines()
    readme = (book.ROOT / "README.md").read_text()
    for page in pages:
        assert page.removesuffix(".md") in toctree, f"{page} is not in book/index.md's toctree"
        assert f"]({page})" in readme, f"the README does not link {page}"


def test_walk_table_question_and_title():
    nb = notebook(markdown("# 02 · Online softmax: attention without scores\n\nThis notebook answers: "
                           "**can we compute the\nsame thing?** More text."))
    assert book.notebook_title(nb) == ("02 · Online softmax: attention without scores", "02 · Online softmax")
    assert book.notebook_question(nb) == "Can we compute the same thing?"
    table = book.walk_table({"02_x": nb})
    assert "[02 · Online softmax](notebooks/02_x.ipynb)" in table and book.colab_url("02_x") in table


def page(body):
    return f"<html><body>{body}</body></html>"


def test_link_checker_finds_missing_files_anchors_alt_text_and_widget_placeholders(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "_images").mkdir()
    (tmp_path / "_images" / "a.png").write_bytes(b"")
    (tmp_path / "index.html").write_text(page(
        '<a href="sub/page.html#here">ok</a> <a href="sub/page.html#gone">anchor</a>'
        '<a href="missing.html">file</a> <a href="https://example.org/x">external</a>'
        '<a href="#top" id="top">self</a> <a href="mailto:a@b">mail</a>'
        '<img src="_images/a.png" alt="a figure"> <img src="_images/a.png">'
        '<img src="_images/none.png" alt="x">'))
    (tmp_path / "sub" / "page.html").write_text(page(
        '<h2 id="here">Here</h2><a href="../index.html#top">back</a><a href="..">up</a>'
        f'<script type="{browser_check.WIDGET_VIEW}">{{}}</script>'))
    problems = browser_check.check_links(tmp_path)
    text = "\n".join(problems)
    assert "no id 'gone' in sub/page.html" in text
    assert "missing.html" in text
    assert "_images/none.png" in text
    assert "has no alt text" in text
    assert "ipywidgets placeholder" in text
    assert len(problems) == 5, problems


def test_link_checker_accepts_a_clean_site(tmp_path):
    (tmp_path / "index.html").write_text(page('<a href="index.html#a" id="a">x</a><a href="#">top</a>'))
    assert browser_check.check_links(tmp_path) == []


def test_figure_check_counts_image_outputs_against_the_page(tmp_path):
    (tmp_path / "_sources" / "notebooks").mkdir(parents=True)
    (tmp_path / "notebooks").mkdir()
    figure = {"output_type": "display_data", "metadata": {}, "data": {"image/png": PNG}}
    nb = notebook(code("plot()", [figure, figure]))
    (tmp_path / "_sources" / "notebooks" / "01_x.ipynb").write_text(json.dumps(nb))
    img = f'<img alt="a" src="../_images/{"a" * 64}.png">'
    (tmp_path / "notebooks" / "01_x.html").write_text(page(img + img))
    assert browser_check.check_figures(tmp_path) == []
    (tmp_path / "notebooks" / "01_x.html").write_text(page(img))
    (problem,) = browser_check.check_figures(tmp_path)
    assert problem == "notebooks/01_x.html: 1 figure(s) on the page, 2 in the notebook"


@pytest.mark.parametrize(("text", "expected"), [
    ("see https://a.org/x.html.", "see <https://a.org/x.html>."),
    ("guides (https://a.org/b, .../c)", "guides (<https://a.org/b>, .../c)"),
    ("[a](https://a.org) and <https://b.org>", "[a](https://a.org) and <https://b.org>"),
    ("`pip install git+https://github.com/x/y`", "`pip install git+https://github.com/x/y`"),
    ("```\ncurl https://a.org\n```", "```\ncurl https://a.org\n```"),
    ('<a href="https://a.org">x</a>', '<a href="https://a.org">x</a>'),
])
def test_linkify(text, expected):
    assert book.linkify(text) == expected
