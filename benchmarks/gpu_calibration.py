"""Calibration on a GPU: llmc's GPTQ / AWQ / SmoothQuant on CUDA against llm-compressor on the same GPU
(and llmc on the host's CPU cores), side by side on one machine.

    python benchmarks/gpu_calibration.py [--shape smollm2|llama-1b] [--layers N] [--samples 64]
        [--seq-len 512] [--schemes gptq-w4a16 awq-w4a16 sq-w8a8] [--repeats 2]
        [--tokenizer DIR] [--peer-path DIR] [--cpu]

No weights travel to a lent GPU machine, so the model is synthetic: the named architecture's shape
with random weights (the wall time of these algorithms depends on shapes and token counts, not on the
values), written to disk first, plus a tokenizer folder (`--tokenizer`, SmolLM2's) because
llm-compressor saves one. Calibration tokens are seeded random ids, the same file for every tool.
Each run is a fresh child process timing the quantization call alone (llmc: quantize_model with
`device="cuda"`, layers streamed from disk; llm-compressor 0.14: oneshot with its sequential pipeline,
model in host memory, layers onloaded to the GPU). `--peer-path` is a folder holding llm-compressor
and its dependencies (prepended to PYTHONPATH). `--cpu` also times llmc on the CPU and reports how
many weight codes the CUDA run gives differently (float rounding differs by device).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from algorithms_vs_llmcompressor import PAIRS  # noqa: E402  (same scheme pairs as the CPU comparison)

SHAPES = {  # (hidden, intermediate, heads, kv heads, default layers, vocab)
    "smollm2": (576, 1536, 9, 3, 30, 49152),
    "llama-1b": (2048, 8192, 32, 8, 16, 49152),
}

LLMC_CHILD = """
import json, sys, time, torch
from pathlib import Path
from safetensors.torch import load_file
from llmc.model.source import ModelSource
from llmc.quant.spec import Scheme, TensorSpec
from llmc.quant.stream import quantize_model
folder, tokens, scheme, out, device = sys.argv[1], sys.argv[2], eval(sys.argv[3]), Path(sys.argv[4]), sys.argv[5]
ids = load_file(tokens)["input_ids"]
from transformers import AutoModelForCausalLM  # noqa: F401
import transformers.models.llama.modeling_llama  # noqa: F401  (imports are outside llm-compressor's timer too)
if device == "cuda":
    torch.zeros(1, device="cuda")  # CUDA context start-up is not calibration time (llm-compressor's is outside too)
t = time.monotonic()
quantize_model(ModelSource(Path(folder), "synthetic", "synthetic"), scheme, out, calibration=ids, device=device)
if device == "cuda":
    torch.cuda.synchronize()
wall = time.monotonic() - t
peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else 0.0
print(json.dumps({"wall_s": wall, "peak_gpu_mb": peak}))
"""


def write_model(folder: Path, shape: str, layers: int, tokenizer: Path | None) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, heads, kv, _, vocab = SHAPES[shape]
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=2048,
                         tie_word_embeddings=True, rope_theta=100000.0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    if tokenizer is not None:
        for f in tokenizer.iterdir():
            if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
                shutil.copyfile(f, folder / f.name)


def _run(cmd: list[str], env: dict | None = None) -> dict:
    r = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{cmd[:3]} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def code_mismatch(a: Path, b: Path) -> float:
    """Fraction of quantized weight codes that differ between two canonical forms."""
    import torch
    from safetensors.torch import load_file

    differ = total = 0
    for fa in sorted((a / "layers").glob("*.safetensors")):
        ta, tb = load_file(str(fa)), load_file(str(b / "layers" / fa.name))
        for k, v in ta.items():
            if k.endswith(".weight") and v.dtype in (torch.int8, torch.uint8):
                differ += int((v != tb[k]).sum())
                total += v.numel()
    return differ / max(total, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--schemes", nargs="+", default=["gptq-w4a16", "awq-w4a16", "sq-w8a8"], choices=sorted(PAIRS))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tokenizer", type=Path)
    ap.add_argument("--peer-path", type=Path)
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args()

    import torch
    from safetensors.torch import save_file

    if not torch.cuda.is_available():
        sys.exit("no CUDA GPU visible to torch: this benchmark times calibration on a GPU")
    layers = args.layers or SHAPES[args.shape][4]
    peer_env = None
    if args.peer_path:
        # only the peer's folder: llmc's own dependencies (a newer transformers) must not shadow its pins
        peer_env = {**os.environ, "PYTHONPATH": str(args.peer_path), "THREADS": str(os.cpu_count())}
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": args.shape,
                      "layers": layers, "samples": args.samples, "seq_len": args.seq_len}), flush=True)
    rows: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="llmc-gpu-calibration-") as tmp:
        model = Path(tmp) / "model"
        write_model(model, args.shape, layers, args.tokenizer)
        tokens = Path(tmp) / "tokens.safetensors"
        vocab = SHAPES[args.shape][5]
        ids = torch.randint(0, vocab, (args.samples, args.seq_len), generator=torch.Generator().manual_seed(0))
        save_file({"input_ids": ids}, str(tokens))
        for rep in range(args.repeats):
            for scheme in args.schemes:
                llmc_expr, peer_scheme = PAIRS[scheme]
                tools = ["llmc-cuda"] + (["llm-compressor-cuda"] if peer_env else []) + (["llmc-cpu"] if args.cpu else [])
                for tool in tools:
                    out = Path(tmp) / f"{tool}-{scheme}-{rep}"
                    if tool.startswith("llmc"):
                        device = tool.removeprefix("llmc-")
                        m = _run([sys.executable, "-c", LLMC_CHILD, str(model), str(tokens), llmc_expr, str(out), device])
                    else:
                        try:
                            m = _run([sys.executable, str(REPO / "benchmarks" / "_llmcompressor_child.py"),
                                      str(model), str(tokens), peer_scheme, str(out)], env=peer_env)
                        except RuntimeError as e:  # keep llmc's rows when the peer cannot run here
                            print(json.dumps({"scheme": scheme, "tool": tool, "error": str(e)[-1500:]}), flush=True)
                            continue
                    row = {"scheme": scheme, "tool": tool, "repeat": rep, **m}
                    if tool == "llmc-cpu":
                        row["codes_differing_from_cuda"] = code_mismatch(Path(tmp) / f"llmc-cuda-{scheme}-{rep}", out)
                    rows.setdefault((scheme, tool), []).append(row)
                    print(json.dumps(row), flush=True)
                    if not tool.startswith("llmc"):
                        shutil.rmtree(out, ignore_errors=True)
            for p in Path(tmp).glob(f"*-{rep}"):
                shutil.rmtree(p, ignore_errors=True)

    print("\n| scheme | tool | wall s (median [min, max]) | vs llmc-cuda |")
    print("|---|---|---|---|")
    for scheme in args.schemes:
        ref = statistics.median(r["wall_s"] for r in rows[(scheme, "llmc-cuda")])
        for (s, tool), rs in rows.items():
            if s != scheme:
                continue
            walls = [r["wall_s"] for r in rs]
            print(f"| {scheme} | {tool} | {statistics.median(walls):.1f} [{min(walls):.1f}, {max(walls):.1f}] "
                  f"| {statistics.median(walls) / ref:.2f}x |")


if __name__ == "__main__":
    main()
