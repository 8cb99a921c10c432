"""A probe's cache key names its TensorSpec by `probe_text` (issue 44, F7): a field added to TensorSpec with a
default re-keys no cached rate, today's keys stay as they were (repr), and two specs that differ key differently."""

from __future__ import annotations

import dataclasses

import pytest

from llmc.formats import files, gguf, onnx_genai, onnx_qdq
from llmc.planning import probes
from llmc.quant import numerics
from llmc.quant.spec import TensorSpec, probe_text

SPECS = [TensorSpec("fp8_e4m3", "tensor"), TensorSpec("int4", "group", 64, symmetric=False, zero_grid="nonzero"),
         TensorSpec("int4", "group", 128, scale_grid="fp8_row"), TensorSpec("nvfp4", "group", 16),
         TensorSpec("int8", "token", dynamic=True)]
# TensorSpec as it would be with a field added later (a default, and a value other than it)
LATER = dataclasses.make_dataclass("TensorSpec", [("later", int | None, None)], bases=(TensorSpec,), frozen=True)


def keys_of(spec: TensorSpec, monkeypatch) -> list[str]:
    """The cache key of every probe that names a TensorSpec, for `spec` (nothing timed)."""
    keys: list[str] = []
    monkeypatch.setattr(probes, "rate", lambda key, run_once, repeats=probes.REPEATS: keys.append(key) or 1.0)
    numerics.fake_quantize_rate(spec, "float32", 576, 512)
    numerics.quantize_rate(spec, "float32")
    onnx_qdq.insert_qdq_rate(spec, True)
    gguf.convert_rate(gguf.ConvertWork("Q4_0", "repacked", spec))
    files.repack_rate("gptq", spec, repack=lambda *a: {}, decode=lambda t: t, output_dims={})
    onnx_genai.builder_repack_rate(spec)
    return keys


@pytest.mark.parametrize("spec", SPECS, ids=probe_text)
def test_todays_keys_are_reprs_and_a_new_default_field_keeps_them(spec: TensorSpec, monkeypatch) -> None:
    assert probe_text(spec) == repr(spec)  # the keys rates were cached under before probe_text: none re-measured
    keys = keys_of(spec, monkeypatch)
    assert len(keys) == 6 and all(repr(spec) in k for k in keys)
    later = LATER(**dataclasses.asdict(spec))
    assert repr(later) != repr(spec)  # repr would have re-keyed every rate
    assert keys_of(later, monkeypatch) == keys


def test_specs_that_differ_key_differently(monkeypatch) -> None:
    all_keys = [keys_of(spec, monkeypatch) for spec in SPECS]
    for n in range(6):  # per probe, one key per spec
        assert len({keys[n] for keys in all_keys}) == len(SPECS)
    base = LATER(**dataclasses.asdict(SPECS[0]))
    moved = dataclasses.replace(base, later=3)  # the new field set: a different quantization, a different key
    assert "later=3" in probe_text(moved)
    assert set(keys_of(moved, monkeypatch)).isdisjoint(keys_of(base, monkeypatch))
