"""A registry that is a directory: <registry>/<recipe name>/<build id>/{artifacts/, manifest.json, report.md}.

An entry appears by one rename of a fully written temp directory, so a listed entry is complete.
The same build id already present and intact (every byte as its manifest says, nothing extra, the artifact files'
sha256 those the cache recorded for the export, the model cards and the manifest fields the build determines the
build's, and a valid signature when a key is set: a missing one is a failure then) is a no-op; any other is
republished (the old folder is renamed away and the new one renamed in), signed when a key is set. An entry owns its
bytes: copies or reflinks of the cache's files, never hard links (`llmc.storage.links.clone_or_copy`), so damage to
one entry reaches no other entry and no cached output. manifest.json carries the provenance: sha256 of every file, the resolved recipe, model and data hashes,
calibration sample ids, package versions, stage timings, evaluation results and gate verdicts; manifest.sig its
optional HMAC (`llmc.publish.signing`). Each artifact folder gets its model card, README.md
(`llmc.publish.model_card`).

Publication holds a lock per entry (`<registry>/.llmc-locks/<recipe>/<build id>.lock`); `.tmp-*` and `.old-*`
folders whose lock is free were left by a process that is gone and are removed. Published files and folders get
the modes the umask gives new ones (0644 / 0755 with the usual 022), whatever the cache's modes were.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import sys
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock

from llmc import __version__
from llmc.errors import InputError
from llmc.eval.report import report_dict
from llmc.storage.paths import confined
from llmc.telemetry.progress import log
from llmc.publish.model_card import CARD_FILE, model_card
from llmc.publish.outputs import write_report_files
from llmc.publish.signing import SIGNATURE_FILE, sign, signature_status, signing_key
from llmc.storage.links import clone_or_copy
from llmc.storage.store import (COMPLETE_MARKER, CorruptOutput, Store, atomic_write_json, atomic_write_text, fsync_dir,
                        remove_if_abandoned, record_files, sha256_file, walk_files)

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


MANIFEST = "manifest.json"
_NOT_IN_MANIFEST = (MANIFEST, SIGNATURE_FILE, COMPLETE_MARKER)
_HEX = re.compile(r"^[0-9a-f]{1,64}$")


def manifest(result: "BuildResult", entry: Path, files: dict[str, str] | None = None) -> dict:
    """The entry's manifest; `files` (relative path -> sha256) when already hashed, else every file is hashed."""
    if files is None:
        files = {
            str(p.relative_to(entry)): sha256_file(p)
            for p in sorted(entry.rglob("*"))
            if p.is_file() and p.name not in _NOT_IN_MANIFEST
        }
    return {
        "schema": "llmc-manifest/1",
        "build_id": result.build_id,
        "llmc_version": __version__,
        "recipe": result.recipe.model_dump(mode="json"),
        **({"overrides": list(result.overrides)} if result.overrides else {}),  # --set, applied to "recipe"
        "model": {"source": result.recipe.model.source, "sha256": result.source.sha256,
                  **({"hub": result.source.hub} if result.source.hub else {})},
        "calibration": result.calibration,
        "packages": package_versions(),
        "files": files,
        "report": report_dict(result),
    }


def _copy_owning_bytes():
    """A copytree copy function giving the entry its own bytes (`llmc.storage.links.clone_or_copy`: a reflink where the
    filesystem has them, else a copy; never a hard link into the cache or another entry). Cached files that were
    links of one file (a Triton repository's version folder links the artifact's files) become links of one copy
    inside this entry."""
    copied: dict[tuple[int, int], str] = {}

    def copy(src: str, dst: str) -> str:
        st = os.stat(src)
        first = copied.get((st.st_dev, st.st_ino)) if st.st_nlink > 1 else None
        if first is not None:
            os.link(first, dst)
        else:
            clone_or_copy(src, dst)
            copied[(st.st_dev, st.st_ino)] = dst
        return dst

    return copy


