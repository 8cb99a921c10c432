"""Exact full-vocabulary KL from the baseline's recorded output-head inputs (llmc.engines.agreement): equal to the KL
of the full logits, never below the top-k bound, verified per model (soft-capping, logit scaling), chunked."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from llmc.engines import agreement
from llmc.engines.agreement import (EXACT, HEAD_FILE, HEAD_INPUT, KL_BOUND, TOPK_BOUND, HeadPost, OutputHead,
                                    exact_kl, kld_kind)
from llmc.engines.torch_ref import TorchEngine
from llmc.engines.workers import _agreement as worker_agreement
from llmc.result import EvalId

VOCAB = 3000
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=128)


def _save(folder: Path, config, seed: int) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _config(kind: str):
    from transformers import Gemma2Config, Gemma3TextConfig, GraniteConfig, LlamaConfig

    if kind == "llama":
        return LlamaConfig(**SMALL)
    if kind == "gemma2":  # a small cap, so that capping moves these small random logits measurably
        return Gemma2Config(**SMALL, head_dim=16, final_logit_softcapping=2.0)
    if kind == "gemma3":
        return Gemma3TextConfig(**SMALL, head_dim=16, final_logit_softcapping=2.0)
    return GraniteConfig(**SMALL, logits_scaling=4.0)


EXPECTED_POST = {"llama": "none", "gemma2": "soft-cap 2", "gemma3": "soft-cap 2", "granite": "x 0.25"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (baseline folder, artifact folder): the same architecture, the artifact's weights different."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(kind: str) -> tuple[Path, Path]:
        if kind not in made:
            folder, config = tmp_path_factory.mktemp(kind), _config(kind)
            made[kind] = (_save(folder / "base", config, seed=0), _save(folder / "artifact", config, seed=1))
        return made[kind]

    return get


WINDOWS = torch.randint(0, VOCAB, (5, 33), generator=torch.Generator().manual_seed(0))


def _direct_kl(base: Path, artifact: Path) -> torch.Tensor:
    """KL(base ‖ artifact) per token from both models' full logits, in float64."""
    with torch.no_grad():
        lp, lq = (TorchEngine(f, streamed=False).model(input_ids=WINDOWS, use_cache=False).logits[:, :-1].double().log_softmax(-1)
                  for f in (base, artifact))
    return (lp.exp() * (lp - lq)).sum(-1)


