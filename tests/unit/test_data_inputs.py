"""Bad and big data sources (llmc.data.loaders): parsed in Python a row at a time with size and depth limits, so
a malformed file is exit 7 naming the file and line (never a crash in a C parser), and a recipe needing a few
hundred tokens reads only as far as it needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import TypeAdapter

import llmc.data.tokens as tokens_module
from llmc.data.registry import read_rows, rows
from llmc.data.sources import DataSource
from llmc.data.tokens import make_tokens
from llmc.errors import InputError
from tests.conftest import make_tokenizer

SOURCE = TypeAdapter(DataSource)
REPO = Path(__file__).resolve().parents[2]


def src(value):
    return SOURCE.validate_python(value)


# A child process: a crash of a C parser kills it (a signal), where an InputError is exit 7.
_CHILD = """
import sys
from pydantic import TypeAdapter
from llmc.data.sources import DataSource
from llmc.errors import LlmcError
kind, path = sys.argv[1], sys.argv[2]
source = TypeAdapter(DataSource).validate_python({"kind": kind, "path": path} | ({} if kind == "text" else {"field": "text"}))
try:
    if sys.argv[3] == "rows":
        from llmc.data.registry import rows
        print(len(rows(source, "calibration")))
    else:
        import resource
        from llmc.data.tokens import make_tokens
        from tests.conftest import make_tokenizer
        ts = make_tokens(source, make_tokenizer(), "calibration", packing="windows", count=4, seq_len=64, seed=0)
        print(tuple(ts.input_ids.shape), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
except LlmcError as e:
    print(e)
    sys.exit(e.exit_code)
"""


def child(kind: str, path: Path, what: str = "rows") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO)) + os.pathsep + str(REPO),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", _CHILD, kind, str(path), what], env=env, capture_output=True,
                          text=True, timeout=300, cwd=REPO)


@pytest.mark.parametrize("nest", ['{"a": ', "["])
def test_deeply_nested_jsonl_row_is_exit_7_not_a_crash(tmp_path: Path, nest: str) -> None:
    """Through `datasets`, 100,000 nested objects killed the process with SIGSEGV (bb4e556; arrays: exit 1)."""
    path = tmp_path / "deep.jsonl"
    depth = 100_000
    inner = nest * depth + ("1" + "}" * depth if nest.startswith("{") else "]" * depth)
    path.write_text(json.dumps({"text": "fine"}) + "\n" + '{"text": ' + inner + "}\n")
    done = child("jsonl", path)
    assert done.returncode == 7, (done.returncode, done.stdout, done.stderr[-2000:])
    assert "deep.jsonl: line 2 nests more deeply" in done.stdout


def test_a_jsonl_row_over_the_cap_is_refused_after_reading_only_the_cap(tmp_path: Path) -> None:
    from llmc.data.loaders import MAX_ROW_BYTES

    path = tmp_path / "long.jsonl"
    with open(path, "w") as f:
        f.write('{"text": "' + "x" * (MAX_ROW_BYTES + 10) + '"}\n')
    with pytest.raises(InputError, match=f"line 1 is over {MAX_ROW_BYTES:,} bytes") as e:
        rows(src({"kind": "jsonl", "path": str(path), "field": "text"}), "calibration")
    assert "kind: text" in e.value.fix


@pytest.mark.parametrize("kind, body, needle", [
    ("csv", b"text\n\xff\xfe\x00garbage\x81\n", "line 2 is not UTF-8 text"),
    ("csv", b'text\n"unterminated ' + b"y" * 100 + b"\n", "is not CSV (unexpected end of data)"),
    ("csv", b"a,b\n1,2\n", "no column 'text'"),
    ("parquet", b"PAR1" + b"\x00garbage" * 50 + b"PAR1", "is not a readable parquet file"),
    ("parquet", b"not parquet at all", "is not a readable parquet file"),
    ("jsonl", b'{"text": "a"}\n[1, 2]\n', "row 1 is a JSON list, not an object"),
    ("jsonl", b'{"text": "a"}\n{"text": \n', "line 2 is not JSON"),
    ("jsonl", b'{"text": "caf\xe9"}\n', "line 1 is not UTF-8 text (at byte 13 of it)"),
    ("json", b'[{"text": "a"}, 3]', "row 1 is a JSON int"),
])
def test_malformed_files_are_input_errors_naming_file_and_line(tmp_path: Path, kind: str, body: bytes,
                                                               needle: str) -> None:
    path = tmp_path / f"data.{kind}"
    path.write_bytes(body)
    with pytest.raises(InputError) as e:
        rows(src({"kind": kind, "path": str(path), "field": "text"}), "calibration")
    assert needle in e.value.message and ("data." + kind) in e.value.message, e.value.message
    assert "garbage" not in str(e.value)  # the refused file's bytes are not quoted


def test_parquet_column_types_are_checked_before_reading(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "nested.parquet"
    pq.write_table(pa.table({"text": [[[1, 2]], [[3]]], "messages": ["not turns", "x"]}), path)
    with pytest.raises(InputError, match="column 'text' is list<.*not text"):
        rows(src({"kind": "parquet", "path": str(path), "field": "text"}), "calibration")
    with pytest.raises(InputError, match="not a list of {role, content} turns"):
        rows(src({"kind": "parquet", "path": str(path), "messages": "messages"}), "calibration")


@pytest.mark.parametrize("column", [[1, 2, 3], [1.5, 2.5, 3.5], [True, False, True]])
def test_a_parquet_column_that_is_not_text_is_refused_naming_it_and_its_type(tmp_path: Path, column: list) -> None:
    """issue 50 item 10: an int64 column was read as text ("1", "2", ...), though non-text columns are refused."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"ids": column, "body": ["a", "b", "c"]}), path)
    arrow_type = str(pa.array(column).type)
    with pytest.raises(InputError) as e:
        rows(src({"kind": "parquet", "path": str(path), "field": "ids"}), "calibration")
    assert e.value.exit_code == 7 and f"column 'ids' is {arrow_type}, not text" in e.value.message
    assert "column of strings" in e.value.fix
    assert [r.text for r in rows(src({"kind": "parquet", "path": str(path), "field": "body"}), "calibration")] \
        == ["a", "b", "c"]


def test_hf_path_that_is_not_a_saved_dataset(tmp_path: Path) -> None:
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "notes.txt").write_text("hello")
    with pytest.raises(InputError, match="is not a saved dataset") as e:
        rows(src({"kind": "hf", "path": str(tmp_path / "folder")}), "calibration")
    assert "save_to_disk" in e.value.fix
    (tmp_path / "folder" / "state.json").write_text("{broken")
    (tmp_path / "folder" / "dataset_info.json").write_text("{}")
    with pytest.raises(InputError, match="cannot be read as a saved dataset"):
        rows(src({"kind": "hf", "path": str(tmp_path / "folder")}), "calibration")
    with pytest.raises(InputError, match="is not a folder"):
        rows(src({"kind": "hf", "path": str(tmp_path / "folder" / "notes.txt")}), "calibration")


