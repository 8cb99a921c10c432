"""A build or an evaluation called as a library function gives torch's thread count back: `threads: 1` of one build
left every later build and test in the process on one core (the default test run's second half ran single-threaded)."""

from __future__ import annotations

import pytest
import torch

from llmc import build
from llmc.quant.device import cpu_threads


def test_cpu_threads_sets_then_restores_even_on_error() -> None:
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="inside"):
        with cpu_threads(1):
            assert torch.get_num_threads() == 1
            raise RuntimeError("inside")
    assert torch.get_num_threads() == before
    with cpu_threads(None):
        assert torch.get_num_threads() == before


def test_build_until_gives_the_threads_back(monkeypatch) -> None:
    before = torch.get_num_threads()
    seen = []

    def walk(*args, **kwargs):
        seen.append(torch.get_num_threads())
        raise RuntimeError("stopped after the thread setting")

    monkeypatch.setattr(build, "_build_until", walk)
    with pytest.raises(RuntimeError, match="stopped"):
        build.build_until(object(), object(), "export", threads=1)
    assert seen == [1] and torch.get_num_threads() == before
