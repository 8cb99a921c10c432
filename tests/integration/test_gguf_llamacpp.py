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

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.llama, pytest.mark.integration]

SEQ_LEN = 128
WINDOWS = 8

# Runs inside whichever Python has llama_cpp: reads {"gguf", "windows", "threads"} JSON on stdin, writes
# per-window per-token NLL (tokens 1..n-1) and top-1 predictions as JSON on stdout.
_SCORER = r"""
import json, sys
import numpy as np
from llama_cpp import Llama

req = json.load(sys.stdin)
windows = req["windows"]
n = len(windows[0])
llm = Llama(model_path=req["gguf"], n_ctx=n, n_batch=n, n_ubatch=n, logits_all=True,
            n_threads=req["threads"], verbose=False)
nll, top1 = [], []
for ids in windows:
    llm.reset()
    llm.eval(ids)
    logits = np.asarray(llm.scores[: n - 1], dtype=np.float64)
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[:, 0]
    nll.append((lse - logits[np.arange(n - 1), ids[1:]]).tolist())
    top1.append(logits.argmax(-1).tolist())
json.dump({"nll": nll, "top1": top1}, sys.stdout)
"""


def _llama_python() -> list[str] | None:
    if importlib.util.find_spec("llama_cpp") is not None:
        return [sys.executable]
    other = Path(os.environ.get("LLMC_LLAMA_PYTHON", REPO / ".venv-llama" / "bin" / "python"))
    if other.is_file():
        probe = subprocess.run([str(other), "-c", "import llama_cpp"], capture_output=True, check=False)
        if probe.returncode == 0:
            return [str(other)]
    return None


def score_in_llama_cpp(gguf: Path, windows: torch.Tensor, threads: int = 2) -> dict[str, np.ndarray]:
    python = _llama_python()
    assert python is not None
    req = json.dumps({"gguf": str(gguf), "windows": windows.tolist(), "threads": threads})
    done = subprocess.run([*python, "-c", _SCORER], input=req, capture_output=True, text=True, timeout=1800, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    return {"nll": np.asarray(out["nll"]), "top1": np.asarray(out["top1"])}


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    if _llama_python() is None:
        pytest.skip("llama_cpp is not importable here nor in LLMC_LLAMA_PYTHON / .venv-llama "
                    "(pip install llama-cpp-python==0.3.36 into a separate venv; it builds llama.cpp from source)")
    from transformers import AutoTokenizer

    from llmc.calibration.corpora import load_corpus
    from llmc.calibration.windows import make_windows
    from llmc.errors import InputError
    from llmc.model.source import resolve_source
    from llmc.store import Store

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


@pytest.mark.parametrize(
    ("scheme_name", "tolerance_pct"),
    [("w8a16", 2.0), ("w4a16-g64", 3.0)],
)
def test_llama_cpp_perplexity_matches_torch_reference(smollm2, scheme_name: str, tolerance_pct: float) -> None:
    from llmc.compiler.compressed_tensors import export_compressed_tensors
    from llmc.compiler.gguf import export_gguf
    from llmc.engines.torch_ref import TorchEngine
    from llmc.quant.canonical import QuantizedModel
    from llmc.quant.spec import Scheme, TensorSpec
    from llmc.quant.stream import quantize_model

    source, windows, root = smollm2
    spec = {"w8a16": TensorSpec("int8", "channel"), "w4a16-g64": TensorSpec("int4", "group", group_size=64)}
    qdir = root / f"q-{scheme_name}"
    quantize_model(source, Scheme(spec[scheme_name]), qdir, calibration=None)
    qm = QuantizedModel.open(qdir)
    res = export_gguf(qm, root / f"gguf-{scheme_name}")
    export_compressed_tensors(qm, root / f"ct-{scheme_name}")

    engine = TorchEngine(root / f"ct-{scheme_name}")
    torch_nll = engine.token_nll(windows).numpy()
    llama = score_in_llama_cpp(res.path, windows)
    ppl_torch, ppl_llama = _ppl(torch_nll), _ppl(llama["nll"])
    delta_pct = 100 * (ppl_llama / ppl_torch - 1)
    # top-1 agreement between the two engines on the same quantized weights
    with torch.no_grad():
        ref_top1 = torch.cat([engine.model(input_ids=b, use_cache=False).logits[:, :-1].argmax(-1)
                              for b in windows.split(4)]).numpy()
    agree = float((ref_top1 == llama["top1"]).mean())
    print(f"\n{scheme_name} -> {res.plan.weight_type} ({res.plan.method}), {WINDOWS} Brown eval windows x {SEQ_LEN}: "
          f"ppl torch {ppl_torch:.3f}, llama.cpp {ppl_llama:.3f} ({delta_pct:+.2f}%), top-1 agreement {agree:.3f}, "
          f"added weight error {res.weight_error['relative_rms']:.2e}")
    assert abs(delta_pct) < tolerance_pct
    assert agree > 0.9
