"""gpt-oss-120b at full width on this CPU (issue 46): a synthetic checkpoint with gpt-oss-120b's exact tensor shapes
(recipes/configs/gpt-oss-120b/config.json, checked against transformers' GptOssConfig() defaults: hidden 2880, 64
query heads of 64, 8 key/value heads, sinks, 128 experts of intermediate 2880, 4 per token, vocab 201,088) but N
decoder layers, stored as gpt-oss ships (`quant_method: mxfp4`: each layer's fused experts as MXFP4
`gate_up_proj_blocks` / `_scales` and `down_proj_blocks` / `_scales`, U8 [experts, rows, blocks, 16] and
[experts, rows, blocks]; attention, sinks, routers, expert biases, norms, embeddings and head bf16), quantized with
benchmarks/recipes/gpt-oss-120b-nvfp4.yaml (experts NVFP4 W4A4 by the exact cast from MXFP4, the rest bf16) by
benchmarks/_moe_quantize_child.py with vLLM's gpt-oss refusal lifted in that process (no runtime reads per-expert
NVFP4 gpt-oss experts; the quantize stage is what is measured).

    PYTHONPATH=. nice -n 10 python benchmarks/gptoss_full_width.py --work /tmp/i46-gptoss-fw --layers 1

`--recipe` quantizes with another recipe instead, e.g. recipes/gpt-oss-120b-mxfp4-vllm.yaml (the experts' MXFP4 codes
passed through for vLLM; issue 44: its plan against its stream).

Prints one JSON line (benchmarks/_moe_full_width.py): the plan's quantize row for this checkpoint (made on this
machine just before), what the stage measured (VmHWM and peak RssAnon sampled every 0.5 s, seconds per layer, the
canonical output on disk, the load average) and measured / planned - 1. Random codes: every byte (two E2M1 codes);
E8M0 exponents 112..125 (2^-15 .. 2^-2, gpt-oss's range: benchmarks/mxfp4_cast.py), so every block casts exactly.
The checkpoint and output are removed afterwards unless --keep.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _moe_full_width import Filler, ShardWriter, main, parser, start_checkpoint  # noqa: E402
from full_width import ROOT  # noqa: E402

RECIPE = ROOT / "benchmarks" / "recipes" / "gpt-oss-120b-nvfp4.yaml"
MXFP4_BLOCK = 32  # elements per E8M0 exponent; 16 bytes of two E2M1 codes each
EXPONENTS = (112, 125)  # E8M0 exponents drawn from (both included)
# the widths that make gpt-oss-120b, as transformers' GptOssConfig() defaults them (they are 120b's)
WIDTHS = ("hidden_size", "intermediate_size", "num_attention_heads", "head_dim", "num_key_value_heads",
          "num_local_experts", "num_experts_per_tok", "vocab_size", "sliding_window", "swiglu_limit")
FUSED = ("experts.gate_up_proj", "experts.down_proj")


def checked_config(layers: int, experts: int | None, vocab: int | None = None) -> tuple[dict, dict]:
    """recipes/configs/gpt-oss-120b/config.json with `layers` decoder layers (and `experts`, and a `vocab` that
    shrinks the embeddings and head outside the layers only), and the widths it shares with transformers'
    GptOssConfig() (a mismatch stops the run)."""
    from transformers import GptOssConfig

    config = json.loads((ROOT / "recipes" / "configs" / "gpt-oss-120b" / "config.json").read_text())
    defaults = GptOssConfig()
    widths = {k: config[k] for k in WIDTHS}
    wrong = {k: (v, getattr(defaults, k)) for k, v in widths.items() if getattr(defaults, k) != v}
    if wrong:
        raise SystemExit(f"recipes/configs/gpt-oss-120b/config.json differs from GptOssConfig(): {wrong}")
    config["num_hidden_layers"] = layers
    if experts is not None:  # fewer experts, every width kept
        config["num_local_experts"] = experts
    if vocab is not None:  # a smaller vocabulary: the decoder layers keep every width
        config["vocab_size"] = widths["vocab_size"] = vocab
    return config, widths


def hub_shapes(config: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of the checkpoint as gpt-oss ships it: transformers' model on the meta device (names and shapes),
    its fused experts ([E, in, out]) as MXFP4 blocks [E, out, in / 32, 16] and exponents [E, out, in / 32]."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    plain = GptOssConfig(**{k: v for k, v in config.items() if k != "quantization_config"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(plain)
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith(FUSED):
            experts, inputs, outputs = t.shape
            out[name + "_blocks"] = ((experts, outputs, inputs // MXFP4_BLOCK, MXFP4_BLOCK // 2), torch.uint8)
            out[name + "_scales"] = ((experts, outputs, inputs // MXFP4_BLOCK), torch.uint8)
        else:
            out[name] = (tuple(t.shape), torch.bfloat16)
    return out


def write_checkpoint(out: Path, config: dict, tokenizer_from: Path) -> dict:
    start_checkpoint(out, config, tokenizer_from)
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (1 << 20,), generator=gen, dtype=torch.uint8)
    exponents = torch.randint(EXPONENTS[0], EXPONENTS[1] + 1, (1 << 20,), generator=gen, dtype=torch.uint8)
    base = (torch.randn(1 << 20, generator=gen) * 0.02).to(torch.bfloat16)
    fill_codes, fill_exponents = Filler({torch.uint8: codes}), Filler({torch.uint8: exponents})
    fill = Filler({torch.bfloat16: base})
    w = ShardWriter(out)
    for name, (shape, dtype) in hub_shapes(config).items():
        if name.endswith("_blocks"):
            w.add(name, fill_codes(torch.empty(shape, dtype=dtype)))
        elif name.endswith("_scales"):
            w.add(name, fill_exponents(torch.empty(shape, dtype=dtype)))
        elif name.endswith(("norm.weight", "layernorm.weight")):
            w.add(name, torch.ones(shape, dtype=dtype))
        else:  # Linear weights and biases, routers, sinks, embeddings, head
            w.add(name, fill(torch.empty(shape, dtype=dtype)))
    return w.close()


if __name__ == "__main__":
    ap = parser(__doc__)
    ap.add_argument("--layers", type=int, default=1, help="decoder layers (36 in gpt-oss-120b)")
    ap.add_argument("--experts", type=int, default=None, help="experts per layer (default gpt-oss-120b's 128)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (default gpt-oss-120b's 201,088; a "
                    "smaller one shrinks only the embeddings and head: the layers keep their widths, on less disk)")
    ap.add_argument("--recipe", type=Path, default=RECIPE, help="the recipe whose quantize stage runs (default: "
                    "benchmarks/recipes/gpt-oss-120b-nvfp4.yaml)")
    args = ap.parse_args()
    config, widths = checked_config(args.layers, args.experts, args.vocab)
    main(args, lambda ckpt, tok: write_checkpoint(ckpt, config, tok),
         # vLLM's refusal of per-expert NVFP4 gpt-oss lifted for the default recipe only (the pass-through plans as is)
         ["--recipe", str(args.recipe), *(["--lift-refusal", "vllm:gpt_oss"] if args.recipe.resolve() == RECIPE.resolve() else [])],
         {"model": "gpt-oss-120b", "recipe": str(args.recipe.resolve().relative_to(ROOT)), "layers": args.layers,
          "experts": config["num_local_experts"], "widths": widths})
