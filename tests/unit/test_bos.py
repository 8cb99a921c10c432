"""BOS per model: windows and samples start with a BOS exactly where the model's tokenizer adds one to text, a GGUF's
tokenizer.ggml.add_bos_token is followed when it is unpacked, and the decision is recorded with its reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmc.calibration.corpora import Document
from llmc.calibration.windows import make_windows
from llmc.data.bos import bos_decision, follow_gguf_flag
from llmc.data.sources import BrownSource, TextSource
from llmc.data.stages import calibration_config
from llmc.data.tokens import make_tokens
from tests.conftest import _TOKENIZER_TEXT, make_tokenizer

TEXT = (_TOKENIZER_TEXT * 8).strip()


def _bpe(specials: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_TOKENIZER_TEXT] * 4, trainer)
    return tok


def qwen_like():
    """Declares <|endoftext|> as its BOS but never adds it (add_bos_token false), as Qwen's GGUF-built tokenizers do."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]),
                                   bos_token="<|endoftext|>", eos_token="<|im_end|>", add_bos_token=False)


def adds_by_flag():
    tok = make_tokenizer()
    tok.add_bos_token = True
    return tok


def adds_by_post_processor():
    """A tokenizers-library template that adds <s>, with no add_bos_token anywhere (Llama-2-style tokenizer.json)."""
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    tok = _bpe(["<unk>", "<s>", "</s>"])
    tok.post_processor = TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def no_bos_token():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=_bpe(["<unk>", "</s>"]), eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize(("make", "used", "reason"), [
    (qwen_like, False, "declares BOS '<|endoftext|>' (id 0) but does not add it to text (add_bos_token is false)"),
    (make_tokenizer, False, "declares BOS '<s>' (id 1) but does not add it"),
    (adds_by_flag, True, "adds its BOS '<s>' (id 1)"),
    (adds_by_post_processor, True, "adds its BOS '<s>' (id 1)"),
    (no_bos_token, False, "has no BOS token"),
])
def test_decision_follows_what_the_tokenizer_does(make, used, reason):
    tok = make()
    d = bos_decision(tok)
    assert d.used is used and reason in d.reason
    assert (tok("hello")["input_ids"][:1] == [tok.bos_token_id]) is used  # the decision is the tokenizer's behaviour
    assert d.record() == {"used": used, "token_id": tok.bos_token_id if used else None, "reason": d.reason}


def _source(tmp_path: Path):
    (tmp_path / "t.txt").write_text("\n\n".join([TEXT] * 6))
    return TextSource(kind="text", path=str(tmp_path / "t.txt"))


@pytest.mark.parametrize("make", [qwen_like, make_tokenizer])
def test_windows_of_a_tokenizer_that_adds_no_bos_are_the_plain_stream(make, tmp_path):
    tok = make()
    source = _source(tmp_path)
    ts = make_tokens(source, tok, "eval", packing="windows", count=3, seq_len=32, seed=None)
    stream = tok("\n\n".join(ts.texts), add_special_tokens=False)["input_ids"]
    assert torch.equal(ts.input_ids, torch.tensor(stream[: 3 * 32]).view(3, 32))  # every position is text
    assert not ts.bos and not ts.bos_decision.used
    assert tok.bos_token_id not in ts.input_ids[:, 0].tolist()
    docs = [Document(id=str(i), text=t) for i, t in enumerate(ts.texts)]
    assert torch.equal(make_windows(tok, docs, 32, 3, seed=None).ids, ts.input_ids)  # the same protocol


@pytest.mark.parametrize("make", [adds_by_flag, adds_by_post_processor])
def test_windows_of_a_tokenizer_that_adds_a_bos_start_with_it(make, tmp_path):
    tok = make()
    ts = make_tokens(_source(tmp_path), tok, "eval", packing="windows", count=3, seq_len=32, seed=None)
    stream = tok("\n\n".join(ts.texts), add_special_tokens=False)["input_ids"]
    assert ts.input_ids[:, 0].tolist() == [tok.bos_token_id] * 3
    assert torch.equal(ts.input_ids[:, 1:], torch.tensor(stream[: 3 * 31]).view(3, 31))
    docs = [Document(id=str(i), text=t) for i, t in enumerate(ts.texts)]
    assert torch.equal(make_windows(tok, docs, 32, 3, seed=None).ids, ts.input_ids)


