"""lm-evaluation-harness tasks (`eval.tasks`) against the models llmc evaluates, through llmc's torch reference
engine (the artifact as llmc loads it: compressed-tensors weights decompressed, activation and KV-cache
quantization re-applied from the artifact's own scales).

Optional: `pip install llmc[harness]` (lm-eval==0.4.13). A task is a harness task name whose data is present
offline, or the path of a task YAML file (its folder is added to the harness's task search path). Loglikelihood
tasks (multiple choice, loglikelihood) run; generation and rolling-loglikelihood tasks are refused with the reason.

Accuracy is shown with the harness's standard error as a 95% interval (acc ± 1.96·stderr). The gate
`min_task_accuracy_ratio` fails when the artifact's *lower* bound divided by the baseline's accuracy is below
the ratio, so sampling noise cannot hide a drop.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import torch
import yaml

from llmc.data.bos import bos_decision
from llmc.errors import EngineUnavailable, InputError
from llmc.model.dtype import BYTES
from llmc.planning.machine import PROCESS_BYTES, forward_seconds, read_seconds
from llmc.planning.rows import CostRow
from llmc.planning.shapes import Shape
from llmc.result import EvalId, Verdict

Z95 = 1.96


def _harness():
    try:
        # lazy: optional lm-eval (llmc[harness]); absent -> EngineUnavailable
        import lm_eval  # noqa: F401
        from lm_eval.api.model import LM
    except ImportError:
        raise EngineUnavailable("eval.tasks needs lm-evaluation-harness, which is not installed",
                                fix="pip install 'llmc[harness]' (lm-eval==0.4.13), or drop eval.tasks") from None
    return LM


def make_lm(engine, tokenizer, batch_size: int = 8):
    """An lm-eval `LM` over a loaded torch engine (`engine.model`, a transformers causal LM)."""
    LM = _harness()

    class LlmcTorchLM(LM):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.tok = engine.model, tokenizer

        def _encode(self, text: str) -> list[int]:
            return self.tok(text, add_special_tokens=False)["input_ids"]

        def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            out = []
            decision = bos_decision(self.tok)  # a BOS only where the tokenizer adds one, as in every other window
            bos = [decision.token_id] if decision.used else []
            # an empty context still needs one token to predict the first continuation token from (lm-eval's rule)
            prefix = bos or [i for i in (decision.declared_id, self.tok.eos_token_id) if i is not None][:1]
            for req in requests:
                context, continuation = req.args
                ctx, cont = (bos + self._encode(context)) or prefix, self._encode(continuation)
                ids = torch.tensor([ctx + cont])
                with torch.no_grad():
                    logits = self.model(input_ids=ids).logits[0, len(ctx) - 1 : -1].float()
                logp = torch.log_softmax(logits, dim=-1)
                target = torch.tensor(cont)
                out.append((float(logp.gather(-1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())))
            return out

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            raise InputError("rolling-loglikelihood tasks are not supported by llmc's harness model",
                             fix="use llmc's own perplexity (eval.corpus) for perplexity tasks")

        def generate_until(self, requests, disable_tqdm: bool = False):
            raise InputError("generation tasks are not supported by llmc's harness model yet",
                             fix="use multiple-choice or loglikelihood tasks")

    return LlmcTorchLM()


def task_names_and_paths(tasks: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """Harness task names, and the folders to add to its search path, from names or task YAML paths."""
    names, include = [], []
    for t in tasks:
        p = Path(t).expanduser()
        if p.suffix in (".yaml", ".yml"):
            if not p.is_file():
                raise InputError(f"task file '{t}' does not exist", fix="give a task YAML path or a harness task name")
            names.append(yaml.safe_load(p.read_text())["task"])
            include.append(str(p.parent.resolve()))
        else:
            names.append(t)
    return names, sorted(set(include))


def tasks_fingerprint(tasks: tuple[str, ...]) -> dict:
    """What enters the tasks' stage key: names as given, and every task file's (and its folder's data files') hash."""
    out = {}
    for t in tasks:
        p = Path(t).expanduser()
        if p.is_file():
            h = hashlib.sha256()
            for f in sorted(p.parent.iterdir()):
                if f.is_file():
                    h.update(f.name.encode() + b"\0" + f.read_bytes())
            out[t] = h.hexdigest()
        else:
            out[t] = None
    return out


def run_tasks(engine, tokenizer, tasks: tuple[str, ...], *, limit: int | None) -> dict[str, dict]:
    """{task: {acc, stderr, ci_low, ci_high, n, metric}} for one loaded model."""
    _harness()
    # lazy: optional lm-eval (llmc[harness]); absent -> EngineUnavailable via _harness()
    import lm_eval
    from lm_eval.tasks import TaskManager

    names, include = task_names_and_paths(tasks)
    manager = TaskManager(include_path=include or None)
    try:
        results = lm_eval.simple_evaluate(model=make_lm(engine, tokenizer), tasks=names, task_manager=manager,
                                          limit=limit, log_samples=False, bootstrap_iters=1000, random_seed=0,
                                          numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    except (KeyError, ValueError) as e:
        raise InputError(f"lm-evaluation-harness could not run tasks {names}: {e}",
                         fix="check the task names (or task YAML files) and that their data is available offline") from None
    out = {}
    for name in names:
        r = results["results"][name]
        metric = "acc_norm" if "acc_norm,none" in r and "acc,none" not in r else "acc"
        acc, se = float(r[f"{metric},none"]), r.get(f"{metric}_stderr,none")
        se = float(se) if isinstance(se, (int, float)) else 0.0
        n = results.get("n-samples", {}).get(name, {}).get("effective")
        out[name] = {"metric": metric, "acc": acc, "stderr": se, "ci_low": max(0.0, acc - Z95 * se),
                     "ci_high": min(1.0, acc + Z95 * se), "n": n}
    return out


def task_verdicts(ratio: float | None, target: EvalId, baseline: dict | None, measured: dict | None) -> list:
    if ratio is None or baseline is None:
        return []
    verdicts = []
    for name, base in baseline.items():
        m = (measured or {}).get(name)
        if m is None:
            verdicts.append(Verdict(f"min_task_accuracy_ratio:{name}", target, False, "not measured",
                                    f">= {ratio}", "quality"))
            continue
        bound = m["ci_low"] / base["acc"] if base["acc"] > 0 else 1.0
        verdicts.append(Verdict(
            f"min_task_accuracy_ratio:{name}", target, bound >= ratio,
            f"{m['metric']} {m['acc']:.4f} (95% CI {m['ci_low']:.4f} .. {m['ci_high']:.4f}) vs baseline "
            f"{base['acc']:.4f}: lower bound ratio {bound:.4f}", f"lower bound / baseline >= {ratio}", "quality"))
    return verdicts


# What a task costs is not in the recipe (its documents, choices and their lengths live in the harness's data), so
# the plan assumes, per task: eval.task_limit documents, else TASK_DOCUMENTS; REQUESTS_PER_DOCUMENT loglikelihood
# requests (a multiple-choice task's choices) of TOKENS_PER_REQUEST tokens, each one forward at batch 1 (make_lm).
# Stated defaults, not measurements: each row's note says so.
TASK_DOCUMENTS = 1000
REQUESTS_PER_DOCUMENT = 4
TOKENS_PER_REQUEST = 128
# importing lm-evaluation-harness and indexing its tasks (TaskManager), once per scored model: 86-139 s measured on
# the 2-core VM at load 13-16 (docs/planner-constants.md#engine-start-up)
HARNESS_START_S = 86.0


def tasks_cost(shape: Shape, *, tasks: Sequence[str], limit: int | None, streamed: bool, compute: str,
               model_bytes: float) -> CostRow:
    """One model's eval.tasks through the torch reference (`make_lm`): the harness's start, the model's load and every
    request's forward at the machine's probed matmul rate, on the stated defaults above where the recipe does not
    say (eval.task_limit)."""
    documents = limit or TASK_DOCUMENTS
    requests = len(tasks) * documents * REQUESTS_PER_DOCUMENT
    tokens = requests * TOKENS_PER_REQUEST
    e = BYTES[compute]
    gemm = 2 * tokens * (shape.layer_params * shape.active * shape.layers + shape.vocab * shape.hidden)
    attention = 2 * tokens * TOKENS_PER_REQUEST / 2 * shape.attn_width * shape.layers
    forward = forward_seconds(gemm, attention, compute=compute, device="cpu", width=shape.hidden,
                              rows=TOKENS_PER_REQUEST)
    model = (shape.outer_params + shape.layer_params) * e if streamed else shape.params * e
    parts = {"process": PROCESS_BYTES, "model" + (" (one layer resident)" if streamed else ""): model,
             "one request's logits": 2 * TOKENS_PER_REQUEST * shape.vocab * 4}
    seconds = HARNESS_START_S + read_seconds(model_bytes) + forward
    per_task = f"eval.task_limit {limit}" if limit else f"{TASK_DOCUMENTS} (a stated default: eval.task_limit unset)"
    return CostRow("tasks", "cpu", sum(parts.values()), 0.0, 0.0, seconds,
                   "streamed (one layer resident)" if streamed else "whole model",
                   f"{len(tasks)} tasks x {per_task} documents x {REQUESTS_PER_DOCUMENT} requests x "
                   f"{TOKENS_PER_REQUEST} tokens (assumed: a task's sizes are not in the recipe), harness start "
                   f"~{HARNESS_START_S:g} s", parts)
