"""llmc's NVFP4 / MXFP4 / MXFP8 weights against llm-compressor's on the same weights: codes, block scales, global
scales, stored bytes, config fields, and each tool's weight reconstruction error.

    bash scripts/setup-peers.sh          # llm-compressor 0.14.0.1 in .venv-llmcompressor (torch pinned)
    PYTHONPATH=$PWD python benchmarks/fp4_parity.py demo:smollm2-135m tiny > benchmarks/results/fp4_parity.jsonl

For each model (a `llmc` source spec, or `tiny`: a random 2-layer Llama, hidden 128, with an all-zero block and a
block 10^6 below the rest planted in layer 0's k_proj) and each scheme, llm-compressor's data-free `oneshot`
(QuantizationModifier, the scheme's weight-only preset, every Linear but lm_head) runs in its own venv as a child
process (benchmarks/_fp4_parity_peer.py) and saves a compressed checkpoint; llmc quantizes the same float32 weights
here, with round to nearest, and writes its tensors with `compressed_tensors_tensors`. NVFP4 is compared twice: with
llmc's per-tensor global scale (`quantize_blocks`' default) and with the global scale shared across the siblings
runtimes fuse (`nvfp4_global_scales`: q/k/v, gate/up), which llm-compressor does. Both tools' weights are decoded
by the formats' definition (`dequantize_blocks`; compressed-tensors decodes the same bytes to the same values, see
tests/unit/test_microscaling_export.py). Each tool's error is sum((decoded - w)^2) / sum(w^2) over all the Linears;
`rel_mse_llmc_search` is llmc's block-scale search (llmc.quant.scale_search, plain MSE) on the same weights, on the
last variant of each format. One JSON line per (model, scheme, llmc variant).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from llmc.formats.microscaling_export import (
    COMPRESSED_TENSORS_FORMATS,
    compressed_tensors_scheme,
    compressed_tensors_tensors,
)
from llmc.quant.microscaling import (
    MICROSCALING_FORMATS,
    BlockQuantized,
    dequantize_blocks,
    nvfp4_global_scales,
    quantize_blocks,
    unpack_e2m1,
)
from llmc.quant.scale_search import search_block_scales

REPO = Path(__file__).resolve().parents[1]
PEER_PYTHON = REPO / ".venv-llmcompressor" / "bin" / "python"
SCHEMES = {"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16", "mxfp8": "MXFP8A16"}


def tiny_model(folder: Path) -> Path:
    """A random 2-layer Llama (float32) with two planted NVFP4 edge blocks in layer 0's k_proj."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
        k = model.model.layers[0].self_attn.k_proj.weight
        k[0, :32] = 0.0  # all-zero blocks
        k[1, 32:64] *= 1e-6  # blocks whose NVFP4 scale rounds below E4M3's smallest subnormal
    model.save_pretrained(folder)
    return folder


def model_folder(spec: str, work: Path) -> Path:
    if spec == "tiny":
        return tiny_model(work / "tiny")
    from llmc.model.source import resolve_source
    from llmc.storage.store import Store

    return Path(resolve_source(spec, Store.default()).folder)


