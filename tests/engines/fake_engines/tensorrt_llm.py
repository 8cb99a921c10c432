"""Stand-in for TensorRT-LLM's LLM API, as much of it as llmc's TensorRT-LLM worker uses."""

import torch

from _fake_logits import logits_for

__version__ = "0.0+fake"


class SamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class CompletionOutput:
    def __init__(self, context_logits):
        self.context_logits = context_logits


class LLM:
    def __init__(self, model, **kwargs):
        self.kwargs = kwargs

    def generate(self, prompts, params):
        return [CompletionOutput(torch.from_numpy(logits_for(ids)).float()
                                 if params.kwargs.get("return_context_logits") else None) for ids in prompts]
