"""How close gpt-oss's FP8 artifact in AMD Quark's layout (llmc.formats.gpt_oss_quark), decoded by the test's own
reader and run by transformers' GptOss forward, comes to llmc's torch engine on the same canonical form, and how much
the quantization moves the logits (issue 45): the numbers behind docs/models.md's "vLLM with FP8 experts, in AMD
Quark's layout". Tiny random gpt-oss (tests/unit/families.py), both layouts the format takes that the tests decode.

    PYTHONPATH=$PWD nice -n 19 python benchmarks/gpt_oss_quark_decode.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch


def main() -> None:
    from transformers import AutoModelForCausalLM

    from llmc.engines.torch_ref import TorchEngine
    from llmc.formats.compressed_tensors import export_compressed_tensors
    from llmc.formats.gpt_oss_quark import export_gpt_oss_quark
    from tests.unit.families import make_tiny
    from tests.unit.test_families import _ids
    from tests.unit.test_gpt_oss_quark import DYNAMIC, STATIC, _decode, _quantized

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src = make_tiny("gpt_oss", root / "model")
        ids = _ids(2, 2)
        for label, quantization in (("tensor-static", STATIC), ("channel-token-dynamic", DYNAMIC)):
            qm = _quantized(src, quantization, root / label / "q")
            export_gpt_oss_quark(qm, root / label / "quark")
            export_compressed_tensors(qm, root / label / "ct")
            with torch.no_grad():
                plain = _decode(root / label / "quark", src)(input_ids=ids).logits
                llmc = TorchEngine(root / label / "ct", streamed=False).model(input_ids=ids, use_cache=False).logits
                base = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(input_ids=ids).logits
            print(f"{label}: max|transformers(decoded) - llmc torch| {(plain - llmc).abs().max().item():.2e}, "
                  f"max|logit| {llmc.abs().max().item():.3f}, effect max|quantized - float| "
                  f"{(plain - base).abs().max().item():.3f}")


if __name__ == "__main__":
    main()
