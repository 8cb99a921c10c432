"""How far an artifact's next-token distributions moved from the baseline's: KL(baseline ‖ artifact) and top-1.

**Exact full-vocabulary KL, without storing the baseline's logits.** Those would be windows × seq × vocab floats
(16 × 511 tokens of SmolLM2's 49,152-token vocabulary: 1.6 GB; of a 152k vocabulary: 5 GB). But the baseline's
logits are a cheap function of what enters its output head: logits = post(h · Wᵀ + b), h the final hidden state of
a token (576 floats for SmolLM2, 85× fewer than its vocabulary), W and b the head's weight and bias, and post the
model's own processing after the head (Gemma 2/3's final-logit soft-capping, Granite's / Cohere's / Falcon-H1's
scaling). So when the torch engine scores the baseline it records h for every token (a forward hook on the output
head) plus the head once, and every engine that has the artifact's full logits recomputes the baseline's logits
chunk by chunk (a bounded number of tokens at a time, never windows × seq × vocab) and takes the exact KL, for
about the price of one more output-head matmul per token. The alternative, scoring the baseline and the artifact
in the same pass, needs both models loaded at once and cannot pair an engine in another process (llama.cpp) with
the torch baseline; this needs only tensors that cross the wire (llmc/engines/workers/_wire.py).

Verified, not assumed: on the first batch the capture checks that post(h · Wᵀ + b) reproduces the model's actual
logits within a tight tolerance, trying the processing the model's config names (a `logits_scaling` divides in
Granite but multiplies in HyperCLOVA X: both are tried) before none. A model whose head llmc cannot reproduce
keeps no head in its reference, and every engine falls back to the top-k bound below; the evaluation records which
KL it is (`kld_kind`: exact | topk_lower_bound) and the baseline's `output_head` says why, so the report and the
gate can state it.

**The top-k lower bound** (what engines without a usable reference head, and older reports, give): KL over the
baseline's top-k tokens plus one bucket for the rest. Merging the tail into one category can only lower KL (data
processing inequality), so it is a lower bound, tight only when the tail is light: on a 152k vocabulary the
top-256 bound read 0.366 where the full KL was 0.414. It is computed beside the exact KL (`kl_topk_bound`), which
costs a gather, so the two can be compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from safetensors.torch import load_file

from llmc.planning import probes

EXACT, TOPK_BOUND = "exact", "topk_lower_bound"
HEAD_FILE = "head.safetensors"  # beside an eval stage's scores.safetensors: the reference head (baseline only)
HEAD_INPUT = "head_input"  # [windows, seq-1, hidden]: what entered the baseline's output head, per token
HEAD_KEYS = (HEAD_INPUT, "head_weight", "head_bias", "head_scale", "head_softcap")
PER_TOKEN_KEYS = ("topk_logprobs", "topk_index", HEAD_INPUT)  # reference tensors indexed by window
KL_BOUND = "kl_topk_bound"  # score key: the top-k bound, kept beside an exact "kl"
CHUNK_BYTES = 64 << 20  # float32 [rows, vocab] temporaries of one exact-KL chunk, all together


@dataclass(frozen=True)
class HeadPost:
    """What a model does to the output head's result: multiply by `scale`, then soft-cap at `softcap`."""

    scale: float = 1.0
    softcap: float | None = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def describe(self) -> str:
        parts = ([f"x {self.scale:g}"] if self.scale != 1.0 else []) + (
            [f"soft-cap {self.softcap:g}"] if self.softcap else [])
        return ", ".join(parts) or "none"


