"""Plan-time checks of a model source (llmc.model.checks, llmc.model.tokenizer_files): already-quantized
checkpoints, tokenizer ids past the embedding, inconsistent configs and corrupt tokenizer files are exit 7 from
`llmc plan`, naming the file, the problem and the fix, before any weight moves."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from llmc.cli import main
from llmc.errors import InputError
from llmc.model import checks
from llmc.model.tokenizer_files import TokenizerFacts, load_tokenizer, tokenizer_facts

sys.path.insert(0, str(Path(__file__).parent))
from test_build import recipe_text  # noqa: E402


def plan(model: Path, tmp_path: Path, **overrides) -> tuple[int, str]:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(recipe_text(model, tmp_path / "reg", **overrides))
    result = CliRunner().invoke(main, ["--quiet", "plan", str(recipe), "--cache-dir", str(tmp_path / "cache")])
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def copy_model(tiny: Path, tmp_path: Path, name: str = "m") -> Path:
    return Path(shutil.copytree(tiny, tmp_path / name))


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


# --------------------------------------------------------------------------- already-quantized sources

@pytest.fixture(scope="module")
def fp8_artifact(tiny_model_session: Path, tmp_path_factory) -> Path:
    """llmc's own FP8 output (compressed-tensors, as the vllm target writes it), with a model card naming its
    parent as a Hub id."""
    import llmc.quant.stream as stream
    from llmc.formats.compressed_tensors import export_compressed_tensors
    from llmc.model.source import ModelSource
    from llmc.quant.canonical import QuantizedModel
    from llmc.quant.spec import Scheme, TensorSpec

    work = tmp_path_factory.mktemp("fp8")
    stream.quantize_model(ModelSource(tiny_model_session, "t", "t"), Scheme(TensorSpec("fp8_e4m3", "channel")),
                          work / "q", None)
    export_compressed_tensors(QuantizedModel.open(work / "q"), work / "export")
    return work / "export"


def test_llmc_fp8_artifact_as_source_is_decoded_and_an_unknown_method_refused(fp8_artifact: Path,
                                                                               tmp_path: Path) -> None:
    """compressed-tensors is decoded (tests/unit/test_packed_sources.py); a quant_method no decoder reads is refused,
    naming the parent the model card gives."""
    code, out = plan(fp8_artifact, tmp_path)
    assert code == 0 and "quantized original, compressed-tensors (float-quantized float8 channel)" in out, out
    model = copy_model(fp8_artifact, tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "hqq"}}))
    code, out = plan(model, tmp_path)
    assert code == 7 and "already quantized (hqq" in out, out
    assert "unquantized checkpoint it was made from" in out and not (tmp_path / "cache" / "quantize").exists()
    (model / "README.md").write_text("---\nbase_model: acme/tiny-base\nlicense: mit\n---\n# tiny fp8\n")
    code, out = plan(model, tmp_path)
    assert code == 7 and "model.source: hf:acme/tiny-base" in out, out


def test_fp8_tensors_without_a_quantization_config_are_still_found(fp8_artifact: Path, tmp_path: Path) -> None:
    model = copy_model(fp8_artifact, tmp_path)
    config = json.loads((model / "config.json").read_text())
    del config["quantization_config"]
    (model / "config.json").write_text(json.dumps(config))
    code, out = plan(model, tmp_path)
    assert code == 7 and "already quantized (fp8" in out and "weight_scale" in out, out


def _header(**tensors) -> checks.Tensors:
    return {name.replace("__", "."): value for name, value in tensors.items()}


@pytest.mark.parametrize("config, tensors, kind", [
    ({"quantization_config": {"quant_method": "compressed-tensors"}}, {}, "compressed-tensors"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, {}, "gptq"),
    ({"quantization_config": {"quant_method": "awq"}}, {}, "awq"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, {}, "fp8"),
    ({"quantization_config": {"load_in_4bit": True}}, {}, "bitsandbytes"),
    ({"quantization_config": {"quant_method": "hqq"}}, {}, "hqq"),
    ({}, {"model.layers.0.mlp.down_proj.qweight": ("I32", (16, 64))}, "gptq/awq"),
    ({}, {"model.layers.0.mlp.down_proj.weight_scale_inv": ("F32", (1, 1))}, "fp8"),
    ({}, {"model.layers.0.mlp.down_proj.weight": ("I8", (64, 64))}, "int8"),
    ({}, {"model.layers.0.mlp.down_proj.weight": ("F8_E4M3", (64, 64))}, "fp8"),
    ({}, {"model.layers.0.mlp.down_proj.SCB": ("F32", (64,))}, "bitsandbytes"),
])
def test_every_quantized_kind_is_named(config: dict, tensors: dict, kind: str) -> None:
    found = checks.quantized_kind({"model_type": "llama", **config}, tensors)
    assert found is not None and found.kind == kind
    with pytest.raises(InputError) as e:
        checks.refuse_quantized(found, "/m", None)
    assert f"already quantized ({kind}" in e.value.message and "base_model" in e.value.fix


def test_modelopt_folder_and_unquantized_model(tiny_model_session: Path, tmp_path: Path) -> None:
    assert checks.quantized_kind({"model_type": "llama"}, {"model.embed_tokens.weight": ("BF16", (8, 4))}) is None
    model = copy_model(tiny_model_session, tmp_path)
    (model / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"},
                                                            "quantization": {"quant_algo": "FP8"}}))
    code, out = plan(model, tmp_path)  # a ModelOpt config over float weights: nothing to decode, refused
    assert code == 7 and "NVIDIA ModelOpt FP8" in out and "no tensor holds such codes" in out, out


def test_base_model_from_the_card() -> None:
    assert checks.base_model_of("---\nbase_model: org/name\n---\n") == "org/name"
    assert checks.base_model_of("---\nlicense: mit\nbase_model:\n  - org/first\n  - org/second\n---\n") == "org/first"
    assert checks.base_model_of("no front matter\nbase_model: x/y\n") is None


def test_gguf_source_says_it_is_dequantized_and_requantized() -> None:
    said = checks.gguf_statement("/models/x.Q4_K_M.gguf", "float32")
    assert "x.Q4_K_M.gguf" in said and "dequantizes" in said and "quantizes that model again" in said
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in checks.gguf_statement("demo:smollm2-135m", "bfloat16")
    assert checks.gguf_statement("/models/folder", "float32") is None


# --------------------------------------------------------------------------- tokenizer against the embedding

def test_bos_past_the_embedding_is_refused_at_plan_time(tiny_model_session: Path, tmp_path: Path) -> None:
    """A tokenizer whose BOS is an added token numbered past the embedding (as a tokenizer rebuilt from a GGUF
    header put BOS at 152,065 past Qwen2's 152,064 rows): exit 7 naming the id and the size."""
    model = copy_model(tiny_model_session, tmp_path)
    rows = json.loads((model / "config.json").read_text())["vocab_size"]
    tj = json.loads((model / "tokenizer.json").read_text())
    tj["added_tokens"].append({"id": rows + 1, "content": "<|bos|>", "single_word": False, "lstrip": False,
                               "rstrip": False, "normalized": False, "special": True})
    (model / "tokenizer.json").write_text(json.dumps(tj))
    edit_json(model / "tokenizer_config.json", bos_token="<|bos|>")
    code, out = plan(model, tmp_path)
    assert code == 7, out
    # tokenizers numbers an added token past a gap as the next free id: rows, still past the embedding
    assert f"bos_token is id {rows:,}, past the {rows:,}-row embedding" in out


def test_config_token_ids_and_vocab_size_against_the_embedding(tiny_model_session: Path, tmp_path: Path) -> None:
    model = copy_model(tiny_model_session, tmp_path)
    rows = json.loads((model / "config.json").read_text())["vocab_size"]
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, rows + 5]}))
    code, out = plan(model, tmp_path)
    assert code == 7 and f"generation_config.json's eos_token_id is id {rows + 5:,}" in out, out
    (model / "generation_config.json").unlink()
    edit_json(model / "config.json", vocab_size=rows + 10)
    code, out = plan(model, tmp_path)
    assert code == 7 and f"vocab_size is {rows + 10:,} but model.embed_tokens.weight has {rows:,} rows" in out, out


