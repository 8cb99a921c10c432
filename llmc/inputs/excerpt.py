"""Short, escaped excerpts of user input for error messages.

An error message quotes what it refuses, but never more than a few dozen characters of it, with
control characters and non-printable code points escaped: pointed at a system file or a binary, llmc
must not print that file's contents back (nor drive the terminal with its escape sequences).
"""

from __future__ import annotations

import reprlib
from typing import Any

EXCERPT_CHARS = 60

# bounded repr of containers: a few items, a few levels (a billion-laughs list is not walked)
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxlong, _SHORT.maxother = 3, EXCERPT_CHARS, 40, EXCERPT_CHARS
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxset = _SHORT.maxfrozenset = _SHORT.maxdict = 6


def excerpt(value: Any, limit: int = EXCERPT_CHARS) -> str:
    """`repr`-style text of value, escaped, at most about `limit` characters (a cut string says its length)."""
    if isinstance(value, str):
        shown = escape(value[:limit], quotes=True)
        return f"'{shown}'" + (f"... ({len(value)} characters)" if len(value) > limit else "")
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        return f"<a {'negative ' if value < 0 else ''}whole number of about {int(value.bit_length() * 0.30103)} digits>"
    try:
        text = _SHORT.repr(value)
    except Exception:  # noqa: BLE001 - a value whose repr fails (a huge int inside a list) is still named
        text = f"<{type(value).__name__}>"
    return escape(text[:limit]) + ("..." if len(text) > limit else "")


def shorten(text: str, limit: int = EXCERPT_CHARS) -> str:
    """Unquoted text (a parser's problem, an anchor's name), escaped and cut to about `limit` characters."""
    return escape(text[:limit]) + ("..." if len(text) > limit else "")


def escape(text: str, quotes: bool = False) -> str:
    """Control characters and other non-printable code points as \\n, \\x1b, \\u202e; with quotes, also \\ and '."""
    out = []
    for ch in text:
        if quotes and ch in "\\'":
            out.append("\\" + ch)
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape").decode("ascii"))
    return "".join(out)
