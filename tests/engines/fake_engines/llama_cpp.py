"""Stand-in for llama-cpp-python's Llama, as much of it as llmc's llama.cpp worker uses."""

import numpy as np

from _fake_logits import logits_for

__version__ = "0.0+fake"


class Llama:
    def __init__(self, model_path, **kwargs):
        self.tokens = []

    def reset(self):
        self.tokens = []

    def eval(self, tokens):
        self.tokens += list(tokens)

    @property
    def n_tokens(self):
        return len(self.tokens)

    @property
    def scores(self):
        return logits_for(self.tokens).astype(np.float32)