@pytest.mark.parametrize(("make", "first_is_bos"), [(qwen_like, False), (adds_by_flag, True)])
def test_samples_get_a_bos_only_from_a_tokenizer_that_adds_one(make, first_is_bos, tmp_path):
    tok = make()
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"text": s}) for s in TEXT.split(". ")[:8]))
    from llmc.data.sources import RecordsSource

    ts = make_tokens(RecordsSource(kind="jsonl", path=str(path), field="text"), tok, "calibration",
                     packing="samples", count=2, seq_len=16, seed=0)
    assert (ts.input_ids[:, 0] == tok.bos_token_id).all().item() is first_is_bos


def test_brown_calibration_key_is_unchanged_where_the_windows_are(monkeypatch):
    """Brown windows keep their pre-rule stage key (corpus hash + config) for tokenizers that add a BOS, since their
    ids are unchanged; a tokenizer whose declared BOS is no longer prepended gets `bos: false` in the key."""
    from llmc.data.tokens import TokenSet
    from llmc.recipe.schema import CalibrationSection

    calib = CalibrationSection()
    assert calib.dataset == BrownSource()

    def key(tok):
        d = bos_decision(tok)
        ts = TokenSet(torch.zeros((1, 4), dtype=torch.int64), None, [], texts=["a"], row_ids=["ca01"], bos=d.used,
                      bos_decision=d)
        return calibration_config(calib, ts)

    adds = key(adds_by_flag())
    assert "bos" not in adds  # what llmc wrote before the rule: cached calibrations stay valid
    assert key(qwen_like()) == {**adds, "bos": False}
    assert key(no_bos_token()) == adds  # never had a BOS: unchanged


@pytest.mark.parametrize(("flag", "make", "after"), [(False, adds_by_flag, False), (True, qwen_like, True),
                                                     (False, qwen_like, False), (None, adds_by_flag, True)])
def test_a_tokenizer_built_from_a_gguf_follows_its_add_bos_flag(flag, make, after):
    tok = make()
    before = bos_decision(tok).used
    note = follow_gguf_flag(tok, flag)
    assert bos_decision(tok).used is after
    assert (note is not None) == (before != after)


def test_gguf_declaring_a_bos_it_does_not_add_unpacks_to_windows_without_it(tiny_model, tmp_path, store):
    """End to end through llmc's GGUF source path: a GGUF with tokenizer.ggml.bos_token_id set and
    tokenizer.ggml.add_bos_token false (the Qwen case) unpacks to a tokenizer that adds none, so no window starts
    with it; the same model with add_bos_token true gets a BOS on every window."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    from llmc.formats.gguf import export_gguf
    from llmc.model.source import ModelSource, resolve_source
    from llmc.quant.canonical import QuantizedModel
    from llmc.quant.spec import Scheme, TensorSpec
    from llmc.quant.stream import quantize_model

    for adds in (False, True):
        model = tiny_model
        if adds:
            tok = AutoTokenizer.from_pretrained(tiny_model)
            tok.add_bos_token = True
            tok.save_pretrained(tiny_model)
        q = tmp_path / f"q-{adds}"
        quantize_model(ModelSource(model, "t", str(model)), Scheme(TensorSpec("int8", "channel")), q, None)
        gguf = export_gguf(QuantizedModel.open(q), tmp_path / f"gguf-{adds}").path
        fields = GGUFReader(gguf).fields
        assert fields["tokenizer.ggml.bos_token_id"].contents() == 1
        assert fields["tokenizer.ggml.add_bos_token"].contents() is adds
        src = resolve_source(str(gguf), store)
        d = bos_decision(AutoTokenizer.from_pretrained(src.folder))
        assert d.used is adds and d.declared_id == 1
        ts = make_tokens(_source(tmp_path), AutoTokenizer.from_pretrained(src.folder), "eval", packing="windows",
                         count=2, seq_len=16, seed=None)
        assert (ts.input_ids[:, 0] == 1).all().item() is adds
