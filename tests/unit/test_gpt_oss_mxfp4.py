"""gpt-oss from its MXFP4 original for vLLM (issue 45): llmc.formats.gpt_oss_mxfp4 writes OpenAI's own layout (the
experts' MXFP4 codes and E8M0 scales re-fused per layer, gate/up rows interleaved, biases fused, everything else as
shipped, `quant_method: mxfp4`), which vLLM's gpt-oss loader reads; the vllm runtime offers it for gpt_oss only where
the source's expert codes pass through and nothing else is quantized, and refuses every other gpt-oss case at plan
time (exit 3; test_moe.test_vllm_targets_of_gpt_oss_are_refused_by_the_plan)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from llmc.errors import IncompatibleTargetError
from llmc.planning.plan import make_plan
from llmc.recipe.load import parse_recipe
from tests.unit.build_helpers import save_as_mxfp4_original
from tests.unit.families import make_tiny

PASS_THROUGH = {"weights": {"format": "mxfp4", "strategy": "group", "group_size": 32},
                "ignore": ["lm_head", "re:.*self_attn.*"]}


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    """A tiny gpt-oss saved as OpenAI ships it (experts MXFP4 `_blocks` / `_scales`, quant_method mxfp4)."""
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    return save_as_mxfp4_original(make_tiny("gpt_oss", root / "dense"), root / "model")


def _recipe(folder: Path, quantization: dict, **target):
    return parse_recipe(yaml.safe_dump({"name": "t", "model": {"source": str(folder)},
                                        "targets": [{"runtime": "vllm", **target}], "quantization": quantization}))


def test_the_mxfp4_original_passed_through_plans_for_vllm_in_openais_layout(original: Path) -> None:
    """The pass-through case plans for vllm with the gpt-oss-mxfp4 exporter (not compressed-tensors)."""
    plan = make_plan(_recipe(original, PASS_THROUGH), original)
    assert [t["exporter"] for t in plan.targets] == ["gpt-oss-mxfp4"]


@pytest.mark.parametrize("case, quantization, target, match", [
    ("attention quantized", {"weights": PASS_THROUGH["weights"], "ignore": ["lm_head"]}, {},
     "quantizes model.layers.0.self_attn.q_proj"),
    ("FP8 experts", {"weights": {"format": "fp8_e4m3", "strategy": "channel"}, "ignore": PASS_THROUGH["ignore"]}, {},
     "not the source's MXFP4 g32"),
    ("W4A16 experts", {"weights": {"format": "int4", "strategy": "group", "group_size": 32},
                       "ignore": PASS_THROUGH["ignore"]}, {}, "not the source's MXFP4 g32"),
    ("NVFP4 experts (a cast, not the source's codes)",
     {"weights": {"format": "nvfp4", "strategy": "group", "group_size": 16}, "ignore": PASS_THROUGH["ignore"]}, {},
     "not the source's MXFP4 g32"),
    ("a KV cache", {**PASS_THROUGH, "kv_cache": {"format": "fp8_e4m3"}}, {}, "KV cache"),
    ("below vLLM's MXFP4 MoE arch", PASS_THROUGH, {"gpu_arch": "sm75"}, "sm80"),
])
def test_every_other_case_of_the_mxfp4_original_is_refused_for_vllm(original: Path, case: str, quantization: dict,
                                                                    target: dict, match: str) -> None:
    with pytest.raises(IncompatibleTargetError, match=match) as refused:
        make_plan(_recipe(original, quantization, **target), original)
    assert refused.value.exit_code == 3, case


def test_the_bf16_gpt_oss_is_refused_even_with_the_pass_through_scheme(original: Path) -> None:
    """No MXFP4 source, nothing to pass through: MXFP4 experts would be rounded anew, so the layout is refused."""
    dense = original.parent / "dense"
    with pytest.raises(IncompatibleTargetError, match="not mxfp4") as refused:
        make_plan(_recipe(dense, PASS_THROUGH), dense)
    assert refused.value.exit_code == 3 and "mxfp4" in refused.value.fix


def test_the_export_holds_the_originals_tensors_and_computes_the_decoded_original(original: Path,
                                                                                  tmp_path: Path) -> None:
    """The quantized form of the pass-through written in OpenAI's layout: every tensor name the original has, the
    experts' `_blocks` / `_scales` byte-identical (gate/up rows interleaved back), every other tensor equal; read back
    by llmc's MXFP4 source decoder (the torch engine) it gives the torch engine's logits on the decoded original, and
    transformers' own Mxfp4 dequantizing load gives them within float tolerance."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from llmc.engines.torch_ref import TorchEngine
    from llmc.formats.gpt_oss_mxfp4 import GptOssMxfp4, export_gpt_oss_mxfp4
    from llmc.model.source import ModelSource
    from llmc.quant import stream
    from llmc.quant.canonical import QuantizedModel
    from tests.unit.test_families import _ids

    scheme = _recipe(original, PASS_THROUGH).quantization.to_scheme()
    stream.quantize_model(ModelSource(original, "t", "t"), scheme, tmp_path / "q", None)
    export = tmp_path / "export"
    export_gpt_oss_mxfp4(QuantizedModel.open(tmp_path / "q"), export)
    assert GptOssMxfp4().recognizes(export)
    source, written = load_file(str(original / "model.safetensors")), load_file(str(export / "model.safetensors"))
    assert set(written) == set(source)
    fused = [k for k in source if k.endswith(("_blocks", "_scales"))]
    assert len(fused) == 8  # 2 layers x gate_up / down x blocks / scales
    for name, tensor in source.items():
        assert written[name].dtype == tensor.dtype and torch.equal(written[name], tensor), name
    ids = _ids(2, 5)
    with torch.no_grad():
        decoded = TorchEngine(original, streamed=False).model(input_ids=ids, use_cache=False).logits
        read_back = TorchEngine(export, streamed=False).model(input_ids=ids, use_cache=False).logits
        hf = AutoModelForCausalLM.from_pretrained(export, quantization_config=Mxfp4Config(dequantize=True),
                                                  dtype=torch.float32).eval()(input_ids=ids).logits
    assert torch.equal(read_back, decoded)
    assert (hf - decoded).abs().max().item() < 1e-4 * max(decoded.abs().max().item(), 1.0)


