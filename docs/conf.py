"""Sphinx configuration for the API reference: `sphinx-build -W -b html docs out/docs`."""
import jax_fusedloss

project = "jax-fusedloss"
author = "the jax-fusedloss authors"
copyright = "2026, the jax-fusedloss authors"
release = version = jax_fusedloss.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # the docstrings' Args/Returns/Raises sections (Google style)
    "sphinx.ext.mathjax",
]
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
