"""Stand-in for GPTQModel, as much of it as llmc's gptqmodel worker uses: GPTQModel.load(...).model, a torch module
with a quantized layer (a `qweight`), whose forward gives deterministic logits and whose generate appends tokens."""

import os
from types import SimpleNamespace

import torch

from _fake_logits import logits_for

__version__ = "0.0+fake"


class TorchQuantLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("qweight", torch.zeros(1, 1, dtype=torch.int32))


class _CausalLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = TorchQuantLinear()

    def forward(self, input_ids):
        rows = [torch.from_numpy(logits_for(ids.tolist())) for ids in input_ids]
        return SimpleNamespace(logits=torch.stack(rows))

    def generate(self, input_ids, max_new_tokens, do_sample=False, **kwargs):
        ids = input_ids
        for _ in range(max_new_tokens):
            nxt = self(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
        return ids


class GPTQModel:
    @staticmethod
    def load(model_id_or_path, device=None, backend="auto", dtype=None, **kwargs):
        if os.environ.get("LLMC_FAKE_FAILURE") == "bad-model":
            raise ValueError(f"{model_id_or_path}: qweight shape mismatch")
        return SimpleNamespace(model=_CausalLM())