@pytest.mark.slow  # a whole build: ~100 s on the shared 2-core machine
def test_llmc_build_of_gpt_oss_from_its_mxfp4_original_for_vllm(original: Path, tmp_path: Path) -> None:
    """`llmc build` with `weights: mxfp4 g32` (attention and head ignored) for a vllm target: the artifact is OpenAI's
    layout (the experts' blocks and scales byte-identical to the source's), evaluated by the torch engine as loaded
    from disk against the decoded original: equal scores (nothing was rounded)."""
    from llmc.build import build
    from llmc.storage.store import Store
    from tests.unit.test_build import recipe_text

    overrides = {"quantization": PASS_THROUGH, "eval.runtimes": ["torch"], "gates.max_ppl_increase_pct": 1000.0}
    result = build(parse_recipe(recipe_text(original, tmp_path / "registry", **overrides)), Store(tmp_path / "cache"),
                   publish=False)
    assert result.passed
    (artifact,) = result.artifacts.values()
    assert artifact.format == "gpt-oss-mxfp4"
    source, written = load_file(str(original / "model.safetensors")), load_file(str(artifact.dir / "model.safetensors"))
    for name in (k for k in source if k.endswith(("_blocks", "_scales"))):
        assert torch.equal(written[name], source[name]), name
    (scored,) = [e for e in result.evals.values() if e.ppl_change is not None]
    (baseline,) = [e for e in result.evals.values() if e.ppl_change is None]
    assert scored.engine == "torch" and scored.perplexity == baseline.perplexity
    assert scored.kld["mean"] == 0.0 and scored.top1_agreement["mean"] == 1.0
