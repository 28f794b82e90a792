"""A griffe extension for the API reference: Sphinx roles in docstrings become inline code.

The docstrings cross-reference with Sphinx roles (``:class:`~timer_core.Timer```), which
Markdown would show literally; the reference shows the name as code instead (the last
component when the target starts with ``~``, as Sphinx does).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def _as_code(match: re.Match[str]) -> str:
    shorten, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if shorten else target}`"


class SphinxRoles(griffe.Extension):
    """Rewrites the roles of every docstring once the object tree is loaded."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        _rewrite(obj)

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        _rewrite(pkg)  # a package's own docstring is not one of its objects


def _rewrite(obj: griffe.Object) -> None:
    if obj.docstring is not None:
        obj.docstring.value = _ROLE.sub(_as_code, obj.docstring.value)
