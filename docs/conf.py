"""Sphinx configuration: MyST pages, autodoc/autosummary over pyhvp.__all__, a sphinx-gallery of
examples/ (run at build time: each example checks itself and raises when wrong), furo theme.

``make docs`` builds with ``-W --keep-going -n``: every warning (an unresolved cross-reference, a
public name without a docstring, an example that fails) fails the build.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "pyhvp"
author = "the pyhvp authors"
copyright = "the pyhvp authors"
release = version = "0.1.0"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "myst_parser",
    "sphinx_gallery.gen_gallery",
    "public_docstrings",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "auto_examples/*.ipynb", "auto_examples/*.py", "**/*.zip"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

autosummary_generate = True
autodoc_default_options = {"members": True}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True

nitpicky = True
# Types from other packages: there is no network at build time (no intersphinx), so these are
# left unlinked rather than reported.
nitpick_ignore_regex = [
    ("py:class", r"(torch|collections\.abc|typing|types|numbers)\..*"),
    ("py:class", r"(Tensor|ProcessGroup|Callable|Iterable|Mapping|Sequence|Hashable|Any)"),
    ("py:class", r"(torch\.)?Generator|Size|dtype|device|nn\.Module|Module"),
    ("py:class", r"Literal\[.*\]|NoneType|ellipsis|Ellipsis|\.\.\."),
    ("py:class", r"pyhvp\.(hvp\.BatchedFunction|submatrix\.Params|backends\.torch\.CompileMode)"),
    ("py:class", r"BatchedFunction|Params|CompileMode|Blocks"),
    ("py:class", r"pyhvp\.instances\.Out"),  # a TypeVar: what a per-instance function returns
    # internal modules and helpers that the design notes name but the reference does not document
    ("py:mod", r"pyhvp\.taylor(\..*)?|(pyhvp\.backends)?\.?(compile_policy|inductor)"),
    ("py:func", r"require_primitive|sum_over_ranks|pyhvp\.taylor\..*"),
]

sphinx_gallery_conf = {
    "examples_dirs": "../examples",
    "gallery_dirs": "auto_examples",
    # every example runs at build time, except the one whose ranks are processes of their own
    # (tests/test_examples.py runs it)
    "filename_pattern": r"/(?!more_than_one_device)[^/]+\.py$",
    "download_all_examples": False,
    "remove_config_comments": True,
    "within_subsection_order": "FileNameSortKey",
    "show_signature": False,
}

html_theme = "furo"
html_title = "pyhvp"
html_static_path = ["_static"]
html_css_files = ["wide-code.css"]  # a wider column: code lines of ~100 characters fit
templates_path = ["_templates"]
