"""Sphinx configuration of the lightning-accum documentation (built strictly: warnings fail)."""

project = "lightning-accum"
author = "lightning-accum developers"
copyright = "2026, lightning-accum developers"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
html_theme = "alabaster"
html_static_path: list[str] = []
suppress_warnings = ["myst.xref_missing"]
