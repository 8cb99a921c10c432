"""Data sources through `llmc build` on a tiny model: chat samples calibrate, the user's text evaluates, the
provenance reaches the manifest, and shared documents stop the build before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from llmc.build import build_until
from llmc.errors import InputError
from llmc.recipe.load import parse_recipe
from llmc.storage.store import Store
from llmc.result import EvalId

WORDS = "the jury said it did find that many of the voters had been registered in the county".split()


def _files(tmp_path: Path) -> dict[str, Path]:
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(12))},
        {"role": "assistant", "content": " ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(30))}]}) + "\n"
        for i in range(12)))
    notes = tmp_path / "notes"
    notes.mkdir()
    for i in range(4):
        (notes / f"{i}.txt").write_text(" ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(400)))
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}")
    return {"chat": chat, "notes": notes, "template": template}


def _recipe(model: Path, calibration: dict, corpus) -> object:
    return parse_recipe(yaml.safe_dump({
        "name": "tiny-data",
        "model": {"source": str(model)},
        "quantization": {"weights": {"format": "fp8_e4m3", "strategy": "channel"},
                         "activations": {"format": "fp8_e4m3", "strategy": "tensor"}},
        "calibration": {"samples": 6, "seq_len": 48, "seed": 0, **calibration},
        "targets": [{"runtime": "vllm", "gpu_arch": "sm90"}],
        "eval": {"corpus": corpus, "seq_len": 48, "windows": 4, "decode_tokens": 0, "throughput_repeats": 1,
                 "bootstrap_samples": 200},
    }))


def test_chat_samples_calibrate_and_user_text_evaluates(tiny_model: Path, tmp_path: Path) -> None:
    f = _files(tmp_path)
    dataset = {"kind": "jsonl", "path": str(f["chat"]), "messages": "messages", "chat_template": str(f["template"])}
    store = Store(tmp_path / "cache")
    result = build_until(_recipe(tiny_model, {"dataset": dataset, "packing": "samples"},
                                 {"kind": "text", "path": str(f["notes"])}), store, "gate")
    c = result.calibration
    assert c["packing"] == "samples" and len(c["tokens_sha256"]) == 64
    assert list(c["chat_templates"].values())[0].startswith("file:chat.jinja:")
    assert len(c["samples_provenance"]) == 6 and all(p["source"] == f"jsonl:{f['chat']}" for p in c["samples_provenance"])
    base = result.evals[EvalId("torch", "baseline")]
    assert base.protocol["corpus"]["kind"] == "text" and base.perplexity > 1
    assert result.evals[EvalId("torch", "vllm-sm90-tp1")].ppl_change is not None

    from llmc.eval.report import render_markdown

    md = render_markdown(result)
    assert f"text:{f['notes']} (whole)" in md and "chat template" in md
    # the same recipe without the template file: other tokens, so another calibrate key
    again = build_until(_recipe(tiny_model, {"dataset": {**dataset, "chat_template": "none"}, "packing": "samples"},
                                {"kind": "text", "path": str(f["notes"])}), store, "quantize")
    def calibrate_key(r) -> str:
        return next(s.key for s in r.stages if s.name == "calibrate")

    assert calibrate_key(again) != calibrate_key(result)


def test_calibrating_on_the_eval_text_stops_the_build(tiny_model: Path, tmp_path: Path) -> None:
    f = _files(tmp_path)
    notes = {"kind": "text", "path": str(f["notes"])}
    store = Store(tmp_path / "cache")
    with pytest.raises(InputError, match="4 documents appear both"):
        build_until(_recipe(tiny_model, {"dataset": notes}, notes), store, "gate")
    assert not (tmp_path / "cache" / "stages" / "quantize").exists()
    held_out = {**notes, "holdout": 2}  # the same folder split by document: allowed
    result = build_until(_recipe(tiny_model, {"dataset": held_out, "samples": 2}, held_out), store, "gate")
    assert result.evals[EvalId("torch", "baseline")].perplexity > 1
