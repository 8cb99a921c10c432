"""The one canonical quantized form that quantize writes and every exporter reads.

    <dir>/quantized.json        scheme, source hash, HF config, every quantized module and its shape
    <dir>/layers/NNNNN.safetensors   one file per decoder layer
    <dir>/rest.safetensors      everything outside the decoder layers (embeddings, final norm, lm_head)
    <dir>/<tokenizer files>     copied from the source so the form is self-contained

Tensor names are the model's own. For each quantized Linear `m`:
    m.weight              codes: int8 (holding int8 or int4 values, signed) or float8_e4m3fn; NVFP4 / MXFP4:
                          uint8 E2M1 codes, one a byte (llmc.quant.microscaling), packed by the exporters
    m.weight_scale        float32, [1] / [out, 1] / [out, in // group]; block-wise FP8: float32
                          [ceil(out / 128), ceil(in / 128)]; NVFP4: float8_e4m3fn [out, in // 16]; MXFP4 / MXFP8:
                          uint8 E8M0 exponents [out, in // 32]
    m.weight_global_scale float32 [1], NVFP4 only: the divisor 448 * 6 / amax (compressed-tensors' convention)
    m.weight_zero_point   int8, same shape as the scale (asymmetric only)
    m.input_scale         float32 [1] (static activation quantization only); NVFP4 activations:
    m.input_global_scale  float32 [1], the calibrated divisor (llmc.quant.numerics.input_scale_name)
For each attention module `a` with a quantized KV cache: a.k_scale, a.v_scale (float32 [1]).
Every other tensor is stored unchanged in the model's dtype; quantized.json's `unquantized_linears` names every
Linear stored so (ignored, outside the decoder layers, or in an `ignore: true` group), for the exporters' configs.

A mixed-precision scheme (`Scheme.groups`) records its groups in quantized.json's scheme, and each quantized module's
entry names its group (`modules[m]["group"]`): `scheme_of(m)` is the plain scheme its tensors above follow.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from llmc.errors import InputError
# the one matcher of module-name patterns (linear time), where the quantized form's readers have always found it
from llmc.inputs.patterns import module_matches  # noqa: F401
from llmc.quant.numerics import dequantize
from llmc.quant.spec import ModuleGroup, ModuleTargets, Scheme, TensorSpec

FORMAT_NAME = "llmc-quantized"
FORMAT_VERSION = 1
META_FILE = "quantized.json"


def scheme_from_dict(d: dict) -> Scheme:
    def spec(x: dict | None) -> TensorSpec | None:
        return TensorSpec(**x) if x else None

    def group(g: dict) -> ModuleGroup:
        targets = ModuleTargets(**{k: tuple(v) for k, v in g["targets"].items()})
        return ModuleGroup(g["name"], targets, spec(g.get("weights")), spec(g.get("activations")))

    return Scheme(
        weights=spec(d["weights"]),
        activations=spec(d.get("activations")),
        kv_cache=spec(d.get("kv_cache")),
        algorithm=d.get("algorithm", "rtn"),
        ignore=tuple(d.get("ignore", ())),
        algorithm_options=tuple(tuple(x) for x in d.get("algorithm_options", ())),
        groups=tuple(group(g) for g in d.get("groups", ())),
    )


@dataclass
class QuantizedModel:
    root: Path
    meta: dict

    @classmethod
    def open(cls, root: Path) -> QuantizedModel:
        root = Path(root)
        try:
            meta = json.loads((root / META_FILE).read_text())
        except FileNotFoundError:
            raise InputError(f"{root} is not an llmc quantized model ({META_FILE} missing)") from None
        if meta.get("format") != FORMAT_NAME or meta.get("format_version") != FORMAT_VERSION:
            raise InputError(f"{root}: unsupported quantized form {meta.get('format')} v{meta.get('format_version')}")
        return cls(root=root, meta=meta)

    @property
    def scheme(self) -> Scheme:
        return scheme_from_dict(self.meta["scheme"])

    @property
    def config(self) -> dict:
        return self.meta["config"]

    @property
    def quantized_modules(self) -> dict[str, dict]:
        return self.meta["modules"]

    @property
    def kv_cache_modules(self) -> list[str]:
        return self.meta.get("kv_cache_modules", [])

    @property
    def unquantized_linears(self) -> list[str]:
        """Every Linear the form keeps in the model's dtype: those the scheme ignores, those outside the decoder
        layers (which the stream never quantizes: an output head, Gemma-4's per_layer_model_projection) and those
        of `ignore: true` groups. Exporters list them as unquantized in their configs."""
        return self.meta.get("unquantized_linears", [])

    def files(self) -> list[Path]:
        return [self.root / f for f in self.meta["files"]]

    def iter_files(self, progress: str = "export: canonical files") -> Iterator[dict[str, torch.Tensor]]:
        """All tensors, one file (one decoder layer, then the rest) at a time. Every exporter reads the form through
        this, so its progress (a bar with ETA on a terminal, `llmc-progress` lines in CI) is counted here, a file
        done when the exporter asks for the next one."""
        from llmc.telemetry.progress import Meter

        files = self.files()
        with Meter(progress, len(files), unit="file", every_s=5.0) as meter:
            for f in files:
                with safe_open(str(f), framework="pt") as h:
                    tensors = {k: h.get_tensor(k) for k in h.keys()}
                yield tensors
                meter.advance()

    def scheme_of(self, module: str) -> Scheme:
        """The plain scheme quantized module `module` was quantized with (its group's, in a mixed scheme)."""
        scheme = self.scheme
        group = self.quantized_modules[module].get("group")
        return scheme.member(scheme.group(group)) if group is not None else scheme

    def modules_by_group(self) -> dict[str, list[str]]:
        """Group name -> its quantized modules ({"": all} for a plain scheme)."""
        out: dict[str, list[str]] = {}
        for name, entry in self.quantized_modules.items():
            out.setdefault(entry.get("group", ""), []).append(name)
        return out

    def dequantized_weight(self, tensors: dict[str, torch.Tensor], module: str) -> torch.Tensor:
        spec = self.scheme_of(module).weights
        return dequantize(
            tensors[f"{module}.weight"],
            tensors[f"{module}.weight_scale"],
            tensors.get(f"{module}.weight_zero_point"),
            spec,
            tensors.get(f"{module}.weight_global_scale"),
        )