@dataclass(frozen=True)
class OutputHead:
    """A baseline's output head: logits = post(h · Wᵀ + b), computed in the weight's dtype as the model does."""

    weight: torch.Tensor  # [vocab, hidden]
    bias: torch.Tensor | None
    post: HeadPost

    @property
    def vocab(self) -> int:
        return int(self.weight.shape[0])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [..., vocab] of hidden states [..., hidden]."""
        return self.post.apply(F.linear(hidden.to(self.weight.dtype), self.weight, self.bias)).float()

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"head_weight": self.weight.detach().contiguous(),
               "head_scale": torch.tensor(self.post.scale, dtype=torch.float64),
               "head_softcap": torch.tensor(self.post.softcap or 0.0, dtype=torch.float64)}
        if self.bias is not None:
            out["head_bias"] = self.bias.detach().contiguous()
        return out

    @classmethod
    def from_reference(cls, reference: dict[str, torch.Tensor]) -> OutputHead | None:
        """The head a reference carries (None: it has none, so only the top-k bound can be computed)."""
        if "head_weight" not in reference or HEAD_INPUT not in reference:
            return None
        softcap = float(reference["head_softcap"])
        return cls(reference["head_weight"], reference.get("head_bias"),
                   HeadPost(float(reference["head_scale"]), softcap or None))


def candidate_posts(config) -> list[HeadPost]:
    """The post-head processings `config` suggests, most specific first, no processing last. Which one the model
    really applies is decided by reproducing its logits (HeadCapture), not by trusting an attribute's name."""
    found: list[HeadPost] = []
    configs = [config]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config:
        configs.append(text)
    for cfg in configs:
        softcap = getattr(cfg, "final_logit_softcapping", None)  # Gemma 2/3, Mistral Large 4
        if softcap:
            found.append(HeadPost(softcap=float(softcap)))
        for name, scales in (("logits_scaling", lambda s: (1 / s, s)),  # Granite divides, HyperCLOVA X multiplies
                             ("logit_scale", lambda s: (s,)),  # Cohere
                             ("lm_head_multiplier", lambda s: (s,))):  # Falcon-H1
            value = getattr(cfg, name, None)
            if isinstance(value, (int, float)) and value not in (0, 1):
                found += [HeadPost(scale=float(s)) for s in scales(value)]
    return list(dict.fromkeys(found + [HeadPost()]))


def reproduction_tolerance(logits: torch.Tensor, dtype: torch.dtype) -> float:
    """How close post(h · Wᵀ + b) must come to the model's logits: 1e-4 of their magnitude, plus a few units in
    the last place of the model's dtype (a matmul blocked differently rounds differently)."""
    return (1e-4 + 4 * torch.finfo(dtype).eps) * max(1.0, float(logits.abs().max()))


