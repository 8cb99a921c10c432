"""One set of input caps (llmc.inputs.caps) for every reader: a parquet or saved-dataset cell over the row cap, a
chat template that loops, builds or writes without bound, a binary file given as text, and a row longer than the
read budget are each refused (or cut) before they cost gigabytes. On 8a48c9f a 64 MiB parquet cell peaked at
6.25 GB, a nested-loop template at 6.15 GB and 4 MB of random bytes as text at 1.6 GB (issue 50, item 5)."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest
from pydantic import TypeAdapter

import llmc.data.loaders as loaders
from llmc.data.chat import TemplateLimit, bounded_render, render
from llmc.data.registry import Row, read_rows, rows
from llmc.data.sources import DataSource
from llmc.errors import InputError
from llmc.inputs import caps
from llmc.model import tokenizer_files
from tests.conftest import make_tokenizer

SOURCE = TypeAdapter(DataSource)
TURNS = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]


def src(value):
    return SOURCE.validate_python(value)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def test_every_reader_takes_its_caps_from_one_module() -> None:
    assert loaders.MAX_ROW_BYTES is caps.MAX_ROW_BYTES and loaders.MAX_JSON_FILE_BYTES is caps.MAX_JSON_FILE_BYTES
    assert tokenizer_files.JSON_CAPS is caps.TOKENIZER_JSON_CAPS
    assert tokenizer_files.OTHER_CAPS is caps.TOKENIZER_OTHER_CAPS
    assert caps.TOKENIZER_OTHER_CAPS["chat_template.jinja"] == caps.MAX_TEMPLATE_BYTES


# --------------------------------------------------------------------------- parquet and saved-dataset cells


def _small_cap(monkeypatch, cap: int = 1000) -> int:
    monkeypatch.setattr(loaders, "MAX_ROW_BYTES", cap)
    return cap


def test_a_parquet_cell_over_the_cap_is_refused_naming_file_column_and_row(tmp_path: Path, monkeypatch) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    cap = _small_cap(monkeypatch)
    path = tmp_path / "docs.parquet"
    texts = [f"doc {i}" for i in range(40)]
    texts[37] = "x" * (cap + 1)  # in the third batch of 16 rows
    pq.write_table(pa.table({"body": texts}), path)
    read = loaders.parquet(src({"kind": "parquet", "path": str(path), "field": "body"}))
    assert [r.text for r in itertools.islice(read, 32)] == texts[:32]  # two batches of 16 rows, streamed
    with pytest.raises(InputError) as e:
        next(read)  # the third batch is refused from its offsets: no row of it becomes a Python string
    assert "docs.parquet: column 'body' row 37 holds 1,001 bytes of text; a cell is read up to 1,000 bytes" in str(e.value)
    assert "kind: text" in e.value.fix and e.value.exit_code == 7


def test_a_parquet_chat_row_counts_all_its_turns(tmp_path: Path, monkeypatch) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    _small_cap(monkeypatch)
    path = tmp_path / "chat.parquet"
    short = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    long = [{"role": "user", "content": "q" * 600}, {"role": "assistant", "content": "a" * 600}]  # 1,200 together
    pq.write_table(pa.table({"messages": [short, None, long]}), path)
    with pytest.raises(InputError, match="column 'messages' row 2 holds 1,200 bytes"):
        rows(src({"kind": "parquet", "path": str(path), "messages": "messages"}), "calibration")
    pq.write_table(pa.table({"messages": [short, None, short]}), path)
    assert len(rows(src({"kind": "parquet", "path": str(path), "messages": "messages"}), "calibration")) == 2


def test_a_saved_dataset_cell_over_the_cap_is_refused(tmp_path: Path, monkeypatch) -> None:
    import datasets

    _small_cap(monkeypatch)
    datasets.Dataset.from_dict({"text": ["fine", "y" * 1500]}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(InputError, match="column 'text' row 1 holds 1,500 bytes of text"):
        rows(src({"kind": "hf", "path": str(tmp_path / "saved")}), "calibration")


# --------------------------------------------------------------------------- rows longer than the read budget


def test_a_row_longer_than_the_read_budget_is_cut_there(tmp_path: Path) -> None:
    path = tmp_path / "long.jsonl"
    path.write_text('{"text": "short"}\n{"text": "' + "z" * 50_000 + '"}\n{"text": "never read"}\n')
    part, complete = read_rows(src({"kind": "jsonl", "path": str(path), "field": "text"}), "calibration", 1000)
    assert [len(r.text) for r in part] == [5, 996] and not complete  # budget + 1, as a text file is cut


# --------------------------------------------------------------------------- binary files given as text


def test_random_bytes_as_a_text_source_are_refused(tmp_path: Path) -> None:
    import random

    path = tmp_path / "blob.txt"
    path.write_bytes(random.Random(0).randbytes(200_000))
    with pytest.raises(InputError) as e:
        rows(src({"kind": "text", "path": str(path)}), "calibration")
    assert "blob.txt: is not UTF-8 text" in str(e.value) and "iconv" in e.value.fix


def test_utf16_text_is_refused_and_a_stray_bad_byte_is_not(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("Plain words, many of them. " * 200, encoding="utf-16")
    with pytest.raises(InputError, match="a.txt: is not UTF-8 text"):
        rows(src({"kind": "text", "path": str(tmp_path / "a.txt")}), "calibration")
    (tmp_path / "b.txt").write_bytes(b"Plain words, caf\xe9 and more. " * 5)
    assert len(rows(src({"kind": "text", "path": str(tmp_path / "b.txt")}), "calibration")) == 1


# --------------------------------------------------------------------------- chat templates


def test_the_bounded_render_is_transformers_render(tok) -> None:
    template = ("{{ bos_token }}{% for m in messages %}{% if loop.first %}[{{ loop.length }}]{% endif %}<|{{ m['role'] }}|>"
                "{{ m['content'] | trim | tojson }}{{ eos_token }}\n{% endfor %}{% generation %}x{% endgeneration %}")
    expected = tok.apply_chat_template(TURNS, chat_template=template, tokenize=False)
    assert bounded_render(template, TURNS, dict(tok.special_tokens_map)) == expected
    assert expected.startswith('<s>[2]<|user|>"hello"</s>')


HOSTILE = {
    "nested loops, no output": "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "nested loops writing": "{% for i in range(99999) %}{% for j in range(99999) %}{{ messages }}{% endfor %}{% endfor %}",
    "loops over the turns": "{% for a in messages * 999 %}{% for b in messages * 999 %}{{ a }}{% endfor %}{% endfor %}",
    "a long string": "{{ 'x' * 1000000000 }}",
    "a long list": "{{ (['abcd'] * 100000000) | join }}",
    "doubling with ~": "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "doubling with +": "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "a wide filter": "{{ 'x' | center(1000000000) }}",
    "a wide % format": "{{ '%0999999999d' % 1 }}",
    "a wide str.format": "{{ '{:>999999999}'.format(1) }}",
    "a huge power": "{{ 10 ** (10 ** 10) }}",
    "exponential macro recursion": "{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(40) }}",
}


@pytest.mark.parametrize("template", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_template_is_stopped_quickly(template: str) -> None:
    start = time.process_time()  # CPU time: the shared test machine's load does not count
    with pytest.raises(TemplateLimit):
        bounded_render(template, TURNS, {})
    assert time.process_time() - start < 10  # ~2 s at most; hours or gigabytes on 8a48c9f


@pytest.mark.parametrize("where", ["file", "model"])
def test_a_looping_template_is_an_input_error_naming_it(tmp_path: Path, tok, where: str) -> None:
    looping = HOSTILE["nested loops writing"]
    path = tmp_path / "loops.jinja"
    path.write_text(looping)
    source = src({"kind": "jsonl", "path": "unused.jsonl", "messages": "messages",
                  "chat_template": str(path) if where == "file" else "model"})
    if where == "model":
        tok = make_tokenizer()
        tok.chat_template = looping  # as chat_template.jinja or tokenizer_config.json would give it
    start = time.process_time()
    with pytest.raises(InputError) as e:
        render(Row(source="jsonl:unused.jsonl", row="3", messages=tuple(TURNS)), source, tok)
    assert time.process_time() - start < 10
    named = "loops.jinja" if where == "file" else "the model's chat template"
    assert named in str(e.value) and "took over 250,000 steps" in str(e.value) and "row 3" in str(e.value)
    assert e.value.exit_code == 7


def test_a_template_file_over_the_cap_is_refused(tmp_path: Path, tok, monkeypatch) -> None:
    import llmc.data.chat as chat

    monkeypatch.setattr(chat, "MAX_TEMPLATE_BYTES", 100)
    path = tmp_path / "big.jinja"
    path.write_text("{{ messages }}" + " " * 200)
    source = src({"kind": "jsonl", "path": "x.jsonl", "messages": "messages", "chat_template": str(path)})
    with pytest.raises(InputError, match="chat template file .*big.jinja is 214 bytes; at most 100 are read"):
        render(Row(source="x", row="0", messages=tuple(TURNS)), source, tok)
