"""A griffe extension for the API reference: accelkit's docstrings, written for ``help()``, read as Markdown.

- A docstring's ``Example:`` section reads as Google style's ``Examples:``: griffe takes ``Example:`` for an
  admonition, whose text is Markdown (there ``>>>`` starts a quote, and ``[[4, 5]]`` a link), where
  ``Examples:`` renders the doctests as Python code.
- Sphinx roles (``:func:`pad_across_processes```, ``:class:`~accelkit.WorkerError```) read as code.

mkdocs.yml loads it (``extensions:``); the site does not publish it (``exclude_docs``).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)
_ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|exc|obj):`~?([^`]+)`")


class ExampleSections(griffe.Extension):
    """Rewrites each docstring as it is loaded, before mkdocstrings parses it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            text = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
            obj.docstring.value = _ROLE.sub(r"`\1`", text)
