"""A canonical quantized form -> GGUF -> transformers' GGUF loader: does the file read back into the canonical
model (tokenizer ids, logits, NLL on 256 tokens of Brown text)? Used for Gemma-3-270M (docs/models.md, model
families) where llama.cpp is not built.

    PYTHONPATH=. python benchmarks/gguf_transformers_check.py QUANTIZED_FOLDER SOURCE_FOLDER [OUT]
"""
import sys, time, torch
from pathlib import Path
from llmc.formats.gguf import export_gguf
from llmc.quant.canonical import QuantizedModel
from transformers import AutoModelForCausalLM, AutoTokenizer
q = Path(sys.argv[1]); src = Path(sys.argv[2]); out = Path(sys.argv[3] if len(sys.argv) > 3 else "gguf-check")
qm = QuantizedModel.open(q)
t = time.time(); r = export_gguf(qm, out); print("export s", round(time.time() - t, 1), r.summary()["type_plan"])
from llmc.calibration.corpora import load_corpus
text = " ".join(d.text for d in load_corpus("brown", "eval")[:3])
hf_tok = AutoTokenizer.from_pretrained(src)
ids = hf_tok(text, return_tensors="pt").input_ids[:, :256]
g_tok = AutoTokenizer.from_pretrained(out, gguf_file="model.gguf")
g_ids = g_tok(text, return_tensors="pt").input_ids[:, :256]
print("tokenizer ids equal:", torch.equal(ids, g_ids), ids[0, :8].tolist(), g_ids[0, :8].tolist())
ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
tensors = {k: v for f in qm.iter_files() for k, v in f.items()}
own = ref.state_dict()
state = {k: v for k, v in tensors.items() if k in own}
for m in qm.quantized_modules:
    state[f"{m}.weight"] = qm.dequantized_weight(tensors, m)
ref.load_state_dict(state, strict=False)
loaded = AutoModelForCausalLM.from_pretrained(out, gguf_file="model.gguf", dtype=torch.float32).eval()
with torch.no_grad():
    a = ref(input_ids=ids).logits; b = loaded(input_ids=ids).logits
nll = lambda l: torch.nn.functional.cross_entropy(l[0, :-1], ids[0, 1:]).item()
print("max abs logit diff", (a - b).abs().max().item(), "logit range", a.abs().max().item())
print("mean NLL canonical", nll(a), "gguf via transformers", nll(b), "top1 agree", (a.argmax(-1) == b.argmax(-1)).float().mean().item())
