"""Confinement: every path llmc writes, or reads from a manifest or registry entry, stays inside its root.

Names that become path components (recipe, target, variant, model name) are checked by the recipe schema's
patterns (`SAFE_NAME`); relative paths that come from files llmc did not just write (manifest `files`, report
references) go through `confined`, which refuses absolute paths, `..`, empty components, NUL and other control
characters, backslashes, and any component that is a symbolic link, then checks that the resolved path is still
under the resolved root.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from llmc.errors import InputError

# A name that is one path component on every filesystem llmc writes to: starts with a letter or digit (so never
# '.', '..' or a hidden file), then letters, digits, '.', '_' or '-'.
SAFE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"


def _show(text: str) -> str:
    """The offending path for a message: escaped, so control characters cannot rewrite the terminal, and short."""
    shown = ascii(text)
    return shown if len(shown) <= 120 else shown[:117] + "..."


def _unsafe_reason(relative: str) -> str | None:
    if not relative:
        return "it is empty"
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in relative):
        return "it contains a NUL or control character"
    if "\\" in relative:
        return "it contains a backslash"
    if relative.startswith("/") or PurePosixPath(relative).is_absolute():
        return "it is absolute"
    parts = relative.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "it has an empty, '.' or '..' component"
    return None


def confined(root: Path, relative: str, *, what: str = "path") -> Path:
    """`root / relative`, refused (InputError) unless it stays inside `root` without following a symbolic link.

    `relative` is a '/'-separated path as written in a manifest. Components that do not exist yet are allowed
    (callers write them); existing ones must not be symbolic links."""
    if not isinstance(relative, str):
        raise InputError(f"{what} {_show(str(relative))} is not a string",
                         fix="regenerate the file with llmc; do not edit paths by hand")
    reason = _unsafe_reason(relative)
    if reason:
        raise InputError(f"{what} {_show(relative)} is refused: {reason}",
                         fix=f"{what}s must be relative, '/'-separated and stay inside {root}")
    base = Path(root).resolve()
    current = base
    for part in relative.split("/"):
        current = current / part
        try:
            mode = os.lstat(current).st_mode
        except FileNotFoundError:
            break  # the rest does not exist yet: nothing below can be a link
        if stat.S_ISLNK(mode):
            raise InputError(f"{what} {_show(relative)} is refused: {current} is a symbolic link",
                             fix=f"replace the link with the real file or folder inside {base}")
    target = (base / relative).resolve()
    if target != base and base not in target.parents:
        raise InputError(f"{what} {_show(relative)} resolves to {target}, outside {base}",
                         fix=f"keep {what}s inside {base}")
    return base / relative
