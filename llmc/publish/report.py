"""Which report `llmc report REF` may print: only reports llmc wrote, never an arbitrary file.

Accepted: a build id (or a prefix of one) in the cache, a build folder directly under `<cache>/builds/`, or a
registry entry whose manifest.json lists the report with the sha256 it still has. Paths are confined
(`llmc.storage.paths.confined`): no symbolic link in the way, nothing outside the folder.
"""

from __future__ import annotations

import re
from pathlib import Path

from llmc.errors import InputError
from llmc.storage.paths import confined
from llmc.storage.store import sha256_file

_HEX = re.compile(r"^[0-9a-f]{1,64}$")
_ACCEPTED = ("a build id (prefix) in the cache, a build folder under <cache>/builds, "
             "or a registry entry (a folder with manifest.json)")


def report_file(ref: str, cache_root: Path, name: str) -> Path:
    """The path of `name` (report.md / report.html) for `ref`; InputError for anything else."""
    builds = Path(cache_root).resolve() / "builds"
    path = Path(ref)
    if path.is_dir():
        if path.resolve().parent == builds:
            return _existing(confined(builds, f"{path.resolve().name}/{name}", what="report"), ref)
        if (path / "manifest.json").exists():
            return _entry_report(path, name)
        raise InputError(f"{path} is neither a build folder under {builds} nor a registry entry",
                         fix=f"pass {_ACCEPTED}")
    if not _HEX.match(ref):
        raise InputError(f"{ascii(ref)[:80]} is not a folder, and not a build id",
                         fix=f"pass {_ACCEPTED}")
    hits = sorted(d for d in builds.glob(f"{ref}*") if d.is_dir() and not d.is_symlink())
    if len(hits) != 1:
        raise InputError(f"{ref} matches {len(hits)} build ids in the cache ({builds})",
                         fix="pass a longer build id, or the registry entry's path")
    return _existing(confined(builds, f"{hits[0].name}/{name}", what="report"), ref)


def _entry_report(entry: Path, name: str) -> Path:
    # lazy: publish.local pulls torch (outputs -> eval.ci); `llmc report` stays light
    from llmc.publish.local import read_manifest

    files = read_manifest(entry)["files"]
    if name not in files:
        raise InputError(f"registry entry {entry} lists no {name} in its manifest",
                         fix="pass a registry entry llmc published")
    path = _existing(confined(entry, name, what="report"), str(entry))
    if sha256_file(path) != files[name]:
        raise InputError(f"{path} does not match the sha256 in the entry's manifest",
                         fix="run `llmc verify` on the entry and publish it again")
    return path


def _existing(path: Path, ref: str) -> Path:
    if not path.is_file():
        raise InputError(f"{ref} has no {path.name}", fix="rebuild, or pass another build")
    return path