@pytest.mark.parametrize("kind", ["llama", "gemma2", "gemma3", "granite"])
def test_exact_kl_equals_the_kl_of_the_full_logits_and_bounds_the_top_k(models, kind: str) -> None:
    base, artifact = models(kind)
    baseline = TorchEngine(base, streamed=False)
    reference = baseline.score(WINDOWS, batch_size=2, top_k=16)
    assert baseline.output_head["reproduced"] and baseline.output_head["post"] == EXPECTED_POST[kind]
    assert reference[HEAD_INPUT].shape == (5, 32, 32) and reference["head_weight"].shape == (VOCAB, 32)

    scores = TorchEngine(artifact, streamed=False).score(WINDOWS, batch_size=2, reference=reference, top_k=16)
    assert kld_kind(scores) == EXACT
    direct = _direct_kl(base, artifact)
    assert torch.allclose(scores["kl"], direct, rtol=1e-4, atol=1e-6)
    assert (scores[KL_BOUND] <= scores["kl"] + 1e-6).all()  # the bound is a lower bound, per token
    assert scores[KL_BOUND].mean() < 0.9 * scores["kl"].mean()  # and a loose one with 16 of 3000 tokens


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "granite"])
def test_a_head_llmc_cannot_reproduce_falls_back_to_the_bound_and_says_why(
        models, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    base, artifact = models(kind)
    # llmc not knowing the model's processing: only "none" is tried, and it does not reproduce the logits
    monkeypatch.setattr(agreement, "candidate_posts", lambda config: [HeadPost()])
    baseline = TorchEngine(base, streamed=False)
    reference = baseline.score(WINDOWS, batch_size=2, top_k=16)
    assert not baseline.output_head["reproduced"] and "does not reproduce" in baseline.output_head["reason"]
    assert not any(k.startswith("head") for k in reference)
    scores = TorchEngine(artifact, streamed=False).score(WINDOWS, batch_size=2, reference=reference, top_k=16)
    assert kld_kind(scores) == TOPK_BOUND and KL_BOUND not in scores
    assert (scores["kl"] <= _direct_kl(base, artifact) + 1e-6).all()


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_a_bfloat16_baseline_reproduces_its_head_in_its_own_dtype(models, kind: str) -> None:
    base, artifact = models(kind)
    baseline = TorchEngine(base, dtype="bfloat16", streamed=False)
    reference = baseline.score(WINDOWS, batch_size=2, top_k=16)
    assert baseline.output_head["reproduced"] and reference["head_weight"].dtype == torch.bfloat16
    scores = TorchEngine(artifact, dtype="bfloat16", streamed=False).score(WINDOWS, batch_size=2, reference=reference, top_k=16)
    assert kld_kind(scores) == EXACT and torch.isfinite(scores["kl"]).all()


def test_exact_kl_works_a_bounded_chunk_of_tokens_at_a_time(models, monkeypatch: pytest.MonkeyPatch) -> None:
    base, artifact = models("llama")
    reference = TorchEngine(base, streamed=False).score(WINDOWS, batch_size=2, top_k=16)
    unchunked = TorchEngine(artifact, streamed=False).score(WINDOWS, batch_size=2, reference=reference, top_k=16)["kl"]

    monkeypatch.setattr(agreement, "CHUNK_BYTES", 7 * VOCAB * 4 * 4)  # 7 tokens' temporaries
    rows_seen: list[int] = []
    original = OutputHead.logits

    def spy(self, hidden):
        rows_seen.append(hidden.shape[0])
        return original(self, hidden)

    monkeypatch.setattr(OutputHead, "logits", spy)
    chunked = TorchEngine(artifact, streamed=False).score(WINDOWS, batch_size=2, reference=reference, top_k=16)["kl"]
    assert max(rows_seen) == 7 and sum(rows_seen) == WINDOWS.shape[0] * (WINDOWS.shape[1] - 1)
    assert len(rows_seen) == 2 * math.ceil(64 / 7) + math.ceil(32 / 7)  # batches of 2, 2 and 1 window(s)
    assert torch.allclose(chunked, unchunked, rtol=1e-5, atol=1e-7)


def _random_head(vocab: int = 500, hidden: int = 24) -> tuple[OutputHead, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    head = OutputHead(torch.randn(vocab, hidden, generator=g) * 0.5, torch.randn(vocab, generator=g) * 0.1,
                      HeadPost(scale=0.7, softcap=4.0))
    return head, torch.randn(2, 9, hidden, generator=g), torch.randn(2, 9, vocab, generator=g) * 3


def test_the_workers_numpy_kl_is_the_same_computation() -> None:
    head, hidden, logits = _random_head()
    want = exact_kl(head, hidden, logits)
    lp, lq = head.logits(hidden).double().log_softmax(-1), logits.double().log_softmax(-1)
    assert torch.allclose(want, (lp.exp() * (lp - lq)).sum(-1), rtol=1e-5, atol=1e-7)
    wire = {"reference_head_input": hidden.numpy(), "reference_head_weight": head.weight.numpy(),
            "reference_head_bias": head.bias.numpy(), "reference_head_post": np.array([0.7, 4.0])}
    got = worker_agreement.reference_head(wire)
    for w in range(2):
        kl = worker_agreement.exact_kl(got, got["input"][w], logits[w].numpy().astype(np.float64), chunk_bytes=1)
        assert np.allclose(kl, want[w].numpy(), rtol=1e-5, atol=1e-7)
    assert worker_agreement.reference_head({"windows": np.zeros(1)}) is None


def test_a_nan_artifact_gives_a_nan_kl_not_a_small_one() -> None:
    head, hidden, logits = _random_head()
    logits[1, 4, 7] = float("nan")
    kl = exact_kl(head, hidden, logits)
    assert kl[1, 4].isnan() and torch.isfinite(kl[0]).all()
    np_head = {"input": hidden.numpy(), "weight": head.weight.numpy(), "bias": head.bias.numpy(),
               "post": np.array([0.7, 4.0])}
    assert np.isnan(worker_agreement.exact_kl(np_head, hidden[1].numpy(), logits[1].numpy())[4])


def test_a_bound_says_so_in_the_gate() -> None:
    from llmc.eval.gates import evaluate_gates
    from llmc.recipe.schema import Gates
    from llmc.result import Evaluation

    kld = {"mean": 0.05, "ci_low": 0.04, "ci_high": 0.06, "level": 0.95}
    gates = Gates(max_mean_kld=0.1)
    bound = Evaluation("trtllm", protocol={"top_k": 256}, kld=kld, kld_kind=TOPK_BOUND)
    exact = Evaluation("torch", protocol={"top_k": 256}, kld=kld, kld_kind=EXACT)
    assert "top-k lower bound (k=256)" in evaluate_gates(gates, "t", bound)[0].measured
    assert "bound" not in evaluate_gates(gates, "t", exact)[0].measured


@pytest.mark.heavy
def test_a_build_stores_the_head_and_gates_on_the_exact_kl(tiny_model: Path, tmp_path: Path) -> None:
    import sys

    from llmc.build import build
    from llmc.eval.report import render_markdown
    from llmc.recipe.load import parse_recipe
    from llmc.storage.store import Store

    sys.path.insert(0, str(Path(__file__).parent))
    from test_build import recipe_text

    store = Store(tmp_path / "cache")
    result = build(parse_recipe(recipe_text(tiny_model, tmp_path / "r", **{"gates.max_mean_kld": 1.0})), store,
                   publish=False)
    base, art = result.evals[EvalId("torch", "baseline")], result.evals[EvalId("torch", "vllm-sm90-tp1")]
    assert base.output_head["reproduced"] and (store.lookup("eval", base.key) / HEAD_FILE).is_file()
    assert not (store.lookup("eval", art.key) / HEAD_FILE).is_file()
    assert art.kld_kind == EXACT and art.kld_bound["mean"] <= art.kld["mean"]
    assert "over the full vocabulary" in render_markdown(result)


def test_the_workers_window_scores_are_torch_log_softmax_nll_top1_and_reference_logprobs() -> None:
    head, hidden, logits = _random_head()  # logits [2 windows, 9 positions, vocab]: positions 0..8 score ids 1..9
    vocab = logits.shape[-1]
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (2, 10), generator=g)
    reference_index = torch.topk(head.logits(hidden), 4, dim=-1).indices
    wire = {"reference_index": reference_index.numpy(), "reference_head_input": hidden.numpy(),
            "reference_head_weight": head.weight.numpy(), "reference_head_bias": head.bias.numpy(),
            "reference_head_post": np.array([0.7, 4.0])}
    scores = worker_agreement.WindowScores(wire)
    for w in range(2):
        scores.add(w, ids[w].numpy(), logits[w].numpy().astype(np.float64))
    got = scores.arrays()

    log_q = logits.double().log_softmax(-1)
    assert np.allclose(got["nll"], -log_q.gather(-1, ids[:, 1:, None])[..., 0].numpy(), atol=1e-9)
    assert (got["top1_index"] == logits.argmax(-1).numpy()).all()
    assert np.allclose(got["logprobs_at_reference"], log_q.gather(-1, reference_index).numpy(), atol=1e-5)
    assert np.allclose(got["kl_exact"], exact_kl(head, hidden, logits).numpy(), rtol=1e-5, atol=1e-7)

    # another vocabulary (a GGUF that trimmed it): no exact KL, the rest still scored; no reference: NLL/top-1 only
    trimmed = worker_agreement.WindowScores(wire)
    trimmed.add(0, ids[0].numpy(), logits[0, :, :-1].numpy().astype(np.float64))
    assert "kl_exact" not in trimmed.arrays() and "logprobs_at_reference" in trimmed.arrays()
    bare = worker_agreement.WindowScores({})
    bare.add(0, ids[0].numpy(), logits[0].numpy().astype(np.float64))
    assert set(bare.arrays()) == {"nll", "top1_index"}
