"""The real workers of the out-of-process engines, run through the shared runner against stand-ins for vLLM,
llama.cpp and TensorRT-LLM (tests/engines/fake_engines: deterministic logits, same API surface). The real
engines' environments are tested in test_vllm_cpu.py / test_trtllm.py / tests/integration where installed;
this runs everywhere and checks that each worker scores what the torch reference scores from the same logits."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from llmc.engines import open_engine
from llmc.engines.environments import _importable_version
from llmc.engines.torch_ref import score_logits

FAKES = Path(__file__).with_name("fake_engines")
_spec = importlib.util.spec_from_file_location("_fake_logits", FAKES / "_fake_logits.py")
fake = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake)


@pytest.fixture
def fake_engines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This Python as every engine's environment, the stand-ins importable in it, a GPU that says so, and a
    model folder (the stand-ins read nothing from it)."""
    for var in ("LLMC_VLLM_PYTHON", "LLMC_LLAMA_PYTHON", "LLMC_TRTLLM_PYTHON", "LLMC_GPTQMODEL_PYTHON"):
        monkeypatch.setenv(var, sys.executable)
    monkeypatch.setenv("PYTHONPATH", str(FAKES))
    nvidia_smi = tmp_path / "bin" / "nvidia-smi"
    nvidia_smi.parent.mkdir()
    nvidia_smi.write_text("#!/bin/sh\n")
    nvidia_smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{nvidia_smi.parent}:{os.environ['PATH']}")
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.gguf").write_bytes(b"")
    (model / "config.json").write_text("{}")
    _importable_version.cache_clear()
    yield model
    _importable_version.cache_clear()


def _windows_and_reference(top_k: int = 8) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(0, fake.VOCAB, (3, 20), generator=g)
    return windows, score_logits(torch.randn(3, 19, fake.VOCAB, generator=g), windows[:, 1:], top_k)


def _expected(windows: torch.Tensor, top_k: int, reference: dict | None) -> dict[str, torch.Tensor]:
    logits = torch.stack([torch.from_numpy(fake.logits_for(w.tolist())[:-1]) for w in windows]).float()
    return score_logits(logits, windows[:, 1:], top_k, reference)


def test_vllm_worker_returns_the_actual_tokens_nll(fake_engines: Path) -> None:
    windows, _ = _windows_and_reference()
    with open_engine("vllm", fake_engines, dtype="float32") as engine:
        scores, tput = engine.measure(windows, windows[:1], decode_tokens=3, repeats=2)
        alone = engine.score(windows)
    assert list(scores) == ["nll"] and scores["nll"].dtype == torch.float64
    assert torch.allclose(scores["nll"], _expected(windows, 8, None)["nll"].double(), atol=1e-5)
    assert torch.equal(alone["nll"], scores["nll"])
    assert tput["engine_version"] == "0.0+fake" and tput["engine_dtype"] == "bfloat16"
    assert tput["prefill_tokens_per_s"]["n"] == 2 and tput["decode_tokens_per_s"]["n"] == 2


# gptqmodel's worker: 7 s of CPU on the 2-core EPYC (load ~15), its other cases stay in the fast tier
@pytest.mark.parametrize("engine_name",
                         ["llama.cpp", "tensorrt-llm", pytest.param("gptqmodel", marks=pytest.mark.heavy)])
def test_full_distribution_workers_score_like_the_torch_reference(fake_engines: Path, engine_name: str) -> None:
    windows, reference = _windows_and_reference()
    with open_engine(engine_name, fake_engines, dtype="float32") as engine:
        scores, tput = engine.measure(windows, windows[:1], decode_tokens=2, repeats=1, reference=reference, top_k=8)
        throughput = engine.throughput(windows[:1], decode_tokens=2, repeats=1)
    want = _expected(windows, 8, reference)
    assert sorted(scores) == ["kl", "nll", "top1"]
    for k in scores:
        assert torch.allclose(scores[k].double(), want[k].double(), atol=1e-5), k
    assert tput["engine_version"] == "0.0+fake" and tput["prompt_tokens"] == 20 and tput["repeats"] == 1
    assert throughput["prefill_tokens_per_s"]["n"] == 1


def test_gptqmodel_worker_names_the_kernel_it_ran(fake_engines: Path) -> None:
    windows, _ = _windows_and_reference()
    with open_engine("gptqmodel", fake_engines, dtype="float32") as engine:
        _, tput = engine.measure(windows, windows[:1], decode_tokens=2, repeats=1)
    assert tput["kernels"] == ["TorchQuantLinear"] and tput["engine_dtype"] == "bfloat16"
    assert tput["backend"] == "auto" and tput["decode_tokens_per_s"]["n"] == 1


