"""Stand-in for vLLM's LLM API, as much of it as llmc's vLLM worker uses (tests/engines/test_workers.py)."""

import numpy as np

from _fake_logits import logits_for

__version__ = "0.0+fake"


class SamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class Logprob:
    def __init__(self, logprob: float):
        self.logprob = logprob


class RequestOutput:
    def __init__(self, prompt_logprobs):
        self.prompt_logprobs = prompt_logprobs


class LLM:
    def __init__(self, **kwargs):
        self.kwargs = kwargs

    def generate(self, prompts, params, use_tqdm=True):
        outputs = []
        for prompt in prompts:
            ids = prompt["prompt_token_ids"]
            logits = logits_for(ids)
            logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
            outputs.append(RequestOutput([None] + [{ids[t]: Logprob(float(logp[t - 1, ids[t]]))}
                                                   for t in range(1, len(ids))]))
        return outputs
