"""The built-in data-source loaders: brown, text, jsonl/json/csv (Python's json and csv modules, a row at a time),
parquet (pyarrow, the named column in batches after its type is checked) and hf (the `datasets` library).

Each yields rows lazily, so a recipe that needs 256 tokens stops reading after them (`read_rows`' max_chars), and
parses its files with bounded memory and depth: a malformed, oversized or deeply nested file is an InputError
(exit 7) naming the file and the line, never a crash inside a C parser."""

from __future__ import annotations

import csv
import glob
import itertools
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from llmc.calibration.corpora import brown_documents
from llmc.data.registry import Row, loader
from llmc.data.sources import label
from llmc.errors import InputError
from llmc.inputs.caps import (ARROW_BATCH_ROWS, MAX_JSON_FILE_BYTES, MAX_ROW_BYTES, MAX_UNDECODABLE_SHARE,
                              UNDECODABLE_SAMPLE_CHARS)
from llmc.inputs.excerpt import excerpt, shorten
from llmc.inputs.files import read_input_text, shown


@loader("brown")
def brown(source, role) -> list[Row]:
    return [Row(source="brown", row=d.id, text=d.text) for d in brown_documents(role)]


# A row of a jsonl/csv file is read whole before it is parsed: longer ones are refused (split the document, or use
# a text source, which reads only what the recipe needs). A .json file is parsed whole: larger ones are refused.
# A parquet / saved-dataset cell is measured from Arrow's offsets before it becomes a Python string.
BATCH_ROWS = ARROW_BATCH_ROWS


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
def text(source, *, max_chars: int | None = None) -> Iterator[Row]:
    """One document per file (or per `separator` piece); a UTF-8 byte-order mark is not text. With `max_chars`, a
    file is read up to one character past it (the rest cannot be needed)."""
    files = _files(source.path, (".txt",))
    root = Path(os.path.commonpath([str(f.parent) for f in files]))
    for f in files:
        with _opened(f, encoding="utf-8-sig", errors="replace") as handle:
            body = handle.read(-1 if max_chars is None else max_chars + 1)
        _refuse_binary(body, f)
        name = str(f.relative_to(root))
        pieces = body.split(source.separator) if source.separator else [body]
        for i, piece in enumerate(pieces):
            if piece.strip():
                yield Row(source=label(source), row=f"{name}#{i}" if source.separator else name,
                          text=piece.strip("\n"))


def _refuse_binary(body: str, path: Path) -> None:
    """InputError when a text file's start is mostly bytes that are not UTF-8 (decoded as U+FFFD) or NULs: binary
    data or another encoding, which a byte-level tokenizer turns into ~3 tokens a byte (4 MB of random bytes cost
    1.6 GB to tokenize). A stray bad byte in real text is still read, replaced."""
    sample = body[:UNDECODABLE_SAMPLE_CHARS]
    bad = sample.count("\ufffd") + sample.count("\x00")
    if bad > 8 + MAX_UNDECODABLE_SHARE * len(sample):
        raise _bad_file(path, f"is not UTF-8 text: {bad:,} of its first {len(sample):,} characters are undecodable "
                        "bytes or NULs (binary data, or another encoding such as UTF-16 or Latin-1)",
                        fix="point the source at text files, or convert this one to UTF-8 "
                        "(e.g. iconv -f latin1 -t utf-8)")


def _opened(path: Path, **text_mode):
    """A data file opened for reading (text mode when `text_mode` names an encoding); InputError if it cannot be."""
    try:
        return open(path, "r" if text_mode else "rb", **text_mode)
    except OSError as e:
        raise InputError(f"data file {shown(path)} cannot be read ({e.strerror})",
                         fix="check the path and its permissions") from None


def _bad_file(path: Path, what: str, fix: str = "repair or re-export the file") -> InputError:
    return InputError(f"data file {shown(path)}: {what}", fix=fix)


def _row_value(record, column: str, path: Path, where: str):
    if not isinstance(record, dict):
        raise _bad_file(path, f"{where} is a JSON {type(record).__name__}, not an object",
                        fix="write one JSON object per row, e.g. {\"text\": \"...\"}")
    return record.get(column)


