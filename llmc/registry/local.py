"""A registry that is a directory: <registry>/<recipe name>/<build id>/{artifacts/, manifest.json, report.md}.

An entry appears by one rename of a fully written temp directory, so a listed entry is complete.
The same build id already present is a no-op. manifest.json carries the provenance: sha256 of
every file, the resolved recipe, model and data hashes, calibration sample ids, package versions,
stage timings, evaluation results and gate verdicts.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from llmc import __version__
from llmc.errors import InputError
from llmc.eval.report import report_dict
from llmc.registry.outputs import write_report_files
from llmc.store import COMPLETE_MARKER, Store, atomic_write_json, fsync_dir, sha256_file

if TYPE_CHECKING:
    from llmc.result import BuildResult

PACKAGES = ("torch", "transformers", "compressed-tensors", "safetensors", "gguf", "pydantic", "numpy")


def package_versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0], "llmc": __version__}
    for p in PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            pass
    return out


def manifest(result: "BuildResult", entry: Path) -> dict:
    files = {
        str(p.relative_to(entry)): sha256_file(p)
        for p in sorted(entry.rglob("*"))
        if p.is_file() and p.name not in ("manifest.json", COMPLETE_MARKER)
    }
    return {
        "schema": "llmc-manifest/1",
        "build_id": result.build_id,
        "llmc_version": __version__,
        "recipe": result.recipe.model_dump(mode="json"),
        "model": {"source": result.recipe.model.source, "sha256": result.source.sha256},
        "calibration": result.calibration,
        "packages": package_versions(),
        "files": files,
        "report": report_dict(result),
    }


def _copy_keeping_links():
    """A copytree copy function that links a file to its earlier copy when the sources were hard links
    of one file (a Triton repository's version folder links the artifact's files): no second copy."""
    copied: dict[tuple[int, int], str] = {}

    def copy(src: str, dst: str) -> str:
        st = os.stat(src)
        first = copied.get((st.st_dev, st.st_ino)) if st.st_nlink > 1 else None
        if first is not None:
            os.link(first, dst)
        else:
            shutil.copy2(src, dst)
            copied[(st.st_dev, st.st_ino)] = dst
        return dst

    return copy


def publish_build(result: "BuildResult", store: Store) -> tuple[Path, bool]:
    """Copy artifacts + manifest + report into the registry; (entry path, was it already there)."""
    registry = Path(result.recipe.publish.registry).expanduser()
    entry = registry / result.recipe.name / result.build_id
    if (entry / COMPLETE_MARKER).is_file():
        return entry, True
    tmp = entry.with_name(f".{entry.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "artifacts").mkdir(parents=True)
    for label, art in result.artifacts.items():
        shutil.copytree(art.dir, tmp / "artifacts" / label, ignore=shutil.ignore_patterns(".*"),
                        copy_function=_copy_keeping_links())
    write_report_files(result, tmp)
    atomic_write_json(tmp / "manifest.json", manifest(result, tmp))
    atomic_write_json(tmp / COMPLETE_MARKER, {"build_id": result.build_id})
    if entry.exists():  # an incomplete leftover
        shutil.rmtree(entry)
    os.replace(tmp, entry)
    fsync_dir(entry.parent)
    return entry, False


def verify_entry(entry: Path) -> list[str]:
    """Files whose sha256 no longer matches the manifest (empty list: intact)."""
    m = json.loads((Path(entry) / "manifest.json").read_text())
    bad = []
    for rel, digest in m["files"].items():
        p = Path(entry) / rel
        if not p.is_file() or sha256_file(p) != digest:
            bad.append(rel)
    return bad


def find_entry(registry: Path, ref: str) -> Path:
    """An entry by path, '<name>/<build id prefix>', or build-id prefix."""
    p = Path(ref)
    if (p / "manifest.json").is_file():
        return p
    hits = [d for d in Path(registry).glob("*/*") if (d / COMPLETE_MARKER).is_file()
            and (d.name.startswith(ref) or f"{d.parent.name}/{d.name}".startswith(ref))]
    if len(hits) != 1:
        raise InputError(f"{'no' if not hits else len(hits)} registry entries match '{ref}' under {registry}",
                         fix="pass a longer build id or the entry's path")
    return hits[0]
