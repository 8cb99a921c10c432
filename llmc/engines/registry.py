"""Every evaluation engine, by name: what the build may ask of it and where its code lives.

Importing this module imports no engine: each engine module (torch, onnxruntime, ...) is imported when
`open_engine` opens it, so reading the registry (recipe validation, reports, the CLI) stays light.
Adding an engine is one `EngineSpec` line here plus its module (docs/extending.md, "Adding an evaluation engine").
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from llmc.registry import Registry

if TYPE_CHECKING:
    from torch import Tensor

    from llmc.planning.machine import Machine
    from llmc.planning.rows import CostRow
    from llmc.planning.shapes import Shape
    from llmc.quant.spec import Scheme

# The engine that scores the unquantized source for engines that cannot load it themselves.
REFERENCE_ENGINE = "torch"
DEFAULT_TIMEOUT_S = 3600.0
# What an evaluation's tokens/s is (EngineSpec.speed_kind): only "runtime" is shown and gated as speed.
SpeedKind = Literal["runtime", "reference", "emulated"]


class Engine(Protocol):
    """A loaded model in one engine. Scores hold per-token tensors [windows, seq-1]: `nll` always; without a
    reference also `topk_logprobs`/`topk_index` (to serve as one), with a reference `kl` and `top1`, where the
    engine gives full distributions (vLLM returns the actual tokens' log-probs only, so NLL alone)."""

    name: str

    def score(self, windows: Tensor, *, batch_size: int = 4, reference: dict[str, Tensor] | None = None,
              top_k: int = 256) -> dict[str, Tensor]: ...

    def throughput(self, prompt: Tensor, *, decode_tokens: int, repeats: int,
                   batch_sizes: Sequence[int] = (1,)) -> dict: ...

    def measure(self, windows: Tensor, prompt: Tensor, *, decode_tokens: int, repeats: int, batch_size: int = 4,
                reference: dict[str, Tensor] | None = None, top_k: int = 256,
                throughput_batch_sizes: Sequence[int] = (1,)) -> tuple[dict[str, Tensor], dict]:
        """(scores, throughput) in one go: out-of-process engines load the model once for both."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> Engine: ...

    def __exit__(self, *exc: object) -> None: ...


@dataclass(frozen=True)
class Scoring:
    """One scoring as the plan costs it (each engine module's `scoring_cost`, through `EngineSpec.scoring_cost`; the
    arithmetic they share: llmc.engines.base): the evaluation protocol's sizes (one corpus), what the engine loads,
    and the machine planned for."""

    shape: Shape
    machine: Machine
    windows: int
    seq_len: int
    decode_tokens: int
    repeats: int  # throughput repeats, each a prefill of one window and a decode of decode_tokens
    top_k: int
    model_bytes: float  # the files the engine loads: the artifact's, or the source's for a baseline
    reference: bool  # an artifact scored against the baseline's scores (KL, top-1), not a baseline itself

    @property
    def tokens(self) -> int:
        return self.windows * self.seq_len


@dataclass(frozen=True)
class EngineEnvironment:
    """An engine that runs in its own Python environment (its pins clash with llmc's), through a worker
    script in llmc/engines/workers/ (llmc.engines.runner). Where that Python is: llmc.engines.environments."""

    worker: str  # file in llmc/engines/workers/ (an absolute path also works: tests use stand-ins)
    python_variable: str  # environment variable naming the interpreter
    venv: str  # conventional venv folder name, looked for in the current directory and an llmc checkout
    module: str  # what that interpreter must be able to import
    setup: str  # how to create the conventional venv
    failure_fix: str  # the fix printed when the worker exits non-zero
    timeout_s: float = DEFAULT_TIMEOUT_S  # for one worker run; LLMC_ENGINE_TIMEOUT_S overrides it


@dataclass(frozen=True)
class EngineSpec:
    name: str
    loader: str  # "module:Class", imported only when the engine is opened
    loads_source: bool  # can score the unquantized source as the baseline; else paired with REFERENCE_ENGINE's
    title: str = ""  # how messages name it; the name when empty
    every_batch_size: bool = False  # measures throughput at every requested batch size; others at batch 1
    cpu_build: bool = False  # runs here as its CPU build: schemes whose capability rule says cpu=False are skipped
    environment: EngineEnvironment | None = None  # set for out-of-process engines
    # under torchrun, scores its share of the windows on every rank and gathers them (llmc.engines.split); others
    # run on rank 0 alone
    splits_over_ranks: bool = False
    # What its tokens/s measure. "runtime": the engine's own kernels run the artifact (a serving runtime's speed
    # on this machine). "emulation": llmc computes the quantized arithmetic itself in float (dequantize, then
    # matmul), so on a quantized artifact its tok/s is not the format's speed (reports never show it as speed,
    # performance gates never read it); on the unquantized source it is the plain framework's speed.
    speed: Literal["runtime", "emulation"] = "runtime"
    emulated_formats: tuple[str, ...] = ()  # a runtime that runs these number formats as float arithmetic here
    emulation_note: str = ""  # why, for reports
    places_on_device: bool = False  # opened with a torch device to compute on (recipe key eval.device)

    @property
    def display(self) -> str:
        return self.title or self.name

    def speed_kind(self, scheme: Scheme | None) -> SpeedKind:
        """What this engine's tok/s on a model quantized with `scheme` (None: the unquantized source) is:
        'runtime' (the runtime's own speed), 'reference' (plain framework speed of the unquantized model in an
        emulating engine) or 'emulated' (llmc's emulation of the quantized arithmetic: not the artifact's speed)."""
        if scheme is None:
            return "runtime" if self.speed == "runtime" else "reference"
        if self.speed == "emulation":
            return "emulated"
        formats = {t.format for m in scheme.members().values()  # a mixed scheme: every group's
                   for t in (m.weights, m.activations, m.kv_cache) if t is not None}
        return "emulated" if formats & set(self.emulated_formats) else "runtime"

    @property
    def baseline_engine(self) -> str:
        """The engine whose scores of the source model this engine's artifacts are compared with."""
        return self.name if self.loads_source else REFERENCE_ENGINE

    def batch_sizes(self, requested: Sequence[int]) -> list[int]:
        """The batch sizes throughput is measured at (they enter the eval stage key)."""
        return list(requested) if self.every_batch_size else [1]

    def cannot_run(self, scheme: Scheme) -> str | None:
        """Why this machine's build of the engine cannot run `scheme` (None: it can). A skipped evaluation is
        reported with its reason and is not gated."""
        return _cpu_build_refusal(self.name, scheme) if self.cpu_build else None

    def open(self, folder: Path, *, dtype: str = "float32", device: str | None = None,
             streamed: bool | None = None) -> Engine:
        """The engine on `folder`; `device` only for an engine that `places_on_device` (others run where they do);
        `streamed` (the decision of llmc.engines.torch_stream.decide_torch_loading: one decoder layer at a time)
        only for the torch reference, which needs it."""
        module, cls = self.loader.split(":")
        placed = {"device": device} if device is not None and self.places_on_device else {}
        if self.name == REFERENCE_ENGINE:
            if streamed is None:  # a caller's bug, not a user's: the engine decides nothing itself
                raise TypeError("the torch reference loads as its caller decided: pass streamed= "
                                "(llmc.engines.torch_stream.decide_torch_loading, or decide_torch_loading_of "
                                "without a plan)")
            placed["streamed"] = streamed
        return getattr(importlib.import_module(module), cls)(Path(folder), dtype=dtype, **placed)

    def scoring_cost(self, scoring: Scoring) -> CostRow | None:
        """The plan's row for one scoring in this engine, from its module's `scoring_cost` (each engine costs itself,
        beside its code); None for an engine without a cost model (the GPU engines TensorRT, TensorRT-LLM; the torch
        reference is costed by the evaluate stage itself, llmc.engines.torch_cost.eval_cost)."""
        cost = getattr(importlib.import_module(self.loader.split(":")[0]), "scoring_cost", None)
        return cost(scoring) if cost is not None else None


def _cpu_build_refusal(runtime: str, scheme: Scheme) -> str | None:
    """The capability data's verdict on `runtime`'s CPU build for `scheme` (measured limits, not guesses)."""
    # lazy: importing llmc.engines loads no other llmc module (pinned by test_engines)
    from llmc.runtimes.catalog import runtime as target_runtime
    from llmc.runtimes.catalog import scheme_keys

    rules = target_runtime(runtime).rules
    for key in scheme_keys(scheme):
        rule = rules.get(key)
        if rule is None or not rule.cpu:
            return f"{runtime}-cpu does not run {key}" + (f" ({rule.cpu_note})" if rule and rule.cpu_note else "")
    return None


ENGINES: Registry[EngineSpec] = Registry("engine")
for _spec in (
    EngineSpec("torch", "llmc.engines.torch_ref:TorchEngine", loads_source=True, every_batch_size=True,
               splits_over_ranks=True, places_on_device=True,
               speed="emulation", emulation_note="llmc's torch reference dequantizes weights and fake-quantizes "
               "activations / KV cache in float: the function of the quantized model, not its speed"),
    EngineSpec("vllm", "llmc.engines.vllm_cpu:VllmEngine", loads_source=True, title="vLLM", cpu_build=True,
               environment=EngineEnvironment(
                   worker="vllm_worker.py", python_variable="LLMC_VLLM_PYTHON", venv=".venv-vllm", module="vllm",
                   setup="bash scripts/setup-vllm.sh",
                   failure_fix="check that this vLLM version accepts the artifact (llmc inspect)")),
    EngineSpec("llama.cpp", "llmc.engines.llamacpp:LlamaCppEngine", loads_source=False,
               environment=EngineEnvironment(
                   worker="llama_worker.py", python_variable="LLMC_LLAMA_PYTHON", venv=".venv-llama",
                   module="llama_cpp", setup="bash scripts/setup-llama.sh",
                   failure_fix="check the GGUF with `llmc inspect`; a crash (-11) at the first eval usually means "
                               "a llama.cpp build for another CPU (bash scripts/setup-llama.sh)")),
    EngineSpec("onnxruntime", "llmc.engines.onnxrt:OnnxRuntimeEngine", loads_source=False,
               emulated_formats=("fp8_e4m3",), emulation_note="ONNX Runtime's CPU execution provider runs FP8 "
               "Q/DQ as float arithmetic (docs/formats-and-runtimes.md): the function, not FP8 speed"),
    EngineSpec("tensorrt-llm", "llmc.engines.trtllm:TensorRtLlmEngine", loads_source=True, title="TensorRT-LLM",
               environment=EngineEnvironment(
                   worker="trtllm_worker.py", python_variable="LLMC_TRTLLM_PYTHON", venv=".venv-trtllm",
                   module="tensorrt_llm",
                   setup="on a GPU machine: python -m venv .venv-trtllm && .venv-trtllm/bin/pip install tensorrt-llm",
                   failure_fix="check that this TensorRT-LLM version accepts the artifact (llmc inspect)")),
    EngineSpec("tensorrt", "llmc.engines.tensorrt:TensorRtEngine", loads_source=False, title="TensorRT"),
    EngineSpec("gptqmodel", "llmc.engines.gptqmodel:GptqModelEngine", loads_source=False, title="GPTQModel",
               environment=EngineEnvironment(
                   worker="gptqmodel_worker.py", python_variable="LLMC_GPTQMODEL_PYTHON", venv=".venv-gptqmodel",
                   module="gptqmodel", setup="bash scripts/setup-gptqmodel.sh",
                   failure_fix="check the checkpoint with `llmc inspect`; LLMC_GPTQMODEL_BACKEND=gptq_torch (or "
                               "awq_torch) picks GPTQModel's plain torch kernel instead of its automatic choice")),
):
    ENGINES.add(_spec.name, _spec)
ENGINE_NAMES: tuple[str, ...] = ENGINES.names()


def engine_spec(name: str) -> EngineSpec:
    """The engine registered as `name` (UnknownName, also a ValueError, naming the registered ones)."""
    return ENGINES[name]


def open_engine(name: str, folder: Path, *, dtype: str = "float32", device: str | None = None,
                streamed: bool | None = None) -> Engine:
    """Load the model in `folder` into engine `name` (EngineUnavailable / EngineFailed when it cannot), on `device`
    where the engine places itself on one; the torch reference streamed or whole as its caller decided
    (llmc.engines.torch_stream.decide_torch_loading)."""
    return engine_spec(name).open(folder, dtype=dtype, device=device, streamed=streamed)
