"""Torch reference engine: runs an artifact from disk the way a W8A8 runtime computes it.

transformers decompresses a compressed-tensors checkpoint's weights exactly (`dequantize=True`),
but then silently drops activation and KV-cache quantization, which would make a W8A8 or FP8-KV
artifact look better than it is. So this engine loads the decompressed weights through
transformers and re-applies, from the artifact's own config and files, what the runtime does:
  - static input activations: quantize-dequantize with the stored `input_scale`;
  - dynamic activations: per-token (or per-tensor) scales computed on the fly;
  - KV cache: keys and values quantize-dequantized with the stored `k_scale` / `v_scale`.
A plain (unquantized) folder runs as is; that is the baseline.

`device`: where the model computes (a GPU: the whole model resident, or one decoder layer at a time when streamed).
Windows go in from the host and every score comes back to the host, so callers never see a device tensor.

When its caller decided so (`llmc.engines.torch_stream.decide_torch_loading`: the dense model would not fit, or
LLMC_TORCH_EVAL=streamed), the engine evaluates one decoder layer at a time instead: the same hooks, the same NLL,
a fraction of the memory. Its timings are then of the streamed pass, and no decode timing is taken (that would
reload every layer per token).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from llmc import distributed
from llmc.engines.agreement import HEAD_INPUT, HEAD_KEYS, HeadCapture, reference_rows, score_logits
from llmc.engines.agreement import agreement, topk_kl  # noqa: F401  (their former home: imported from here elsewhere)
from llmc.engines.base import EngineBase
from llmc.engines.torch_stream import (build_dense_model, build_streaming_model, check_config_patterns,
                                       is_decoded_original, streamed_logits, targets_match)
from llmc.errors import EngineFailed
from llmc.formats.compressed_tensors import spec_from_args
from llmc.formats.microscaling_export import COMPRESSED_TENSORS_FORMATS
from llmc.model.attention import register_kv_attention, route_kv
from llmc.model.families import expert_count
from llmc.quant.canonical import module_matches
from llmc.quant.numerics import fake_quantize, input_scale_name
from llmc.quant.spec import TensorSpec
from llmc.storage.resource_errors import raise_if_resource
from llmc.telemetry.progress import steps

KV_ATTENTION = "llmc_quantized_kv"
_HEAD_TENSORS = frozenset(HEAD_KEYS)
_KV_SCALES: dict[int, tuple[torch.Tensor, torch.Tensor, TensorSpec]] = {}


NVFP4_FORMAT = COMPRESSED_TENSORS_FORMATS["nvfp4"][0]


def _has_nvfp4(qcfg: dict) -> bool:
    """Whether any config group holds NVFP4 weights (a mixed-precision artifact's groups name their own format)."""
    return qcfg.get("format") == NVFP4_FORMAT or any(
        g.get("format") == NVFP4_FORMAT for g in (qcfg.get("config_groups") or {}).values())


def _quantize_kv(module: nn.Module, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    entry = _KV_SCALES.get(id(module))
    if entry is None:
        return key, value
    k_scale, v_scale, spec = entry
    return fake_quantize(key, spec, k_scale), fake_quantize(value, spec, v_scale)


def _artifact_tensors(folder: Path, suffixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                if k.endswith(suffixes):
                    out[k] = h.get_tensor(k)
    return out


class TorchEngine(EngineBase):
    name = "torch"

    def __init__(self, folder: Path, *, streamed: bool, dtype: str = "float32",
                 device: str | torch.device = "cpu") -> None:
        """`streamed`: the caller's decision (llmc.engines.torch_stream.decide_torch_loading: the plan's in a build,
        `decide_torch_loading_of` without one); the engine decides nothing itself."""
        self.folder = Path(folder)
        self.dtype = getattr(torch, dtype)
        self.device = torch.device(device)
        # Under torchrun every rank loads the model (llmc.engines.split); a failure on one is raised on all of them
        # (distributed.agree), so they stay in step, and all take the same path, whose arithmetic the scores follow:
        # streamed where any rank's decision says so
        streamed = distributed.any_rank(streamed)
        self.streamed = streamed
        failure = None
        try:
            self.model = self._load_streaming() if streamed else self._load()
        except Exception as e:  # noqa: BLE001 - raised on every rank just below
            failure = e
        distributed.agree(failure)

    def _load_streaming(self) -> nn.Module:
        try:
            model, self._decoder, qcfg = build_streaming_model(self.folder, self.dtype)
        except EngineFailed:
            raise
        except Exception as e:
            raise_if_resource(e, f"loading {self.folder} one layer at a time")
            raise EngineFailed(
                f"could not prepare {self.folder} for streamed evaluation: {type(e).__name__}: {e}",
                fix="check the artifact with `llmc inspect`; it may be incomplete or corrupted",
            ) from None
        # what lies outside the decoder layers computes on the device too; the layers come one at a time
        model._apply(lambda t: t if t.is_meta else t.to(self.device))
        if qcfg is not None:
            self._apply_runtime_quantization(model, qcfg)
        return model

    def _load(self) -> nn.Module:
        # lazy: transformers (~2 s), only when a model loads; onnxrt/tensorrt import this module
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        # The load report lists input_scale/k_scale/v_scale as "unexpected": this engine reads
        # them itself below. Keep transformers' own chatter out of the build log.
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        warnings.filterwarnings("ignore", message=".*quantization_config.*", category=UserWarning)

        config = json.loads((self.folder / "config.json").read_text())
        qcfg = config.get("quantization_config")
        check_config_patterns(self.folder, qcfg)
        decoded = is_decoded_original(self.folder, config)  # a quantized original: decoded as it is read, then dense
        try:
            if decoded:
                model, qcfg = build_dense_model(self.folder, self.dtype), None
            elif qcfg is None:
                model = AutoModelForCausalLM.from_pretrained(self.folder, dtype=self.dtype, trust_remote_code=False)
            # MoE: llmc's own decompression into per-expert Linears (why: there); NVFP4: compressed-tensors
            # decodes it to bf16, llmc exactly (torch_stream.LayerDecoder)
            elif expert_count(config) > 1 or _has_nvfp4(qcfg):
                model = build_dense_model(self.folder, self.dtype)
            else:
                # lazy: transformers (~2 s), only when a model loads; onnxrt/tensorrt import this module
                from transformers import CompressedTensorsConfig

                model = AutoModelForCausalLM.from_pretrained(
                    self.folder, dtype=self.dtype, quantization_config=CompressedTensorsConfig(dequantize=True),
                    trust_remote_code=False,  # never a folder's own code (llmc.model.tokenizer_files)
                )
        except Exception as e:
            raise_if_resource(e, f"transformers loading {self.folder}")
            raise EngineFailed(
                f"transformers could not load {self.folder}: {type(e).__name__}: {e}",
                fix="check the artifact with `llmc inspect`; it may be incomplete or corrupted",
            ) from None
        model.eval().to(self.device)
        if qcfg is not None:
            self._apply_runtime_quantization(model, qcfg)
        return model

    def _apply_runtime_quantization(self, model: nn.Module, qcfg: dict) -> None:
        from compressed_tensors.quantization.quant_config import QuantizationConfig  # lazy: ~3 s, quantized only

        groups = list(qcfg.get("config_groups", {}).values())
        ignore = tuple(qcfg.get("ignore") or ())
        del QuantizationConfig  # imported to fail loudly here if compressed-tensors is missing
        # each Linear's activations as its config group says (a mixed-precision artifact's groups differ), the
        # group matched as the decoder matches it (torch_stream.targets_match)
        specs = {id(g): spec_from_args(g["input_activations"])
                 for g in groups if g.get("input_activations")}
        stored_names = {f".{input_scale_name(sp)}" for sp in specs.values() if not sp.dynamic}
        scales = _artifact_tensors(self.folder, tuple(sorted(stored_names))) if stored_names else {}
        for name, mod in model.named_modules():
            if not specs or not isinstance(mod, nn.Linear) or module_matches(name, ignore):
                continue
            group = next((g for g in groups if targets_match(name, tuple(g.get("targets") or ("Linear",)))), None)
            spec = specs.get(id(group)) if group is not None else None
            if spec is not None:
                stored = f".{input_scale_name(spec)}"  # NVFP4: the global scale its block scales are computed under
                scale = scales.get(f"{name}{stored}")
                scale = None if scale is None else scale.to(self.device)
                if not spec.dynamic and scale is None:
                    raise EngineFailed(f"{self.folder}: static activations but no {name}{stored} in the files")
                mod.register_forward_pre_hook(
                    lambda _m, args, s=scale, sp=spec: (fake_quantize(args[0], sp, s), *args[1:])
                )
        kv_args = qcfg.get("kv_cache_scheme")
        if kv_args:
            spec = spec_from_args(kv_args)
            scales = _artifact_tensors(self.folder, (".k_scale", ".v_scale"))
            register_kv_attention(KV_ATTENTION, _quantize_kv)
            scaled = []
            for name, mod in model.named_modules():
                k, v = scales.get(f"{name}.k_scale"), scales.get(f"{name}.v_scale")
                if k is not None and v is not None:
                    _KV_SCALES[id(mod)] = (k.float().to(self.device), v.float().to(self.device), spec)
                    scaled.append((mod, model.config))
            if not scaled:
                raise EngineFailed(f"{self.folder}: kv_cache_scheme is set but no k_scale/v_scale tensors exist")
            route_kv(scaled, KV_ATTENTION)

    # ------------------------------------------------------------------ measurements

    @torch.no_grad()
    def token_nll(self, windows: torch.Tensor, batch_size: int = 4) -> torch.Tensor:
        """[n, seq-1] float64 negative log-likelihood of tokens 1..seq-1 of each window."""
        return self._score(windows, batch_size, None, 1, capture_head=False)["nll"]

    def score(
        self, windows: torch.Tensor, batch_size: int = 4, reference: dict | None = None, top_k: int = 256
    ) -> dict[str, torch.Tensor]:
        """Per-token NLL, plus either this model's top-k log-probs and its output head's inputs (to serve as a
        reference: llmc.engines.agreement) or, given a reference, per-token KL(reference || this) and top-1
        agreement. `output_head` then says whether the head reproduced the model's logits (exact KL possible)."""
        return self._score(windows, batch_size, reference, top_k, capture_head=reference is None)

    @torch.no_grad()
    def _score(self, windows: torch.Tensor, batch_size: int, reference: dict | None, top_k: int, *,
               capture_head: bool) -> dict[str, torch.Tensor]:
        # Under torchrun each rank scores its own block of whole batches (the batches one process would run); a
        # failure on one rank is raised on every rank before they gather.
        failure, scores = None, {}
        try:
            scores = self._score_block(windows, batch_size, reference, top_k, capture_head=capture_head)
        except Exception as e:  # noqa: BLE001 - raised on every rank just below
            failure = e
        distributed.agree(failure)
        if distributed.active():
            scores, self.output_head = _gathered(scores, getattr(self, "output_head", None) if capture_head else None)
        return scores

    def _score_block(self, windows: torch.Tensor, batch_size: int, reference: dict | None, top_k: int, *,
                     capture_head: bool) -> dict[str, torch.Tensor]:
        """This rank's scores: every window in one process, its block of whole batches under torchrun."""
        parts: dict[str, list[torch.Tensor]] = {}
        lo, hi = distributed.shard_bounds(windows.shape[0], batch_size) if distributed.active() else (0, len(windows))
        mine = windows[lo:hi]  # lo is a multiple of batch_size: the same batches one process would run
        with HeadCapture(self.model) if capture_head else contextlib.nullcontext() as capture:

            def on_logits(start: int, logits: torch.Tensor) -> None:
                start += lo
                batch = windows[start : start + batch_size].to(self.device)
                if capture is not None:
                    capture.after_forward(logits)
                ref = None if reference is None else {
                    k: v.to(self.device) for k, v in reference_rows(reference, start, start + batch_size).items()}
                out = score_logits(logits, batch[:, 1:], top_k, ref)
                for k, v in out.items():  # scored where the logits are, kept on the host
                    parts.setdefault(k, []).append(v.cpu())

            t = time.perf_counter()
            if self.streamed:
                streamed_logits(self.model, self._decoder, mine, batch_size, self.dtype, on_logits, self.device)
            else:
                for start in steps(range(0, mine.shape[0], batch_size), "score windows", unit="batch"):
                    ids = mine[start : start + batch_size].to(self.device)
                    on_logits(start, self.model(input_ids=ids, use_cache=False).logits[:, :-1].float())
            self._synchronize()
            self._scored = (mine.numel(), time.perf_counter() - t)
        scores = {k: torch.cat(v) for k, v in parts.items()}
        if capture is not None:
            scores.update(capture.tensors())
            self.output_head = capture.report
        return scores

    def _synchronize(self) -> None:
        """Wait for the device's queued work, so that a time taken after it is the work's (CUDA runs asynchronously)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def throughput(self, prompt: torch.Tensor, decode_tokens: int, repeats: int,
                   batch_sizes: Sequence[int] = (1,)) -> dict:
        """Throughput at each of `batch_sizes` (the prompt [1, n] repeated per sequence); the top-level figures
        are the first batch size's, all of them under `by_batch_size`."""
        if self.streamed:  # no per-token decode one layer at a time: the streamed scoring pass is the timing
            tokens, seconds = getattr(self, "_scored", (0, 0.0))
            rate = {"median": tokens / seconds, "min": tokens / seconds, "max": tokens / seconds, "n": 1} if seconds else None
            first = {"prefill_tokens_per_s": rate, "decode_tokens_per_s": None, "streamed": True,
                     "threads": torch.get_num_threads()}
            return {**first, "batch_size": batch_sizes[0], "by_batch_size": {str(batch_sizes[0]): first}}
        by_batch = {b: self._throughput_at(prompt.expand(b, -1), decode_tokens, repeats) for b in batch_sizes}
        first = by_batch[batch_sizes[0]]
        return {**first, "batch_size": batch_sizes[0], "by_batch_size": {str(b): t for b, t in by_batch.items()}}

    @torch.no_grad()
    def _throughput_at(self, prompt: torch.Tensor, decode_tokens: int, repeats: int) -> dict:
        """Prefill tok/s of `prompt` ([batch, n]) and greedy decode tok/s of `decode_tokens` new tokens per
        sequence, counted over the whole batch."""
        prefill, decode = [], []
        prompt = prompt.to(self.device)
        self.model(input_ids=prompt[:, :8], use_cache=False)  # warm-up
        for _ in range(repeats):
            self._synchronize()
            t = time.perf_counter()
            self.model(input_ids=prompt, use_cache=False)
            self._synchronize()
            prefill.append(prompt.numel() / (time.perf_counter() - t))
            if decode_tokens:
                short = prompt[:, :64]
                t = time.perf_counter()
                out = self.model(input_ids=short, use_cache=True)
                t_prefill = time.perf_counter() - t
                past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
                t = time.perf_counter()
                for _ in range(decode_tokens):
                    out = self.model(input_ids=nxt, past_key_values=past, use_cache=True)
                    past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
                self._synchronize()
                decode.append(decode_tokens * prompt.shape[0] / (time.perf_counter() - t))
                del t_prefill
        return {
            "prefill_tokens_per_s": summary(prefill),
            "decode_tokens_per_s": summary(decode) if decode else None,
            "prompt_tokens": int(prompt.shape[1]),
            "decode_tokens": decode_tokens,
            "repeats": repeats,
            "threads": torch.get_num_threads(),
        }


def _gathered(scores: dict[str, torch.Tensor], head_report: dict | None) -> tuple[dict[str, torch.Tensor], dict | None]:
    """Every rank's per-window scores stacked in rank order (= window order), so intervals computed from them
    are a single process's; the output head kept only when every rank that scored windows reproduced it."""
    ranks = [(s, r) for s, r in distributed.gather_objects((scores, head_report)) if s]
    if not ranks:
        return scores, head_report
    per_window = [k for k in ranks[0][0] if k not in _HEAD_TENSORS or k == HEAD_INPUT]
    failed = next((r for _, r in ranks if r is not None and not r.get("reproduced", False)), None)
    out = {k: torch.cat([s[k] for s, _ in ranks]) for k in per_window if all(k in s for s, _ in ranks)}
    if failed is None:
        out.update({k: v for k, v in ranks[0][0].items() if k in _HEAD_TENSORS and k != HEAD_INPUT})
    else:
        out.pop(HEAD_INPUT, None)
    return out, failed if failed is not None else ranks[0][1]


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}
