"""Data sources (llmc.data): every kind read from small files made here, chat templates, samples vs windows,
provenance hashes, the overlap check and too-little-data errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import TypeAdapter, ValidationError

from llmc.data.registry import rows
from llmc.data.sources import BrownSource, DataSource, label
from llmc.data.tokens import make_tokens
from llmc.errors import InputError
from tests.conftest import make_tokenizer

SOURCE = TypeAdapter(DataSource)
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
REPO = Path(__file__).resolve().parents[2]


def src(value):
    return SOURCE.validate_python(value)


@pytest.fixture(scope="module")
def tok():
    t = make_tokenizer()
    t.chat_template = TEMPLATE
    t.add_bos_token = True  # a Llama-style tokenizer: plain text starts with BOS (llmc.data.bos)
    return t


def _texts(n: int, words: int = 40) -> list[str]:
    return [f"document {i} " + " ".join(f"w{(i * 7 + j) % 50}" for j in range(words)) for i in range(n)]


def test_short_forms_and_brown_serializes_as_before() -> None:
    assert src("brown") == BrownSource()
    assert SOURCE.dump_python(src("brown"), mode="json") == "brown"
    hub = src("hf:acme/notes")
    assert (hub.kind, hub.dataset, hub.split) == ("hf", "acme/notes", "train")
    with pytest.raises(ValidationError, match="not a data source"):
        src("wikitext")
    with pytest.raises(ValidationError, match="exactly one of 'field'"):
        src({"kind": "jsonl", "path": "x.jsonl"})
    with pytest.raises(ValidationError, match="always split by file"):
        src({"kind": "brown", "holdout": 5})


def test_text_file_folder_glob_and_separator(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("alpha one")
    (tmp_path / "sub" / "b.txt").write_text("beta one\n===\nbeta two\n===\n\n")
    (tmp_path / "notes.md").write_text("not text")
    assert [r.text for r in rows(src({"kind": "text", "path": str(tmp_path / "a.txt")}), "calibration")] == ["alpha one"]
    folder = rows(src({"kind": "text", "path": str(tmp_path)}), "calibration")
    assert [r.row for r in folder] == ["a.txt", "sub/b.txt"]  # *.txt only, recursively, sorted
    split = rows(src({"kind": "text", "path": str(tmp_path / "**" / "*.txt"), "separator": "\n===\n"}), "eval")
    assert [r.text for r in split] == ["alpha one", "beta one", "beta two"]
    assert [r.row for r in split] == ["a.txt#0", "sub/b.txt#0", "sub/b.txt#1"]
    with pytest.raises(InputError, match="no data files"):
        rows(src({"kind": "text", "path": str(tmp_path / "missing*.txt")}), "calibration")


def test_holdout_splits_documents_between_roles(tmp_path: Path) -> None:
    for i in range(20):
        (tmp_path / f"{i:02d}.txt").write_text(f"doc {i}")
    s = src({"kind": "text", "path": str(tmp_path), "holdout": 10})
    cal, ev = rows(s, "calibration"), rows(s, "eval")
    assert [r.row for r in ev] == ["09.txt", "19.txt"]
    assert len(cal) == 18 and not {r.row for r in cal} & {r.row for r in ev}


def _write_records(tmp_path: Path, kind: str, records: list[dict]) -> Path:
    import datasets

    ds = datasets.Dataset.from_list(records)
    path = tmp_path / f"data.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif kind == "parquet":
        ds.to_parquet(str(path))
    elif kind == "csv":
        ds.to_csv(str(path), index=False)
    return path


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "csv"])
def test_tabular_text_column(kind: str, tmp_path: Path) -> None:
    records = [{"id": i, "body": t} for i, t in enumerate(_texts(3))]
    path = _write_records(tmp_path, kind, records)
    got = rows(src({"kind": kind, "path": str(path), "field": "body"}), "calibration")
    assert [r.text for r in got] == [r["body"] for r in records]
    assert [r.row for r in got] == ["0", "1", "2"] and got[0].source == f"{kind}:{path}"
    with pytest.raises(InputError, match="no column 'missing'"):
        rows(src({"kind": kind, "path": str(path), "field": "missing"}), "calibration")


def test_json_array_file(tmp_path: Path) -> None:
    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"text": "first row"}, {"text": "second row"}]))
    assert [r.text for r in rows(src({"kind": "json", "path": str(path), "field": "text"}), "eval")] == [
        "first row", "second row"]


def test_jsonl_messages_go_through_the_chat_template(tmp_path: Path, tok) -> None:
    turns = [[{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i} " * 5}]
             for i in range(4)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": t}) + "\n" for t in turns))
    s = src({"kind": "jsonl", "path": str(path), "messages": "messages"})
    ts = make_tokens(s, tok, "calibration", packing="samples", count=4, seq_len=64, seed=0)
    assert ts.texts[0] == "<|user|>question 0\n<|assistant|>" + "answer 0 " * 5 + "\n"
    assert list(ts.chat_templates.values())[0].startswith("model:")
    first = ts.attention_mask[0].sum().item()
    assert tok.decode(ts.input_ids[0, :first]) == ts.texts[0]  # the template's text, no BOS added before it
    none = make_tokens(src({"kind": "jsonl", "path": str(path), "messages": "messages", "chat_template": "none"}),
                       tok, "calibration", packing="samples", count=4, seq_len=64, seed=0)
    assert none.texts[0].startswith("user: question 0\nassistant: answer 0") and none.chat_templates == {
        f"jsonl:{path}": "none"}
    assert none.sha256 != ts.sha256
    assert none.input_ids[0, 0].item() == tok.bos_token_id  # no template writes a start: BOS, as for plain text
    template_file = tmp_path / "t.jinja"
    template_file.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}")
    custom = make_tokens(src({"kind": "jsonl", "path": str(path), "messages": "messages",
                              "chat_template": str(template_file)}), tok, "calibration", packing="samples",
                         count=4, seq_len=64, seed=0)
    assert custom.texts[0].startswith("[user] question 0 [assistant]")
    assert list(custom.chat_templates.values())[0].startswith("file:t.jinja:")


def test_plain_text_wrapped_as_user_turn(tmp_path: Path, tok) -> None:
    (tmp_path / "a.txt").write_text("hello there")
    ts = make_tokens(src({"kind": "text", "path": str(tmp_path), "wrap_as_user": True}), tok, "eval",
                     packing="samples", count=1, seq_len=32, seed=None)
    assert ts.texts == ["<|user|>hello there\n"]


def test_model_without_a_template_is_an_error_naming_the_fix(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello there")
    with pytest.raises(InputError, match="no chat template") as e:
        make_tokens(src({"kind": "text", "path": str(tmp_path), "wrap_as_user": True}), make_tokenizer(), "eval",
                    packing="samples", count=1, seq_len=32, seed=None)
    assert "chat_template" in e.value.fix


def test_save_to_disk_folder(tmp_path: Path) -> None:
    import datasets

    datasets.Dataset.from_list([{"text": t} for t in _texts(3)]).save_to_disk(str(tmp_path / "saved"))
    got = rows(src({"kind": "hf", "path": str(tmp_path / "saved")}), "calibration")
    assert [r.text for r in got] == _texts(3)


_HUB_CHILD = """
import sys
from pydantic import TypeAdapter
from llmc.data.sources import DataSource
from llmc.data.registry import rows
from llmc.errors import InputError
s = TypeAdapter(DataSource).validate_python(sys.argv[1])
try:
    print([r.text for r in rows(s, "calibration")])