def _json_value(text: str, path: Path, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise _bad_file(path, f"{where} is not JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:  # Python's parser stops at the interpreter's recursion limit; no C parser sees it
        raise _bad_file(path, f"{where} nests more deeply than any text or chat row does",
                        fix="a row is an object of text columns, or of a list of {role, content} turns") from None
    except ValueError as e:  # an integer of thousands of digits
        raise _bad_file(path, f"{where} cannot be read as JSON ({shorten(str(e), 80)})") from None


def _utf8(data: bytes, path: Path, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _bad_file(path, f"{where} is not UTF-8 text (at byte {e.start} of it)",
                        fix="save the file as UTF-8") from None


def _json_records(path: Path) -> Iterator[dict]:
    """A .json file: one array of objects (read whole, up to MAX_JSON_FILE_BYTES), or JSON lines."""
    with _opened(path) as f:
        start = f.read(64).lstrip(b"\xef\xbb\xbf \t\r\n")
    if not start.startswith(b"["):
        yield from _jsonl_records(path)
        return
    data = read_input_text(path, "data file", MAX_JSON_FILE_BYTES,
                           "write it as JSON lines (.jsonl, one object per line), which is read a row at a time")
    records = _json_value(data.lstrip("\ufeff"), path, "the file")
    del data
    if not isinstance(records, list):
        raise _bad_file(path, f"holds a JSON {type(records).__name__}, not an array of row objects",
                        fix="write a JSON array of objects, or JSON lines")
    yield from records


def _lines(path: Path) -> Iterator[str]:
    """A text file's lines, each read up to MAX_ROW_BYTES and decoded as UTF-8 (a leading byte-order mark dropped)."""
    with _opened(path) as f:
        for number in itertools.count(1):
            line = f.readline(MAX_ROW_BYTES + 1)
            if not line:
                return
            if len(line) > MAX_ROW_BYTES:
                raise _bad_file(path, f"line {number} is over {MAX_ROW_BYTES:,} bytes",
                                fix="split long documents into several rows, or use a text source (kind: text), "
                                "which reads only as much as the recipe needs")
            text = _utf8(line, path, f"line {number}")
            yield text.lstrip("\ufeff") if number == 1 else text


def _jsonl_records(path: Path) -> Iterator[dict]:
    """The objects of a JSON-lines file, one line at a time."""
    for number, text in enumerate(_lines(path), 1):
        if text.strip():
            yield _json_value(text, path, f"line {number}")


def _csv_records(path: Path) -> Iterator[dict]:
    """The rows of a CSV file with a header line, parsed by Python's csv module (strict: an unterminated quote is
    an error, as it was for pandas) one row at a time."""
    csv.field_size_limit(MAX_ROW_BYTES)
    reader = csv.DictReader(_lines(path), strict=True)
    try:
        yield from reader
    except csv.Error as e:
        raise _bad_file(path, f"line {reader.line_num} is not CSV ({shorten(str(e), 80)})",
                        fix="write a header line and one row per document (quote fields holding commas or "
                        "newlines), or use jsonl") from None


_RECORDS = {"jsonl": _jsonl_records, "json": _json_records, "csv": _csv_records}


@loader("jsonl")
@loader("json")
@loader("csv")
def records(source, *, max_chars: int | None = None) -> Iterator[Row]:
    """Rows of jsonl/json/csv files, parsed in Python one row at a time (no C parser sees a file first: a row
    nested 100,000 deep is a clear error, not a crash of pyarrow's reader)."""
    files = _files(source.path, (f".{source.kind}",))
    read = _RECORDS[source.kind]
    yield from _column_rows(source, source.path, ((record, path) for path in files for record in read(path)))


def _column_rows(source, where: str, records: Iterable[tuple[object, Path]]) -> Iterator[Row]:
    """Rows from (record, file) pairs: the `field` (plain text) or `messages` (chat turns) column of each."""
    column = source.field or source.messages
    seen: set[str] = set()
    any_value = False
    for i, (record, path) in enumerate(records):
        if column is None:
            column = "text" if isinstance(record, dict) and "text" in record else None
            if column is None:
                raise InputError(f"{shown(where)}: which column holds the text? (columns: "
                                 f"{_names(record if isinstance(record, dict) else [])})",
                                 fix="set 'field' (plain text) or 'messages' (chat turns)")
        value = _row_value(record, column, path, f"row {i}")
        if value is None:
            if len(seen) < 100:
                seen.update(map(str, record))
            continue
        any_value = True
        if source.messages is not None:
            if not isinstance(value, list) or not all(isinstance(t, dict) and "role" in t and "content" in t
                                                      for t in value):
                raise InputError(f"{shown(where)} row {i}: {excerpt(column)} is not a list of {{role, content}} turns",
                                 fix="point 'messages' at a column of chat turns, or use 'field' for plain text")
            yield Row(source=label(source), row=str(i),
                      messages=tuple({"role": t["role"], "content": t["content"]} for t in value))
        elif str(value).strip():
            yield Row(source=label(source), row=str(i), text=str(value))
    if not any_value and column is not None and column not in seen:
        raise InputError(f"{shown(where)} has no column {excerpt(column)} (columns: {_names(seen)})",
                         fix="name an existing column in 'field' (plain text) or 'messages' (chat turns)")


@loader("parquet")
def parquet(source, *, max_chars: int | None = None) -> Iterator[Row]:
    """Rows of parquet files, BATCH_ROWS at a time, reading only the named column once its type is checked."""
    # lazy: pyarrow, only for parquet sources
    import pyarrow as pa
    import pyarrow.parquet as pq

    def batches():
        for path in _files(source.path, (".parquet",)):
            try:
                f = pq.ParquetFile(path)
                column = _arrow_column(f.schema_arrow, source, str(path))
                first = 0
                for batch in f.iter_batches(batch_size=BATCH_ROWS, columns=[column]):
                    for value in _capped_values(batch.column(0), f"data file {shown(path)}", column, first):
                        yield {column: value}, path
                    first += batch.num_rows
            except (pa.ArrowException, OSError, ValueError) as e:
                raise _bad_file(path, f"is not a readable parquet file ({type(e).__name__})",
                                fix="re-export the file (pyarrow.parquet.write_table or Dataset.to_parquet)") from None

    yield from _column_rows(source, source.path, batches())


def _cell_bytes(array):
    """Each row's bytes of text in an Arrow array, from its offsets (no value becomes a Python object): a string's
    length, or the sum of a row's turns' `content` lengths for a list of {role, content} structs; None for numbers."""
    import numpy as np  # lazy: with pyarrow, only for parquet and dataset sources
    import pyarrow as pa  # lazy: pyarrow, only for parquet sources
    import pyarrow.compute as pc  # lazy: pyarrow, only for parquet sources

    t = array.type
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return pc.fill_null(pc.binary_length(array), 0).to_numpy(zero_copy_only=False)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        turns = array.flatten()  # the turns of the non-null rows, in order
        rows = pc.list_parent_indices(array).to_numpy(zero_copy_only=False)
        contents = turns.field("content") if pa.types.is_struct(turns.type) else turns
        lengths = _cell_bytes(contents)
        if lengths is None:
            return None
        return np.bincount(rows, weights=lengths, minlength=len(array)).astype(np.int64)
    return None


def _capped_values(array, where: str, column: str, first_row: int) -> list:
    """An Arrow column's values as Python objects, after checking from Arrow's offsets that no row holds more than
    MAX_ROW_BYTES of text (a 64 MiB cell would otherwise become a Python string, then tokens: ~300 bytes a byte)."""
    lengths = _cell_bytes(array)
    if lengths is not None and len(lengths) and lengths.max() > MAX_ROW_BYTES:
        i = int((lengths > MAX_ROW_BYTES).argmax())
        raise InputError(f"{where}: column {excerpt(column)} row {first_row + i} holds {int(lengths[i]):,} bytes of "
                         f"text; a cell is read up to {MAX_ROW_BYTES:,} bytes",
                         fix="split long documents into several rows, or use a text source (kind: text), which "
                         "reads only as much as the recipe needs")
    return array.to_pylist()


def _names(columns: Iterable) -> str:
    """Column names for a message: escaped, sorted, the first 20."""
    return shorten(", ".join(excerpt(str(c), 40) for c in sorted(map(str, columns))[:20]), 400)


def _arrow_column(schema, source, where: str) -> str:
    """The column a source reads, checked against an Arrow schema before any row is read: a string column for
    `field`, a list of {role, content} structs for `messages`."""
    import pyarrow as pa  # lazy: pyarrow, only for parquet sources

    column = source.field or source.messages or ("text" if "text" in schema.names else None)
    if column is None:
        raise InputError(f"{shown(where)}: which column holds the text? (columns: {_names(schema.names)})",
                         fix="set 'field' (plain text) or 'messages' (chat turns)")
    if column not in schema.names:
        raise InputError(f"{shown(where)} has no column {excerpt(column)} (columns: {_names(schema.names)})",
                         fix="name an existing column in 'field' (plain text) or 'messages' (chat turns)")
    t = schema.field(column).type
    if source.messages is not None:
        turn = t.value_type if pa.types.is_list(t) or pa.types.is_large_list(t) else None
        ok = turn is not None and pa.types.is_struct(turn) and {"role", "content"} <= {f.name for f in turn}
        if not ok:
            raise InputError(f"{shown(where)}: column {excerpt(column)} is {shorten(str(t), 80)}, not a list of "
                             "{role, content} turns",
                             fix="point 'messages' at a column of chat turns, or use 'field' for plain text")
    elif not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)):
        # numbers, booleans, dates are not documents: calibrating on "17" is a wrong column, not text
        raise InputError(f"{shown(where)}: column {excerpt(column)} is {shorten(str(t), 80)}, not text",
                         fix="point 'field' at a column of strings (or cast the column to string when writing "
                         "the file)")
    return column


@loader("hf")
def hub(source, *, max_chars: int | None = None) -> Iterator[Row]:
    import datasets  # lazy: datasets (~3 s), only for Hugging Face dataset sources

    with _quiet(datasets):
        ds = _load_saved(datasets, source) if source.path is not None else _load_hub(datasets, source)
    column = _arrow_column(ds.features.arrow_schema, source, label(source))

    def batches():
        first = 0
        for table in ds.select_columns([column]).with_format("arrow").iter(batch_size=BATCH_ROWS):
            for value in _capped_values(table.column(0).combine_chunks(), shown(label(source)), column, first):
                yield {column: value}, source.path
            first += table.num_rows

    yield from _column_rows(source, label(source), batches())


def _load_saved(datasets, source):
    """A folder written by save_to_disk: its own files are checked before datasets opens it."""
    folder = Path(source.path).expanduser()
    fix = "give the folder Dataset.save_to_disk (or DatasetDict.save_to_disk) wrote"
    if not folder.is_dir():
        raise InputError(f"hf source path {shown(folder)} is not a folder", fix=fix)
    if not ((folder / "dataset_dict.json").is_file() or
            ((folder / "state.json").is_file() and (folder / "dataset_info.json").is_file())):
        raise InputError(f"hf source path {shown(folder)} is not a saved dataset (no dataset_dict.json, or no "
                         "state.json and dataset_info.json)", fix=fix)
    try:
        ds = datasets.load_from_disk(str(folder))
    except Exception as e:  # noqa: BLE001 - datasets raises many types for a damaged folder
        raise InputError(f"hf source path {shown(folder)} cannot be read as a saved dataset ({type(e).__name__})",
                         fix=fix) from None
    if isinstance(ds, datasets.DatasetDict):
        if source.split not in ds:
            raise InputError(f"the saved dataset {shown(folder)} has no split '{source.split}' (splits: "
                             f"{', '.join(ds)})", fix="set split to one of them")
        ds = ds[source.split]
    return ds


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
