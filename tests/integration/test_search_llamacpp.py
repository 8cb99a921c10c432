"""The searched mix for llama.cpp in the real runtime: recipes/smollm2-search-llamacpp.yaml (small calibration) built
to its GGUF, which llama.cpp (llama-cpp-python) loads and scores on Brown eval windows against llmc's torch reference of
the same quantized weights (read from a compressed-tensors export of the same canonical form). The file holds several
ggml types at once (Q8_0, MXFP4, NVFP4, ... per tensor, as the search chose them).

llama-cpp-python is found as tests/integration/test_gguf_llamacpp.py finds it (in-process, else LLMC_LLAMA_PYTHON or
<repo>/.venv-llama); the test skips, saying so, when neither has it.

    LLMC_LLAMA_PYTHON=<venv>/bin/python pytest -m "slow and llama" tests/integration/test_search_llamacpp.py -s
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
SMALL = ["calibration.samples=4", "calibration.seq_len=128", "eval.windows=4", "eval.seq_len=256"]
GGML_TYPE = {"Q4_0": "Q4_0", "Q8_0": "Q8_0", "W4A16-MXFP4": "MXFP4", "W4A16-NVFP4": "NVFP4", "bf16": "F16"}


def _ppl(nll: np.ndarray) -> float:
    return math.exp(float(np.mean(nll)))


def test_llama_cpp_loads_and_scores_the_searched_gguf(tmp_path: Path) -> None:
    from llmc.engines.llamacpp import llama_cpp_version

    if llama_cpp_version() is None:
        pytest.skip("llama_cpp is not importable in LLMC_LLAMA_PYTHON / .venv-llama (bash scripts/setup-llama.sh; "
                    "it builds llama.cpp from source)")
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    from llmc.build import build_until
    from llmc.calibration.corpora import load_corpus
    from llmc.calibration.windows import make_windows
    from llmc.engines.llamacpp import LlamaCppEngine
    from llmc.engines.torch_ref import TorchEngine
    from llmc.errors import InputError
    from llmc.formats.compressed_tensors import export_compressed_tensors
    from llmc.quant.canonical import QuantizedModel
    from llmc.recipe.load import load_recipe
    from llmc.storage.store import Store

    recipe = load_recipe(REPO / "recipes" / "smollm2-search-llamacpp.yaml", SMALL)
    try:
        result = build_until(recipe, Store.default(), "export")
    except InputError as e:  # the demo model or the corpus not installed
        pytest.skip(str(e))
    chosen = result.search[""]
    [artifact] = result.artifacts.values()
    gguf = Path(artifact.dir)
    # the file types each Linear as the search chose (NVFP4 falls back to F16 on no SmolLM2 width: all are /64)
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(gguf / "model.gguf")).tensors}
    chosen_types = {GGML_TYPE[c] for c in chosen["units"].values()}
    assert len(chosen_types) >= 2 and chosen_types <= set(types.values())
    layer0 = chosen["units"]["layers.0.attention"]
    assert types["blk.0.attn_q.weight"] == GGML_TYPE[layer0]

    qm = QuantizedModel.open(result.quantized_dirs[""])
    export_compressed_tensors(qm, tmp_path / "ct")
    tok = AutoTokenizer.from_pretrained(result.source.folder)
    windows = make_windows(tok, load_corpus("brown", "eval"), SEQ_LEN, WINDOWS, seed=None).ids
    reference = TorchEngine(tmp_path / "ct", streamed=False).score(windows)
    scores, tput = LlamaCppEngine(gguf).measure(windows, windows[:1], decode_tokens=8, repeats=1,
                                                 reference=reference)
    ppl_torch, ppl_llama = _ppl(reference["nll"].numpy()), _ppl(scores["nll"].numpy())
    delta_pct = 100 * (ppl_llama / ppl_torch - 1)
    agree, kld = float(scores["top1"].mean()), float(scores["kl"].mean())
    print(f"\nsearched GGUF ({chosen['effective_bits']:.2f} effective bits; {sorted(chosen_types)}), {WINDOWS} Brown "
          f"eval windows x {SEQ_LEN}: ppl torch {ppl_torch:.3f}, llama.cpp {ppl_llama:.3f} ({delta_pct:+.2f}%), "
          f"top-1 agreement {agree:.3f}, KLD {kld:.4f}, llama.cpp {tput['engine_version']}")
    # llama.cpp runs the same weights as the torch reference; what remains is its Q8_0 activations on the CPU
    assert abs(delta_pct) <= 2.0
    assert agree > 0.9
    assert kld < 0.05
