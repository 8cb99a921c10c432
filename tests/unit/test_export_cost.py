"""The export stages' own work in `llmc plan` (issue 44, "Plan accuracy"): what each format's `cost` adds to writing
and hashing its files, from a probed rate times the work's size (benchmarks/results/planner-log.md, "The export
stages' own work")."""

from __future__ import annotations

import json

from dataclasses import replace

import pytest
import torch

from llmc.formats import base, gptq_format, onnx_genai, onnx_qdq
from llmc.planning.machine import Machine
from llmc.planning.shapes import Shape
from llmc.quant.spec import TensorSpec
from llmc.runtimes import catalog as targets

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": True,
         "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
         "vocab_size": 49152, "num_hidden_layers": 30}


def _work(layers: int = 30, linears: tuple = ((1536, 576), (576, 1536)) * 30) -> targets.ExportWork:
    shape = Shape(params=134_500_000, layers=layers, hidden=576, heads=9, vocab=49152, layer_params=3_540_000,
                  outer_params=28_300_000, largest_linear=1536 * 576, widest_input=1536, intermediate=1536,
                  attn_width=576, active=1.0, stored_bytes=538_000_000)
    written = targets.WrittenTensors(linears=linears, weights=TensorSpec("fp8_e4m3", "channel"),
                                     layer_unquantized=20_000, outer=shape.outer_params, elem=4, kept_elem=4)
    return targets.ExportWork(shape=shape, written=[written], bits=8, packed_bytes=sum(o * i for o, i in linears),
                              outer_bytes=shape.outer_params * 4.0, read_seconds=0.0, shared_with=None,
                              outer_written_before=False, compute="float32",
                              machine=Machine(available=None, gpu_free=None, device="cpu"),
                              config={**LLAMA, "num_hidden_layers": layers})


@pytest.fixture
def pinned(monkeypatch):
    """Rates that are functions of what the cost asks: a tiny export of n layers takes 2 + n s; the quantizer
    runs 1e8 elements/s, insert_qdq 2e7; writing and hashing 1 GB/s."""
    asked: list[tuple[str, int]] = []

    def rate(config: dict, layers: int) -> float:
        asked.append((config["model_type"], layers))
        return 1.0 / (2.0 + layers)

    monkeypatch.setattr(onnx_qdq, "graph_export_rate", rate)
    monkeypatch.setattr(onnx_qdq, "quantize_rate", lambda spec, dtype, elements: 1e8)
    monkeypatch.setattr(onnx_qdq, "insert_qdq_rate", lambda weights, static_inputs: 2e7)
    monkeypatch.setattr(base, "file_write_seconds", lambda nbytes, files=1: nbytes / 1e9)
    return asked


def test_the_onnx_graph_export_is_costed_per_decoder_layer_from_two_probed_sizes(pinned) -> None:
    """torch.onnx's export: the 1-layer export plus each further layer at the probed difference between
    GRAPH_PROBE_LAYERS and 1 layer (here 3 s + 1 s per layer), probed on the model's own family."""
    assert onnx_qdq.graph_export_seconds({**LLAMA, "num_hidden_layers": 30}) == pytest.approx(3.0 + 29 * 1.0)
    assert onnx_qdq.graph_export_seconds({**LLAMA, "num_hidden_layers": 1}) == pytest.approx(3.0)
    assert set(pinned) == {("llama", 1), ("llama", onnx_qdq.GRAPH_PROBE_LAYERS)}


