"""The target registry (llmc.runtimes): each runtime's record, looked up by the planner, build, inspect and docs."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmc.runtimes import catalog as targets
from llmc.errors import IncompatibleTargetError
from llmc.quant.spec import Scheme, TensorSpec
from llmc.recipe.schema import Target

W4_G32 = Scheme(TensorSpec("int4", "group", group_size=32))


def test_exllamav2_target_gets_gptq_checkpoints_on_cuda_only() -> None:
    from llmc.planning.plan import check_target

    rt = targets.runtime("exllamav2")
    assert rt.format == "gptq" and targets.format_for(Target(runtime="exllamav2")).name == "gptq"
    assert check_target(W4_G32, Target(runtime="exllamav2", gpu_arch="sm80"))[0] == "native"
    with pytest.raises(IncompatibleTargetError, match="no CPU support"):
        check_target(W4_G32, Target(runtime="exllamav2", gpu_arch="cpu"))
    with pytest.raises(IncompatibleTargetError, match="does not run W8A8-FP8"):
        check_target(Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "tensor")),
                     Target(runtime="exllamav2", gpu_arch="sm90"))
    with pytest.raises(IncompatibleTargetError, match="triton"):
        check_target(W4_G32, Target(runtime="exllamav2", gpu_arch="sm80", triton=True))
    assert "exllamav2" in Path("docs/compatibility.md").read_text()


def test_every_runtime_reads_a_registered_format_and_rules_name_known_archs() -> None:
    from llmc.runtimes.names import ARCH_ORDER

    assert len(targets.runtimes()) == 10
    for rt in targets.runtimes():
        for row in rt.matrix_rows():
            assert targets.is_implemented(row.format), (rt.name, row.format)
        assert rt.known_versions and rt.rules
        for key, rule in rt.rules.items():
            for arch in (rule.native_from, rule.degraded_from, rule.native_until):
                assert arch is None or arch in ARCH_ORDER, (rt.name, key, arch)


def test_the_recipe_names_the_registered_runtimes_without_importing_the_catalog() -> None:
    """llmc.recipe.schema takes its `runtime:` choices from the leaf module llmc.runtimes.names, not from the catalog
    (which imports every format module): the names there are the registered runtimes, in registration order."""
    import subprocess
    import sys
    import typing

    from llmc.recipe.schema import Runtime
    from llmc.runtimes.names import RUNTIME_NAMES

    assert RUNTIME_NAMES == targets.runtime_names() == typing.get_args(Runtime)
    code = "import sys, llmc.recipe.schema; print('llmc.runtimes.catalog' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_scheme_names_and_gpu_archs_come_from_one_table_each() -> None:
    """A scheme's name, its capability key and the recipe's accepted pairs all read llmc.quant.spec.SCHEMES;
    the recipe's gpu_arch takes ARCH_ORDER (and cpu)."""
    import typing

    from llmc.quant.spec import KV_CACHE_SCHEMES, SCHEMES
    from llmc.recipe.schema import GpuArch
    from llmc.runtimes.names import ARCH_ORDER

    for (w, a), name in SCHEMES.items():
        for kv in (None, *KV_CACHE_SCHEMES):
            scheme = Scheme(TensorSpec(w, "channel"), TensorSpec(a, "token", dynamic=True) if a else None,
                            TensorSpec(kv, "tensor") if kv else None)
            assert scheme.name == name
            assert targets.scheme_keys(scheme) == [name] + ([KV_CACHE_SCHEMES[kv]] if kv else [])
    assert set(SCHEMES.values()) | set(KV_CACHE_SCHEMES.values()) >= {k for rt in targets.runtimes() for k in rt.rules}
    w4a8 = Scheme(TensorSpec("int4", "channel"), TensorSpec("int8", "token", dynamic=True))  # no runtime runs it
    assert w4a8.name == "int4+int8" and targets.scheme_keys(w4a8) == ["int4+int8"]
    assert typing.get_args(GpuArch) == ("cpu", *ARCH_ORDER)


def test_tensorrt_llm_version_picks_the_checkpoint_format() -> None:
    assert targets.format_for(Target(runtime="tensorrt-llm")).name == "modelopt-hf"
    assert targets.format_for(Target(runtime="tensorrt-llm", version=">=0.12")).name == "modelopt-hf"
    assert targets.format_for(Target(runtime="tensorrt-llm", version="<0.17")).name == "trtllm-checkpoint"


def test_recipe_runtimes_come_from_the_registry() -> None:
    from pydantic import ValidationError

    assert {Target(runtime=name).runtime for name in targets.runtime_names()} == set(targets.runtime_names())
    with pytest.raises(ValidationError):
        Target(runtime="no-such-runtime")


def test_registering_a_name_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="twice"):
        targets.register_runtime(targets.runtime("vllm"))


