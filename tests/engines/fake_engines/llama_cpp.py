"""Stand-in for llama-cpp-python's Llama, as much of it as llmc's llama.cpp worker uses."""

import errno
import os
import signal

import numpy as np

from _fake_logits import logits_for

__version__ = "0.0+fake"


class Llama:
    def __init__(self, model_path, **kwargs):
        # LLMC_FAKE_FAILURE: fail as a real engine does when the machine runs out (tests of llmc's runner)
        failure = os.environ.get("LLMC_FAKE_FAILURE")
        if failure == "memory":
            raise MemoryError("std::bad_alloc")
        if failure == "disk":
            raise OSError(errno.ENOSPC, "No space left on device")
        if failure == "oom-killer":
            os.kill(os.getpid(), signal.SIGKILL)
        if failure == "bad-model":
            raise ValueError(f"{model_path}: unknown tensor type 42")
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