except InputError as e:
    print("ERROR", e.message, "FIX", e.fix)
"""


def _hub_cache(cache: Path, records: list[dict]) -> None:
    """The layout `datasets` leaves in HF_DATASETS_CACHE after downloading the Hub dataset acme/notes."""
    from datasets.packaged_modules.json.json import Json

    data = cache.parent / "notes.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    builder = Json(data_files={"train": str(data)}, cache_dir=str(cache), dataset_name="acme___notes",
                   hash="0" * 40, config_name="default")
    builder.download_and_prepare()
    built = Path(builder.cache_dir)
    (built / "acme___notes-train.arrow").rename(built / "notes-train.arrow")
    built.parents[1].rename(cache / "acme___notes" / "default")


def test_hub_dataset_resolved_offline_from_the_cache(tmp_path: Path) -> None:
    cache = tmp_path / "hf-cache"
    _hub_cache(cache, [{"text": "cached one"}, {"text": "cached two"}])
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(cache), "PYTHONPATH": str(REPO)}

    def child(arg: str) -> str:
        return subprocess.run([sys.executable, "-c", _HUB_CHILD, arg], env=env, capture_output=True, text=True,
                              check=True, timeout=120).stdout

    assert child("hf:acme/notes").strip() == "['cached one', 'cached two']"
    missing = child("hf:acme/absent")
    assert missing.startswith("ERROR could not load the dataset 'acme/absent'") and "offline mode" in missing
    assert "HF_DATASETS_OFFLINE=1" in missing and "save_to_disk" in missing


def test_weighted_mix_draws_by_weight(tmp_path: Path, tok) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        for i, t in enumerate(_texts(12, words=60)):
            (tmp_path / name / f"{i:02d}.txt").write_text(f"{name} {t}")
    mix = src({"kind": "mix", "sources": [{"source": {"kind": "text", "path": str(tmp_path / "a")}, "weight": 3},
                                          {"source": {"kind": "text", "path": str(tmp_path / "b")}, "weight": 1}]})
    ts = make_tokens(mix, tok, "calibration", packing="samples", count=8, seq_len=32, seed=0)
    sources = [p["source"] for p in ts.provenance]
    assert sources.count(f"text:{tmp_path / 'a'}") == 6 and sources.count(f"text:{tmp_path / 'b'}") == 2
    windows = make_tokens(mix, tok, "calibration", packing="windows", count=4, seq_len=32, seed=0)
    assert [p["source"].endswith("/a") for p in windows.provenance] == [True, True, True, False]
    assert label(mix) == f"mix(text:{tmp_path / 'a'}×3, text:{tmp_path / 'b'}×1)"


@pytest.mark.heavy
def test_windows_match_the_original_protocol_and_record_rows(tok) -> None:
    from llmc.calibration.corpora import brown_documents
    from llmc.calibration.windows import make_windows

    ts = make_tokens(BrownSource(), tok, "calibration", packing="windows", count=6, seq_len=64, seed=3)
    old = make_windows(tok, brown_documents("calibration"), 64, 6, seed=3)
    assert torch.equal(ts.input_ids, old.ids) and [p["window"] for p in ts.provenance] == old.window_index
    assert ts.attention_mask is None and all(p["rows"] and p["rows"][0].startswith("c") for p in ts.provenance)
    again = make_tokens(BrownSource(), tok, "calibration", packing="windows", count=6, seq_len=64, seed=3)
    assert again.sha256 == ts.sha256
    other_seed = make_tokens(BrownSource(), tok, "calibration", packing="windows", count=6, seq_len=64, seed=4)
    assert other_seed.sha256 != ts.sha256


def test_samples_are_truncated_padded_and_masked(tmp_path: Path, tok) -> None:
    (tmp_path / "short.txt").write_text("short one")
    (tmp_path / "long.txt").write_text(" ".join(_texts(5)))
    ts = make_tokens(src({"kind": "text", "path": str(tmp_path)}), tok, "calibration", packing="samples", count=2,
                     seq_len=24, seed=0)
    lengths = ts.attention_mask.sum(dim=1).tolist()
    assert sorted(lengths)[1] == 24 and sorted(lengths)[0] < 24  # the long one truncated, the short one padded
    short = lengths.index(min(lengths))
    assert ts.input_ids[short, 0].item() == tok.bos_token_id and (ts.input_ids[short, lengths[short]:] == tok.eos_token_id).all()
    assert {p["rows"][0] for p in ts.provenance} == {"short.txt", "long.txt"}


def test_too_little_data_says_how_much_there_is(tmp_path: Path, tok) -> None:
    (tmp_path / "a.txt").write_text(_texts(1, words=30)[0])
    s = src({"kind": "text", "path": str(tmp_path)})
    with pytest.raises(InputError, match=r"asked for 50 windows of 32 tokens .* holds \d+ tokens in 1 documents: \d+ windows"):
        make_tokens(s, tok, "calibration", packing="windows", count=50, seq_len=32, seed=0)
    with pytest.raises(InputError, match="asked for 3 samples but the calibration part .* holds 1 non-empty rows"):
        make_tokens(s, tok, "calibration", packing="samples", count=3, seq_len=32, seed=0)


def test_overlap_between_calibration_and_eval_is_an_error_unless_allowed() -> None:
    from llmc.data.hygiene import check_overlap

    with pytest.raises(InputError, match="1 documents appear both") as e:
        check_overlap(["The  cat sat.\n", "other"], ["the cat\tSAT.", "third"], allowed=False)
    assert "allow_calibration_overlap" in e.value.fix
    assert check_overlap(["The cat sat."], ["the cat sat."], allowed=True) == 1
    assert check_overlap(["a b"], ["a c"], allowed=False) == 0