def test_stage_configs_are_the_keys_builds_had_before_the_registry(tiny_model_session: Path, tmp_path: Path) -> None:
    """Artifacts in users' caches stay valid: each format's stage config is what llmc.build hashed before."""
    from llmc.formats.compressed_tensors import vllm_serve_args
    from llmc.model.source import ModelSource
    from llmc.quant.canonical import QuantizedModel
    from llmc.quant.stream import quantize_model
    from llmc.runtimes.catalog import ExportRequest, target_key

    out = tmp_path / "q"
    quantize_model(ModelSource(folder=tiny_model_session, sha256="x", origin="test"), W4_G32, out, None)
    qm = QuantizedModel.open(out)

    def config(target: Target) -> dict:
        fmt = targets.format_for(target)
        return {"exporter": fmt.name, **fmt.stage_config(ExportRequest(qm, target, max_model_len=512, max_batch_size=4))}

    vllm = Target(runtime="vllm", tensor_parallel=2)
    assert config(vllm) == {"exporter": "compressed-tensors", "target": target_key(vllm),
                            "serve": vllm_serve_args(qm, tensor_parallel=2, max_model_len=512)}
    trt = Target(runtime="tensorrt-llm")
    assert config(trt) == {"exporter": "modelopt-hf", "target": target_key(trt),
                           "options": {"tensor_parallel": 1, "max_batch_size": 4, "max_num_tokens": 8192}}
    legacy = Target(runtime="tensorrt-llm", version="<0.17", tensor_parallel=2)
    assert config(legacy)["options"] == {"tensor_parallel": 2, "dtype": "float16"}
    assert config(Target(runtime="tensorrt")) == {"exporter": "onnx-qdq", "opset": 21}  # shared by every target
    assert config(Target(runtime="llama.cpp", gpu_arch="cpu"))["options"] == {"embedding_type": "f16", "requantize": False}
    assert config(Target(runtime="onnxruntime", gpu_arch="cpu"))["options"] == {"accuracy_level": 4}
    assert config(Target(runtime="lmdeploy"))["serve"]["lmdeploy"]["model_format"] == "awq"
    assert "triton" not in config(vllm)["target"] and "triton" in target_key(Target(runtime="vllm", triton=True))


