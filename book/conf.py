"""Sphinx configuration of the rendered collection (built by ``python3 ci/book.py``; see there).

Sphinx reads the sources ci/book.py stages in ``out/book-src/``; this folder holds the configuration,
the landing page (``index.md``, with ``{{ walk_table }}`` filled in by the staging), the API page and
static assets. The repository's name and the MathJax copy come from ci/book.py.
"""

import importlib.util
import os
from pathlib import Path

_CONF_DIR = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("tpuattn_book", _CONF_DIR.parent / "ci" / "book.py")
book = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(book)

project = "tpuattn"
author = "the tpuattn authors"
copyright = "the tpuattn authors, Apache-2.0"
html_title = "tpuattn: attention on TPUs"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "sphinx.ext.napoleon",
    "sphinx_copybutton",
]
exclude_patterns = ["**.ipynb_checkpoints"]
templates_path = [str(_CONF_DIR / "_templates")]  # absolute: autosummary resolves it from the sources

# MyST: $...$ and $$...$$ math, headings as link anchors, ::: fences.
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "html_image"]
myst_heading_anchors = 3

# MyST-NB: render the committed outputs, never execute; no widget JavaScript from a CDN (ci/book.py
# replaces widget views with their static fallback).
nb_execution_mode = "off"
nb_ipywidgets_js = {}
nb_merge_streams = True

# The API reference, from the docstrings.
autosummary_generate = True
autosummary_imported_members = False
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_typehints = "description"
autodoc_member_order = "bysource"
add_module_names = False
# The docstrings are Google style (``Args:``, ``Returns:``, ``Attributes:``, ``Options:``); napoleon
# turns those sections into fields. Attributes as ``:ivar:`` fields, so a dataclass's fields are not
# described twice (once by napoleon, once by autodoc's members).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
napoleon_custom_sections = [("Options", "params_style")]   # an implementation's **options, as Args

# Copy buttons skip prompts and outputs.
copybutton_exclude = ".linenos, .gp, .go"

html_theme = "sphinx_book_theme"
html_static_path = ["_static"]
html_css_files = ["tpuattn-book.css"]
html_theme_options = {
    "repository_url": book.REPOSITORY_URL,
    "repository_branch": book.BRANCH,
    "path_to_docs": "",            # the staged sources mirror the repository's layout
    "use_repository_button": True,
    "use_download_button": True,
    "use_fullscreen_button": True,
    "launch_buttons": {"colab_url": "https://colab.research.google.com"},
    "home_page_in_toc": True,
    "show_toc_level": 2,
    "navigation_with_keys": False,
}
html_last_updated_fmt = None
html_context = {"default_mode": "light"}   # figures are drawn on white
html_show_search_summary = False           # summaries fetch() pages, which file:// forbids: offline search

# MathJax from the site itself (vendored by ci/book.py), never from a CDN. Without it a local stub
# loads and the formulas stay readable as TeX source.
_mathjax = os.environ.get("TPUATTN_BOOK_MATHJAX", "")
if _mathjax:
    html_static_path.append(_mathjax)
    mathjax_path = "mathjax/tex-chtml.js"
else:
    mathjax_path = "no-mathjax.js"


def _api_modules():
    """What the module template needs about tpuattn: kept import paths (alias -> the module they
    are), packages, and each package's ``__all__`` under the names of the modules that define them
    (a package page lists its public API as links, documented once, where it is defined)."""
    import importlib
    import pkgutil

    import tpuattn

    aliases, public = {}, {}
    names = ["tpuattn"] + [info.name for info in pkgutil.walk_packages(tpuattn.__path__, "tpuattn.")]
    for name in names:
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 -- autodoc reports it on the module's page
            continue
        if module.__name__ != name:
            aliases[name] = module.__name__
        elif hasattr(module, "__path__"):
            public[name] = [f"{getattr(getattr(module, item), '__module__', name)}.{item}"
                            for item in getattr(module, "__all__", [])
                            if getattr(getattr(module, item), "__module__", name) != name]
    return aliases, public


_aliases, _public = _api_modules()
autosummary_context = {"book_aliases": _aliases, "book_packages": _public}

