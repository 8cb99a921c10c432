"""The evaluation protocol, reproduced from its description alone (docs/data.md, "The perplexity protocol"): a short
script using only transformers, gguf and the Brown files (no llmc code in its scoring) gets llmc's baseline
perplexity on the real models to 4 significant digits."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

WINDOWS, SEQ_LEN = 4, 512

# The whole protocol, written from docs/data.md: the Brown evaluation split (every 10th of the 500 files in name
# order), each file's paragraphs (split at blank lines, stripped) detagged and joined with "\n", documents joined
# with "\n\n", tokenized once without special tokens; windows of seq_len tokens, the first one the tokenizer's BOS
# when the GGUF says to add one; ppl = exp(mean NLL of positions 1..seq_len-1 over the first N windows).
INDEPENDENT = r'''
import json, math, re, sys
from pathlib import Path
import torch
from gguf import GGUFReader
from transformers import AutoModelForCausalLM, AutoTokenizer

gguf, brown, seq_len, n = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()

def detag(paragraph):
    text = " ".join(re.findall(r"(\S+)/\S+", paragraph)).replace("``", '"').replace("''", '"')
    text = re.sub(r" ([,.;:!?%)\]}]|'s\b|n't\b|'re\b|'ll\b|'ve\b|'d\b|'m\b)", r"\1", text)
    return re.sub(r"([(\[{$]) ", r"\1", text)

files = sorted(p for p in brown.iterdir() if re.fullmatch(r"c[a-r]\d\d", p.name))[9::10]
docs = ["\n".join(detag(p.strip()) for p in re.split(r"\n\s*\n", f.read_text()) if p.strip()) for f in files]
stream = tok("\n\n".join(docs), add_special_tokens=False)["input_ids"]
flag = GGUFReader(str(gguf)).fields.get("tokenizer.ggml.add_bos_token")
bos = [tok.bos_token_id] if flag is not None and bool(flag.contents()) else []
body = seq_len - len(bos)
nll = []
with torch.no_grad():
    for i in range(n):
        ids = torch.tensor([bos + stream[i * body : (i + 1) * body]])
        logits = model(input_ids=ids).logits[0, :-1].float()
        nll.append(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none").double())
print(json.dumps({"ppl": math.exp(torch.cat(nll).mean().item()), "bos": bool(bos)}))
'''


def _llmc_baseline_ppl(source: str, tmp_path: Path) -> tuple[float, bool]:
    from llmc.calibration.corpora import load_corpus
    from llmc.calibration.windows import make_windows
    from llmc.engines.torch_ref import TorchEngine
    from llmc.model.source import resolve_source
    from llmc.model.tokenizer_files import load_tokenizer
    from llmc.storage.store import Store

    folder = resolve_source(source, Store.default(), "float32").folder
    windows = make_windows(load_tokenizer(folder), load_corpus("brown", "eval"), SEQ_LEN, WINDOWS, seed=None)
    nll = TorchEngine(folder, streamed=False).token_nll(windows.ids)
    return math.exp(nll.mean().item()), windows.bos


@pytest.mark.parametrize("source", ["demo:smollm2-135m", "demo:gemma3-270m"])
def test_an_independent_script_reproduces_llmcs_baseline_perplexity(source: str, tmp_path: Path) -> None:
    from llmc.calibration.corpora import brown_dir
    from llmc.model.source import describe_source

    gguf = describe_source(source)  # locating the file: the package's own path (or its assemble())
    done = subprocess.run([sys.executable, "-c", INDEPENDENT, str(gguf), str(brown_dir()), str(SEQ_LEN), str(WINDOWS)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    independent = json.loads(done.stdout.strip().splitlines()[-1])
    ppl, bos = _llmc_baseline_ppl(source, tmp_path)
    assert independent["bos"] == bos
    assert abs(independent["ppl"] - ppl) <= 5e-5 * ppl, (independent, ppl)  # 4 significant digits