def test_the_onnx_qdq_export_cost_counts_the_graph_and_the_weight_passes(pinned) -> None:
    """`OnnxQdq.cost` adds the graph's export, the float model's pass over the quantized weights and `insert_qdq` at
    its probed rate to the files' write: drop any term and the difference to the base cost no longer matches; all
    grow with the model."""
    fmt = targets.artifact_format("onnx-qdq")
    work = _work()
    plain = base.ArtifactFormat.cost(fmt, "tensorrt", work).seconds
    elements = sum(o * i for o, i in work.written[0].linears)
    graph, passes = 3.0 + 29 * 1.0, onnx_qdq.FLOAT_MODEL_PASSES * elements / 1e8 + elements / 2e7
    assert fmt.cost("tensorrt", work).seconds - plain == pytest.approx(graph + passes)
    # twice the layers: the graph's part per layer and the weights' passes both grow
    deeper = _work(layers=60, linears=((1536, 576), (576, 1536)) * 60)
    added = fmt.cost("tensorrt", deeper).seconds - base.ArtifactFormat.cost(fmt, "tensorrt", deeper).seconds
    assert added == pytest.approx(3.0 + 59 * 1.0 + 2 * passes)


def test_the_graph_probe_builds_a_tiny_model_of_the_family() -> None:
    """The probe's model keeps what changes the graph (family, tied embeddings, biases), at tiny widths."""
    tiny = onnx_qdq.graph_probe_config({**LLAMA, "model_type": "qwen2", "attention_bias": True,
                                        "tie_word_embeddings": False, "layer_types": ["full_attention"] * 30}, 3)
    assert tiny["model_type"] == "qwen2" and tiny["attention_bias"] and not tiny["tie_word_embeddings"]
    assert tiny["num_hidden_layers"] == 3 and tiny["hidden_size"] == 64 and "layer_types" not in tiny


@pytest.mark.heavy
def test_the_graph_probe_exports_its_tiny_model() -> None:
    """The probe's timer runs the exporter's own `_export_float_graph` on the tiny model and returns exports/s."""
    rate = onnx_qdq._graph_timer(onnx_qdq.graph_probe_config(LLAMA, 1))()
    assert 0 < rate < 1e3


def test_insert_qdq_is_costed_per_quantized_weight_at_its_probed_rate(pinned) -> None:
    """`insert_qdq_seconds`: every quantized weight the export writes at the probed rate of the scheme's weights
    (with or without static input scales); twice the weights, twice the time."""
    work = _work()
    elements = sum(o * i for o, i in work.written[0].linears)
    assert onnx_qdq.insert_qdq_seconds(work) == pytest.approx(elements / 2e7)
    doubled = replace(work, written=[work.written[0], work.written[0]])
    assert onnx_qdq.insert_qdq_seconds(doubled) == pytest.approx(2 * elements / 2e7)


def test_the_insert_qdq_probe_times_insert_qdq_itself(monkeypatch) -> None:
    """The probe's timer runs the exporter's own `insert_qdq` on a one-MatMul float graph holding the dequantized
    weight (its check passes: the codes go in), and returns weight elements/s."""
    calls: list[dict] = []
    real = onnx_qdq.insert_qdq

    def counted(model, qm, weights):
        calls.append(real(model, qm, weights))
        return calls[-1]

    monkeypatch.setattr(onnx_qdq, "insert_qdq", counted)
    rate = onnx_qdq._insert_timer(TensorSpec("fp8_e4m3", "channel"), True)()
    assert 0 < rate < 1e12 and calls and calls[0] == {"quantized_matmuls": 1, "activation_qdq": True}


