"""gpt-oss's MXFP4 experts passed through, decided once (issue 44): where every routed expert targets MXFP4 g32 and no
forward pass runs, the layer loop decides `experts_kept` (llmc.quant.loop_plan.decide_experts_kept), the stream copies
the stored codes without decoding or quantizing the experts (llmc.quant.mxfp4_source.pass_through_layer_codes), and
the plan prices exactly that: the layer's stored bytes read, the codes unpacked and written. Before, the stream decoded
every expert, rounded it by RTN, decoded the stored codes again to check it and then wrote those codes; the plan
priced that (~34 min a layer at gpt-oss-120b's widths)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from llmc.model import source_formats
from llmc.model.source import ModelSource
from llmc.pipeline import quantize as quantize_stage
from llmc.planning.plan import plan_recipe
from llmc.quant import mxfp4_source, numerics, stream
from llmc.recipe.load import load_recipe, parse_recipe
from llmc.storage.store import Store
from tests.unit.build_helpers import save_as_mxfp4_original
from tests.unit.families import make_tiny
from tests.unit.test_plan_honest import pin_probes

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "gpt-oss-120b-mxfp4-vllm.yaml"
PASS_THROUGH = {"weights": {"format": "mxfp4", "strategy": "group", "group_size": 32},
                "ignore": ["lm_head", "re:.*self_attn.*"]}
COPY_RATE, DECODE_RATE, KEPT_RATE = 3e8, 3e7, 2e7  # pinned: weights (elements) per second
DISK_READ, WRITE = 1.4e9, 1e9  # pin_probes' defaults: bytes per second


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gpt_oss_passthrough")
    return save_as_mxfp4_original(make_tiny("gpt_oss", root / "dense"), root / "model")


def _scheme(quantization: dict):
    return parse_recipe(yaml.safe_dump({"name": "t", "model": {"source": "x"}, "targets": [{"runtime": "vllm"}],
                                        "quantization": quantization})).quantization.to_scheme()


def test_the_pass_through_decodes_and_quantizes_no_expert_and_writes_the_same_bytes(original: Path, tmp_path: Path,
                                                                                    monkeypatch) -> None:
    """The decided pass-through never decodes an expert nor runs the quantizer on one; the layer files are byte for
    byte those of the old path (decode, RTN, check, then the kept codes), forced here by the decision."""
    scheme = _scheme(PASS_THROUGH)
    calls = {"decode": 0, "quantize": 0}
    decode, quantize = source_formats.decode, numerics.quantize_weight

    def counted_decode(*args, **kwargs):
        calls["decode"] += 1
        return decode(*args, **kwargs)

    def counted_quantize(*args, **kwargs):
        calls["quantize"] += 1
        return quantize(*args, **kwargs)

    monkeypatch.setattr(source_formats, "decode", counted_decode)
    monkeypatch.setattr(numerics, "quantize_weight", counted_quantize)
    kept = stream.quantize_model(ModelSource(original, "t", "t"), scheme, tmp_path / "kept", None)
    assert kept.loop.experts_kept and kept.loop.as_dict()["experts_codes"] == "mxfp4 passed through"
    assert calls == {"decode": 0, "quantize": 0}  # attention and head ignored: nothing else is quantized

    old = stream.quantize_model(ModelSource(original, "t", "t"), scheme, tmp_path / "old", None,
                                stream.StreamOptions(loop=replace(kept.loop, experts_kept=False)))
    assert not old.loop.experts_kept
    assert calls["decode"] > 0 and calls["quantize"] > 0  # the old path: every expert decoded and rounded
    files = sorted(p.relative_to(tmp_path / "kept") for p in (tmp_path / "kept" / "layers").iterdir())
    assert len(files) == 2
    for f in [*files, Path("rest.safetensors")]:
        assert (tmp_path / "kept" / f).read_bytes() == (tmp_path / "old" / f).read_bytes(), f
    meta = json.loads((tmp_path / "kept" / "quantized.json").read_text())
    assert meta["layer_loop"]["experts_codes"] == "mxfp4 passed through"


def test_an_expert_left_unquantized_or_cast_is_decoded(original: Path, tmp_path: Path) -> None:
    """No pass-through where an expert's target is not the source's own MXFP4 g32: an NVFP4 cast, or experts ignored
    (they stay the decoded bf16 weights)."""
    nvfp4 = _scheme({**PASS_THROUGH, "weights": {"format": "nvfp4", "strategy": "group", "group_size": 16}})
    assert not stream.quantize_model(ModelSource(original, "t", "t"), nvfp4, tmp_path / "nvfp4", None).loop.experts_kept
    ignored = _scheme({**PASS_THROUGH, "ignore": [*PASS_THROUGH["ignore"], "re:.*experts.*"]})
    assert mxfp4_source.source_codes_fact("mxfp4", ignored, {
        "model.layers.0.mlp.experts.0.gate_proj": (64, 32), "model.layers.0.self_attn.q_proj": (32, 32)},
        1, "gpt_oss") is None
    assert mxfp4_source.source_codes_fact(None, _scheme(PASS_THROUGH), {
        "model.layers.0.mlp.experts.0.gate_proj": (64, 32)}, 1, "gpt_oss") is None


def _plan(monkeypatch, tmp_path: Path, *overrides: str):
    pin_probes(monkeypatch)
    # the rates themselves (their probes' llmc timers may be replayed from the session: tests/conftest.py)
    monkeypatch.setattr(mxfp4_source, "passed_through_rate", lambda: COPY_RATE)
    monkeypatch.setattr(mxfp4_source, "kept_codes_rate", lambda fmt: KEPT_RATE)
    monkeypatch.setattr(quantize_stage, "decode_rate", lambda fmt: DECODE_RATE)
    recipe = load_recipe(RECIPE, list(overrides))
    plan = plan_recipe(recipe, Store(tmp_path / "cache"), RECIPE)
    (row,) = [r for r in plan.rows if r.name.startswith("quantize")]
    return row


def _widths() -> tuple[int, int]:
    """gpt-oss-120b's routed expert weights in one layer, and the layer's stored bytes of them (MXFP4: half a byte
    a weight and an E8M0 byte per 32)."""
    config = json.loads((REPO / "recipes" / "configs" / "gpt-oss-120b" / "config.json").read_text())
    experts = config["num_local_experts"] * 3 * config["hidden_size"] * config["intermediate_size"]
    return experts, experts // 2 + experts // 32


def test_the_plan_prices_the_pass_through_as_a_copy_of_the_stored_bytes(monkeypatch, tmp_path: Path) -> None:
    """recipes/gpt-oss-120b-mxfp4-vllm.yaml at 120B widths: the quantize row's layer is read (its stored bytes at the
    probed disk rate), its codes unpacked (the probed copy rate) and written (the probed write rate): no decode, no
    quantize part, no bf16 layer held; the layer's time is those three, within the stream's per-layer overhead."""
    row = _plan(monkeypatch, tmp_path)
    assert row.decision.experts_kept and "copied as stored" in row.why
    parts = row.layer_parts
    assert set(parts) == {"read", "forward", "write", "mxfp4 codes copied", "stream overhead"}
    assert parts["forward"] == 0.0
    experts, stored = _widths()
    assert parts["mxfp4 codes copied"] == pytest.approx(experts / COPY_RATE)
    # the layer's stored bytes: the experts' codes and scales, and its bf16 attention, sinks, router and biases
    assert stored < parts["read"] * DISK_READ < 1.05 * stored
    assert experts < parts["write"] * WRITE < 1.05 * experts  # one code a byte
    copy = parts["read"] + parts["mxfp4 codes copied"] + parts["write"]
    assert copy <= row.layer_seconds < 1.02 * copy
    assert row.layer_seconds == pytest.approx(copy + parts["stream overhead"])
    assert row.parts["layer"] < 0.02 * experts * 2  # the experts are never held as bf16 weights
    assert row.parts["layer codes"] >= experts and row.parts["quantizer float32 copy"] == 0.0


def test_a_cast_to_nvfp4_keeps_its_decode_and_quantize_parts(monkeypatch, tmp_path: Path) -> None:
    """The same source bound for NVFP4 experts (a llama.cpp target) is not passed through: every expert is decoded
    (the probed decode rate), rounded and cast (llmc.quant.mxfp4_source.keep_layer_codes)."""
    row = _plan(monkeypatch, tmp_path, "quantization.weights={format: nvfp4, strategy: group, group_size: 16}",
                "targets=[{runtime: llama.cpp}]")
    assert not row.decision.experts_kept
    experts, _ = _widths()
    assert row.layer_parts["decode"] == pytest.approx(experts / DECODE_RATE)
    assert row.layer_parts["mxfp4 codes kept"] == pytest.approx(experts / KEPT_RATE)
    assert row.layer_parts["quantize"] > 0 and "mxfp4 codes copied" not in row.layer_parts
    assert row.layer_seconds > 10 * _plan(monkeypatch, tmp_path / "kept").layer_seconds
