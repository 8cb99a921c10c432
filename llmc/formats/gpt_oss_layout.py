"""gpt-oss's fused-expert layout as vLLM's gpt-oss loader reads it: the pieces the gpt-oss formats share (issue 45).

llmc's canonical form holds gpt-oss's experts per expert (`model.layers.L.mlp.experts.E.{gate,up,down}_proj`, the
stream splits the fused `gate_up_proj` by even / odd rows: `llmc.model.families`' gpt_oss row, `gate_up:
interleaved`). vLLM's gpt-oss loader (vllm/model_executor/models/gpt_oss.py) wants gate and up fused again, rows
interleaved (row 2i gate i, row 2i + 1 up i), in OpenAI's MXFP4 layout (llmc.formats.gpt_oss_mxfp4) or in Quark's
per-expert one (llmc.formats.gpt_oss_quark). Both are written here: one canonical file at a time (a decoder layer),
its experts re-fused by the format's own function, the other tensors as the canonical form holds them."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch

from llmc.errors import IncompatibleTargetError
from llmc.formats.base import ArtifactFormat, ExportLayout, ExportRequest, RuntimeTarget, read_json, target_key
from llmc.formats.base import quantization_config as hf_quantization_config
from llmc.formats.files import write_model_files, write_shards
from llmc.quant.canonical import QuantizedModel

FAMILY = "gpt_oss"
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
EXPERT = re.compile(r"^(?P<block>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)$")


def attention_linears(config: dict) -> list[str]:
    """gpt-oss's attention Linears (the Linears besides the routed experts and the head a scheme could quantize)."""
    return [f"model.layers.{i}.self_attn.{p}" for i in range(config.get("num_hidden_layers", 0))
            for p in ("q_proj", "k_proj", "v_proj", "o_proj")]


def interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[rows, ...] gate and up -> [2 rows, ...] with gate's row i at 2i and up's at 2i + 1 (the inverse of the
    stream's even / odd split)."""
    return torch.stack([gate, up], dim=1).reshape(2 * gate.shape[0], *gate.shape[1:]).contiguous()


def experts_by_block(tensors: dict[str, torch.Tensor],
                     refuse: Callable[[str], Exception]) -> dict[str, list[dict[str, str]]]:
    """The routed experts of one canonical file: per MoE block (`model.layers.L.mlp.experts`), per expert 0..E-1, its
    gate / up / down module names. `refuse(what)`: the error for a block that does not hold gate/up/down of every
    expert 0..E-1."""
    found: dict[str, dict[int, dict[str, str]]] = {}
    for key in tensors:
        module, _, _ = key.rpartition(".")
        m = EXPERT.match(module)
        if m:
            found.setdefault(m["block"], {}).setdefault(int(m["e"]), {})[m["proj"]] = module
    blocks = {}
    for block, by_expert in found.items():
        n = len(by_expert)
        if sorted(by_expert) != list(range(n)) or any(len(p) != len(PROJECTIONS) for p in by_expert.values()):
            raise refuse(f"{block} holds experts {sorted(by_expert)} with projections "
                         f"{sorted({k for p in by_expert.values() for k in p})}, not gate/up/down of 0..{n - 1}")
        blocks[block] = [by_expert[e] for e in range(n)]
    return blocks


def write_artifact(qm: QuantizedModel, out: Path, fuse: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
                   quantization_config: dict, serve_args: dict | None) -> list[Path]:
    """Write the safetensors shards (each canonical file through `fuse`, which re-fuses its layer's experts),
    config.json with `quantization_config`, the tokenizer files and the runtime arguments."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(qm.config)
    written = write_shards(out, (fuse(t) for t in qm.iter_files()))
    config["quantization_config"] = quantization_config
    write_model_files(out, config, qm.root, serve_args, dtype=qm.meta.get("dtype", "float32"))
    return written


def vllm_serve_args(qm: QuantizedModel, *, tensor_parallel: int, max_model_len: int | None) -> dict:
    """The arguments `vllm serve` needs for a gpt-oss artifact: vLLM reads the quant_method from config.json."""
    dtype = qm.meta.get("dtype", "float32")
    args = {"dtype": "auto" if dtype == "float32" else dtype, "tensor_parallel_size": tensor_parallel}
    if max_model_len:
        args["max_model_len"] = max_model_len
    return {"vllm": args, "command": "vllm serve <artifact> " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in args.items())}


class GptOssForVllm(ArtifactFormat):
    """What the two gpt-oss layouts vLLM loads share as formats: the runtime arguments, the write through the
    subclass's `export` function, recognizing a folder by its `quant_method`, and the GPU arch its MoE method needs
    (`min_arch`, read in `min_arch_source`; `arch_reason` says so in the refusal)."""

    layout = ExportLayout()  # streams the canonical files a layer at a time (write_shards), re-fusing each layer
    families = frozenset({FAMILY})
    moe_families = frozenset({FAMILY})
    quant_method: str
    min_arch: str
    min_arch_source: str
    arch_reason: str
    export: Callable[..., list[Path]]

    def check_arch(self, target: RuntimeTarget) -> None:
        from llmc.runtimes.base import arch_at_least  # lazy: runtimes import formats

        if target.gpu_arch == "cpu" or not arch_at_least(target.gpu_arch, self.min_arch):
            raise IncompatibleTargetError(
                f"target {target.label}: {self.arch_reason}; gpu_arch is {target.gpu_arch} ({self.min_arch_source})",
                fix=f"set gpu_arch to {self.min_arch} or newer")

    def stage_config(self, request: ExportRequest) -> dict:
        serve = vllm_serve_args(request.quantized, tensor_parallel=request.target.tensor_parallel,
                                max_model_len=request.max_model_len)
        return {"target": target_key(request.target), "serve": serve}

    def write(self, request: ExportRequest, out: Path) -> None:
        self.export(request.quantized, out, serve_args=self.stage_config(request)["serve"])

    def recognizes(self, path: Path) -> bool:
        q = hf_quantization_config(path)
        config = read_json(Path(path) / "config.json") or {}
        return bool(q) and q.get("quant_method") == self.quant_method and config.get("model_type") == FAMILY
