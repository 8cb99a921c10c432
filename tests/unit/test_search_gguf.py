"""quantization.search for llama.cpp: the candidates' bytes are ggml's block sizes (what model.gguf holds), and the
searched mix's GGUF types every Linear as its unit's chosen candidate, its decoder-layer Linears taking exactly the
solved bytes, never more than the budget (a tiny random Llama, tests/unit/families.py make_tiny)."""

from __future__ import annotations

import random
from fractions import Fraction
from pathlib import Path

import pytest
import yaml

from llmc.errors import RecipeError
from llmc.formats.gguf import Gguf
from llmc.formats.registry import artifact_format
from llmc.quant.spec import TensorSpec
from llmc.recipe.load import parse_recipe
from tests.unit.families import make_tiny

Q4_0 = {"name": "Q4_0", "weights": {"format": "int4", "strategy": "group", "group_size": 32}}
Q8_0 = {"name": "Q8_0", "weights": {"format": "int8", "strategy": "group", "group_size": 32}}
CANDIDATES = [Q4_0, "W4A16-MXFP4", "W4A16-NVFP4", Q8_0, "bf16"]
TARGET = {"runtime": "llama.cpp", "gpu_arch": "cpu"}
# ggml's linear tensors in a llama block, and what the search names them
GGUF_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
GGML_TYPE = {"Q4_0": "Q4_0", "Q8_0": "Q8_0", "W4A16-MXFP4": "MXFP4", "W4A16-NVFP4": "NVFP4", "bf16": "F16"}