def run_peer(folder: Path, scheme: str, out: Path) -> dict:
    proc = subprocess.run([str(PEER_PYTHON), str(REPO / "benchmarks" / "_fp4_parity_peer.py"), str(folder), scheme,
                           str(out)], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"llm-compressor child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def config_differences(theirs: dict, name: str) -> dict:
    """Fields of the peer's quantization_config that differ from the one llmc writes for `name` (the preset it
    names, as tests/unit/test_microscaling_export.py writes a checkpoint), version aside."""
    from compressed_tensors.quantization import QuantizationConfig

    fmt = COMPRESSED_TENSORS_FORMATS[name][0]
    ours = QuantizationConfig(config_groups={"group_0": compressed_tensors_scheme(name, ["Linear"])}, format=fmt,
                              quantization_status="compressed", ignore=["lm_head"]).model_dump(mode="json")
    ours["quant_method"] = "compressed-tensors"

    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            if isinstance(v, dict) and v:
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    # compressed-tensors 0.20 (llmc's) leaves unset fields out of its dump where 0.19 writes null or {}: the same.
    a, b = flat(ours), flat(theirs)
    unset = (None, {}, "<unset>")
    return {k: [a.get(k, "<unset>"), b.get(k, "<unset>")] for k in sorted(set(a) | set(b))
            if k != "version" and a.get(k, "<unset>") != b.get(k, "<unset>")
            and not (a.get(k, "<unset>") in unset and b.get(k, "<unset>") in unset)}


def compare(name: str, weights: dict[str, torch.Tensor], peer: dict[str, torch.Tensor], shared: bool,
            search: bool) -> dict:
    fmt = MICROSCALING_FORMATS[name]
    scales = nvfp4_global_scales(weights) if shared and name == "nvfp4" else {}
    n = {k: 0 for k in ("elements", "codes_equal", "blocks", "scales_equal", "codes_equal_where_scale_equal",
                        "elements_where_scale_equal", "tensors", "tensors_identical_bytes", "global_equal",
                        "peer_scale_eps_blocks")}
    sq = {"weight": 0.0, "llmc": 0.0, "peer": 0.0, "search": 0.0}
    global_rel = 0.0
    for module, w in weights.items():
        ours = quantize_blocks(w, fmt, global_scale=scales.get(module))
        stored = compressed_tensors_tensors(ours)
        theirs = {k: peer[f"{module}.{k}"] for k in stored}
        codes = "weight_packed" if fmt.element == "e2m1" else "weight"
        their_codes = unpack_e2m1(theirs[codes]) if fmt.element == "e2m1" else theirs[codes]
        their_q = BlockQuantized(codes=their_codes, scale=theirs["weight_scale"],
                                 global_scale=theirs.get("weight_global_scale"), format=fmt)
        same_code = (ours.codes.view(torch.uint8) == their_codes.view(torch.uint8))
        same_scale = ours.scale.view(torch.uint8) == theirs["weight_scale"].view(torch.uint8)
        where = same_scale.repeat_interleave(fmt.block_size, -1)
        n["elements"] += w.numel()
        n["codes_equal"] += int(same_code.sum())
        n["blocks"] += same_scale.numel()
        n["scales_equal"] += int(same_scale.sum())
        n["elements_where_scale_equal"] += int(where.sum())
        n["codes_equal_where_scale_equal"] += int(same_code[where].sum())
        n["tensors"] += 1
        n["tensors_identical_bytes"] += all(torch.equal(stored[k].view(torch.uint8), theirs[k].view(torch.uint8))
                                           for k in stored)
        if name == "nvfp4":
            n["global_equal"] += torch.equal(stored["weight_global_scale"], theirs["weight_global_scale"])
            global_rel = max(global_rel, abs(ours.global_scale.item() / their_q.global_scale.item() - 1))
            n["peer_scale_eps_blocks"] += int(((theirs["weight_scale"].float() == 0.125) & ~same_scale).sum())
        sq["weight"] += float(w.double().pow(2).sum())
        sq["llmc"] += float((dequantize_blocks(ours).double() - w.double()).pow(2).sum())
        sq["peer"] += float((dequantize_blocks(their_q).double() - w.double()).pow(2).sum())
        if search:
            best = search_block_scales(w, fmt, global_scale=scales.get(module))
            sq["search"] += float((dequantize_blocks(best).double() - w.double()).pow(2).sum())
    row = {"codes_equal_pct": 100 * n["codes_equal"] / n["elements"],
           "scales_equal_pct": 100 * n["scales_equal"] / n["blocks"],
           "codes_equal_where_scale_equal_pct": 100 * n["codes_equal_where_scale_equal"]
           / max(n["elements_where_scale_equal"], 1),
           "tensors_identical_bytes": f'{n["tensors_identical_bytes"]}/{n["tensors"]}',
           "rel_mse_llmc": sq["llmc"] / sq["weight"], "rel_mse_peer": sq["peer"] / sq["weight"]}
    if search:
        row["rel_mse_llmc_search"] = sq["search"] / sq["weight"]
    if name == "nvfp4":
        row.update(global_scales_equal=f'{n["global_equal"]}/{n["tensors"]}', global_max_rel_diff=global_rel,
                   peer_eps_scale_blocks=n["peer_scale_eps_blocks"])
    return row


def main(specs: list[str]) -> None:
    if not PEER_PYTHON.exists():
        sys.exit(f"no llm-compressor venv at {PEER_PYTHON}; run: bash scripts/setup-peers.sh")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for spec in specs:
            folder = model_folder(spec, work)
            state = load_file(folder / "model.safetensors")
            weights = {k.removesuffix(".weight"): v.float() for k, v in state.items()
                       if k.endswith("_proj.weight")}  # every Linear llm-compressor quantizes (lm_head is tied)
            for name, scheme in SCHEMES.items():
                out = work / f"{spec.replace(':', '_')}-{name}"
                versions = run_peer(folder, scheme, out)
                peer = load_file(out / "model.safetensors")
                config = json.loads((out / "config.json").read_text())["quantization_config"]
                variants = [False, True] if name == "nvfp4" else [False]
                for shared in variants:
                    row = {"model": spec, "format": name, "peer_scheme": scheme,
                           "llmc_global_scale": ("shared across fused siblings" if shared else "per tensor")
                           if name == "nvfp4" else None,
                           **compare(name, weights, peer, shared, search=shared or name != "nvfp4"),
                           "config_fields_differing": config_differences(config, name), **versions}
                    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["demo:smollm2-135m", "tiny"])