class HeadCapture:
    """Records, while the torch engine scores the baseline, the input of its output head for every token, after
    checking on the first batch that the head reproduces the model's logits. `report` (JSON) says which
    processing reproduced them and how closely, or why the reference keeps no head."""

    def __init__(self, model: nn.Module) -> None:
        self.inputs: list[torch.Tensor] = []
        self.head: OutputHead | None = None
        self.report: dict = {}
        self._pending: torch.Tensor | None = None
        self._hook = None
        lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if not isinstance(lm_head, nn.Linear):
            self._fail(f"the output head is {type(lm_head).__name__}, not a linear layer llmc can re-apply")
            return
        self._module, self._candidates = lm_head, candidate_posts(model.config)
        self._hook = lm_head.register_forward_hook(self._record)

    def _record(self, _module: nn.Module, args: tuple, _output: torch.Tensor) -> None:
        self._pending = args[0].detach()

    def _fail(self, reason: str) -> None:
        self.report = {"reproduced": False, "reason": reason}
        self.inputs.clear()
        self.close()

    def after_forward(self, logits: torch.Tensor) -> None:
        """Call after each forward pass with its logits [b, seq-1, vocab] (the last position dropped)."""
        if self._hook is None:
            return
        pending, self._pending = self._pending, None
        if pending is None:
            self._fail("the model computed its logits without calling its output head module")
            return
        hidden = pending[:, : logits.shape[1]]
        if self.head is None:
            self._verify(hidden, logits)
            if self.head is None:
                return
        self.inputs.append(hidden.to("cpu", copy=True))  # the reference lives on the host, whatever computed it

    def _verify(self, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        weight = self._module.weight.detach()
        tolerance = reproduction_tolerance(logits, weight.dtype)
        diffs = []
        for post in self._candidates:
            head = OutputHead(weight, None if self._module.bias is None else self._module.bias.detach(), post)
            diff = float((head.logits(hidden) - logits).abs().max())
            diffs.append(f"{post.describe()}: {diff:.3g}")
            if diff <= tolerance:  # NaN never passes
                self.head = head
                self.report = {"reproduced": True, "post": post.describe(), "max_abs_diff": diff,
                               "tolerance": tolerance}
                return
        self._fail(f"h · Wᵀ + b does not reproduce the model's logits under any processing its config names "
                   f"(max |difference| {'; '.join(diffs)}; tolerance {tolerance:.3g})")

    def tensors(self) -> dict[str, torch.Tensor]:
        """The reference's head tensors (empty when the head was not reproduced)."""
        if self.head is None or not self.inputs:
            return {}
        return {HEAD_INPUT: torch.cat(self.inputs), **{k: v.cpu() for k, v in self.head.tensors().items()}}

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def __enter__(self) -> HeadCapture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- scoring


def reference_rows(reference: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    """The reference for windows start..stop: per-token tensors sliced, the head as is."""
    return {k: v[start:stop] if k in PER_TOKEN_KEYS else v for k, v in reference.items()}


def chunk_rows(vocab: int, chunk_bytes: int | None = None) -> int:
    """Tokens per exact-KL chunk: log p, p, log q and their product, float32 [rows, vocab], fit in `chunk_bytes`."""
    return max(1, (chunk_bytes or CHUNK_BYTES) // (vocab * 4 * 4))


def exact_kl(head: OutputHead, head_input: torch.Tensor, logits: torch.Tensor,
             chunk_bytes: int | None = None) -> torch.Tensor:
    """Per-token full-vocabulary KL(baseline ‖ artifact), float64 [...], from the baseline's head input [..., hidden]
    and the artifact's logits [..., vocab], chunk_rows(vocab) tokens at a time."""
    vocab = logits.shape[-1]
    hidden = head_input.reshape(-1, head_input.shape[-1])
    flat = logits.reshape(-1, vocab)
    rows = chunk_rows(vocab, chunk_bytes)
    out = torch.empty(flat.shape[0], dtype=torch.float64, device=flat.device)
    for start in range(0, flat.shape[0], rows):
        log_p = head.logits(hidden[start : start + rows]).log_softmax(-1)
        log_q = flat[start : start + rows].float().log_softmax(-1)
        p = log_p.exp()
        # p = 0 (a -inf baseline logit) contributes nothing, even where the artifact's log q is -inf too
        out[start : start + rows] = torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1, dtype=torch.float64)
    return out.clamp_min(0.0).reshape(logits.shape[:-1])


def score_logits(logits: torch.Tensor, targets: torch.Tensor, top_k: int, reference: dict | None = None
                 ) -> dict[str, torch.Tensor]:
    """Per-token scores of next-token `logits` [b, s, vocab] for `targets` [b, s]: the NLL, plus either
    the top-k log-probs (to serve as a reference) or, given a reference for the same rows, KL(reference || this)
    and top-1 agreement. The KL is exact when the reference carries its output head (then the top-k bound is
    kept as `kl_topk_bound`), else the bound. Every engine with full logits uses it.

    log p = logits - logsumexp(logits): without a reference head only the few entries needed are ever formed, never
    a full-vocabulary log-softmax (that alone cost ~15% on top of the forward pass)."""
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    out = {"nll": (lse.squeeze(-1) - logits.gather(-1, targets[..., None]).squeeze(-1)).double()}
    if reference is None:
        top = logits.topk(top_k, dim=-1)
        out["topk_logprobs"], out["topk_index"] = top.values - lse, top.indices.int()
        return out
    out.update(agreement(reference, logits.gather(-1, reference["topk_index"].long()) - lse, logits.argmax(-1)))
    head = OutputHead.from_reference(reference)
    if head is not None and head.vocab == logits.shape[-1]:
        out[KL_BOUND], out["kl"] = out["kl"], exact_kl(head, reference[HEAD_INPUT], logits)
    return out


def agreement(reference: dict, logprobs_at_reference: torch.Tensor, argmax: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token top-k-bound KL(reference || this) and top-1 agreement, from this model's log-probs at the
    reference's top-k indices and its own argmax (what engines scoring in another process send back)."""
    return {"kl": topk_kl(reference["topk_logprobs"], logprobs_at_reference),
            "top1": (argmax.long() == reference["topk_index"][..., 0].long()).double()}


def with_exact_kl(scores: dict[str, torch.Tensor], kl: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """`scores` with an exact per-token KL an engine computed elsewhere (a worker) as "kl", the bound beside it."""
    if kl is not None:
        scores[KL_BOUND], scores["kl"] = scores["kl"], kl.double()
    return scores


def topk_kl(ref_logprobs: torch.Tensor, new_logprobs_at_ref: torch.Tensor) -> torch.Tensor:
    """KL(ref || new) per token over the reference's top-k tokens plus one bucket for the rest.

    Exact on the top-k; merging the tail into one category can only lower KL (data processing
    inequality), so this is a lower bound of the full-vocabulary KL, tight when the tail is light.
    """
    p = ref_logprobs.double().exp()
    q_top = new_logprobs_at_ref.double()
    kl = (p * (ref_logprobs.double() - q_top)).sum(-1)
    tail_p = (1 - p.sum(-1)).clamp_min(1e-12)
    tail_q = (1 - q_top.exp().sum(-1)).clamp_min(1e-12)
    return (kl + tail_p * (tail_p.log() - tail_q.log())).clamp_min(0.0)


def kld_kind(scores: dict[str, torch.Tensor]) -> str | None:
    """Which KL `scores["kl"]` is: EXACT, TOPK_BOUND, or None when the engine measured none."""
    if "kl" not in scores:
        return None
    return EXACT if KL_BOUND in scores else TOPK_BOUND


# --------------------------------------------------------------------------- storage (an eval stage's folder)


def split_head(scores: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(per-token scores, the reference head): stored apart so that reading a result's NLL never loads the head."""
    return ({k: v for k, v in scores.items() if k not in HEAD_KEYS},
            {k: v for k, v in scores.items() if k in HEAD_KEYS})


def load_reference(folder: Path) -> dict[str, torch.Tensor]:
    """A baseline's stored scores with its head, if it recorded one, as engines take a reference."""
    reference = load_file(str(Path(folder) / "scores.safetensors"))
    if (Path(folder) / HEAD_FILE).is_file():
        reference.update(load_file(str(Path(folder) / HEAD_FILE)))
    return reference


# --------------------------------------------------------------------------- cost (the planner's probe of the scoring)

SCORING_PROBE_ROWS = 64  # tokens per timed call: [64, vocab] float32 logits, 39 MB at a 152k vocabulary
_PROBE_HIDDEN = 8  # the probe's reference head: its matmul negligible (the plan counts the head's FLOPs itself)


def scoring_rate(vocab: int, top_k: int, reference: bool, device: str = "cpu") -> float:
    """Logit elements/s (tokens x vocab) `score_logits` scores at `vocab`: the NLL and top-k of a baseline; with
    `reference`, the agreement and the exact KL against a reference head, less that head's matmul, which the plan
    prices as FLOPs. What an engine scoring full logits spends beside its forward, as the planner times it
    (llmc.planning.probes: timed several times, cached per machine; llmc.planning.target.rate_class groups it by
    `reference` and device)."""
    where = "" if device == "cpu" else f" {device}"
    return probes.rate(f"score_logits reference={reference}{where} vocab={vocab} top_k={top_k}",
                       _scoring_timer(vocab, top_k, reference, device))


def _scoring_timer(vocab: int, top_k: int, reference: bool, device: str):
    """A function timing one `score_logits` of SCORING_PROBE_ROWS tokens and returning its logit elements/s."""
    state: dict = {}

    def sync() -> None:
        if state["logits"].is_cuda:
            torch.cuda.synchronize(state["logits"].device)

    def run_once() -> float:
        if not state:
            g = torch.Generator().manual_seed(0)
            rows, k = SCORING_PROBE_ROWS, max(1, min(top_k, vocab))
            logits = torch.randn(1, rows, vocab, generator=g).to(device)
            targets = torch.randint(0, vocab, (1, rows), generator=g).to(device)
            ref = None
            if reference:
                top = torch.randn(1, rows, vocab, generator=g).topk(k, dim=-1)
                ref = {"topk_logprobs": top.values.log_softmax(-1).to(device),
                       "topk_index": top.indices.int().to(device),
                       HEAD_INPUT: torch.randn(1, rows, _PROBE_HIDDEN, generator=g).to(device),
                       **OutputHead(torch.randn(vocab, _PROBE_HIDDEN, generator=g).to(device), None,
                                    HeadPost(1.0, None)).tensors()}
            state.update(logits=logits, targets=targets, ref=ref, k=k)
            score_logits(logits, targets, k, ref)  # warm-up: first-call dispatch
        return probes.sustained_rate(SCORING_PROBE_ROWS * vocab,
                                     lambda: score_logits(state["logits"], state["targets"], state["k"], state["ref"]),
                                     sync)

    return run_once
