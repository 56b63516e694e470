"""The site as a reader gets it: built from the chapter runs this test session
made (tools/chapter_runs.py), then read in headless Chromium.

The browser is Debian's `chromium` (`.ci/run` installs it), driven by
Playwright's Python package. Without either the tests fail: a site nobody
looked at is not a tested site.
"""

from __future__ import annotations

import functools
import http.server
import json
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import nbformat
import pytest

from conftest import BUILD, CHAPTERS, LAST, ROOT
from tools import chapter_runs

HTML = BUILD / "html"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
WIDTHS = {"desktop": 1400, "phone": 390}
# Chromium flags for a machine with no network and no display.
BROWSER_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run"]


def chapter_page(chapter: dict) -> str:
    return f"chapters/{chapter['number']:02d}-{chapter['slug']}.html"


@pytest.fixture(scope="module")
def site(request) -> Path:
    """Build the site exactly as `nox -s site` does, minus its benchmark runs."""
    if request.config.getoption("--upto") != LAST:
        pytest.skip("the site needs every chapter: run without --upto")
    shutil.rmtree(HTML / ".doctrees", ignore_errors=True)
    build = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         "-d", str(BUILD / "doctrees"), str(ROOT), str(HTML)],
        cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert build.returncode == 0, f"the site does not build:\n{build.stdout}\n{build.stderr}"
    return HTML


@pytest.fixture(scope="module")
def server(site):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                            functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_port}/"
    httpd.shutdown()


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.fail("no chromium on PATH: `apt-get install chromium` (.ci/run does)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: it is in requirements.txt")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        yield chromium
        chromium.close()


class Visit:
    """One page in a fresh browser context (no cache), with what went wrong on it."""

    def __init__(self, browser, url: str, width: int):
        self.context = browser.new_context(viewport={"width": width, "height": 900})
        self.page = self.context.new_page()
        self.problems: list[str] = []
        self.page.on("console", lambda m: self.problems.append(f"console {m.type}: {m.text}")
                     if m.type in ("error", "warning") else None)
        self.page.on("pageerror", lambda e: self.problems.append(f"script error: {e}"))
        # ERR_ABORTED: a request cut short by navigating on (the root page's redirect).
        self.page.on("requestfailed", lambda r: None if "ERR_ABORTED" in (r.failure or "")
                     else self.problems.append(f"failed: {r.url} ({r.failure})"))
        self.page.on("response", lambda r: self.problems.append(f"HTTP {r.status}: {r.url}")
                     if r.status >= 400 else None)
        self.page.goto(url)
        self.page.wait_for_load_state("networkidle")

    def weight(self, site: Path, base: str) -> int:
        """Bytes of the page and of every file it loads or references (lazy images too)."""
        urls = self.page.evaluate("""() => [location.href,
            ...performance.getEntriesByType('resource').map(e => e.name),
            ...[...document.querySelectorAll('img[src], script[src]')].map(e => e.src),
            ...[...document.querySelectorAll('link[href]')].filter(
                e => /stylesheet|preload|icon/.test(e.rel)).map(e => e.href)]""")
        files = {site / url[len(base):].split("?")[0].split("#")[0]
                 for url in urls if url.startswith(base)}
        return sum(f.stat().st_size for f in files if f.is_file())

    def sideways(self) -> int:
        """How many pixels the page scrolls sideways (0 when it fits)."""
        return self.page.evaluate(
            "document.documentElement.scrollWidth - document.documentElement.clientWidth")

    def close(self) -> None:
        self.context.close()


def all_pages(site: Path) -> list[str]:
    return sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html")
                  if not p.relative_to(site).parts[0].startswith("_"))


def test_every_page_loads_cleanly_and_fits(site, server, browser):
    """No console error, no failed request, no sideways scrolling, at both widths."""
    pages = all_pages(site)
    assert {chapter_page(c) for c in CHAPTERS} <= set(pages)
    problems, weights = [], {}
    for path in pages:
        # Loaded once, at the first width; the others by resizing the window,
        # as a reader turning a tablet does (the theme lays out on resize).
        visit = Visit(browser, server + path, WIDTHS["desktop"])
        weights[path] = visit.weight(site, server)
        for name, width in WIDTHS.items():
            visit.page.set_viewport_size({"width": width, "height": 900})
            if visit.sideways() > 1:
                problems.append(f"{path} ({name}): scrolls sideways by {visit.sideways()} px")
        problems += [f"{path}: {p}" for p in visit.problems]
        visit.close()
    # Page weight, for the record: the page and every file it loads or references.
    report = BUILD / "site-weights.json"
    report.write_text(json.dumps(weights, indent=1) + "\n")
    chapter_weights = [weights[chapter_page(c)] for c in CHAPTERS]
    print(f"\nchapter page weight: {min(chapter_weights) / 1e6:.2f}-"
          f"{max(chapter_weights) / 1e6:.2f} MB (all pages: {report})")
    assert not problems, "\n".join(problems)
    # The theme's 1.5 MB icon script is left out (docs/_templates/static/).
    assert max(chapter_weights) < 1_500_000, report.read_text()


def test_tables_made_by_cells_are_tables(site):
    """A cell that displays a Markdown table (chapter 0's contract, chapter 8's
    answers) renders as a table, not as a paragraph of pipes."""
    for page in all_pages(site):
        assert not re.search(r"<p>\|[^<]*\|", (site / page).read_text()), page
    contract = (site / chapter_page(CHAPTERS[0])).read_text()
    assert re.search(r"<th[^>]*>(<p>)?\s*runtime calls\s*(</p>)?</th>", contract)


