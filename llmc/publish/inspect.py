"""`llmc inspect`: say what a path is and which runtimes accept it.

Registry entries and llmc's canonical quantized form are described here; artifacts by the format in the target
registry (`llmc.runtimes`) that recognises them. Whatever carries a record of its files is also verified against it,
every byte: a registry entry against its manifest (and its signature when a key is set), a cached stage output
against the sizes and sha256 its complete marker recorded. `inspect_path` returns the problems so the CLI exits
non-zero on any.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmc.errors import InputError
from llmc.quant.canonical import META_FILE, QuantizedModel
from llmc.runtimes.catalog import recognize
from llmc.formats.base import architectures
from llmc.result import gates_summary
from llmc.publish.local import read_manifest, verify_entry
from llmc.publish.signing import signature_status, signing_key
from llmc.storage.store import COMPLETE_MARKER, check_files


def _gates_line(rep: object) -> str:
    """The gates' state as the report recorded it: "all passed" only when every gate was measured."""
    try:
        return gates_summary(rep.get("verdicts", []))[1]  # type: ignore[union-attr]
    except (AttributeError, KeyError, TypeError):
        return "unreadable (the manifest's report has no valid verdicts)"


def describe(path: Path) -> str:
    return inspect_path(path)[0]


def inspect_path(path: Path) -> tuple[str, list[str]]:
    """(description, integrity problems) of `path`; problems are empty when nothing differs from its record."""
    path = Path(path)
    if (path / "manifest.json").exists():
        return _describe_entry(path)
    lines, problems = [_describe_folder(path)], []
    record = verify_record(path)
    if record is not None:
        lines.append(record[0])
        problems = record[1]
    return "\n".join(lines), problems


def verify_path(path: Path, *, require_signature: bool = False) -> tuple[str, list[str]]:
    """Only the integrity part of `inspect_path`: (lines, problems). A path with no record to verify against is an
    InputError. `require_signature`: a registry entry must also carry a signature that the key set here checks."""
    path = Path(path)
    if (path / "manifest.json").exists():
        problems = verify_entry(path)
        status = signature_status(path, signing_key())[0]
        if require_signature and not status.startswith("valid") and not any("signature" in p for p in problems):
            problems.append(f"signature required, but {status}")
        return "\n".join([f"registry entry {path}", _files_line(path, problems), _signature_line(path)]), problems
    record = verify_record(path)
    if record is None:
        raise InputError(f"{path} carries no record of its files to verify against",
                         fix="pass a registry entry (manifest.json) or a cached stage output (.llmc-complete)")
    return f"{path}\n{record[0]}", record[1]


def verify_record(path: Path) -> tuple[str, list[str]] | None:
    """A cached stage output checked byte for byte against its complete marker's record; None without one."""
    marker = Path(path) / COMPLETE_MARKER
    if not marker.is_file():
        return None
    try:
        files = json.loads(marker.read_text()).get("files")
    except (ValueError, UnicodeDecodeError, AttributeError):
        files = None
    if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
        return f"  files: {COMPLETE_MARKER} holds no record of them", [f"{COMPLETE_MARKER} holds no file record"]
    problems = check_files(Path(path), files, full=True)
    if problems:
        return f"  files: DO NOT MATCH the record written with them: {'; '.join(problems)}", problems
    return f"  files: all {len(files)} match the sizes and sha256 recorded when they were written", []


def _files_line(entry: Path, problems: list[str]) -> str:
    if problems:
        return f"  files: MODIFIED/MISSING/EXTRA: {'; '.join(problems)}"
    return "  files: all sha256 match the manifest, nothing extra"


def _signature_line(entry: Path) -> str:
    return f"  signature: {signature_status(entry, signing_key())[0]}"


def _describe_entry(path: Path) -> tuple[str, list[str]]:
    m = read_manifest(path)  # refuses a manifest that lists paths outside the entry
    problems = verify_entry(path)

    def get(*keys: str) -> object:
        node: object = m
        for k in keys:
            node = node.get(k) if isinstance(node, dict) else None
        return "?" if node is None else node

    targets = get("report", "targets")
    lines = [
        f"registry entry {path}",
        f"  build {get('build_id')} of recipe '{get('recipe', 'name')}', scheme {get('report', 'scheme')}, "
        f"llmc {get('llmc_version')}",
        f"  model {get('model', 'source')} (sha256 {get('model', 'sha256')})",
        f"  gates: {_gates_line(m.get('report'))}; files: {len(m['files'])}",
        _files_line(path, problems),
        _signature_line(path),
    ]
    for label, t in (targets.items() if isinstance(targets, dict) else []):
        exporter = t.get("exporter", "?") if isinstance(t, dict) else "?"
        lines.append(f"  artifact {ascii(label)[1:-1]}: {exporter} at artifacts/{ascii(label)[1:-1]}")
    return "\n".join(lines), problems


def _describe_folder(path: Path) -> str:
    if (path / META_FILE).is_file():
        qm = QuantizedModel.open(path)
        s = qm.scheme
        return "\n".join([
            f"llmc canonical quantized form at {path}",
            f"  scheme {s.name} ({s.algorithm}): weights {s.weights.describe()}"
            + (f", activations {s.activations.describe()}" if s.activations else "")
            + (f", KV cache {s.kv_cache.format}" if s.kv_cache else "") if not s.mixed else
            f"  scheme {s.name} ({s.algorithm}), mixed precision: "
            + "; ".join(f"group {g.name} ({g.targets.describe()}): "
                        + (f"{s.member(g).name}, {len(qm.modules_by_group().get(g.name, []))} Linears"
                           if g.quantized else "unquantized") for g in s.groups),
            f"  {len(qm.quantized_modules)} quantized Linear modules in {len(qm.files()) - 1} layers; "
            f"source {qm.meta['source']['origin']} ({qm.meta['source']['sha256']})",
            "  exporters read this; runtimes do not",
        ])
    fmt = recognize(path)
    if fmt is not None:
        return fmt.describe(path)
    if (path / "config.json").is_file():
        cfg = json.loads((path / "config.json").read_text())
        q = cfg.get("quantization_config")
        arch = architectures(cfg)
        if q is None:
            return f"unquantized Hugging Face checkpoint at {path} ({arch}, dtype {cfg.get('dtype') or cfg.get('torch_dtype')})"
        return f"Hugging Face checkpoint at {path} ({arch}) quantized with {q.get('quant_method')} (not produced by llmc)"
    raise InputError(f"{path} is not an llmc artifact, quantized form or registry entry",
                     fix="pass a folder with config.json, quantized.json or manifest.json")
