"""Issue 35: the weights quantization does not touch (embeddings, final norm, LM head) keep the source's dtype where
it is no wider than the compute dtype: a bf16 model computed in float32 no longer writes a float32 copy of its
vocabulary (+2.2 GB at a 7B's 152k rows), and what the build computes is unchanged."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from llmc.model.dtype import kept_dtype, kept_elem
from llmc.recipe.load import parse_recipe


def test_kept_dtype_is_the_source_s_unless_wider_than_the_compute_dtype() -> None:
    assert kept_dtype(torch.bfloat16, torch.float32) is torch.bfloat16
    assert kept_dtype(torch.float16, torch.float32) is torch.float16
    assert kept_dtype(torch.float32, torch.float32) is torch.float32
    assert kept_dtype(torch.float32, torch.bfloat16) is torch.bfloat16  # never wider than what the layers are in
    assert kept_elem(2, "float32") == 2 and kept_elem(4, "bfloat16") == 2


def bf16_model(tiny_model_factory, folder: Path) -> Path:
    """A tiny untied model stored in bfloat16, as most Hub checkpoints are."""
    model = tiny_model_factory(folder, tie=False)
    weights = folder / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(weights)).items()}, str(weights),
              metadata={"format": "pt"})
    return model


def dtypes(folder: Path) -> dict[str, str]:
    """Each tensor's dtype as the safetensors headers name it (BF16, F32, F8_E4M3, ...)."""
    out = {}
    for f in folder.rglob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_slice(k).get_dtype() for k in h.keys()})  # noqa: SIM118
    return out


def test_a_bf16_model_computed_in_float32_keeps_its_embeddings_and_head_in_bf16(tiny_model_factory, tmp_path: Path,
                                                                                  monkeypatch) -> None:
    from llmc.build import build_until
    from llmc.engines.torch_stream import build_dense_model
    from llmc.storage.store import Store

    model = bf16_model(tiny_model_factory, tmp_path / "bf16")
    r = parse_recipe(yaml.safe_dump({
        "name": "kept", "model": {"source": str(model), "dtype": "float32"},
        "quantization": {"weights": {"format": "fp8_e4m3", "strategy": "channel"},
                         "activations": {"format": "fp8_e4m3", "strategy": "tensor"}},
        "calibration": {"samples": 4, "seq_len": 32}, "targets": [{"runtime": "vllm"}]}))
    result = build_until(r, Store(tmp_path / "cache"), "export")
    [artifact] = result.artifacts.values()
    canonical = dtypes(next(iter(result.quantized_dirs.values())))
    exported = dtypes(artifact.dir)
    for held in (canonical, exported):
        assert held["model.embed_tokens.weight"] == held["lm_head.weight"] == held["model.norm.weight"] \
            == "BF16"
        assert held["model.layers.0.input_layernorm.weight"] == "F32"  # inside the layers: as computed
        assert held["model.layers.0.mlp.down_proj.weight"] == "F8_E4M3"

    # what the build computes from the artifact: the same logits as from the float32 copies the old form wrote
    # (bf16 -> float32 is exact)
    widened = tmp_path / "widened"
    shutil.copytree(artifact.dir, widened)
    for f in widened.glob("*.safetensors"):
        tensors = load_file(str(f))
        save_file({k: v.float() if v.dtype == torch.bfloat16 else v for k, v in tensors.items()}, str(f),
                  metadata={"format": "pt"})
    assert dtypes(widened)["lm_head.weight"] == "F32"
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        kept = build_dense_model(artifact.dir, torch.float32)(ids).logits
        old = build_dense_model(widened, torch.float32)(ids).logits
    assert torch.equal(kept, old)