def test_the_onnx_genai_export_cost_counts_the_builder_and_what_feeds_it(monkeypatch, pinned) -> None:
    """`OnnxGenai.cost` adds the builder's run (probed at 1 and BUILDER_PROBE_LAYERS layers of the family: here 6 s
    + 1 s per further layer) and, for int4, the GPTQ intermediate (its files written and read back, every weight
    repacked by llmc and again by the builder's loader, each at its probed rate); for 8-bit, the float model's pass
    and `insert_qdq`. Drop any term and the difference to the base cost no longer matches."""
    asked: list[int] = []

    def rate(config: dict, layers: int) -> float:
        asked.append(layers)
        return 1.0 / (5.0 + layers)

    monkeypatch.setattr(onnx_genai, "builder_rate", rate)
    monkeypatch.setattr(gptq_format, "repack_rate", lambda weights: 4e6)
    monkeypatch.setattr(onnx_genai, "builder_repack_rate", lambda weights: 1e6)
    monkeypatch.setattr(onnx_genai, "file_write_seconds", lambda nbytes, files=1: nbytes / 1e9)
    monkeypatch.setattr(onnx_genai, "uncached_read_seconds", lambda nbytes, files=1: nbytes / 2e9)
    fmt = targets.artifact_format("onnx")
    builder = 6.0 + 29 * 1.0
    assert onnx_genai.builder_seconds({**LLAMA, "num_hidden_layers": 30}) == pytest.approx(builder)
    assert set(asked) == {1, onnx_genai.BUILDER_PROBE_LAYERS}
    eight = _work()
    elements = sum(o * i for o, i in eight.written[0].linears)
    added = fmt.cost("onnxruntime", eight).seconds - base.ArtifactFormat.cost(fmt, "onnxruntime", eight).seconds
    assert added == pytest.approx(builder + onnx_qdq.FLOAT_MODEL_PASSES * elements / 1e8 + elements / 2e7)
    int4_weights = TensorSpec("int4", "group", group_size=64, symmetric=True)
    int4 = replace(eight, bits=4, packed_bytes=elements / 2,
                   written=[replace(eight.written[0], weights=int4_weights)])
    intermediate = targets.artifact_format("gptq").written_bytes(int4.written[0])
    added = fmt.cost("onnxruntime", int4).seconds - base.ArtifactFormat.cost(fmt, "onnxruntime", int4).seconds
    assert added == pytest.approx(builder + intermediate / 1e9 + intermediate / 2e9 + elements / 4e6 + elements / 1e6)


def _int4_work() -> targets.ExportWork:
    work = _work()
    weights = TensorSpec("int4", "group", group_size=64, symmetric=True)
    return replace(work, bits=4, packed_bytes=work.packed_bytes / 2, written=[replace(work.written[0], weights=weights)])


@pytest.mark.parametrize("step", ["llmc's GPTQ repack", "the builder's GPTQ loader"])
def test_a_slower_int4_repack_step_makes_the_planned_export_slower(monkeypatch, pinned, step: str) -> None:
    """The int4 export's per-weight terms are probes of the real code: slow down the step itself (llmc's `to_gptq`,
    which `export_gptq` runs on every block; the builder loader's `repack_quantized_tensor`, which it runs on every
    Linear) and the plan's export time grows by that step's share (the other step's rate pinned). A clock that moves
    only when the step runs (and by a hair per reading) makes the probe's rate exact: a probe that stopped running
    the step would not see it slow down."""
    pytest.importorskip("onnxruntime_genai")
    from onnxruntime_genai.models.loaders import base as loaders

    from llmc.formats import files, gptq_format
    from llmc.planning import probes

    monkeypatch.setattr(files, "REPACK_PROBE_SHAPE", (64, 128))  # the same code on a smaller Linear: fast
    monkeypatch.setattr(onnx_genai, "builder_seconds", lambda config: 0.0)
    monkeypatch.setattr(onnx_genai, "intermediate_seconds", lambda work: 0.0)
    clock, per_call = [0.0], [0.3]

    def perf_counter() -> float:
        clock[0] += 1e-9
        return clock[0]

    monkeypatch.setattr(probes.time, "perf_counter", perf_counter)

    def slowed(real, works=lambda *args: True):
        def run(*args, **kwargs):
            clock[0] += per_call[0] if works(*args) else 0.0
            return real(*args, **kwargs)
        return run

    if step == "llmc's GPTQ repack":
        monkeypatch.setattr(gptq_format, "to_gptq", slowed(gptq_format.to_gptq))
        monkeypatch.setattr(onnx_genai, "builder_repack_rate", lambda weights: 1e6)
    else:
        monkeypatch.setattr(gptq_format, "repack_rate", lambda weights: 1e6)
        monkeypatch.setattr(loaders.QuantizedModel, "repack_quantized_tensor",  # called on every slot, filled or not
                            slowed(loaders.QuantizedModel.repack_quantized_tensor,
                                   lambda model, module, *_: module.qweight is not None))
    fmt, work = targets.artifact_format("onnx"), _int4_work()
    elements = sum(o * i for o, i in work.written[0].linears)
    per_probe_call = 64 * 128  # one block of rows (llmc), one Linear (the loader): one slowed call per probe call

    def planned() -> float:
        monkeypatch.setattr(probes, "_book", probes.RateBook())  # measured again
        return fmt.cost("onnxruntime", work).seconds

    fast = planned()
    assert onnx_genai.repack_seconds(work) == pytest.approx(elements / per_probe_call * 0.3 + elements / 1e6,
                                                            rel=1e-3)
    per_call[0] = 0.9
    assert planned() - fast == pytest.approx(elements / per_probe_call * (0.9 - 0.3), rel=1e-3)