def test_reports_and_registry_import_neither_the_orchestrator_nor_an_engine() -> None:
    import subprocess
    import sys

    code = ("import sys, llmc.eval.report, llmc.publish.local, llmc.publish.inspect, llmc.result\n"
            "print(sorted(m for m in sys.modules if m == 'llmc.build'\n"
            "             or m.startswith('llmc.engines.') and m != 'llmc.engines.registry'))")  # the registry is data
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_llmc_eval_routes_artifacts_to_the_engines_that_read_their_format(tmp_path: Path) -> None:
    from llmc.errors import InputError
    from llmc.eval.standalone import artifact_folders

    gguf = tmp_path / "gguf-artifact"
    gguf.mkdir()
    (gguf / "model.gguf").write_bytes(b"GGUF")
    assert artifact_folders(gguf, "llama.cpp") == [("gguf-artifact", gguf)]
    with pytest.raises(InputError, match="no artifact the torch engine loads.*gguf"):
        artifact_folders(gguf, "torch")
    plain = tmp_path / "hf"
    plain.mkdir()
    (plain / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    assert artifact_folders(plain, "torch") == [("hf", plain)]
    with pytest.raises(InputError, match="unquantized"):
        artifact_folders(plain, "onnxruntime")  # paired with the torch baseline: it cannot load the source
    with pytest.raises(InputError, match="neither an artifact folder"):
        artifact_folders(tmp_path / "missing", "torch")


def test_a_format_library_that_does_not_import_fails_the_build_before_any_stage_runs(tiny_model: Path, tmp_path: Path,
                                                                                       monkeypatch) -> None:
    import importlib

    import yaml

    from llmc.build import build_until
    from llmc.errors import EngineUnavailable
    from llmc.recipe.load import parse_recipe
    from llmc.formats.compressed_tensors import CompressedTensors
    from llmc.storage.store import Store

    every_format_imports = [m for f in targets.formats() for m in f.libraries]
    assert "compressed_tensors" in every_format_imports and all(importlib.util.find_spec(m) for m in every_format_imports)
    monkeypatch.setattr(CompressedTensors, "libraries", ("compressed_tensors", "llmc_no_such_package"))
    recipe = parse_recipe(yaml.safe_dump({
        "name": "w", "model": {"source": str(tiny_model)},
        "quantization": {"weights": {"format": "fp8_e4m3", "strategy": "channel"}},
        "targets": [{"runtime": "vllm"}], "gates": {"allow_unevaluated": True}}))
    store = Store(tmp_path / "cache")
    with pytest.raises(EngineUnavailable, match="compressed-tensors exporter needs the Python package "
                                                "llmc_no_such_package.*ModuleNotFoundError") as e:
        build_until(recipe, store, "export")
    assert "constraints.txt" in e.value.fix
    assert not (store.root / "stages" / "quantize").exists()  # refused before the quantize stage wrote anything
    build_until(recipe, store, "quantize")  # a build that exports nothing does not need the exporter's packages
    assert (store.root / "stages" / "quantize").is_dir()


def _export_work(**changes) -> targets.ExportWork:
    """A 2-layer 7B-width model's FP8 export, as the export stage hands it to its format (`Export.cost`)."""
    from dataclasses import replace

    from llmc.planning.machine import Machine
    from llmc.planning.shapes import Shape

    shape = Shape(params=2_000_000_000, layers=2, hidden=3584, heads=28, vocab=152064, layer_params=233_000_000,
                  outer_params=1_090_000_000, largest_linear=3584 * 18944, widest_input=18944, intermediate=18944,
                  attn_width=3584, active=1.0, stored_bytes=4_000_000_000)
    linears = ((18944, 3584), (3584, 18944)) * 2
    written = targets.WrittenTensors(linears=linears, weights=TensorSpec("fp8_e4m3", "channel"),
                                     layer_unquantized=10_000, outer=shape.outer_params, elem=2, kept_elem=2)
    work = targets.ExportWork(shape=shape, written=[written], bits=8, packed_bytes=sum(o * i for o, i in linears),
                              outer_bytes=shape.outer_params * 2.0, read_seconds=0.0, shared_with=None,
                              outer_written_before=False, compute="bfloat16",
                              machine=Machine(available=None, gpu_free=None, device="cpu"))
    return replace(work, **changes)


def test_a_format_costs_its_own_export_from_how_its_exporter_works(monkeypatch) -> None:
    """`ArtifactFormat.cost` (issue 44): the export stage asks the format, which reads its own `ExportLayout`:
    compressed-tensors passes 8-bit codes through mmap and links outer weights an earlier export of the same scheme
    wrote as stored; a repacking format pays its repack time; a whole-model exporter holds the float32 model."""
    from llmc.formats import base, gptq_format

    monkeypatch.setattr(base, "file_write_seconds", lambda nbytes, files=1: nbytes / 1e9)  # no disk probe
    ct, gptq, onnx = (targets.artifact_format(n) for n in ("compressed-tensors", "gptq", "onnx"))
    first = ct.cost("vllm", _export_work())
    artifact = ct.written_bytes(_export_work().written[0])
    # the codes stay file pages; the direct-I/O buffers of reading and writing GB files (llmc.storage.direct_io)
    assert first.disk_bytes == artifact and first.host_bytes == base.PROCESS_BYTES + 3 * (16 << 20)
    outer = _export_work().outer_bytes
    assert outer > base.MAX_SHARD_BYTES  # the outer weights are shard files of their own
    second = ct.cost("sglang-tp2", _export_work(outer_written_before=True))
    assert second.disk_bytes == pytest.approx(artifact - outer) and "identical to an earlier export" in second.why
    shared = ct.cost("sglang", _export_work(shared_with="vllm"))
    assert shared.disk_bytes == 0 and "same weight files as vllm" in shared.why
    # a format that does not write the outer weights as stored links none of them
    assert gptq.cost("exllamav2", _export_work(outer_written_before=True)).disk_bytes == gptq.written_bytes(
        _export_work().written[0])
    monkeypatch.setattr(gptq_format, "repack_rate", lambda weights: 5e7)  # the GPTQ codec's probe (issue 44)
    repacked = gptq.cost("exllamav2", _export_work(bits=4))
    assert repacked.seconds - gptq.written_bytes(_export_work().written[0]) / 1e9 == pytest.approx(
        sum(o * i for o, i in _export_work().written[0].linears) / 5e7)
    whole = onnx.cost("onnxruntime", _export_work())
    assert whole.strategy == "whole model in memory" and whole.host_bytes == base.PROCESS_BYTES + 3 * 2e9 * 4


def test_targets_share_weight_files_where_the_format_says_so() -> None:
    """`ArtifactFormat.files_key`: compressed-tensors' files do not depend on tensor_parallel (the TP=2 target links
    the TP=1 one's), the legacy TensorRT-LLM checkpoint's per-rank files do."""
    ct = targets.format_for(Target(runtime="vllm"))
    assert ct.files_key(Target(runtime="vllm", tensor_parallel=2)) == ct.files_key(Target(runtime="sglang"))
    legacy = targets.format_for(Target(runtime="tensorrt-llm", version="<0.17", tensor_parallel=2))
    assert legacy.name == "trtllm-checkpoint"
    assert legacy.files_key(Target(runtime="tensorrt-llm", version="<0.17", tensor_parallel=2)) == (legacy.name, 2)
    assert legacy.files_key(Target(runtime="tensorrt-llm", version="<0.17")) == (legacy.name, 1)
