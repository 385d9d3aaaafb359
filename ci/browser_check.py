"""Open every page of the built site (out/book/) in headless chromium and check it as a reader would.

    python3 ci/browser_check.py                 # after python3 ci/book.py
    python3 ci/browser_check.py --site out/book --no-screenshots

Two passes:

1. Links, without a browser: every ``<a href>``, ``<img src>``, ``<link href>`` and ``<script src>``
   that points inside the site must name a file that exists, and an anchor (``page.html#x``) an
   ``id`` on that page; every ``<img>`` needs alt text; no ipywidgets placeholder is left; every image
   output of a notebook is on its page.
2. Chromium (Debian's ``/usr/bin/chromium``, driven by playwright): each page from ``file://``, as
   someone who opened the folder offline would. Console errors, uncaught exceptions, resources that
   fail to load and any request that leaves the site (a CDN would fail offline: such requests are
   blocked and listed) are errors. On notebook pages the Colab link must be there and the formulas
   typeset (when MathJax is vendored); the search page must find a word of the walk. Screenshots of
   the landing page and each notebook page, desktop (1280 wide) and phone (390 wide), go to
   ``out/book/screenshots/``.

Exits 1 with the list of problems. Without chromium, as root (in CI or not) it installs Debian's
``chromium`` and ``chromium-driver`` itself (``apt-get install -y``, after ``apt-get update`` when the
package lists do not have them); as any other user it fails with the command that installs them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _venv  # noqa: E402

ROOT = _venv.ROOT
CHROMIUM = Path("/usr/bin/chromium")
PACKAGES = ("chromium", "chromium-driver")  # Debian's; the driver keeps the two at one version
INSTALL = f"sudo apt-get install -y {' '.join(PACKAGES)}"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
SEARCH_WORD = "softmax"
VIEWPORTS = {"desktop": (1280, 800), "phone": (390, 844)}
SKIP_DIRS = ("_static", "_sources", "_images", "screenshots")
# Close-ups on each notebook page (desktop): the first of each, when the page has one.
ELEMENT_SHOTS = (("figure", "div.cell_output img"), ("widget", "div.widget-fallback"), ("math", "div.math"),
                 ("hidden", "article.bd-article details"))


# --------------------------------------------------------------------------------------------------
# Pass 1: links (no browser)


class PageParser(HTMLParser):
    """Collects a page's ids and the URLs it links or loads, with the tag that names each."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[tuple[str, str]] = []          # (tag.attribute, url)
        self.images_without_alt: list[str] = []
        self.widget_views = 0

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        for key in ("id", "name") if tag == "a" else ("id",):
            if attributes.get(key):
                self.ids.add(attributes[key])
        if tag in ("a", "link") and attributes.get("href") is not None:
            self.links.append((f"{tag}.href", attributes["href"]))
        if tag in ("img", "script", "source", "iframe") and attributes.get("src"):
            self.links.append((f"{tag}.src", attributes["src"]))
        if tag == "img" and not (attributes.get("alt") or "").strip():
            self.images_without_alt.append(attributes.get("src", "?"))
        if tag == "script" and attributes.get("type") == WIDGET_VIEW:
            self.widget_views += 1


def parse(path: Path) -> PageParser:
    parser = PageParser()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    return parser


def is_external(url: str) -> bool:
    scheme = urlsplit(url).scheme
    return bool(scheme) and scheme != "file" or url.startswith("//")


