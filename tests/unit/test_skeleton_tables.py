"""The calibration skeleton keeps a plain lookup table (`nn.Embedding`) in the dtype it is stored in and casts the
rows it gathers (issue 44: a 7B's bf16 152k-row embedding was converted into 2.2 GB of float32 before the first
layer, 1.3-3.7 s of the 7B-width quantize stage on the 2-core EPYC VM): the same layer inputs and codes, the table
kept as stored, a scaling embedding (Gemma's) still converted, and the plan counting what the build holds."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import llmc.quant.stream as stream
from llmc.model.checkpoint import CheckpointReader
from llmc.model.skeleton import (build_skeleton, capture_layer_inputs, decoder_layers, gathered_params, materialize,
                                 materialize_skeleton)
from llmc.model.source import ModelSource
from llmc.quant.spec import Scheme, TensorSpec
from tests.conftest import make_tiny_model

REPO = Path(__file__).resolve().parents[2]
SCHEMES = {
    "fp8-static": Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "tensor")),
    "smoothquant": Scheme(TensorSpec("int8", "channel"), TensorSpec("int8", "token", dynamic=True),
                          algorithm="smoothquant"),  # traces the first layer's structure through the skeleton
    "gptq": Scheme(TensorSpec("int4", "group", group_size=32), algorithm="gptq"),
}


def _bf16_model(folder: Path, tie: bool) -> Path:
    """A tiny random Llama stored in bfloat16 (the float32 compute dtype converts it)."""
    make_tiny_model(folder, tie=tie)
    for f in folder.glob("*.safetensors"):
        save_file({n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in load_file(f).items()}, f,
                  metadata={"format": "pt"})
    return folder


def _outer(reader: CheckpointReader, prefix: str) -> dict[str, torch.Tensor]:
    return reader.get_many([n for n in reader.names() if not n.startswith(prefix + ".") and n != "lm_head.weight"])


def test_the_table_stays_as_stored_and_the_first_layer_gets_the_same_inputs(tmp_path: Path) -> None:
    reader = CheckpointReader(_bf16_model(tmp_path / "m", tie=True))
    ids = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    inputs = {}
    for how in ("kept", "converted"):
        model = build_skeleton(reader.config(), torch.float32)
        prefix, layers = decoder_layers(model)
        if how == "kept":
            materialize_skeleton(model, _outer(reader, prefix), torch.float32)
            assert model.get_input_embeddings().weight.dtype == torch.bfloat16
        else:  # as before: every outer tensor converted to the compute dtype
            materialize(model, _outer(reader, prefix), torch.float32)
            assert model.get_input_embeddings().weight.dtype == torch.float32
        hidden: list[torch.Tensor] = []
        extras = capture_layer_inputs(model, layers, [ids], hidden.append)
        inputs[how] = (hidden, extras)
    (kept, kept_extras), (converted, converted_extras) = inputs["kept"], inputs["converted"]
    assert kept[0].dtype == torch.float32 and torch.equal(kept[0], converted[0])
    position = [a for a in kept_extras[0][0][1].values() if isinstance(a, tuple)]  # the rotary tables (cos, sin)
    assert position and all(t.dtype == torch.float32 for t in position[0])
    assert all(torch.equal(a, b) for a, b in zip(position[0],
                                                 [a for a in converted_extras[0][0][1].values()
                                                  if isinstance(a, tuple)][0]))


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("name", list(SCHEMES))
def test_the_codes_are_byte_identical_to_a_converted_table(tmp_path: Path, monkeypatch, name: str,
                                                           tie: bool) -> None:
    folder = _bf16_model(tmp_path / "m", tie=tie)
    calibration = stream.Calibration(torch.randint(3, 200, (4, 16), generator=torch.Generator().manual_seed(0)),
                                     batch_size=2)
    seen: list[torch.dtype] = []

    def recording(model, tensors, dtype):
        materialize_skeleton(model, tensors, dtype)
        seen.append(model.get_input_embeddings().weight.dtype)

    monkeypatch.setattr(stream, "materialize_skeleton", recording)
    stream.quantize_model(ModelSource(folder, "t", "t"), SCHEMES[name], tmp_path / "kept", calibration)
    assert seen == [torch.bfloat16]
    monkeypatch.setattr(stream, "materialize_skeleton", lambda model, tensors, dtype:
                        materialize(model, tensors, dtype))
    stream.quantize_model(ModelSource(folder, "t", "t"), SCHEMES[name], tmp_path / "converted", calibration)

    def digests(out: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((out / "layers").iterdir())}

    assert digests(tmp_path / "kept") == digests(tmp_path / "converted")


def test_a_scaling_embedding_is_converted_and_the_plan_counts_only_plain_tables() -> None:
    """Gemma 3 multiplies its embedding's rows by sqrt(hidden) in the table's dtype, so its table is converted as
    before; the plan's count (`gathered_params`, from a meta skeleton) follows the same rule."""
    from transformers import AutoConfig

    gemma = AutoConfig.for_model("gemma3_text", vocab_size=256, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=16).to_dict()
    model = build_skeleton(gemma, torch.float32)
    table = {"model.embed_tokens.weight": torch.randn(256, 64).to(torch.bfloat16)}
    materialize_skeleton(model, table, torch.float32)
    assert model.get_input_embeddings().weight.dtype == torch.float32
    assert gathered_params(gemma) == 0
    qwen = json.loads((REPO / "recipes" / "configs" / "Qwen2-7B" / "config.json").read_text())
    assert gathered_params(qwen) == qwen["vocab_size"] * qwen["hidden_size"]