@pytest.mark.parametrize("name", ["gptq", "awq"])
def test_a_slower_repack_makes_the_planned_gptq_or_awq_export_slower_by_that_step(monkeypatch, pinned,
                                                                                   name: str) -> None:
    """Issue 44: the GPTQ and AWQ exports price their repack with a probe of the real code (`files.repack_linear`
    with the format's own codec), not a constant: slow down the codec itself (`to_gptq` / `to_awq`, run once per
    block of rows) and the planned export grows by exactly that step. A named profile has no such probe (0, as
    every host-work term there); a machine file answers it by the kind of probe (`gptq repack`, any scheme)."""
    from llmc.formats import awq_format, files, gptq_format
    from llmc.planning import probes, target

    module, codec = {"gptq": (gptq_format, "to_gptq"), "awq": (awq_format, "to_awq")}[name]
    monkeypatch.setattr(files, "REPACK_PROBE_SHAPE", (64, 128))  # the same code on a smaller Linear: fast
    monkeypatch.setattr(base, "check_seconds", lambda config: 0.0)  # the config check's own probe: not this test's
    clock, per_call = [0.0], [0.3]

    def perf_counter() -> float:
        clock[0] += 1e-9
        return clock[0]

    def slowed(*args, real=getattr(module, codec), **kwargs):
        clock[0] += per_call[0]
        return real(*args, **kwargs)

    monkeypatch.setattr(probes.time, "perf_counter", perf_counter)
    monkeypatch.setattr(module, codec, slowed)
    fmt, work = targets.artifact_format(name), _int4_work()
    elements = sum(o * i for o, i in work.written[0].linears)
    per_probe_call = 64 * 128  # one block of rows: one slowed call per `repack_linear`

    def planned() -> float:
        monkeypatch.setattr(probes, "_book", probes.RateBook())  # measured again
        return fmt.cost(name, work).seconds

    fast = planned()
    assert fmt.repack_seconds(work) == pytest.approx(elements / per_probe_call * 0.3, rel=1e-3)
    assert list(probes.book().measured_now) == [f"{name} repack {work.written[0].weights!r} elements={64 * 128}"]
    per_call[0] = 0.9
    assert planned() - fast == pytest.approx(elements / per_probe_call * (0.9 - 0.3), rel=1e-3)
    with target.planning_for(target.load("h100-sxm")):
        assert fmt.repack_seconds(work) == 0.0
    m = target.TargetMachine(name="m", estimate=False, cpu="", cpu_flags="", cpus=2, memory_bytes=10**10, gpu=None,
                             gpu_count=0, gpu_memory_bytes=0,
                             rates={f"{name} repack TensorSpec(other) elements=1": [2e6, 4e6]})
    with target.planning_for(m):
        assert fmt.repack_seconds(work) == pytest.approx(elements / 3e6)


