"""The built-in data-source loaders: brown, text, jsonl/json/parquet/csv and hf (all tabular formats through the
`datasets` library, so no format is parsed here by hand)."""

from __future__ import annotations

import glob
import os
from pathlib import Path

from llmc.calibration.corpora import brown_documents
from llmc.data.registry import Row, loader
from llmc.data.sources import label
from llmc.errors import InputError


@loader("brown")
def brown(source, role) -> list[Row]:
    return [Row(source="brown", row=d.id, text=d.text) for d in brown_documents(role)]


def _files(pattern: str, suffixes: tuple[str, ...]) -> list[Path]:
    p = Path(pattern).expanduser()
    if p.is_dir():
        found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in suffixes)
    elif p.is_file():
        found = [p]
    else:
        found = sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
    if not found:
        raise InputError(f"no data files at '{pattern}' (looked for {'/'.join(suffixes)} files)",
                         fix="give an existing file, folder or glob (relative paths are from the working directory)")
    return found


@loader("text")
def text(source) -> list[Row]:
    files = _files(source.path, (".txt",))
    root = Path(os.path.commonpath([str(f.parent) for f in files]))
    out = []
    for f in files:
        body = f.read_text(encoding="utf-8", errors="replace")
        name = str(f.relative_to(root))
        pieces = body.split(source.separator) if source.separator else [body]
        for i, piece in enumerate(pieces):
            if piece.strip():
                out.append(Row(source=label(source), row=f"{name}#{i}" if source.separator else name,
                               text=piece.strip("\n")))
    return out


def _dataset_rows(ds, source, where: str) -> list[Row]:
    column = source.field or source.messages or _default_column(ds.column_names, where)
    if column not in ds.column_names:
        raise InputError(f"{where} has no column '{column}' (columns: {', '.join(ds.column_names)})",
                         fix="name an existing column in 'field' (plain text) or 'messages' (chat turns)")
    out = []
    for i, value in enumerate(ds[column]):
        if source.messages is not None:
            if not isinstance(value, list) or not all(isinstance(t, dict) and "role" in t and "content" in t
                                                      for t in value):
                raise InputError(f"{where} row {i}: '{column}' is not a list of {{role, content}} turns",
                                 fix="point 'messages' at a column of chat turns, or use 'field' for plain text")
            out.append(Row(source=label(source), row=str(i),
                           messages=tuple({"role": t["role"], "content": t["content"]} for t in value)))
        elif value is not None and str(value).strip():
            out.append(Row(source=label(source), row=str(i), text=str(value)))
    return out


def _default_column(columns: list[str], where: str) -> str:
    if "text" in columns:
        return "text"
    raise InputError(f"{where}: which column holds the text? (columns: {', '.join(columns)})",
                     fix="set 'field' (plain text) or 'messages' (chat turns)")


@loader("jsonl")
@loader("json")
@loader("parquet")
@loader("csv")
def records(source) -> list[Row]:
    import datasets

    builder = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv"}[source.kind]
    files = [str(f) for f in _files(source.path, (f".{source.kind}",))]
    with _quiet(datasets):
        ds = datasets.load_dataset(builder, data_files=files, split="train")
    return _dataset_rows(ds, source, source.path)


@loader("hf")
def hub(source) -> list[Row]:
    import datasets

    with _quiet(datasets):
        if source.path is not None:
            ds = datasets.load_from_disk(source.path)
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[source.split]
        else:
            ds = _load_hub(datasets, source)
    return _dataset_rows(ds, source, label(source))


def _load_hub(datasets, source):
    offline = os.environ.get("HF_DATASETS_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "0")).lower() in ("1", "true")
    try:
        return datasets.load_dataset(source.dataset, source.config, split=source.split, revision=source.revision)
    except Exception as e:  # datasets raises several types for "not in the cache and no network"
        cache = os.environ.get("HF_DATASETS_CACHE", str(Path.home() / ".cache" / "huggingface" / "datasets"))
        raise InputError(
            f"could not load the dataset '{source.dataset}' (config {source.config}, split {source.split}, "
            f"revision {source.revision}){' in offline mode' if offline else ''}: {type(e).__name__}: {e}",
            fix=f"on a machine with network run it once to fill the cache ({cache}) and copy the cache here, with "
            "HF_DATASETS_OFFLINE=1 set; or save it with Dataset.save_to_disk and use {kind: hf, path: <folder>}; "
            "or export it to .jsonl/.parquet and use {kind: jsonl, path: ..., field: ...}",
        ) from None


class _quiet:
    """datasets' progress bars would interleave with llmc's own progress output."""

    def __init__(self, datasets) -> None:
        self.datasets = datasets

    def __enter__(self):
        self.was = self.datasets.utils.are_progress_bars_disabled()
        self.datasets.utils.disable_progress_bars()

    def __exit__(self, *exc):
        if not self.was:
            self.datasets.utils.enable_progress_bars()