def _entry_lock(registry: Path, name: str, build_id: str) -> FileLock:
    path = confined(registry, f".llmc-locks/{name}/{build_id}.lock", what="registry lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(path), is_singleton=True)


def sweep_registry(registry: Path) -> list[Path]:
    """Remove `.tmp-*` / `.old-*` folders of publications whose process is gone (their entry lock is free)."""
    removed = []
    for leftover in sorted([*registry.glob("*/.*.tmp-*"), *registry.glob("*/.*.old-*")]):
        build_id = leftover.name[1:].split(".", 1)[0]
        if leftover.is_symlink() or not leftover.is_dir() or not _HEX.match(build_id):
            continue
        if remove_if_abandoned(leftover, _entry_lock(registry, leftover.parent.name, build_id)):
            removed.append(leftover)
    return removed


def publish_build(result: "BuildResult", store: Store) -> tuple[Path, bool]:
    """Copy artifacts + manifest + report into the registry; (entry path, was it already there intact).

    Every artifact byte copied is checked against the sha256 its export recorded: a cached export changed since
    it was written is discarded and CorruptOutput raised (`llmc.build.build` rebuilds it and publishes again)."""
    registry = Path(result.recipe.publish.registry).expanduser()
    registry.mkdir(parents=True, exist_ok=True)
    name, build_id = result.recipe.name, result.build_id
    entry = confined(registry, f"{name}/{build_id}", what="registry entry")
    with _entry_lock(registry, name, build_id):
        sweep_registry(registry)
        if (entry / COMPLETE_MARKER).is_file():
            try:
                problems = verify_entry(entry) or _differences_from_build(entry, result, store)
            except InputError as e:
                problems = [e.message]
            if not problems:
                return entry, True
            log(f"warning: registry entry {entry} does not match its manifest ({'; '.join(problems[:4])}); "
                "republishing it")
        tmp = entry.with_name(f".{build_id}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _write_entry(result, store, tmp)
            _swap_in(tmp, entry)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return entry, False


def _write_entry(result: "BuildResult", store: Store, tmp: Path) -> None:
    (tmp / "artifacts").mkdir(parents=True)
    for label, art in result.artifacts.items():
        shutil.copytree(art.dir, confined(tmp, f"artifacts/{label}", what="artifact folder"),
                        ignore=shutil.ignore_patterns(".*"), copy_function=_copy_owning_bytes())
    write_report_files(result, tmp)
    files = record_files(tmp)  # one read of every byte: the manifest's hashes and the check against the cache
    for label, art in result.artifacts.items():
        expected = _published_record(store, art.dir)
        prefix = f"artifacts/{label}/"
        copied = {rel[len(prefix):]: f for rel, f in files.items() if rel.startswith(prefix)}
        problems = _differences(expected, copied)
        if problems:
            store.discard(art.dir, problems)
            raise CorruptOutput(f"cached export {art.dir} for {label} changed after it was written: "
                                f"{'; '.join(problems[:4])}",
                                fix="rerun: the export was discarded and is rebuilt")
    digests = {rel: f["sha256"] for rel, f in files.items() if "sha256" in f}
    for label in result.artifacts:  # the model cards: written after the check, which covers the export's own files
        card = confined(tmp, f"artifacts/{label}/{CARD_FILE}", what="model card")
        atomic_write_text(card, model_card(result, label))
        digests[card.relative_to(tmp).as_posix()] = sha256_file(card)
    atomic_write_json(tmp / MANIFEST, manifest(result, tmp, digests))
    key = signing_key()
    if key is not None:
        sign(tmp, key)
    atomic_write_json(tmp / COMPLETE_MARKER, {"build_id": result.build_id})
    _follow_umask(tmp)


# Manifest fields the build determines (the same build id gives the same values; the recipe less where it publishes,
# as the build id hashes it); the others ("report" with its stage timings, "packages", "overrides") are what the
# first publication measured or was told, protected by the signature when a key is set.
_BUILD_FIELDS = ("schema", "build_id", "llmc_version", "recipe", "model", "calibration")


def _build_fields(m: dict) -> dict:
    fields = {k: m.get(k) for k in _BUILD_FIELDS}
    if isinstance(fields["recipe"], dict):
        fields["recipe"] = {k: v for k, v in fields["recipe"].items() if k != "publish"}
    return fields


def _differences_from_build(entry: Path, result: "BuildResult", store: Store) -> list[str]:
    """How an entry that matches its own manifest differs from what this build publishes: the artifact files'
    sha256 against the cache's record of the export (so an artifact rewritten together with its manifest hash is
    caught), the model cards (a pure function of the build), and the manifest fields the build determines."""
    m = read_manifest(entry)
    have = _build_fields(m)
    want = _build_fields(json.loads(json.dumps(manifest(result, entry, files={}), default=str)))  # as written
    problems = [f"manifest field {k!r} differs from the build's" for k in _BUILD_FIELDS if have[k] != want[k]]
    published = {rel for rel in m["files"] if rel.startswith("artifacts/")}
    for label, art in result.artifacts.items():
        prefix = f"artifacts/{label}/"
        recorded = _published_record(store, art.dir)
        listed = {rel[len(prefix):]: {"sha256": d} for rel, d in m["files"].items() if rel.startswith(prefix)}
        card = listed.pop(CARD_FILE, {}).get("sha256")
        problems += [f"{p} in {prefix} (against the cache's record)" for p in _differences(recorded, listed)]
        if card != hashlib.sha256(model_card(result, label).encode()).hexdigest():
            problems.append(f"{prefix}{CARD_FILE} is not this build's model card")
        published -= {rel for rel in published if rel.startswith(prefix)}
    return problems + [f"extra {rel} (no artifact of this build)" for rel in sorted(published)]


def _published_record(store: Store, export: Path) -> tuple[dict[str, dict], str | None]:
    """The cache's record of an export's files, less the hidden ones (copytree leaves those out), or why none."""
    recorded, why = store.record(export)
    return {rel: f for rel, f in recorded.items() if not any(part.startswith(".") for part in rel.split("/"))}, why


def _differences(expected: tuple[dict[str, dict], str | None], copied: dict[str, dict]) -> list[str]:
    expected, why = expected
    if why:
        return [f"the cached export has no record of its files: {why}"]
    problems = [f"missing {rel}" for rel in sorted(set(expected) - set(copied))]
    problems += [f"extra {rel}" for rel in sorted(set(copied) - set(expected))]
    problems += [f"modified {rel} (sha256 differs)" for rel in sorted(set(expected) & set(copied))
                 if expected[rel].get("sha256") != copied[rel].get("sha256")]
    return problems


def _follow_umask(folder: Path) -> None:
    """Give every file and folder the mode a new one gets under the umask (copies keep the cache's 0600)."""
    mask = os.umask(0o022)
    os.umask(mask)
    for dirpath, dirnames, filenames in os.walk(folder):
        os.chmod(dirpath, 0o777 & ~mask)
        for n in filenames:
            path = os.path.join(dirpath, n)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)


def _swap_in(tmp: Path, entry: Path) -> None:
    """Rename the written folder to the entry; a modified entry is renamed away first, then removed."""
    old = None
    if entry.exists() or entry.is_symlink():
        old = entry.with_name(f".{entry.name}.old-{os.getpid()}")
        os.replace(entry, old)
    os.replace(tmp, entry)
    fsync_dir(entry.parent)
    if old is not None:
        if old.is_symlink():
            old.unlink()
        else:
            shutil.rmtree(old, ignore_errors=True)


def read_manifest(entry: Path) -> dict:
    """The entry's manifest, refused (InputError) unless it is a regular file of JSON whose `files` maps
    confined relative paths to sha256 digests."""
    path = confined(Path(entry), MANIFEST, what="manifest")
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise InputError(f"{path} is not a regular file", fix="restore the entry by publishing it again")
        m = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{entry} has no {MANIFEST}", fix="pass a registry entry folder") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"{path} is not valid JSON ({type(e).__name__})",
                         fix="restore the entry by publishing it again") from None
    files = m.get("files") if isinstance(m, dict) else None
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise InputError(f"{path} has no 'files' mapping of paths to sha256 digests",
                         fix="restore the entry by publishing it again")
    for rel in files:
        confined(Path(entry), rel, what="manifest path")
        if rel in _NOT_IN_MANIFEST:
            raise InputError(f"{path} lists {rel}, which a manifest never covers",
                             fix="restore the entry by publishing it again")
    return m


def verify_entry(entry: Path) -> list[str]:
    """How the entry differs from its manifest: files modified, missing or extra, links, and an invalid signature
    when a key is set (empty list: intact). A manifest listing a path outside the entry is an InputError."""
    entry = Path(entry)
    m = read_manifest(entry)
    problems = []
    present = {rel: (st, path) for rel, st, path in walk_files(entry) if rel not in _NOT_IN_MANIFEST}
    for rel, digest in sorted(m["files"].items()):
        if rel not in present:
            problems.append(f"missing {rel}")
            continue
        st, path = present[rel]
        if not stat.S_ISREG(st.st_mode):
            problems.append(f"not a regular file: {rel}")
        elif sha256_file(path) != digest:
            problems.append(f"modified {rel}")
    problems += [f"extra {rel}" for rel in sorted(set(present) - set(m["files"]))]
    status, failed = signature_status(entry, signing_key())
    if failed:
        problems.append(f"signature {status}")
    return problems