@pytest.mark.parametrize("group", [32, 128, 256])
def test_the_repack_probe_quantizes_whole_groups_of_any_group_size(monkeypatch, group: int) -> None:
    """The probe's Linear has whole groups of the scheme (its inputs rounded up): a group of 128 does not divide
    REPACK_PROBE_SHAPE's 576 inputs, and `llmc plan recipes/llama31-8b-int4-awq.yaml` failed on it."""
    from llmc.formats import awq_format, files, gptq_format
    from llmc.planning import probes

    monkeypatch.setattr(files, "REPACK_PROBE_SHAPE", (64, 96))  # 96 inputs: whole groups of 32 only
    monkeypatch.setattr(probes, "_book", probes.RateBook())
    weights = TensorSpec("int4", "group", group_size=group, symmetric=True)
    out, inp = files.probe_shape(weights)
    assert out == 64 and inp % group == 0 and 96 <= inp < 96 + group
    assert gptq_format.repack_rate(weights) > 0 and awq_format.repack_rate(weights) > 0
    assert all(k.endswith(f"elements={out * inp}") for k in probes.book().measured_now)


@pytest.mark.heavy
def test_the_builder_probe_runs_the_builder_on_its_tiny_model() -> None:
    """The probe's timer runs onnxruntime-genai's builder (a process of its own) on a tiny float model of the family
    with a tokenizer, as `export_onnx` runs it, and returns runs/s."""
    pytest.importorskip("onnxruntime_genai")
    rate = onnx_genai._builder_timer(LLAMA, 1)()
    assert 0 < rate < 10