def check_links(site: Path) -> list[str]:
    """Problems with the internal links, images and widget placeholders of every page of ``site``."""
    site = site.resolve()
    pages = sorted(p for p in site.rglob("*.html") if p.relative_to(site).parts[0] not in SKIP_DIRS)
    parsed: dict[Path, PageParser] = {}

    def page(path: Path) -> PageParser:
        if path not in parsed:
            parsed[path] = parse(path)
        return parsed[path]

    problems = []
    for path in pages:
        name = path.relative_to(site).as_posix()
        info = page(path)
        if info.widget_views:
            problems.append(f"{name}: {info.widget_views} ipywidgets placeholder(s) left (needs a kernel)")
        for src in info.images_without_alt:
            problems.append(f"{name}: <img src={src!r}> has no alt text")
        for attribute, url in info.links:
            if not url or is_external(url) or url.startswith(("mailto:", "javascript:", "data:")):
                continue
            parts = urlsplit(url)
            target = path if not parts.path else (path.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if site not in target.parents and target != site:
                problems.append(f"{name}: {attribute} {url!r} points outside the site")
            elif not target.exists():
                problems.append(f"{name}: {attribute} {url!r}: {target.relative_to(site)} does not exist")
            elif parts.fragment and target.suffix == ".html":
                fragment = unquote(parts.fragment)
                if fragment not in page(target).ids:
                    problems.append(f"{name}: {attribute} {url!r}: no id {fragment!r} in "
                                    f"{target.relative_to(site).as_posix()}")
    return problems


FIGURE = re.compile(r'<img[^>]+src="[^"]*_images/[0-9a-f]{64}\.(?:png|jpe?g|gif|svg)"')


def check_figures(site: Path) -> list[str]:
    """Every image output of a notebook (the copy Sphinx rendered, ``_sources/notebooks/``) is an
    image on its page: no figure, and so no backend/measured/modelled label drawn in one, is lost."""
    problems = []
    for source in sorted((site / "_sources" / "notebooks").glob("*.ipynb")):
        page = site / "notebooks" / f"{source.stem}.html"
        nb = json.loads(source.read_text())
        expected = sum(1 for cell in nb["cells"] for output in cell.get("outputs", [])
                       if any(mime.startswith("image/") for mime in output.get("data", {})))
        found = len(FIGURE.findall(page.read_text())) if page.exists() else 0
        if found != expected:
            problems.append(f"notebooks/{page.name}: {found} figure(s) on the page, "
                            f"{expected} in the notebook")
    return problems


# --------------------------------------------------------------------------------------------------
# Pass 2: chromium


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def chromium_problem(run=subprocess.run) -> str | None:
    """None once ``/usr/bin/chromium`` exists, installing it first when this runs as root; else what
    to install. As root: ``apt-get install -y chromium chromium-driver``, and when that fails (package
    lists missing or stale, as on a fresh container) ``apt-get update`` and the install again."""
    if CHROMIUM.exists():
        return None
    if not is_root():
        return f"no chromium at {CHROMIUM}, and not root to install it: run {INSTALL}"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", *PACKAGES]  # with its recommended fonts, for screenshots
    print(f"[browser] {CHROMIUM} missing: {' '.join(install)} (root)", flush=True)
    if run(install, env=env, check=False).returncode != 0 and not CHROMIUM.exists():
        print("[browser] the install failed: apt-get update, then the install again", flush=True)
        run(["apt-get", "update", "-qq"], env=env, check=False)
        run(install, env=env, check=False)
    if CHROMIUM.exists():
        return None
    return f"no chromium at {CHROMIUM} after {' '.join(install)} (see apt-get's messages above)"


def ensure_chromium() -> Path:
    problem = chromium_problem()
    if problem:
        sys.exit(f"[browser] FAILED: {problem}")
    return CHROMIUM


def launch(playwright):
    return playwright.chromium.launch(executable_path=str(ensure_chromium()), headless=True,
                                      args=["--disable-gpu", "--disable-dev-shm-usage"])


class Recorder:
    """What goes wrong on one page: console errors, exceptions, failed and external requests."""

    def __init__(self, page):
        self.problems: list[str] = []
        page.on("console", self._console)
        page.on("pageerror", lambda error: self.problems.append(f"uncaught exception: {error}"))
        page.on("requestfailed", self._failed)
        page.on("response", self._response)
        page.route("**/*", self._route)

    def _console(self, message):
        if message.type == "error":
            self.problems.append(f"console error: {message.text}")

    def _failed(self, request):
        failure = request.failure or ""
        if "ERR_BLOCKED_BY_CLIENT" not in failure and "net::ERR_ABORTED" not in failure:
            self.problems.append(f"failed to load {short(request.url)} ({failure})")

    def _response(self, response):
        if response.status >= 400:
            self.problems.append(f"HTTP {response.status} for {short(response.url)}")

    def _route(self, route):
        url = route.request.url
        if url.startswith(("file://", "data:", "blob:", "about:")):
            route.continue_()
        else:  # offline, this would fail: the site must not need it
            self.problems.append(f"request leaves the site: {url}")
            route.abort("blockedbyclient")

    def take(self) -> list[str]:
        problems, self.problems = self.problems, []
        return problems


def short(url: str) -> str:
    return url.split("/out/book/", 1)[-1] if url.startswith("file://") else url


def check_pages(site: Path, screenshots: Path | None, colab: dict[str, str], mathjax: bool) -> list[str]:
    from playwright.sync_api import sync_playwright

    site = site.resolve()
    pages = sorted(p for p in site.rglob("*.html") if p.relative_to(site).parts[0] not in SKIP_DIRS)
    problems = []
    if screenshots:   # replace this check's screenshots; ci/lab_check.py's (lab_*.png) stay
        screenshots.mkdir(parents=True, exist_ok=True)
        for old in screenshots.glob("*.png"):
            if not old.name.startswith("lab_"):
                old.unlink()
    with sync_playwright() as playwright:
        browser = launch(playwright)
        context = browser.new_context(viewport=dict(zip(("width", "height"), VIEWPORTS["desktop"],
                                                        strict=True)))
        page = context.new_page()
        recorder = Recorder(page)
        for path in pages:
            name = path.relative_to(site).as_posix()
            page.goto(path.as_uri(), wait_until="load")
            found = []
            stem = path.stem if name.startswith("notebooks/") else None
            if stem:
                if not page.locator(f'a[href="{colab[stem]}"]').count():
                    found.append(f"no link to {colab[stem]}")
                if mathjax and page.locator("span.math, div.math").count():
                    try:
                        page.wait_for_selector("mjx-container", timeout=15000)
                    except Exception:  # noqa: BLE001 -- reported below
                        found.append("formulas not typeset by MathJax")
                if page.locator("article.bd-article details[open]").count():
                    found.append("a hidden (solution / hide-input) block is open")
            page.wait_for_timeout(150)   # late loads (fonts, MathJax extensions)
            found += recorder.take()
            problems += [f"{name}: {p}" for p in found]
        # Search, offline: the built-in index must answer.
        page.goto((site / "search.html").as_uri() + f"?q={SEARCH_WORD}", wait_until="load")
        try:
            page.wait_for_selector("#search-results ul.search li", timeout=20000)
            hits = page.locator("#search-results ul.search li").count()
            print(f"[browser] search for {SEARCH_WORD!r}: {hits} page(s)", flush=True)
        except Exception:  # noqa: BLE001
            problems.append(f"search.html: searching {SEARCH_WORD!r} found nothing")
        problems += [f"search.html: {p}" for p in recorder.take()]
        context.close()
        if screenshots:
            problems += take_screenshots(browser, site, screenshots)
        browser.close()
    return problems


# Headings, paragraphs and list items whose text runs past their column (code blocks, tables and
# outputs scroll on their own and are left out).
OVERFLOW = """() => Array.from(document.querySelectorAll(
    'article.bd-article :is(h1, h2, h3, h4, p, li, dt, dd)'))
  .filter(el => !el.closest('pre, table, .cell_output, .highlight, mjx-container, .math')
                && el.scrollWidth > el.clientWidth + 2)
  .map(el => el.textContent.trim().slice(0, 60))"""


def take_screenshots(browser, site: Path, folder: Path) -> list[str]:
    """Landing page and notebook pages at desktop and phone widths (the top of the page), plus the
    first figure and the widget fallback of each notebook at desktop width."""
    targets = [("index", site / "index.html")] + [
        (p.stem, p) for p in sorted((site / "notebooks").glob("[0-9][0-9]_*.html"))]
    problems = []
    for device, (width, height) in VIEWPORTS.items():
        context = browser.new_context(viewport={"width": width, "height": height},
                                      is_mobile=device == "phone", has_touch=device == "phone")
        page = context.new_page()
        recorder = Recorder(page)
        for name, path in targets:
            page.goto(path.as_uri(), wait_until="load")
            page.wait_for_timeout(300)
            page.screenshot(path=str(folder / f"{name}-{device}.png"))
            overflowing = page.evaluate(OVERFLOW)
            problems += [f"{path.relative_to(site).as_posix()} ({device}): text wider than its column: "
                         f"{text!r}" for text in overflowing]
            if device == "desktop" and name != "index":
                for label, selector in ELEMENT_SHOTS:
                    element = page.locator(selector).first
                    if element.count():
                        element.scroll_into_view_if_needed()
                        page.wait_for_timeout(200)
                        element.screenshot(path=str(folder / f"{name}-{label}.png"))
            problems += [f"{path.relative_to(site).as_posix()} ({device}): {p}" for p in recorder.take()]
        context.close()
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", default=str(ROOT / "out" / "book"), help="the built site")
    parser.add_argument("--no-screenshots", action="store_true")
    args = parser.parse_args()
    _venv.reexec_in(_venv.MAIN)
    sys.path.insert(0, str(ROOT / "ci"))
    import book

    site = Path(args.site).resolve()
    if not (site / "index.html").exists():
        sys.exit(f"[browser] FAILED: no site at {site} (run python3 ci/book.py first)")
    start = time.perf_counter()
    problems = check_links(site) + check_figures(site)
    pages = [p for p in site.rglob("*.html") if p.relative_to(site).parts[0] not in SKIP_DIRS]
    print(f"[browser] links: {len(pages)} pages, {len(problems)} problem(s) "
          f"({time.perf_counter() - start:.1f} s)", flush=True)
    colab = {stem: book.colab_url(stem) for stem in book.notebook_stems()}
    mathjax = (site / "_static" / "mathjax" / "tex-chtml.js").exists()
    screenshots = None if args.no_screenshots else site / "screenshots"
    problems += check_pages(site, screenshots, colab, mathjax)
    seconds = time.perf_counter() - start
    if screenshots:
        print(f"[browser] screenshots: {os.path.relpath(screenshots, ROOT)}/ "
              f"({len(list(screenshots.glob('*.png')))} files)", flush=True)
    if problems:
        print(f"[browser] FAILED: {len(problems)} problem(s) ({seconds:.0f} s)")
        for problem in problems:
            print("  " + problem)
        return 1
    print(f"[browser] ok: {len(pages)} pages opened in chromium, no console error, failed load or broken "
          f"link ({seconds:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
