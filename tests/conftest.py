"""Shared fixtures: tiny random Hugging Face models (with a real tokenizer) built inside the tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("LLMC_PROGRESS_JSON", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_TOKENIZER_TEXT = (
    "The jury said it did find that many of the voters had been registered. "
    "It is a truth universally acknowledged that a single man in possession of a good fortune "
    "must be in want of a wife. To be, or not to be, that is the question. "
    "In the beginning God created the heaven and the earth. 0123456789 ,.;:!?'\"()-\n"
)


def make_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer trained in milliseconds, with BOS/EOS, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_TOKENIZER_TEXT] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def make_tiny_model(
    folder: Path,
    *,
    arch: str = "llama",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    seed: int = 0,
    tie: bool = True,
) -> Path:
    """Save a random tiny causal LM + tokenizer as a Hugging Face safetensors folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = make_tokenizer()
    torch.manual_seed(seed)
    model_type = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}[arch]
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=tie,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger-than-default weights so quantization error is visible
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return Path(folder)


@pytest.fixture
def tiny_model(tmp_path: Path) -> Path:
    return make_tiny_model(tmp_path / "tiny")


@pytest.fixture(scope="session")
def tiny_model_session(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def store(tmp_path: Path):
    from llmc.storage.store import Store

    return Store(tmp_path / "cache")


@pytest.fixture
def tiny_model_factory():
    """make_tiny_model itself, for tests that need several shapes."""
    return make_tiny_model


@pytest.fixture(autouse=True)
def _progress_speaks_again():
    """`llmc --quiet` invoked in-process (click's CliRunner) leaves llmc.telemetry.progress quiet for every later test."""
    yield
    from llmc.telemetry.progress import set_quiet

    set_quiet(False)