@pytest.mark.parametrize(("spec", "bits"), [
    (TensorSpec("int4", "group", group_size=32), Fraction(9, 2)),  # Q4_0: 18 bytes a block of 32
    (TensorSpec("int4", "group", group_size=128), Fraction(9, 2)),  # repacked into Q4_0 all the same
    (TensorSpec("int8", "group", group_size=32), Fraction(17, 2)),  # Q8_0: 34 bytes a block of 32
    (TensorSpec("int8", "channel"), Fraction(17, 2)),
    (TensorSpec("mxfp4", "group", group_size=32), Fraction(17, 4)),  # MXFP4: 17 bytes a block of 32
    (TensorSpec("nvfp4", "group", group_size=16), Fraction(9, 2)),  # NVFP4: 36 bytes a block of 64, + `.scale`
    (None, Fraction(16)),  # unquantized: F16 whatever the model's dtype
])
def test_gguf_linear_bytes_are_ggml_block_sizes(spec, bits) -> None:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    fmt = artifact_format(Gguf.name)
    shape = (96, 256)
    scale = 4 if spec is not None and spec.format == "nvfp4" else 0
    got = fmt.linear_weight_bytes(shape, spec, 4)
    assert got == shape[0] * shape[1] * bits / 8 + scale
    if spec is not None:  # the gguf library's own table agrees
        from llmc.formats.gguf import type_plan

        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_plan(spec).weight_type]]
        assert got == Fraction(shape[0] * shape[1] // block * size + scale)
    # an input width no multiple of the type's block: the exporter writes F16
    if spec is not None and spec.format == "nvfp4":
        assert fmt.linear_weight_bytes((96, 96), spec, 4) == 96 * 96 * 2


def test_default_linear_bytes_are_the_stored_bits() -> None:
    fmt = artifact_format("compressed-tensors")
    assert fmt.linear_weight_bytes((16, 64), TensorSpec("nvfp4", "group", group_size=16), 4) == 16 * 64 * Fraction(9, 16)
    assert fmt.linear_weight_bytes((16, 64), TensorSpec("fp8_e4m3", "tensor"), 4) == 16 * 64
    assert fmt.linear_weight_bytes((16, 64), None, 2) == 16 * 64 * 2


def _recipe(model: Path, bits: float, root: Path, candidates=CANDIDATES, **search) -> object:
    text = {"kind": "text", "path": str(root / "text")}  # a few small files: tokenizing Brown would take longer
    return parse_recipe(yaml.safe_dump({
        "name": "tiny-search-gguf", "model": {"source": str(model)},
        "quantization": {"search": {"candidates": candidates, "budget": {"effective_bits": bits},
                                    "granularity": "linear", **search}},
        "calibration": {"dataset": text, "samples": 4, "seq_len": 32, "seed": 0}, "targets": [TARGET],
        "eval": {"corpus": text, "seq_len": 32, "windows": 2}, "publish": {"registry": str(root / "registry")}}))


def test_spelled_out_candidates_parse_and_a_scheme_name_is_not_reused() -> None:
    r = _recipe(Path("/nonexistent"), 5.0, Path("/tmp"))
    search = r.quantization.search
    assert search.names == ("Q4_0", "W4A16-MXFP4", "W4A16-NVFP4", "Q8_0", "bf16")
    members = search.members(r.quantization.algorithm)
    assert members["Q4_0"].weights == TensorSpec("int4", "group", group_size=32)
    assert members["Q8_0"].weights == TensorSpec("int8", "group", group_size=32)
    with pytest.raises(RecipeError) as e:
        _recipe(Path("/x"), 5.0, Path("/tmp"), candidates=[{**Q4_0, "name": "W4A16-INT"}, "bf16"])
    assert e.value.exit_code == 2 and "under a scheme's own name" in str(e.value)
    with pytest.raises(RecipeError) as e:  # named twice
        _recipe(Path("/x"), 5.0, Path("/tmp"), candidates=[Q4_0, {**Q8_0, "name": "Q4_0"}, "bf16"])
    assert "repeat" in str(e.value)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("search-gguf")
    # intermediate 96: down_proj's input is no multiple of NVFP4's ggml block of 64 (F16 there, and so costed)
    make_tiny("llama", root / "model", num_hidden_layers=3, intermediate_size=96)
    words = ("the jury said it did find that many of the voters had been registered in the county while a truth "
             "universally acknowledged holds that a single man in possession of good fortune must want").split()
    rng = random.Random(0)
    (root / "text").mkdir()
    for i in range(4):
        (root / "text" / f"{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(300)))
    return root


def _gguf_linears(path: Path) -> dict[str, tuple[str, int]]:
    """HF Linear name -> (its ggml type, the bytes of its tensors in the file: the weight and NVFP4's `.scale`)."""
    from gguf import GGUFReader

    out: dict[str, tuple[str, int]] = {}
    for t in GGUFReader(str(path)).tensors:
        parts = t.name.split(".")
        if parts[0] != "blk" or parts[2] not in GGUF_LINEARS:
            continue
        hf = f"model.layers.{parts[1]}.{GGUF_LINEARS[parts[2]]}"
        kind, size = out.get(hf, (None, 0))
        out[hf] = (t.tensor_type.name if parts[3] == "weight" else kind, size + int(t.n_bytes))
    return out


@pytest.mark.heavy
def test_searched_gguf_takes_the_solved_bytes_within_the_budget(tiny: Path) -> None:
    from llmc.build import build_until
    from llmc.storage.store import Store

    store = Store(tiny / "cache")
    seen_types: set[str] = set()
    for bits in (4.6, 6.0, 9.0):  # tight, middle, loose: the measurement is cached after the first
        result = build_until(_recipe(tiny / "model", bits, tiny), store, "export")
        chosen = result.search[""]
        [artifact] = result.artifacts.values()
        written = _gguf_linears(Path(artifact.dir) / "model.gguf")
        assert len(written) == 3 * 7
        total = sum(size for _, size in written.values())
        # the file's decoder-layer Linears take the solved bytes exactly, never more than the budget
        assert total == chosen["bytes"] and total <= chosen["budget_bytes"]
        for unit, candidate in chosen["units"].items():  # each Linear in its unit's chosen type
            kind, _ = written[unit]
            fallback = candidate == "W4A16-NVFP4" and unit.endswith("down_proj")  # input 96: F16
            assert kind == ("F16" if fallback else GGML_TYPE[candidate]), (unit, candidate, kind)
            seen_types.add(kind)
    assert len(seen_types) >= 3  # the budgets drew several of ggml's types


def test_with_several_target_formats_each_candidate_costs_the_largest(tiny: Path) -> None:
    """vLLM (compressed-tensors) beside llama.cpp (GGUF): a unit's bytes are the larger file's, so the mix fits both:
    NVFP4 with GGUF's `.scale` per tensor, bf16 in the model's float32 rather than GGUF's F16."""
    from llmc.planning.plan import make_plan

    recipe = parse_recipe(yaml.safe_dump({
        "name": "two-formats", "model": {"source": str(tiny / "model")},
        "quantization": {"search": {"candidates": ["W4A16-NVFP4", "bf16"], "budget": {"effective_bits": 8.0},
                                    "granularity": "linear"}},
        "targets": [{"runtime": "vllm", "gpu_arch": "sm100"}, TARGET]}))
    space = make_plan(recipe, tiny / "model", refuse=False).search[""]
    gguf, ct = artifact_format(Gguf.name), artifact_format("compressed-tensors")
    nvfp4 = TensorSpec("nvfp4", "group", group_size=16)
    shapes = {"q_proj": (64, 64), "k_proj": (64, 64), "v_proj": (64, 64), "o_proj": (64, 64), "gate_proj": (96, 64),
              "up_proj": (96, 64), "down_proj": (64, 96)}
    seen = 0
    for unit, (fp4, kept) in zip(space.units, space.sizes):
        expect_fp4 = expect_kept = Fraction(0)
        for name in unit.linears:
            shape = shapes[name.rsplit(".", 1)[1]]
            expect_fp4 += max(gguf.linear_weight_bytes(shape, nvfp4, 4), ct.linear_weight_bytes(shape, nvfp4, 4))
            expect_kept += shape[0] * shape[1] * 4
        assert (fp4, kept) == (expect_fp4, expect_kept)
        seen += 1
    assert seen == len(space.units) > 0