@pytest.mark.heavy  # a worker subprocess: 5 s of CPU on the 2-core EPYC (load ~15)
def test_gptqmodel_load_failure_is_a_runtime_failure(fake_engines: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmc.errors import EngineFailed

    monkeypatch.setenv("LLMC_FAKE_FAILURE", "bad-model")
    windows, _ = _windows_and_reference()
    with pytest.raises(EngineFailed, match="qweight shape mismatch") as e:
        with open_engine("gptqmodel", fake_engines, dtype="float32") as engine:
            engine.measure(windows, windows[:1], decode_tokens=0, repeats=1)
    assert "LLMC_GPTQMODEL_BACKEND" in e.value.fix


def test_tensorrt_llm_worker_serves_as_a_baseline(fake_engines: Path) -> None:
    windows, _ = _windows_and_reference()
    with open_engine("tensorrt-llm", fake_engines, dtype="float32") as engine:
        scores = engine.score(windows, top_k=8)
    want = _expected(windows, 8, None)
    assert sorted(scores) == ["nll", "topk_index", "topk_logprobs"]
    assert torch.equal(scores["topk_index"], want["topk_index"])
    assert torch.allclose(scores["topk_logprobs"], want["topk_logprobs"], atol=1e-5)


@pytest.mark.parametrize("failure, message", [
    ("memory", "out of memory in llama.cpp evaluating"),
    ("disk", "disk full writing llama.cpp's files while evaluating"),
    ("oom-killer", "out of memory in llama.cpp evaluating"),
])
def test_a_worker_that_runs_out_is_a_resource_error(fake_engines: Path, failure: str, message: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of memory or disk inside an engine's process is exit 4 with the fix, not "runtime failed": as the
    worker's error.json says, or, for a worker the out-of-memory killer SIGKILLed, as its exit status says."""
    from llmc.errors import ResourceError

    monkeypatch.setenv("LLMC_FAKE_FAILURE", failure)
    windows, _ = _windows_and_reference()
    with pytest.raises(ResourceError) as e:
        with open_engine("llama.cpp", fake_engines, dtype="float32") as engine:
            engine.measure(windows, windows[:1], decode_tokens=1, repeats=1)
    assert e.value.exit_code == 4 and e.value.message.startswith(message), e.value.message
    assert "rerun" in e.value.fix
    if failure == "oom-killer":
        assert "SIGKILL" in e.value.message or "out-of-memory killer" in e.value.message


def test_a_worker_that_fails_otherwise_is_still_a_runtime_failure(fake_engines: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from llmc.errors import EngineFailed

    monkeypatch.setenv("LLMC_FAKE_FAILURE", "bad-model")
    windows, _ = _windows_and_reference()
    with pytest.raises(EngineFailed, match="unknown tensor type 42"):
        with open_engine("llama.cpp", fake_engines, dtype="float32") as engine:
            engine.measure(windows, windows[:1], decode_tokens=1, repeats=1)


def test_llama_worker_computes_the_exact_kl_from_the_reference_head(fake_engines: Path) -> None:
    """The baseline's output-head inputs and head cross the wire; the worker re-applies the head and returns the
    full-vocabulary KL, the same as the torch engine computes from the same logits."""
    from llmc.engines.agreement import EXACT, HEAD_INPUT, KL_BOUND, HeadPost, OutputHead, kld_kind

    windows, _ = _windows_and_reference()
    g = torch.Generator().manual_seed(1)
    head = OutputHead(torch.randn(fake.VOCAB, 16, generator=g), torch.randn(fake.VOCAB, generator=g) * 0.1,
                      HeadPost(scale=0.5, softcap=3.0))
    hidden = torch.randn(3, 19, 16, generator=g)
    reference = {**score_logits(head.logits(hidden), windows[:, 1:], 8), HEAD_INPUT: hidden, **head.tensors()}
    with open_engine("llama.cpp", fake_engines, dtype="float32") as engine:
        scores = engine.score(windows, reference=reference, top_k=8)
    assert kld_kind(scores) == EXACT
    logits = torch.stack([torch.from_numpy(fake.logits_for(w.tolist())[:-1]) for w in windows]).float()
    lp, lq = head.logits(hidden).double().log_softmax(-1), logits.double().log_softmax(-1)
    assert torch.allclose(scores["kl"], (lp.exp() * (lp - lq)).sum(-1), rtol=1e-5, atol=1e-6)
    in_torch = _expected(windows, 8, reference)
    for k in ("kl", KL_BOUND, "top1", "nll"):
        assert torch.allclose(scores[k].double(), in_torch[k].double(), rtol=1e-5, atol=1e-5), k
    assert (scores[KL_BOUND] <= scores["kl"] + 1e-6).all()