def test_an_added_token_whose_id_is_taken_is_checked_as_transformers_numbers_it(tiny_model_session: Path,
                                                                                 tmp_path: Path) -> None:
    """tokenizer.json says the new BOS is id 5, which the vocabulary already uses: tokenizers renumbers it to the
    first free id, past the embedding (found by test_fuzz_sources). The loaded tokenizer's ids are checked."""
    model = copy_model(tiny_model_session, tmp_path)
    rows = json.loads((model / "config.json").read_text())["vocab_size"]
    tj = json.loads((model / "tokenizer.json").read_text())
    tj["added_tokens"].append({"id": 5, "content": "<|bos|>", "single_word": False, "lstrip": False, "rstrip": False,
                               "normalized": False, "special": True})
    (model / "tokenizer.json").write_text(json.dumps(tj))
    edit_json(model / "tokenizer_config.json", bos_token="<|bos|>")
    code, out = plan(model, tmp_path)
    assert code == 7 and f"bos_token is id {rows:,}, past the {rows:,}-row embedding" in out, out


def test_facts_of_a_loaded_tokenizer(tiny_model_session: Path) -> None:
    tok = load_tokenizer(tiny_model_session)
    facts = tokenizer_facts(tok)
    assert facts.max_id == len(tok) - 1 and not facts.has_chat_template
    assert {facts.special_ids[r] for r in ("bos_token", "eos_token", "unk_token")} == {
        tok.bos_token_id, tok.eos_token_id, tok.unk_token_id}


