"""Sphinx configuration for the Out of Tree site (built by `nox -s site`)."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).parent.resolve()
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
# The per-stage kernels (acme-stage-NN) are written into the build folder.
BUILD = Path(os.environ.get("ACME_BUILD_DIR", ROOT / "_build")).resolve()
os.environ["JUPYTER_PATH"] = str(BUILD / "jupyter")

project = "Out of Tree"
author = "Out of Tree"
copyright = "2026, Out of Tree"

extensions = ["myst_nb", "sphinx_tabs.tabs", "sphinx_togglebutton", "acme_book",
              "acme_errors",   # docs/errors.md's cards, from tests/bad_inputs.toml
              "acme_figures"]  # the index's pictures, from the stage snapshots
root_doc = "docs/index"
exclude_patterns = ["_build", ".nox", ".git", ".ci", "README.md", "tests", "csrc", "src",
                    "tools", "**/.ipynb_checkpoints", ".pytest_cache",
                    "docs/_generated"]  # pages other pages include (tools/versions.py)

html_theme = "sphinx_book_theme"
html_title = "Out of Tree"
html_theme_options = {"show_toc_level": 2, "use_download_button": True}
# Light or dark as the reader's system says; unset, the theme logs "Got invalid
# theme mode" to the console on every page.
html_context = {"default_mode": "auto"}
# docs/_templates/static/webpack-macros.html drops the theme's 1.5 MB icon script.
templates_path = ["docs/_templates"]
# The header has a search button; the theme's sidebar search field would be a second one.
html_sidebars = {"**": ["navbar-logo.html", "icon-links.html", "sbt-sidebar-nav.html"]}
html_static_path = ["docs/_static"]
html_css_files = ["acme.css"]  # diffs in red and green
html_favicon = "docs/_static/favicon.svg"
# docs/_root/index.html: the site's root page sends readers to the book's first page.
html_extra_path = ["docs/_root"]

myst_enable_extensions = ["colon_fence"]

# Chapters are not executed by myst-nb: the site shows the run the test suite
# made (or, when that is missing or stale, a run made just before Sphinx reads:
# docs/_ext/acme_book.py), each in the kernel of its own stage. A chapter
# whose run failed is a warning, which -W turns into a failed build.
nb_execution_mode = "off"
nb_execution_timeout = 600
nb_execution_raise_on_error = False
nb_execution_show_tb = True
sphinx_tabs_disable_tab_closing = True
# Failing cells show their exception line (tools/chapter_support.py), not an
# IPython traceback: render them as plain text.
nb_render_error_lexer = "text"
# Cells that display Markdown (chapter 0's contract table, chapter 8's rename
# answers) need tables, which the default, strict CommonMark, does not parse.
nb_render_markdown_format = "myst"
