"""DeepSeek-V3 at full width on this CPU (issue 46): a synthetic checkpoint with DeepSeek-V3's exact tensor shapes
(recipes/configs/DeepSeek-V3/config.json: hidden 7168, 128 heads, MLA ranks 1536/512, 256 routed experts of 2048 + 1
shared, vocab 129,280) but 1 dense + 1 MoE layer, stored FP8 block-wise as the original ships (every decoder-layer
Linear weight but the router an F8_E4M3 `weight` with a float32 `weight_scale_inv` per 128x128 block; norms, router,
embeddings and head bf16), quantized with recipes/deepseek-r1-nvfp4.yaml (experts NVFP4; the plan's decision streams
the MoE layer expert by expert, llmc.quant.expert_stream) by benchmarks/_moe_quantize_child.py: the quantize
stage as the build runs it (written when `llmc quantize` still refused this machine for the export row's memory:
it checks only the stages it runs since).

    nice -n 10 python benchmarks/deepseek_full_width.py --work /tmp/i46-ds-full-width

Prints one JSON line: the plan's quantize row for this checkpoint (peak host RAM, disk, time, the decision) and what
the stage measured (peak RSS = VmHWM and peak RssAnon sampled every 0.5 s, its seconds, per layer and per expert, the
canonical output's size on disk and the work folder's peak while experts were spilled, the load average). The child
is stopped if the (shared) disk falls under --min-free-gb. The checkpoint and output are removed afterwards unless
--keep. Random codes: every byte but E4M3's two NaN codes, one 1 MiB block rotated per chunk (memcpy speed).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _moe_full_width import Filler, ShardWriter, main, parser, start_checkpoint  # noqa: E402
from full_width import ROOT  # noqa: E402

BLOCK = 128
SCALE_INV = 5e-5  # a code of 448 decodes to 0.022: weights of a trained model's order
RECIPE = ROOT / "recipes" / "deepseek-r1-nvfp4.yaml"


def fp8_linear(name: str, shape: tuple[int, ...]) -> bool:
    """The tensors DeepSeek-V3's checkpoint stores in FP8: the decoder layers' Linear weights but the router's."""
    return ".layers." in name and name.endswith(".weight") and len(shape) == 2 and not name.endswith("mlp.gate.weight")


def write_checkpoint(out: Path, layers: int, dense: int, tokenizer_from: Path, experts: int | None = None) -> dict:
    from llmc.planning.shapes import from_config

    config = json.loads((ROOT / "recipes" / "configs" / "DeepSeek-V3" / "config.json").read_text())
    config.update(num_hidden_layers=layers, first_k_dense_replace=dense)
    if experts is not None:  # fewer routed experts, every width kept (the expert-by-expert path's cost is per expert)
        config.update(n_routed_experts=experts)
    start_checkpoint(out, config, tokenizer_from)
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    shapes = from_config(plain).shapes
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (1 << 20,), generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # E4M3's NaNs -> 1.0
    base = (torch.randn(1 << 20, generator=gen) * 0.02).to(torch.bfloat16)
    fill = Filler({torch.uint8: codes, torch.bfloat16: base})
    w = ShardWriter(out)
    for name, shape in shapes.items():
        if fp8_linear(name, shape):
            w.add(name, fill(torch.empty(shape, dtype=torch.uint8)).view(torch.float8_e4m3fn))
            grid = (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))
            w.add(f"{name}_scale_inv", torch.full(grid, SCALE_INV, dtype=torch.float32))
        elif len(shape) == 1:
            w.add(name, torch.ones(shape, dtype=torch.float32 if "e_score_correction_bias" in name else torch.bfloat16))
        else:
            w.add(name, fill(torch.empty(shape, dtype=torch.bfloat16)))
    return w.close()


if __name__ == "__main__":
    ap = parser(__doc__)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dense", type=int, default=1, help="first_k_dense_replace")
    ap.add_argument("--experts", type=int, default=None,
                    help="routed experts per MoE layer (default DeepSeek-V3's 256; a multiple of its 8 groups)")
    args = ap.parse_args()
    main(args, lambda ckpt, tok: write_checkpoint(ckpt, args.layers, args.dense, tok, args.experts),
         ["--recipe", str(RECIPE)],
         {"model": "deepseek-v3", "layers": args.layers, "dense": args.dense, "routed_experts": args.experts or 256})
