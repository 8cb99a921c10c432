"""The GGUF artifact in the real runtime: SmolLM2-135M quantized by llmc, exported to GGUF, loaded by
llama.cpp (llama-cpp-python) and scored on Brown eval windows against llmc's torch reference of the same
quantized weights.

llama-cpp-python builds llama.cpp from source (8-40 min here) and is kept out of the project venv: it is
used in-process when importable, else from the venv named by LLMC_LLAMA_PYTHON (default:
<repo>/.venv-llama/bin/python) through a subprocess; the test skips, saying so, when neither has it.

    bash scripts/setup-llama.sh
    pytest -m "slow and llama" tests/integration/test_gguf_llamacpp.py -s
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.llama, pytest.mark.integration]

SEQ_LEN = 128
WINDOWS = 8

def _llama_available() -> bool:
    from llmc.engines.llamacpp import llama_cpp_version

    return llama_cpp_version() is not None


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    if not _llama_available():
        pytest.skip("llama_cpp is not importable in LLMC_LLAMA_PYTHON / .venv-llama (bash scripts/setup-llama.sh; "
                    "it builds llama.cpp from source)")
    from transformers import AutoTokenizer

    from llmc.calibration.corpora import load_corpus
    from llmc.calibration.windows import make_windows
    from llmc.errors import InputError
    from llmc.model.source import resolve_source
    from llmc.storage.store import Store

    try:
        source = resolve_source("demo:smollm2-135m", Store.default())
        docs = load_corpus("brown", "eval")
    except InputError as e:
        pytest.skip(str(e))
    tok = AutoTokenizer.from_pretrained(source.folder)
    windows = make_windows(tok, docs, SEQ_LEN, WINDOWS, seed=None).ids
    return source, windows, tmp_path_factory.mktemp("smollm2-gguf")


def _ppl(nll: np.ndarray) -> float:
    return math.exp(float(np.mean(nll)))


def _score_both(smollm2, name: str, weights):
    """`weights` (a TensorSpec) quantized by llmc, exported as GGUF and compressed-tensors from the same canonical
    form; (torch reference scores, llama.cpp scores against them, llama.cpp throughput, the GGUF export)."""
    from llmc.engines.llamacpp import LlamaCppEngine
    from llmc.engines.torch_ref import TorchEngine
    from llmc.formats.compressed_tensors import export_compressed_tensors
    from llmc.formats.gguf import export_gguf
    from llmc.quant.canonical import QuantizedModel
    from llmc.quant.spec import Scheme
    from llmc.quant.stream import quantize_model

    source, windows, root = smollm2
    qdir = root / f"q-{name}"
    quantize_model(source, Scheme(weights), qdir, None)
    qm = QuantizedModel.open(qdir)
    res = export_gguf(qm, root / f"gguf-{name}")
    export_compressed_tensors(qm, root / f"ct-{name}")
    # the torch reference on the same quantized weights is the reference distribution
    reference = TorchEngine(root / f"ct-{name}", streamed=False).score(windows)
    scores, tput = LlamaCppEngine(res.path.parent).measure(windows, windows[:1], decode_tokens=8, repeats=1,
                                                           reference=reference)
    return reference, scores, tput, res


@pytest.mark.parametrize(
    ("scheme_name", "tolerance_pct"),
    [("w8a16", 2.0), ("w4a16-g64", 3.0)],
)
def test_llama_cpp_perplexity_matches_torch_reference(smollm2, scheme_name: str, tolerance_pct: float) -> None:
    from llmc.quant.spec import TensorSpec

    spec = {"w8a16": TensorSpec("int8", "channel"), "w4a16-g64": TensorSpec("int4", "group", group_size=64)}
    reference, scores, tput, res = _score_both(smollm2, scheme_name, spec[scheme_name])
    ppl_torch, ppl_llama = _ppl(reference["nll"].numpy()), _ppl(scores["nll"].numpy())
    delta_pct = 100 * (ppl_llama / ppl_torch - 1)
    agree, kld = float(scores["top1"].mean()), float(scores["kl"].mean())
    print(f"\n{scheme_name} -> {res.plan.weight_type} ({res.plan.method}), {WINDOWS} Brown eval windows x {SEQ_LEN}: "
          f"ppl torch {ppl_torch:.3f}, llama.cpp {ppl_llama:.3f} ({delta_pct:+.2f}%), top-1 agreement {agree:.3f}, "
          f"KLD {kld:.4f}, added weight error {res.weight_error['relative_rms']:.2e}, "
          f"llama.cpp decode {tput['decode_tokens_per_s']['median']:.1f} tok/s")
    assert abs(delta_pct) < tolerance_pct
    assert agree > 0.9
    assert kld < 0.05


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_llama_cpp_runs_llmc_fp4_gguf_as_the_torch_reference(smollm2, fmt: str) -> None:
    """llama.cpp's own FP4 kernels on llmc's MXFP4 / NVFP4 blocks (and NVFP4's `.scale`): perplexity within 1% of
    llmc's torch reference on the same weights (issue 34). What remains between them is llama.cpp's CPU arithmetic,
    which quantizes each FP4 matmul's activations to Q8_0."""
    from llmc.quant.spec import TensorSpec

    weights = {"mxfp4": TensorSpec("mxfp4", "group", group_size=32),
               "nvfp4": TensorSpec("nvfp4", "group", group_size=16)}[fmt]
    reference, scores, tput, res = _score_both(smollm2, fmt, weights)
    types = res.summary()["tensor_types"]
    assert res.plan.weight_type == fmt.upper() and types[fmt.upper()] == 7 * 30  # every q/k/v/o/gate/up/down
    assert types.get("F32", 0) == 61 + (210 if fmt == "nvfp4" else 0)  # norms (+ NVFP4's `.scale` per weight)
    ppl_torch, ppl_llama = _ppl(reference["nll"].numpy()), _ppl(scores["nll"].numpy())
    delta_pct = 100 * (ppl_llama / ppl_torch - 1)
    agree, kld = float(scores["top1"].mean()), float(scores["kl"].mean())
    print(f"\n{fmt} GGUF, {WINDOWS} Brown eval windows x {SEQ_LEN}: ppl torch {ppl_torch:.3f}, llama.cpp "
          f"{ppl_llama:.3f} ({delta_pct:+.2f}%), top-1 agreement {agree:.3f}, KLD {kld:.4f} "
          f"({'exact' if 'kl_topk_bound' in scores else 'top-k bound'}), llama.cpp {tput['engine_version']}")
    assert abs(delta_pct) <= 1.0
    assert agree > 0.9
    assert kld < 0.05
