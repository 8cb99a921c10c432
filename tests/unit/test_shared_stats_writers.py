"""Two builds recording calibration statistics into one shared folder (llmc.quant.shared_stats): the files only grow
and the completion marker claims what the files hold."""

from __future__ import annotations

from pathlib import Path

import torch

from llmc.quant.shared_stats import SharedStats


def _stats(*linears: str, value: float = 1.0) -> dict[str, dict[str, torch.Tensor]]:
    return {"channel_absmax": {n: torch.full((4,), value) for n in linears}, "key_absmax": {}, "value_absmax": {}}


def test_a_scheme_observing_fewer_modules_never_drops_what_another_recorded(tmp_path: Path) -> None:
    """A search's measurement records every Linear of layer 0 and finishes; a hand-mixed build that leaves layer 0
    unquantized records nothing there, then finishes too: layer 0's statistics stay, and both claims hold."""
    q, k = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"
    up = "model.layers.1.mlp.up_proj"
    measuring, hand = SharedStats(tmp_path, 2), SharedStats(tmp_path, 2)
    measuring.save(0, _stats(q, k))
    measuring.save(1, _stats(up))
    measuring.finish({q, k, up}, set())
    hand.save(0, _stats())  # layer 0 unquantized in this scheme: nothing observed there
    hand.save(1, _stats(up, value=2.0))
    hand.finish({up}, set())
    assert hand.covers({q, k, up}, set()) and measuring.covers({q, k, up}, set())
    assert set(hand.load(0)["channel_absmax"]) == {q, k}
    assert torch.equal(hand.load(1)["channel_absmax"][up], torch.full((4,), 2.0))  # the newest recording of a name


def test_an_incomplete_folder_is_not_claimed(tmp_path: Path) -> None:
    stats = SharedStats(tmp_path, 2)
    stats.save(0, _stats("a"))
    stats.finish({"a"}, set())
    assert not stats.covers({"a"}, set())
