"""Did-you-mean for the commands: the closest of a list of choices to what a user typed."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any, Optional


def closest(value: Any, choices: Iterable[Any], cutoff: float = 0.7) -> Optional[str]:
    """The choice closest to ``value`` as text (None when none is close).

    Args:
        value: what the user typed.
        choices: the accepted values.
        cutoff: how alike the two must be (difflib's ratio, 0..1; at 0.6 "moe" matched "d_model").
    """
    texts = [str(choice) for choice in choices]
    typed = str(value)
    folded = {text.lower(): text for text in texts}
    if typed.lower() in folded:  # a different case only: HYBRID for hybrid
        return folded[typed.lower()]
    found = difflib.get_close_matches(typed, texts, n=1, cutoff=cutoff)
    return found[0] if found else None


def choice_error(key: str, value: Any, choices: Iterable[Any], what: str = "one of") -> str:
    """The message for ``key=value`` outside ``choices``: did you mean the closest, then the choices.

    Args:
        key: the setting as the user types it (``strategy.schedule``).
        value: the value given.
        choices: the accepted values (shown in order).
        what: how the list is introduced (``one of``).
    """
    choices = [str(choice) for choice in choices]
    near = closest(value, choices)
    hint = f": did you mean {key}={near}? Use" if near else "; use"
    return f"{key}={value!r} is not a choice{hint} {what} {', '.join(choices)}."
