"""Confinement of a model source: nothing is read through a symbolic link that leaves the model folder.

A local model folder may hold symbolic links between its own files; a Hugging Face Hub snapshot
(`<cache>/models--org--name/snapshots/<commit>/`) links each file to `../../blobs/<hash>` of the same repository
cache, and exactly that is allowed besides. Anything else (a `generation_config.json` linked to `/etc/shadow`, a
weights file linked to another user's home) is refused before a byte of it is read, with the file named and no
byte of it quoted. `source_file` is the one resolver every reader of a source file goes through;
`check_folder_confined` applies it to every entry of the folder once, when the source is resolved, so the files
transformers opens by its own names (tokenizer, templates, vocabularies) are covered too.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from llmc.errors import InputError
from llmc.inputs.files import shown

_FIX = ("copy the file into the model folder in place of the link (cp --remove-destination \"$(readlink -f FILE)\" "
        "FILE) if it belongs to the model, else remove the link")


def allowed_roots(folder: Path) -> tuple[Path, ...]:
    """Where a file of `folder` may really be: the folder itself (its real path), and for a Hub snapshot folder
    also its repository cache's `blobs/` (only when that is a real folder, not a link to somewhere else)."""
    real = Path(os.path.realpath(folder))
    roots = [real]
    snapshots, repo = real.parent, real.parent.parent
    if snapshots.name == "snapshots" and repo.name.startswith("models--"):
        blobs = repo / "blobs"
        try:
            if stat.S_ISDIR(os.lstat(blobs).st_mode):
                roots.append(blobs)
        except OSError:
            pass
    return tuple(roots)


def _inside(target: Path, roots: tuple[Path, ...]) -> bool:
    return any(target == r or r in target.parents for r in roots)


def source_file(folder: Path, name: str, what: str = "model file",
                roots: tuple[Path, ...] | None = None) -> Path:
    """`folder / name`, refused (InputError, exit 7) when it resolves, through any symbolic link, to a place outside
    `allowed_roots(folder)`. A path that does not exist is returned as it is: the caller says it is missing."""
    path = Path(folder) / name
    if not os.path.lexists(path):
        return path
    roots = roots if roots is not None else allowed_roots(folder)
    target = Path(os.path.realpath(path))
    if not _inside(target, roots):
        raise InputError(f"{what} {shown(path)} leads through a symbolic link to {shown(target)}, outside the model "
                         f"folder {shown(roots[0])}; llmc reads nothing outside a model's folder", fix=_FIX)
    return path


def check_folder_confined(folder: Path) -> None:
    """Refuse the folder when any entry (files and sub-folders, hidden ones excepted: no loader reads those) is a
    symbolic link leaving it. Only names are looked at (lstat, readlink): no file is opened."""
    folder = Path(folder)
    roots = allowed_roots(folder)
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        base = Path(dirpath)
        for name in sorted(dirnames + [f for f in filenames if not f.startswith(".")]):
            if os.path.islink(base / name):
                source_file(base, name, roots=roots)
