"""Griffe extension: the docstrings' Sphinx roles (``:class:`~a.b.C```) shown as code (`C`) in the API reference.

The source keeps its roles; this only changes how the site renders them. They become plain code, not
cross-references, so a role naming something the reference does not render never fails the strict build.
"""

import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const|ref):`([^`]+)`")


def _code(match: re.Match) -> str:
    text = match.group(1)
    titled = re.fullmatch(r"(.+?)\s*<[^>]+>", text)
    if titled:
        return f"`{titled.group(1)}`"
    if text.startswith("~"):
        text = text[1:].rsplit(".", 1)[-1]
    return f"`{text}`"


class SphinxRoles(griffe.Extension):
    """Rewrites roles in every docstring griffe loads."""

    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_code, obj.docstring.value)
