"""ONNX Runtime engine: scores an ONNX artifact with onnxruntime on the CPU, with the session options a
deployment gets by default (all graph optimizations, so ORT's own Q/DQ and MatMulNBits kernels run).

Two layouts:
- onnxruntime-genai folder (`genai_config.json`): one `model.onnx` with inputs input_ids, attention_mask
  and past_key_values.{i}.key/value, outputs logits and present.{i}.key/value. Decode tok/s feeds
  `present` back as `past` one token at a time, as onnxruntime-genai's generator does.
- Q/DQ graph (llmc.formats.onnx_qdq; its `llmc-serve.json` says kind onnx-qdq): input_ids -> logits, no cache;
  only prefill tok/s is measured.
Scoring runs each window as one prefill and reads the full logits, so besides the NLL it measures KL divergence
(exact where the reference carries its output head: llmc.engines.agreement) and top-1 agreement.
(Not called onnxruntime.py: that would shadow the real package.)
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from llmc.formats.onnx_qdq import MODEL_FILE as QDQ_MODEL
from llmc.formats.files import SERVE_FILE
from llmc.engines.base import EngineBase, Scoring, protocol_seconds, read_seconds, scores_bytes, window_logits_bytes
from llmc.engines.agreement import reference_rows, score_logits
from llmc.engines.torch_ref import summary
from llmc.errors import EngineFailed, EngineUnavailable
from llmc.planning.machine import PROCESS_BYTES
from llmc.planning.rows import CostRow
from llmc.storage.resource_errors import raise_if_resource

GENAI_CONFIG = "genai_config.json"


def _ort():
    try:
        import onnxruntime  # lazy: heavy engine package, only to score; absent -> EngineUnavailable
    except ImportError as e:
        raise EngineUnavailable(f"onnxruntime is not importable: {e}", fix="bash scripts/setup.sh") from None
    return onnxruntime


def _serve_kind(folder: Path) -> str | None:
    try:
        return json.loads((folder / SERVE_FILE).read_text()).get("kind")
    except (FileNotFoundError, json.JSONDecodeError, AttributeError):
        return None


class OnnxRuntimeEngine(EngineBase):
    name = "onnxruntime"

    def __init__(self, folder: Path, *, dtype: str = "float32", threads: int | None = None,
                 session_config: dict[str, str] | None = None) -> None:
        del dtype  # the graph's own types decide the arithmetic
        ort = _ort()
        folder = Path(folder)
        if _serve_kind(folder) == "onnx-qdq":
            self.model_path, self.layers = folder / QDQ_MODEL, 0  # no KV cache
            self.inputs, self.outputs = {"input_ids": "input_ids"}, {"logits": "logits"}
        else:
            try:
                cfg = json.loads((folder / GENAI_CONFIG).read_text())["model"]
            except (FileNotFoundError, KeyError, json.JSONDecodeError) as e:
                raise EngineFailed(f"{folder} has neither a readable {GENAI_CONFIG} ({e}) nor a Q/DQ {QDQ_MODEL}",
                                   fix="export the artifact for an onnxruntime target") from None
            dec = cfg["decoder"]
            self.model_path = folder / dec["filename"]
            self.layers, self.kv_heads, self.head_size = (dec["num_hidden_layers"], dec["num_key_value_heads"],
                                                          dec["head_size"])
            self.inputs, self.outputs = dec["inputs"], dec["outputs"]
        self.threads = threads or os.cpu_count() or 1
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.threads
        opts.log_severity_level = 3
        for key, value in (session_config or {}).items():  # e.g. {"session.disable_quant_qdq": "1"}
            opts.add_session_config_entry(key, value)
        try:
            self.session = ort.InferenceSession(str(self.model_path), opts, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own exception types for invalid graphs/data
            raise_if_resource(e, f"onnxruntime loading {self.model_path}")
            raise EngineFailed(f"onnxruntime could not load {self.model_path}: {e}",
                               fix="check the artifact with `llmc inspect`; re-export it if files are damaged") from None
        types = {i.name: i.type for i in self.session.get_inputs()}
        past = self.inputs.get("past_key_names")
        self.kv_dtype = np.float16 if past and "float16" in types.get(past % 0, "") else np.float32
        self.version = ort.__version__

    def _feed(self, ids: np.ndarray, past: list[np.ndarray] | None, past_len: int) -> dict[str, np.ndarray]:
        b, s = ids.shape
        feed = {self.inputs["input_ids"]: ids.astype(np.int64)}
        if not self.layers:
            return feed
        feed[self.inputs["attention_mask"]] = np.ones((b, past_len + s), dtype=np.int64)
        for i in range(self.layers):
            for j, kind in enumerate(("past_key_names", "past_value_names")):
                feed[self.inputs[kind] % i] = (past[2 * i + j] if past is not None else
                                               np.zeros((b, self.kv_heads, 0, self.head_size), dtype=self.kv_dtype))
        return feed

    def _run(self, ids: np.ndarray, past: list[np.ndarray] | None = None, past_len: int = 0):
        names = [self.outputs["logits"]] + [self.outputs[k] % i for i in range(self.layers)
                                             for k in ("present_key_names", "present_value_names")]
        out = self.session.run(names, self._feed(ids, past, past_len))
        return out[0], out[1:]

    def score(self, windows: torch.Tensor, reference: dict | None = None, top_k: int = 256,
              batch_size: int = 1) -> dict[str, torch.Tensor]:
        """Per-token NLL, and either top-k log-probs (as a reference) or KL / top-1 against `reference`.
        One window at a time, whatever `batch_size`."""
        del batch_size
        parts: dict[str, list[torch.Tensor]] = {}
        for w in range(windows.shape[0]):
            ids = windows[w : w + 1]
            logits, _ = self._run(ids.numpy())
            logits = torch.from_numpy(np.ascontiguousarray(logits[:, :-1])).float()
            ref = None if reference is None else reference_rows(reference, w, w + 1)
            out = score_logits(logits, ids[:, 1:], top_k, ref)
            for k, v in out.items():
                parts.setdefault(k, []).append(v)
        return {k: torch.cat(v) for k, v in parts.items()}

    def throughput(self, prompt: torch.Tensor, decode_tokens: int, repeats: int,
                   batch_sizes: Sequence[int] = (1,)) -> dict:
        """Prefill tok/s of the prompt's first row and greedy decode tok/s after a 64-token prefill (batch 1
        only, whatever `batch_sizes`: EngineSpec.batch_sizes)."""
        del batch_sizes
        ids = prompt[:1].numpy()
        self._run(ids[:, :8])  # warm-up
        prefill, decode = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            self._run(ids)
            prefill.append(ids.size / (time.perf_counter() - t))
            if decode_tokens and self.layers:
                short = ids[:, :64]
                logits, past = self._run(short)
                nxt, n = logits[:, -1:].argmax(-1), short.shape[1]
                t = time.perf_counter()
                for _ in range(decode_tokens):
                    logits, past = self._run(nxt, past, n)
                    nxt, n = logits[:, -1:].argmax(-1), n + 1
                decode.append(decode_tokens / (time.perf_counter() - t))
        return {"prefill_tokens_per_s": summary(prefill), "decode_tokens_per_s": summary(decode) if decode else None,
                "prompt_tokens": int(ids.shape[1]), "decode_tokens": decode_tokens if self.layers else 0, "repeats": repeats,
                "threads": self.threads, "engine_version": self.version}


# What the plan's row rests on (docs/planner-constants.md#engine-start-up, measured by benchmarks/engine_costs.py on
# SmolLM2-135M W4A16 int4 MatMulNBits, 0.18 GB of files): importing onnxruntime (0.73-0.82 s); creating the session
# (graph optimizations, MatMulNBits pre-packing: 3.2-3.9 s beside the import, per byte of the files); the bytes the
# session allocates per byte of them (0.31 GB). Its time per token did not move with the window's length (2,048
# tokens as 8 x 256 and as 4 x 512: 41.6-43.2 and 39.5-48.4 s), so its prefills are timed at the float32 probe's
# rate at PROBE_ROWS rows, which predicted 1.26-1.39x the measured scoring and throughput times in both shapes
IMPORT_S = 0.8
SESSION_RATE = 0.05e9
SESSION_BYTES_PER_FILE_BYTE = 1.7
PROBE_ROWS = 64
SPEED_OVER_FLOAT32_PROBE = 1.35


def scoring_cost(s: Scoring) -> CostRow:
    """One scoring in ONNX Runtime (in llmc's process): the session created from the artifact's files, each window one
    prefill at the machine's probed float32 rate (the CPU execution provider computes in float32: FP8 Q/DQ as
    float, int4 MatMulNBits dequantized to float32 blocks), then the throughput repeats."""
    score_s, throughput_s = (t / SPEED_OVER_FLOAT32_PROBE for t in protocol_seconds(s, "float32", PROBE_ROWS))
    start_s = IMPORT_S + read_seconds(s) + s.model_bytes / SESSION_RATE
    parts = {"process": PROCESS_BYTES, "session (weights, pre-packed)": s.model_bytes * SESSION_BYTES_PER_FILE_BYTE,
             "one window's logits": window_logits_bytes(s), "scores and reference": scores_bytes(s)}
    return CostRow("onnxruntime", "cpu", sum(parts.values()), 0.0, 0.0, start_s + score_s + throughput_s,
                   "in process, one window at a time",
                   f"session start ~{start_s:.0f} s, scoring ~{score_s:.0f} s, throughput ~{throughput_s:.0f} s at "
                   f"{SPEED_OVER_FLOAT32_PROBE:g}x the probed float32 matmul rate (fitted on SmolLM2 int4)", parts)