def test_the_quantize_plan_holds_a_kept_table_as_stored() -> None:
    """At Qwen2-7B's widths from bf16 in float32: the skeleton's table is 2 bytes a weight, not 4 held (6 while it
    was converted), and its conversion is no longer timed."""
    from dataclasses import replace

    from llmc.model.dtype import BYTES
    from llmc.pipeline.quantize import quantize_cost
    from llmc.planning.machine import Machine
    from llmc.planning.shapes import Shape, from_config
    from llmc.quant.algorithms.catalog import AlgorithmSteps
    from tests.unit.build_helpers import layer_loop

    config = json.loads((REPO / "recipes" / "configs" / "Qwen2-7B" / "config.json").read_text())
    converted = Shape.of(from_config(config), config, BYTES["bfloat16"])
    kept = replace(converted, gathered_params=gathered_params(config))
    fp8 = AlgorithmSteps.of(SCHEMES["fp8-static"])
    kwargs = dict(compute="float32", stored_elem=2, machine=Machine(available=None, gpu_free=None, device="cpu"))
    loop = layer_loop(fp8, activations="memory")
    before, after = quantize_cost(converted, loop, fp8, **kwargs), quantize_cost(kept, loop, fp8, **kwargs)
    table = config["vocab_size"] * config["hidden_size"]
    assert before.parts["outer weights"] - after.parts["outer weights"] == pytest.approx(table * (4 - 2))
    assert after.fixed_seconds < before.fixed_seconds


def test_the_fisher_proxys_tied_head_computes_in_the_compute_dtype(tmp_path: Path, monkeypatch) -> None:
    """quantization.search's fisher pass ties the output head to the skeleton's table: kept as stored, the head
    gets a compute-dtype copy, so the gradients equal those of a converted table."""
    folder = _bf16_model(tmp_path / "m", tie=True)
    scheme = Scheme(TensorSpec("int4", "group", group_size=16))
    windows = torch.randint(3, 200, (4, 16), generator=torch.Generator().manual_seed(0))

    def gradients(work: Path) -> list[torch.Tensor]:
        got: list[torch.Tensor] = []
        stream.measure_model(ModelSource(folder, "t", "t"), scheme, stream.Calibration(windows, batch_size=2), work,
                             lambda i, layer, linears, inputs, extras, outputs, stats, grads: got.extend(grads),
                             gradients=True)
        return got

    kept = gradients(tmp_path / "kept")
    monkeypatch.setattr(stream, "materialize_skeleton", lambda model, tensors, dtype:
                        materialize(model, tensors, dtype))
    converted = gradients(tmp_path / "converted")
    assert len(kept) == len(converted) > 0
    assert all(a.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(kept, converted))
