"""Module-name patterns a user (a recipe, or an artifact's quantization_config) hands llmc, matched in linear time.

compressed-tensors' convention, as `ignore`, a group's `names` and a config group's `targets` spell it: an exact
module name, a trailing dotted part ('o_proj'), or 're:<regex>' matched from the start of the full name. Python's
`re` backtracks: 're:(.*)*x$' against one module name never returns. Every such regex goes through RE2 instead
(google-re2), whose time is linear in the name. RE2 has no backreferences and no lookaround: a pattern using them
is refused (`PatternRefused`) when the recipe is validated, before any weight loads.
"""

from __future__ import annotations

import functools
import re

import re2

from llmc.errors import InputError
from llmc.inputs.excerpt import excerpt, shorten

REGEX_PREFIX = "re:"
MAX_PATTERN_CHARS = 1000

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # RE2 would print its own refusal to stderr; ours names the pattern and the fix


class PatternRefused(InputError):
    """A 're:' pattern that is not a regular expression, or one the linear-time matcher cannot run.

    An InputError where it comes from an artifact's config; recipe validation turns it into a RecipeError naming
    the key."""


@functools.lru_cache(maxsize=1024)
def compiled(regex: str) -> "re2._Regexp":
    """`regex` compiled by RE2; PatternRefused naming it (and how to rewrite it) where it cannot be."""
    shown = excerpt(REGEX_PREFIX + regex)
    if len(regex) > MAX_PATTERN_CHARS:
        raise PatternRefused(f"pattern {shown} is longer than {MAX_PATTERN_CHARS} characters",
                             fix="shorten it")
    try:
        re.compile(regex)  # Python's parser: its messages say where a malformed pattern goes wrong
    except (re.error, RecursionError, OverflowError, ValueError) as e:
        where = f" at position {e.pos}" if getattr(e, "pos", None) is not None else ""
        raise PatternRefused(
            f"pattern {shown} is not a valid regular expression ({shorten(getattr(e, 'msg', str(e)), 80)}{where})",
            fix="escape special characters with a backslash (e.g. 're:.*\\.mlp\\..*'), or give the module name "
                "without 're:'") from None
    try:
        return re2.compile(regex, _OPTIONS)
    except re2.error as e:
        reason = e.args[0].decode("utf-8", "replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise PatternRefused(
            f"pattern {shown} uses what the linear-time matcher (RE2) does not run: {shorten(reason, 80)}; "
            "backreferences (\\1), lookahead/lookbehind ((?=, (?!, (?<=, (?<!), possessive or atomic groups and "
            "repeats over 1000 are not supported",
            fix="rewrite it without them: list the alternatives ('re:.*\\.(q|k|v)_proj$'), use a character class "
                "instead of a lookahead, or give exact or trailing module names without 're:'") from None


def check_patterns(patterns: tuple[str, ...] | list[str]) -> None:
    """Compile every 're:' entry now (PatternRefused on the first that cannot be), so none fails mid-build."""
    for p in patterns:
        if p.startswith(REGEX_PREFIX):
            compiled(p[len(REGEX_PREFIX):])


def regex_matches(regex: str, name: str) -> bool:
    """Whether `regex` matches `name` from its start (Python's `re.match`), in time linear in `name`."""
    return compiled(regex).match(name) is not None


def module_matches(name: str, patterns: tuple[str, ...] | list[str]) -> bool:
    """compressed-tensors-style patterns: exact name, trailing dotted part, or 're:<regex>' from the start."""
    for p in patterns:
        if p.startswith(REGEX_PREFIX):
            if regex_matches(p[len(REGEX_PREFIX):], name):
                return True
        elif name == p or name.endswith("." + p):
            return True
    return False