def test_simulator_code_is_labelled(site):
    """Every snippet a chapter marks `:simulator:` (code a vendor's driver or
    kernels replace) carries the label on the page; chapters 18, 20 and 23,
    where simulator code sits beside the glue, have at least one."""
    for chapter in CHAPTERS:
        marked = chapter_runs.source(chapter).read_text().count("\n:simulator:")
        shown = (site / chapter_page(chapter)).read_text().count('class="acme-simulator"')
        assert shown == marked, (chapter["number"], marked, shown)
        if chapter["number"] in (18, 20, 23):
            assert marked, chapter["number"]


def test_root_sends_readers_to_the_book(site, server, browser):
    visit = Visit(browser, server, WIDTHS["desktop"])
    visit.page.wait_for_url("**/docs/index.html")
    assert "Out of Tree" in visit.page.title()
    icons = visit.page.eval_on_selector_all("link[rel~=icon]", "els => els.map(e => e.href)")
    assert icons and all(visit.page.request.get(url).ok for url in icons), icons
    # One search control in the header, none in the sidebar.
    assert visit.page.locator("button.search-button__button:visible, "
                              "form.bd-search:visible").count() == 1
    visit.close()


def test_tabs_switch(site, server, browser):
    # The first chapter that shows code in C++ and Python tabs.
    tabbed = next(c for c in CHAPTERS if "group-tab" in chapter_runs.source(c).read_text())
    visit = Visit(browser, server + chapter_page(tabbed), WIDTHS["desktop"])
    tabs = visit.page.locator(".sphinx-tabs").first
    buttons, panels = tabs.locator("[role=tab]"), tabs.locator("[role=tabpanel]")
    assert buttons.count() >= 2
    assert panels.nth(0).is_visible() and not panels.nth(1).is_visible()
    buttons.nth(1).click()
    panels.nth(1).wait_for(state="visible", timeout=5_000)
    panels.nth(0).wait_for(state="hidden", timeout=5_000)
    visit.close()


def test_diffs_open_and_read_as_diffs(site, server, browser):
    visit = Visit(browser, server + chapter_page(CHAPTERS[2]), WIDTHS["desktop"])
    box = visit.page.locator("div.admonition.dropdown",
                             has_text="Diff from the previous stage").first
    diff = box.locator("div.highlight-diff")
    assert not diff.is_visible()
    box.locator(".toggle-button").click()
    diff.wait_for(state="visible")
    colour = "el => getComputedStyle(el).backgroundColor"
    added = diff.locator(".gi").first.evaluate(colour)
    removed = diff.locator(".gd").first.evaluate(colour) if diff.locator(".gd").count() else None
    red_green = lambda rgb: [int(v) for v in re.findall(r"\d+", rgb)[:3]]
    r, g, b = red_green(added)
    assert g > r and g > b, f"added lines are not green: {added}"
    if removed is not None:
        r, g, b = red_green(removed)
        assert r > g and r > b, f"removed lines are not red: {removed}"
    visit.close()


def test_search_finds_the_fallback_chapter_first(site, server, browser):
    visit = Visit(browser, server + "search.html?q=fallback", WIDTHS["desktop"])
    first = visit.page.locator("#search-results ul.search li a").first
    first.wait_for(timeout=30_000)
    assert first.get_attribute("href").split("#")[0].endswith(chapter_page(CHAPTERS[2])), \
        first.get_attribute("href")
    visit.close()


def test_downloads_are_notebooks_with_outputs(site, server, browser):
    """Each chapter's download link gives a valid notebook: outputs, no directives."""
    visit = Visit(browser, server + chapter_page(CHAPTERS[0]), WIDTHS["desktop"])
    directive = re.compile(r"```\{|:::+\{|\{(doc|ref)\}`")
    for chapter in CHAPTERS:
        visit.page.goto(server + chapter_page(chapter))
        link = visit.page.locator("a.download[href$='.ipynb']").first
        response = visit.page.request.get(link.evaluate("a => a.href"))
        assert response.ok, chapter_page(chapter)
        notebook = nbformat.reads(response.text(), as_version=4)
        nbformat.validate(notebook)
        assert notebook.metadata.kernelspec.name == f"acme-stage-{chapter['number']:02d}"
        # The outputs are the test run's, all of them.
        run = nbformat.read(BUILD / "executed" / f"{chapter['number']:02d}-{chapter['slug']}.ipynb",
                            as_version=4)
        outputs = lambda nb: [c.outputs for c in nb.cells if c.cell_type == "code"]
        assert outputs(notebook) == outputs(run) and any(outputs(run)), chapter_page(chapter)
        assert "acme-stage-" in notebook.cells[0].source  # how to run it comes first
        leftovers = [c.source for c in notebook.cells
                     if c.cell_type == "markdown" and directive.search(c.source)]
        assert not leftovers, f"{chapter_page(chapter)}: directives left:\n{leftovers[0]}"
    visit.close()


# Chapter 16 reaches the book's files every way a chapter does: chapter_support,
# tests/ through BOOK, and worker processes that import from tests/ themselves.
@pytest.mark.parametrize("number", [16])
def test_download_runs_from_another_folder(site, number, tmp_path):
    """A downloaded notebook runs in its stage's kernel from any folder."""
    from nbclient import NotebookClient

    chapter = next(c for c in CHAPTERS if c["number"] == number)
    name = f"{number:02d}-{chapter['slug']}.ipynb"
    downloads = list((site / "_downloads").rglob(name))
    assert len(downloads) == 1, downloads
    notebook = nbformat.read(downloads[0], as_version=4)
    NotebookClient(notebook, kernel_name=notebook.metadata.kernelspec.name, timeout=600,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
