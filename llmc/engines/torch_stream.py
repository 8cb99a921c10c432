"""Streamed evaluation for the torch reference: one decoder layer resident, every window through layer i before
layer i+1 loads.

The whole-model path (`TorchEngine` loading through transformers) holds every weight at once: a 70B in bf16 is
~140 GB. Here the model is built on the meta device, only what lies outside the decoder layers (embeddings, final
norm, output head) is loaded, and each decoder layer is read from the folder's safetensors, decompressed where
it is quantized (compressed-tensors' own decompressors, as transformers' `dequantize=True` load uses), run on the
hidden states of every window, and dropped. Activation and KV-cache quantization are emulated by the same hooks
and attention function as the whole-model path (`TorchEngine._apply_runtime_quantization`, installed once on the
skeleton: hooks live on modules, which materializing a layer keeps). Logits come from the model's own forward with
the decoder layers replaced by a replay of the final hidden states, so the final norm, the output head and any
post-processing the model applies are exactly the whole-model path's; NLL agrees with it (tests/unit/test_streamed_eval.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from llmc.errors import EngineFailed, InputError
from llmc.telemetry.progress import steps
from llmc.model.skeleton import (build_skeleton, capture_layer_inputs, decoder_layers, layer_output, materialize,
                                 release)
from llmc.model.families import MoeLayout
from llmc.quant.moe import layout_of, per_expert_tensors, unfuse_experts
from llmc.formats.microscaling_export import COMPRESSED_TENSORS_FORMATS, nvfp4_from_compressed_tensors
from llmc.quant.numerics import BLOCK_ELEMENTS
from llmc.model.checkpoint import check_safetensors_header, folder_source_format, safetensors_files, CheckpointReader

COMPRESSED_TENSORS = "compressed-tensors"  # the SourceFormat name of compressed-tensors folders
from llmc.inputs.patterns import PatternRefused, check_patterns, regex_matches
from llmc.planning.machine import memory_available
from llmc.quant.canonical import module_matches

STRATEGY_VARIABLE = "LLMC_TORCH_EVAL"  # auto | streamed | whole: which torch evaluation path runs
WHOLE_MODEL_SHARE = 0.5  # auto streams when the dense model would take more than this share of available memory


def choose_streamed(dense_bytes: int, available: int | None, setting: str | None = None) -> bool:
    """Whether the torch reference evaluates one layer at a time: forced by `setting` (or $LLMC_TORCH_EVAL), else
    when the dense weights would take more than WHOLE_MODEL_SHARE of the available memory (unknown: whole)."""
    setting = (setting or os.environ.get(STRATEGY_VARIABLE) or "auto").strip().lower()
    if setting in ("streamed", "whole"):
        return setting == "streamed"
    return available is not None and dense_bytes > WHOLE_MODEL_SHARE * available


@dataclass(frozen=True)
class TorchLoading:
    """How the torch reference loads a model, decided once (`decide_torch_loading`) and obeyed by `TorchEngine`: one
    decoder layer resident at a time (streamed) or the whole dense model."""

    streamed: bool
    why: str = ""

    def as_dict(self) -> dict:
        return {"streamed": self.streamed}


def decide_torch_loading(dense_bytes: float, available: int | None) -> TorchLoading:
    """The torch reference's loading for a model whose dense weights take `dense_bytes`, on a machine with `available`
    bytes of memory (`choose_streamed`; LLMC_TORCH_EVAL forces either). The plan's evaluation and tasks stages decide
    through it; so does every caller that opens the engine without a plan (`decide_torch_loading_of`)."""
    streamed = choose_streamed(int(dense_bytes), available)
    return TorchLoading(streamed, f"the dense model takes {dense_bytes / 1e9:.1f} GB against "
                                  f"{(available or 0) / 1e9:.1f} GB available")


def decide_torch_loading_of(folder: Path, dtype: str) -> TorchLoading:
    """`decide_torch_loading` for a model folder on this machine, for callers without a plan (`llmc eval`, a build's
    ranks that follow rank 0's scoring): its dense bytes in `dtype` from the safetensors headers only."""
    return decide_torch_loading(dense_bytes(Path(folder), getattr(torch, dtype)), memory_available())


def dense_bytes(folder: Path, dtype: torch.dtype) -> int:
    """Bytes the folder's weights take once decompressed to `dtype` (headers only): quantized codes count as one
    element each (int4 packs eight into an int32, MXFP4 `_blocks` two into a byte), scales and other side tensors as
    they are stored."""
    elem = torch.empty(0, dtype=dtype).element_size()
    total = 0
    for f in safetensors_files(folder):
        for name, info in check_safetensors_header(f).items():
            if name == "__metadata__":
                continue
            n = 1
            for d in info["shape"]:
                n *= d
            if name.endswith((".weight_packed", ".qweight")):  # GPTQ / AWQ: counted as 4-bit, the most a word
                n *= 8 if info["dtype"] == "I32" else 2  # int4 in int32 words, E2M1 two a byte
            if name.endswith(".weight") and info["dtype"] == "U8":  # ModelOpt NVFP4: E2M1 two a byte
                n *= 2
            mxfp4 = name.endswith("_blocks") and info["dtype"] == "U8"  # an MXFP4 source's experts, two a byte
            n *= 2 if mxfp4 else 1
            if mxfp4 or name.endswith((".weight_packed", ".weight", ".qweight")):
                total += n * elem
            else:
                total += info["data_offsets"][1] - info["data_offsets"][0]
    return total


class LayerDecoder:
    """Dense tensors of a compressed-tensors folder, module by module (plain folders pass through), quantized
    weights decompressed to `dtype`."""

    def __init__(self, folder: Path, qcfg: dict | None, dtype: torch.dtype | None = None,
                 layout: MoeLayout | None = None) -> None:
        # a quantized original: decoded; a compressed-tensors folder (an artifact) decompressed below
        self.reader = CheckpointReader(folder, dtype or torch.float32, as_stored=(COMPRESSED_TENSORS,))
        self.qcfg = qcfg
        self.dtype = dtype
        self.groups = self._groups(qcfg) if qcfg else []
        self.layout = layout  # MoE: the family's layout (a source checkpoint of fused experts is split per expert)

    @staticmethod
    def _groups(qcfg: dict) -> list[tuple[tuple[str, ...], object, str]]:
        # lazy: compressed-tensors (~3 s), only for quantized artifacts
        from compressed_tensors.quantization import QuantizationScheme

        out = []
        for group in qcfg.get("config_groups", {}).values():
            scheme = QuantizationScheme.model_validate({k: v for k, v in group.items() if k != "format"} | {
                "format": group.get("format") or qcfg.get("format")})
            out.append((tuple(group.get("targets") or ("Linear",)), scheme, group.get("format") or qcfg.get("format")))
        return out

    def tensors(self, prefix: str, exclude_prefix: str | None = None) -> dict[str, torch.Tensor]:
        """Every tensor under `prefix` (names relative to it), quantized modules decompressed to `weight`."""
        names = [n for n in self.reader.names()
                 if n.startswith(prefix) and not (exclude_prefix and n.startswith(exclude_prefix))]
        raw = {n[len(prefix):]: t for n, t in self.reader.get_many(names).items()}
        if self.layout is not None:
            raw = per_expert_tensors(raw, self.layout)
        if not self.groups:
            return raw
        return self._decompress(raw, prefix)

    def _decompress(self, raw: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
        # lazy: compressed-tensors (~3 s), only for quantized artifacts
        from compressed_tensors.compressors import BaseCompressor

        ignore = tuple(self.qcfg.get("ignore") or ())
        by_module: dict[str, dict[str, torch.Tensor]] = {}
        out: dict[str, torch.Tensor] = {}
        for name, t in raw.items():
            module, _, local = name.rpartition(".")
            if local.startswith("weight") and local != "weight" or (local == "weight" and f"{module}.weight_scale" in raw):
                by_module.setdefault(module, {})[local] = t
            elif local in ("input_scale", "input_global_scale", "input_zero_point", "k_scale", "v_scale"):
                continue  # read by the runtime-quantization hooks, not parameters of the module
            else:
                out[name] = t
        for module, state in by_module.items():
            full = f"{prefix}{module}"
            group = next(((scheme, fmt) for targets, scheme, fmt in self.groups
                          if not module_matches(full, ignore) and targets_match(full, targets)), None)
            if group is None:
                raise EngineFailed(f"{full} holds quantized tensors ({', '.join(sorted(state))}) but no "
                                   "config_groups entry of quantization_config targets it")
            scheme, fmt = group
            compressor = BaseCompressor.get_value_from_registry(fmt)
            if fmt == NVFP4_FORMAT:  # llmc's decode: compressed-tensors' rounds NVFP4 weights to bf16
                dense = nvfp4_from_compressed_tensors(state)
                out[f"{module}.weight"] = dense.to(self.dtype) if self.dtype is not None else dense
            else:
                out[f"{module}.weight"] = self._decompressed(compressor, state, scheme)
        return out

    def _decompressed(self, compressor, state: dict[str, torch.Tensor], scheme) -> torch.Tensor:
        """One module's dense weight in `dtype`. The decompressor returns float32 (the scale's dtype); where the
        codes are one per element (`weight` [out, in]: FP8, INT8) it runs on blocks of rows, each cast as it comes,
        so its float32 result is one block's (llmc.quant.numerics.BLOCK_ELEMENTS), not the Linear's (0.94 GB of
        fresh pages per 70B-width MLP projection) nor the layer's (decompressed whole, then cast: +0.87 GB per
        8B-width layer measured). Packed codes (int4) are decompressed whole."""
        codes = state.get("weight")
        if codes is None or codes.dim() != 2 or codes.numel() <= BLOCK_ELEMENTS:
            dense = compressor.decompress(dict(state), scheme)["weight"]
            return dense.to(self.dtype) if self.dtype is not None else dense
        rows = codes.shape[0]
        out = torch.empty(codes.shape, dtype=self.dtype or torch.float32, device=codes.device)
        step = max(1, BLOCK_ELEMENTS // codes.shape[1])
        for r in range(0, rows, step):  # per-row tensors (channel / group scales, zero points) follow the rows
            part = {k: v[r : r + step] if v.dim() == 2 and v.shape[0] == rows else v for k, v in state.items()}
            out[r : r + step] = compressor.decompress(part, scheme)["weight"]
        return out


NVFP4_FORMAT = COMPRESSED_TENSORS_FORMATS["nvfp4"][0]


def is_decoded_original(folder: Path, config: dict) -> bool:
    """Whether the torch engine reads `folder` as the model its CheckpointReader decodes (not a compressed-tensors
    folder, which it decompresses itself)."""
    fmt = folder_source_format(folder, config)
    return fmt is not None and fmt.name != COMPRESSED_TENSORS


def check_config_patterns(folder: Path, qcfg: object) -> None:
    """An artifact's quantization_config patterns (ignore, each group's targets), compiled before any weight loads:
    InputError naming the key where the linear-time matcher refuses one."""
    if not isinstance(qcfg, dict):
        return
    groups = qcfg.get("config_groups") if isinstance(qcfg.get("config_groups"), dict) else {}
    keyed = [("ignore", qcfg.get("ignore"))] + [(f"config_groups.{k}.targets", g.get("targets"))
                                               for k, g in groups.items() if isinstance(g, dict)]
    for key, patterns in keyed:
        try:
            check_patterns([p for p in patterns or () if isinstance(p, str)] if isinstance(patterns, list) else [])
        except PatternRefused as e:
            raise InputError(f"{folder}/config.json quantization_config.{key}: {e.message}", fix=e.fix) from None


def targets_match(name: str, targets: tuple[str, ...]) -> bool:
    """compressed-tensors targets: a class name (every quantized module llmc writes is a Linear) or 're:<regex>'."""
    return any(regex_matches(t[3:], name) if t.startswith("re:") else t == "Linear" for t in targets)


class _Replay(nn.Module):
    """Stands in for decoder layer 0 when computing logits: returns the final hidden states computed by streaming;
    the other layers become pass-throughs."""

    def __init__(self, hidden: torch.Tensor | None) -> None:
        super().__init__()
        self.hidden = hidden

    def forward(self, hidden_states, *args, **kwargs):
        return self.hidden if self.hidden is not None else hidden_states


def build_streaming_model(folder: Path, dtype: torch.dtype) -> tuple[nn.Module, LayerDecoder, dict | None]:
    """The model on the meta device with everything outside the decoder layers loaded; (model, decoder, qcfg)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    # a quantized original (FP8, MXFP4, ModelOpt, GPTQ, AWQ) is the model its CheckpointReader decodes: no runtime
    # quantization; a compressed-tensors folder keeps its activation quantization (llmc's artifacts, and a source's
    # baseline as its runtime runs it)
    decoded = is_decoded_original(folder, config)
    qcfg = config.pop("quantization_config", None)
    qcfg = None if decoded else qcfg
    check_config_patterns(folder, qcfg)
    model = build_skeleton(config, dtype)
    blocks = unfuse_experts(model)  # MoE: per-expert Linears under the Hub names the files use
    prefix, _ = decoder_layers(model)
    decoder = LayerDecoder(folder, qcfg, dtype, layout_of(config) if blocks else None)
    materialize(model, decoder.tensors("", exclude_prefix=prefix + "."), dtype)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    return model, decoder, qcfg


def build_dense_model(folder: Path, dtype: torch.dtype) -> nn.Module:
    """The whole model decompressed by `LayerDecoder` (compressed-tensors' decompressors) into per-expert Linears:
    how the torch engine loads a quantized Mixture-of-Experts artifact. transformers 5.23's own load merges the
    per-expert tensors into its fused 3-D parameters, which fails for int-quantized (W8A8-INT8) experts
    ("Concatenate ... Ckpt contains: 0") and would leave no Linear for activation quantization to hook."""
    model, decoder, _ = build_streaming_model(folder, dtype)
    prefix, layers = decoder_layers(model)
    materialize(layers, decoder.tensors(prefix + "."), dtype)
    for name, p in model.named_parameters():
        if p.is_meta:
            raise EngineFailed(f"{folder}: no tensor for {name}")
    return model.eval()


def streamed_logits(model: nn.Module, decoder: LayerDecoder, windows: torch.Tensor, batch_size: int,
                    dtype: torch.dtype, on_logits: Callable[[int, torch.Tensor], None],
                    device: torch.device = torch.device("cpu")) -> None:
    """Every window through layer i before layer i+1 loads; then `on_logits(start, logits[:, :-1] float32)` per
    batch of `batch_size` windows, in order. `device`: where the model outside the layers already is; each layer is
    read on the host and computes there, and the windows' hidden states stay there between layers."""

    prefix, layers = decoder_layers(model)
    batches = [b.to(device) for b in windows.split(batch_size)]
    hidden: list[torch.Tensor] = []
    extras = capture_layer_inputs(model, layers, batches, hidden.append)
    with torch.no_grad():
        for i, layer in steps(enumerate(layers), "score windows, layer by layer", total=len(layers), unit="layer"):
            materialize(layer, decoder.tensors(f"{prefix}.{i}."), dtype)
            layer.to(device)
            for b, (args, kwargs) in enumerate(e[i] for e in extras):
                hidden[b] = layer_output(layer(hidden[b], *args, **kwargs))
            release(layer)
        original = list(layers)
        try:
            for b, batch in enumerate(batches):
                for i in range(len(layers)):
                    layers[i] = _Replay(hidden[b] if i == 0 else None)
                logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
                on_logits(b * batch_size, logits)
        finally:
            for i, m in enumerate(original):
                layers[i] = m
