"""The ONNX Runtime artifact in the real runtime: SmolLM2-135M quantized by llmc (W4A16 g64), exported
through onnxruntime-genai's builder, loaded by onnxruntime and scored on Brown eval windows against
llmc's torch reference of the same quantized weights (the compressed-tensors export).

    pytest -m "slow and integration" tests/integration/test_onnx_runtime.py -s
"""

from __future__ import annotations

import math

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration]

SEQ_LEN = 512
WINDOWS = 8


@pytest.fixture(scope="module")
def smollm2_w4(tmp_path_factory):
    from transformers import AutoTokenizer

    from llmc.calibration.corpora import load_corpus
    from llmc.calibration.windows import make_windows
    from llmc.formats.compressed_tensors import export_compressed_tensors
    from llmc.engines.torch_ref import TorchEngine
    from llmc.errors import InputError
    from llmc.model.source import resolve_source
    from llmc.quant.canonical import QuantizedModel
    from llmc.quant.spec import Scheme, TensorSpec
    from llmc.quant.stream import quantize_model
    from llmc.storage.store import Store

    try:
        source = resolve_source("demo:smollm2-135m", Store.default())
        docs = load_corpus("brown", "eval")
    except InputError as e:
        pytest.skip(str(e))
    root = tmp_path_factory.mktemp("smollm2-onnx")
    tok = AutoTokenizer.from_pretrained(source.folder)
    windows = make_windows(tok, docs, SEQ_LEN, WINDOWS, seed=None).ids
    quantize_model(source, Scheme(TensorSpec("int4", "group", group_size=64)), root / "q", None)
    qm = QuantizedModel.open(root / "q")
    export_compressed_tensors(qm, root / "ct")
    reference = TorchEngine(root / "ct", streamed=False).score(windows)
    return qm, windows, reference, root


@pytest.mark.parametrize(("accuracy_level", "tolerance_pct", "max_kld"), [(1, 0.1, 1e-4), (4, 1.0, 0.01)])
def test_onnxruntime_perplexity_matches_torch_reference(smollm2_w4, accuracy_level: int, tolerance_pct: float,
                                                        max_kld: float) -> None:
    from llmc.formats.onnx_genai import export_onnx
    from llmc.engines.onnxrt import OnnxRuntimeEngine

    qm, windows, reference, root = smollm2_w4
    out = root / f"onnx-acc{accuracy_level}"
    summary = export_onnx(qm, out, accuracy_level=accuracy_level)
    scores, tput = OnnxRuntimeEngine(out).measure(windows, windows[:1], decode_tokens=16, repeats=1, reference=reference)
    ppl_torch = math.exp(reference["nll"].mean().item())
    ppl_ort = math.exp(scores["nll"].mean().item())
    delta_pct = 100 * (ppl_ort / ppl_torch - 1)
    kld, agree = scores["kl"].mean().item(), scores["top1"].mean().item()
    print(f"\naccuracy_level {accuracy_level}, {WINDOWS} Brown eval windows x {SEQ_LEN}: ppl torch {ppl_torch:.3f}, "
          f"onnxruntime {ppl_ort:.3f} ({delta_pct:+.3f}%), KLD {kld:.2e}, top-1 agreement {agree:.4f}, "
          f"fp16 scale error {summary['max_relative_weight_error_fp16_scales']:.1e}, "
          f"prefill {tput['prefill_tokens_per_s']['median']:.0f} tok/s, decode {tput['decode_tokens_per_s']['median']:.1f} tok/s")
    assert abs(delta_pct) < tolerance_pct
    assert kld < max_kld
    assert agree > 0.9