def test_the_builder_probe_starts_one_process_per_family_and_prices_its_start_in_every_sample(monkeypatch) -> None:
    """Issue 44: both probe sizes and their repeats run in ONE builder process per family (a process's start and
    imports are most of a run; four of them cost a cold plan minutes under load). Each sample is what one export
    pays: the process's start and imports once, plus one run at that size; builder_seconds stays monotone in
    layers. A second family starts its own process; cached rates start none."""
    import json
    import subprocess
    import types

    from llmc.planning import probes

    launches: list[list] = []
    start_s, per_layer = 30.0, 0.5

    def fake_run(cmd, **kwargs):
        runs = json.loads(cmd[-1])
        launches.append(runs)
        # the first run (the warm-up) loads the builder's lazy imports: 2 s more than its size's later runs
        seconds = [[n, 1.0 + per_layer * n + (2.0 if i == 0 else 0.0)] for i, (n, *_paths) in enumerate(runs)]
        return types.SimpleNamespace(returncode=0, stdout="builder says hi\n" + json.dumps(
            {"start_s": start_s, "runs": seconds}) + "\n", stderr="")

    monkeypatch.setattr(onnx_genai.subprocess, "run", fake_run)
    monkeypatch.setattr(onnx_genai, "_write_probe_model", lambda tiny, folder: None)
    monkeypatch.setattr(probes, "_book", probes.RateBook())
    seconds = {n: onnx_genai.builder_seconds({**LLAMA, "num_hidden_layers": n}) for n in (1, 2, 30)}
    assert len(launches) == 1  # one process for both sizes
    sizes = [n for n, *_ in launches[0]]
    assert sizes[0] == 1 and sorted(sizes[1:]) == sorted([1, onnx_genai.BUILDER_PROBE_LAYERS]
                                                          * onnx_genai.BUILDER_PROBE_REPEATS)
    # one export = start + warm-up's extra (2 s) + one run: 30 + 2 + 1.5 s at 1 layer, then 0.5 s per layer
    assert seconds[1] == pytest.approx(start_s + 2.0 + 1.0 + per_layer)
    assert seconds[30] == pytest.approx(seconds[1] + 29 * per_layer)
    assert seconds[1] < seconds[2] < seconds[30]
    onnx_genai.builder_seconds({**LLAMA, "model_type": "qwen2", "num_hidden_layers": 30})
    assert len(launches) == 2  # another family: its own process
    onnx_genai.builder_seconds({**LLAMA, "num_hidden_layers": 12})
    assert len(launches) == 2  # both sizes cached

    def failed(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ModuleNotFoundError: onnxruntime_genai")

    monkeypatch.setattr(onnx_genai.subprocess, "run", failed)
    with pytest.raises(onnx_genai.EngineFailed, match="onnxruntime_genai"):
        onnx_genai.builder_seconds({**LLAMA, "model_type": "mistral"})


def test_formats_whose_config_names_each_linear_cost_its_check_per_layer(monkeypatch, pinned) -> None:
    """`check_export` builds the model's meta skeleton: compressed-tensors, GPTQ, AWQ and ModelOpt pay it per
    decoder layer (probed at 1 and CHECK_PROBE_LAYERS layers of the model's own config); GGUF and ONNX do not."""
    from llmc.formats import described, gptq_format

    asked: list[int] = []

    def rate(config: dict, layers: int) -> float:
        asked.append(layers)
        return 1.0 / (0.1 + 0.02 * layers)

    monkeypatch.setattr(described, "skeleton_rate", rate)
    # GPTQ / AWQ repack this 8-bit work's weights at their codec's probed rate: not this test's term
    monkeypatch.setattr(gptq_format.RepackedCheckpoint, "repack_seconds", lambda self, work: 0.0)
    assert described.check_seconds({**LLAMA, "num_hidden_layers": 30}) == pytest.approx(0.12 + 29 * 0.02)
    assert set(asked) == {1, described.CHECK_PROBE_LAYERS}
    for name in ("compressed-tensors", "gptq", "awq", "modelopt-hf"):
        fmt = targets.artifact_format(name)
        work = _work()
        added = fmt.cost("t", work).seconds - fmt.cost("t", replace(work, config={})).seconds
        assert added == pytest.approx(0.12 + 29 * 0.02), name
    assert not any(targets.artifact_format(n).describes_linears for n in ("gguf", "onnx", "trtllm-checkpoint"))
    onnx = targets.artifact_format("onnx")  # its config-dependent term is the builder's run, not a config check
    monkeypatch.setattr(onnx_genai, "builder_rate", lambda config, layers: 1.0 / (5.0 + layers))
    assert onnx.cost("t", _work()).seconds - onnx.cost("t", replace(_work(), config={})).seconds == pytest.approx(
        onnx_genai.builder_seconds({**LLAMA, "num_hidden_layers": 30}))


def test_the_check_probe_cuts_per_layer_lists_with_the_layers() -> None:
    """A config with per-layer lists (layer_types) is cut consistently, so transformers builds it."""
    from llmc.formats import described
    from llmc.model.skeleton import config_with_layers

    cut = config_with_layers({**LLAMA, "layer_types": ["full_attention"] * 30, "architectures": ["X"]}, 4)
    assert cut["num_hidden_layers"] == 4 and cut["layer_types"] == ["full_attention"] * 4
    assert cut["architectures"] == ["X"]  # a list of another length stays
    two = {**LLAMA, "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}
    assert config_with_layers(two, 5)["layer_types"] == ["sliding_attention", "full_attention"] * 2 + [
        "sliding_attention"]  # a model of fewer layers than the probe: its pattern repeated
    assert len(described.model_linears(cut)) == 4 * 7 + 1  # llama: q, k, v, o, gate, up, down per layer; lm_head


def test_the_check_probe_carries_per_layer_maps_with_the_layers(tmp_path) -> None:
    """Gemma 4's config.json keeps its full layers' widths in per_layer_config, keyed by layer index: cut or repeated
    with layer_types, so the probe's skeleton builds (a map left at the old indices failed CI: transformers refused
    'full_attention' as not homogeneous)."""
    from llmc.model.skeleton import build_skeleton, config_with_layers
    from tests.unit.families import GEMMA4_GGUF, make_tiny

    config = json.loads((make_tiny("gemma4", tmp_path, **GEMMA4_GGUF) / "config.json").read_text())
    full = {"head_dim": 32, "num_key_value_heads": 1}
    assert config["per_layer_config"] == {"1": full, "3": full}
    longer = config_with_layers(config, 6)
    assert longer["layer_types"][4:] == ["sliding_attention", "full_attention"]
    assert set(longer["per_layer_config"]) == {"1", "3", "5"}
    assert longer["num_kv_shared_layers"] == 3  # half the layers, as in the model
    assert set(config_with_layers(config, 2)["per_layer_config"]) == {"1"}
    assert config_with_layers(config, 2)["num_kv_shared_layers"] == 0  # one would leave no full layer to share
    labels = {"0": "LABEL_0", "1": "LABEL_1"}  # id2label: keyed by index, not by layer
    assert config_with_layers({"num_hidden_layers": 2, "id2label": labels}, 1)["id2label"] == labels
    for layers in (0, 2, 6, 8):
        build_skeleton(config_with_layers(config, layers), torch.float32)  # transformers accepts it


def test_a_profile_plans_no_host_python_work_and_a_machine_file_answers_it_by_class() -> None:
    """A spec-sheet profile has no rate for an export's host work (its plans are estimates): the terms are 0 there.
    A machine file answers another family's or depth's key from the same kind of probe at the same depth."""
    from llmc.formats import described
    from llmc.planning import target

    with target.planning_for(target.load("h100-sxm")):
        assert described.check_seconds(LLAMA) == 0.0 and onnx_qdq.graph_export_seconds(LLAMA) == 0.0
        assert onnx_genai.builder_seconds(LLAMA) == 0.0 and onnx_qdq.insert_qdq_seconds(_work()) == 0.0
    m = target.TargetMachine(name="m", estimate=False, cpu="", cpu_flags="", cpus=2, memory_bytes=10**10, gpu=None,
                             gpu_count=0, gpu_memory_bytes=0,
                             rates={"meta skeleton llama experts=0 layers=1": [10.0],
                                    f"meta skeleton llama experts=0 layers={described.CHECK_PROBE_LAYERS}": [2.0]})
    with target.planning_for(m):
        qwen = {**LLAMA, "model_type": "qwen2"}
        assert described.check_seconds(qwen) == pytest.approx(
            0.1 + (0.5 - 0.1) / (described.CHECK_PROBE_LAYERS - 1) * 29)
        with pytest.raises(target.MachineError, match="torch.onnx export"):
            onnx_qdq.graph_export_seconds(LLAMA)  # a machine file without it: run `llmc probe RECIPE` there


def test_the_first_export_reads_the_canonical_form_from_the_disk_and_later_ones_from_the_page_cache(monkeypatch):
    """The canonical form's large files are written around the page cache: the first export verifies them (read
    around it and hashed) and then reads them through mmap from the disk; a later export of the same quantize stage
    finds them in the page cache when the whole form fits in the memory the plan saw, else reads the disk again.
    Small files (a SmolLM2 layer's 3.5 MB) are copied out of the page cache, verifying them too."""
    from llmc.pipeline.export import canonical_read_seconds
    from llmc.planning import disk, machine
    from llmc.storage.direct_io import DIRECT_MIN_BYTES

    monkeypatch.setattr(disk, "read_rate", lambda: 1e9)
    monkeypatch.setattr(disk, "cached_read_rate", lambda: 10e9)
    monkeypatch.setattr(machine, "hash_rate", lambda: 2e9)
    big_layers, outer = 8 * DIRECT_MIN_BYTES * 4, 2 * DIRECT_MIN_BYTES  # 8 layer files of 4x the threshold
    canonical = big_layers + outer
    first = canonical_read_seconds(canonical, outer, 8, first=True, available=10 * canonical)
    # verify: max(disk, hash) = the disk's 1 GB/s; then the mmap read from the disk again
    assert first == pytest.approx(2 * canonical / 1e9)
    assert canonical_read_seconds(canonical, outer, 8, first=False, available=10 * canonical) == pytest.approx(
        canonical / 10e9)
    assert canonical_read_seconds(canonical, outer, 8, first=False, available=canonical // 2) == pytest.approx(
        canonical / 1e9)
    # 30 small layer files: copied out of the page cache to be hashed, then read from it through mmap
    small = 30 * 3_500_000
    assert canonical_read_seconds(small, 0, 30, first=True, available=None) == pytest.approx(
        small / 10e9 + small / 2e9 + small / 10e9)
