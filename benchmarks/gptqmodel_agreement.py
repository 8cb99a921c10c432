"""GPTQModel against llmc's torch reference on the same weights and the same Brown eval windows (docs/formats-and-runtimes.md, issue 20).

Usage: LLMC_GPTQMODEL_PYTHON=<venv>/bin/python python benchmarks/gptqmodel_agreement.py SOURCE CANONICAL GPTQ_EXPORT AWQ_EXPORT WINDOWS SEQ_LEN
  SOURCE: the unquantized model folder; CANONICAL: the quantize stage folder the two exports came from (its
  compressed-tensors export is what the torch reference scores). Prints one JSON line per engine.
"""
import json, math, os, sys, time
from pathlib import Path
from transformers import AutoTokenizer
from llmc.calibration.corpora import load_corpus
from llmc.calibration.windows import make_windows
from llmc.formats.compressed_tensors import export_compressed_tensors
from llmc.engines.gptqmodel import GptqModelEngine
from llmc.engines.torch_ref import TorchEngine
from llmc.engines.torch_stream import decide_torch_loading_of
from llmc.quant.canonical import QuantizedModel

source, canonical, gptq, awq, n, seq = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
tok = AutoTokenizer.from_pretrained(source)
ids = make_windows(tok, load_corpus("brown", "eval"), seq, n, seed=None).ids
ct = Path(os.environ.get("TMPDIR", "/tmp")) / f"llmc-ct-{Path(canonical).name}"
if not (ct / "config.json").is_file():
    export_compressed_tensors(QuantizedModel.open(Path(canonical)), ct)
ref = TorchEngine(source, streamed=decide_torch_loading_of(source, "float32").streamed).score(ids)
base_nll = ref["nll"].double()
def summary(name, s, tput=None):
    nll = s["nll"].double()
    print(json.dumps({"engine": name, "ppl_base": math.exp(base_nll.mean()), "ppl": math.exp(nll.mean()),
                      "kld": s["kl"].double().mean().item() if "kl" in s else None,
                      "top1": s["top1"].float().mean().item() if "top1" in s else None,
                      "tput": tput}), flush=True)
    return nll
t = time.time(); ours = TorchEngine(ct, streamed=decide_torch_loading_of(ct, "float32").streamed).score(ids, reference=ref); summary("torch-ref(ct)", ours)
print("torch s", time.time() - t, flush=True)
for name, folder in (("gptqmodel-gptq", gptq), ("gptqmodel-awq", awq)):
    t = time.time()
    s, tput = GptqModelEngine(Path(folder)).measure(ids, ids[:1], decode_tokens=16, repeats=2, reference=ref)
    theirs = summary(name, s, tput)
    print(name, "ppl ratio vs torch ref", math.exp(theirs.mean()) / math.exp(ours["nll"].double().mean()), "s", time.time() - t, flush=True)