@pytest.mark.parametrize("kind, body", [
    ("text", "\ufeffFirst words."),
    ("jsonl", '\ufeff{"text": "First words."}\n'),
    ("csv", "\ufefftext\nFirst words.\n"),
    ("json", '\ufeff[{"text": "First words."}]'),
])
def test_byte_order_mark_is_not_text(tmp_path: Path, kind: str, body: str) -> None:
    path = tmp_path / f"bom.{kind}"
    path.write_text(body, encoding="utf-8")
    source = {"kind": kind, "path": str(path)} | ({} if kind == "text" else {"field": "text"})
    assert [r.text for r in rows(src(source), "calibration")] == ["First words."]


def test_a_large_source_is_read_only_as_far_as_the_recipe_needs(tmp_path: Path, monkeypatch) -> None:
    """Evaluation takes the first windows: reading a prefix gives exactly the windows reading the whole file
    gives. A cut source says so."""
    docs = [f"document {i}: " + " ".join(f"word{(i * 13 + j) % 97}" for j in range(200)) for i in range(60)]
    (tmp_path / "corpus").mkdir()
    for i, d in enumerate(docs):
        (tmp_path / "corpus" / f"{i:03d}.txt").write_text(d)
    source = src({"kind": "text", "path": str(tmp_path / "corpus")})
    tok = make_tokenizer()
    whole = make_tokens(source, tok, "eval", packing="windows", count=3, seq_len=64, seed=None)
    monkeypatch.setattr(tokens_module, "MIN_READ_CHARS", 4000)
    monkeypatch.setattr(tokens_module, "READ_CHARS_PER_TOKEN", 2)  # so little that a first read falls short
    part, complete = read_rows(source, "eval", 4000)
    assert not complete and sum(len(r.text) for r in part) < 6000
    cut = make_tokens(source, tok, "eval", packing="windows", count=3, seq_len=64, seed=None)
    assert cut.sha256 == whole.sha256 and len(cut.texts) < len(docs)
    calib = make_tokens(source, tok, "calibration", packing="windows", count=40, seq_len=64, seed=0)
    assert len(calib) == 40  # the first read fell short; the loader read further


@pytest.mark.slow
def test_a_gib_of_calibration_text_stays_within_a_gigabyte(tmp_path: Path) -> None:
    """1 GiB of text (a sparse file: real text, then a hole) and a recipe needing 4 x 64 tokens: the child's peak
    RSS, torch and transformers included, stays under 1 GB (bb4e556 read it whole: past 6 GB)."""
    path = tmp_path / "big.txt"
    with open(path, "w") as f:
        f.write("The jury said it did find that many of the voters had been registered. " * 20_000)
        f.truncate(1 << 30)
    done = child("text", path, "tokens")
    assert done.returncode == 0, done.stderr[-2000:]
    shape, peak_kib = done.stdout.strip().splitlines()[-1].split(") ")
    assert shape == "(4, 64" and int(peak_kib) < 1_000_000, done.stdout
