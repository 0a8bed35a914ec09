"""Sphinx configuration of the documentation site: `sphinx-build -W -b html docs out/docs`.

Pages are Markdown (MyST) except the API reference (reStructuredText, generated from the
docstrings). Math is rendered by a MathJax that ships with the build
(`sphinx-mathjax-offline` copies it into `_static/mathjax`): the site needs no network.
"""
import jax_fusedloss

project = "jax-fusedloss"
author = "the jax-fusedloss authors"
copyright = "2026, the jax-fusedloss authors"
release = version = jax_fusedloss.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # the docstrings' Args/Returns/Raises sections (Google style)
    "sphinx.ext.mathjax",
    "sphinx-mathjax-offline",  # sets mathjax_path to the bundled copy
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# The docstrings' Raises sections are sentences ("TypeError / ValueError at trace time for..."),
# not "Type: description" pairs: render them as written.
napoleon_custom_sections = ["Raises"]
default_role = "code"  # `x` in a docstring is code, as on GitHub
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path = []