def test_vocabulary_check_is_a_pure_function() -> None:
    facts = TokenizerFacts(max_id=99, special_ids={"pad_token": 100})
    with pytest.raises(InputError, match="pad_token is id 100, past the 100-row embedding"):
        checks.check_vocabulary({"vocab_size": 100}, {"model.embed_tokens.weight": ("F32", (100, 8))}, facts, "/m")
    checks.check_vocabulary({"vocab_size": 101}, {"model.embed_tokens.weight": ("F32", (101, 8))}, facts, "/m")
    with pytest.raises(InputError, match="lm_head.weight has 90 rows|past the 90-row"):
        checks.check_vocabulary({}, {"model.embed_tokens.weight": ("F32", (101, 8)),
                                     "lm_head.weight": ("F32", (90, 8))}, facts, "/m")


# --------------------------------------------------------------------------- config and recipe consistency

@pytest.mark.parametrize("change, needle", [
    ({"model_type": "../../etc/llama"}, "is not an architecture name"),
    ({"model_type": "/abs/path"}, "is not an architecture name"),
    ({"head_dim": 24}, "q_proj.weight has 64 rows, but config.json's 4 heads x head_dim 24 make 96"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
    ({"mlp_bias": None}, "transformers refuses it"),  # found by test_fuzz_sources: an internal error before
    ({"model_type": "no_such_family"}, "transformers refuses it"),
])
def test_inconsistent_configs(tiny_model_session: Path, tmp_path: Path, change: dict, needle: str) -> None:
    model = copy_model(tiny_model_session, tmp_path)
    edit_json(model / "config.json", **change)
    code, out = plan(model, tmp_path)
    assert code == 7 and needle in out, out


def test_weights_holding_none_of_the_models_tensors(tiny_model_session: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file
    import torch

    model = copy_model(tiny_model_session, tmp_path)
    for f in model.glob("*.safetensors"):
        f.unlink()
    save_file({"vision.patch.weight": torch.zeros(4, 4)}, str(model / "model.safetensors"))
    code, out = plan(model, tmp_path)
    assert code == 7 and "none of a decoder's" in out, out


def test_seq_len_past_the_context_and_chat_data_without_a_template(tiny_model_session: Path, tmp_path: Path) -> None:
    code, out = plan(tiny_model_session, tmp_path, **{"eval.seq_len": 2048})
    assert code == 7 and "eval.seq_len is 2,048 tokens" in out and "max_position_embeddings 1,024" in out, out
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    code, out = plan(tiny_model_session, tmp_path, **{"calibration.dataset": {"kind": "jsonl", "path": str(chats),
                                                                              "messages": "messages"}})
    assert code == 7 and "no chat template" in out and "chat_template" in out, out


# --------------------------------------------------------------------------- tokenizer files

@pytest.mark.parametrize("name, body, needle", [
    ("tokenizer.json", b"\x00garbage\xff" * 100, "not UTF-8"),
    ("tokenizer.json", b'{"model": 3}', "has no 'model' object"),
    ("tokenizer.json", b"[" * 100_000, "cannot be read as JSON"),
    ("tokenizer_config.json", b"{not json", "is not JSON"),
    ("tokenizer_config.json", b'{"added_tokens_decoder": {"x": {}}}', "not a token id"),
    ("tokenizer_config.json", b'{"bos_token": [1]}', "bos_token is neither a string"),
    ("tokenizer.json", b'{"model": {"vocab": {"a": -1}}}', "not a non-negative whole number"),
    ("special_tokens_map.json", b"[1, 2]", "holds a JSON list"),
])
def test_corrupt_tokenizer_files_are_exit_7(tiny_model_session: Path, tmp_path: Path, name: str, body: bytes,
                                            needle: str) -> None:
    model = copy_model(tiny_model_session, tmp_path)
    (model / name).write_bytes(body)
    code, out = plan(model, tmp_path)
    assert code == 7 and needle in out and name in out, out
    assert "garbage" not in out  # the refused file's bytes are not quoted


def test_huge_tokenizer_is_refused_from_its_size_without_reading_it(tiny_model_session: Path, tmp_path: Path) -> None:
    import resource

    model = copy_model(tiny_model_session, tmp_path)
    with open(model / "tokenizer.json", "wb") as f:  # sparse: 500 MB that take no disk
        f.truncate(500 << 20)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    code, out = plan(model, tmp_path)
    assert code == 7 and "524,288,000 bytes; at most" in out, out
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB: not read whole


def test_load_tokenizer_turns_a_refused_tokenizer_into_exit_7(tiny_model_session: Path, tmp_path: Path) -> None:
    model = copy_model(tiny_model_session, tmp_path)
    tj = json.loads((model / "tokenizer.json").read_text())
    tj["model"]["type"] = "NoSuchModel"
    (model / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(InputError, match="cannot be loaded"):
        load_tokenizer(model)
    assert load_tokenizer(tiny_model_session).bos_token == "<s>"


def test_a_consistent_model_still_plans(tiny_model_session: Path, tmp_path: Path) -> None:
    code, out = plan(tiny_model_session, tmp_path)
    assert code == 0, out
