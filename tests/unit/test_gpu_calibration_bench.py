"""benchmarks/gpu_calibration.py, the one command a lent GPU machine runs (docs/gpu.md): every scheme pair it
names is a valid llmc Scheme at every shape it offers (at bb4e556 the W4 pairs kept an unfilled `{group}`), the
synthetic checkpoint it writes has the named shape and a tokenizer that loads offline, the floor runs on the host, and
(slow) the whole run on this CPU at a tiny width writes every row it promises."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmc.quant.spec import Scheme, TensorSpec

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _module(name: str):
    sys.path.insert(0, str(BENCH))  # the benchmarks import their siblings, as when run as scripts
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


gpu = _module("gpu_calibration")


@pytest.mark.parametrize("shape", sorted(gpu.SHAPES))
@pytest.mark.parametrize("scheme", gpu.SCHEMES)
def test_every_pair_is_a_scheme_with_a_group_dividing_the_shape(shape: str, scheme: str) -> None:
    group = gpu.int4_group(shape)
    expr, peer = gpu.scheme_pair(scheme, group)
    built = eval(expr, {"Scheme": Scheme, "TensorSpec": TensorSpec})  # what _llmc_gpu_child.py does
    assert isinstance(built, Scheme) and peer
    hidden, inter = gpu.SHAPES[shape][:2]
    if built.weights.strategy == "group":
        assert built.weights.group_size == group and hidden % group == 0 and inter % group == 0
    if shape.startswith("llama"):
        assert group == 128  # both tools' usual W4A16 group at Llama widths


def test_fp8_static_pair_is_channel_weights_and_static_tensor_activations() -> None:
    built = eval(gpu.scheme_pair("fp8-static", 128)[0], {"Scheme": Scheme, "TensorSpec": TensorSpec})
    assert built.weights == TensorSpec("fp8_e4m3", "channel")
    assert built.activations == TensorSpec("fp8_e4m3", "tensor") and built.stores_ranges
    assert built.algorithm == "rtn"


def test_the_peer_recipe_for_fp8_static_matches_llmc_format() -> None:
    pytest.importorskip("llmcompressor")
    modifier = _module("_llmcompressor_child").recipe("fp8-static")[0]
    scheme = modifier.config_groups["group_0"]
    assert (scheme.weights.type, scheme.weights.num_bits, scheme.weights.strategy) == ("float", 8, "channel")
    acts = scheme.input_activations
    assert (acts.type, acts.strategy, acts.dynamic) == ("float", "tensor", False)


def test_the_synthetic_checkpoint_has_the_shape_and_an_offline_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    gpu.write_model(tmp_path, "tiny", 3, "bfloat16")
    config = AutoConfig.from_pretrained(tmp_path)
    hidden, inter, heads, kv, vocab = gpu.SHAPES["tiny"]
    assert (config.hidden_size, config.intermediate_size, config.num_attention_heads, config.num_key_value_heads,
            config.vocab_size, config.num_hidden_layers) == (hidden, inter, heads, kv, vocab, 3)
    assert config.dtype == torch.bfloat16
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.convert_tokens_to_ids("w5") == 5 and len(tok) == vocab


def test_the_floor_is_one_forward_of_every_token_through_one_layer(tmp_path: Path) -> None:
    floor = _module("_layer_floor")
    gpu.write_model(tmp_path, "tiny", 3, "float32")
    short = floor.floor_seconds(tmp_path, 2, 32, torch.float32, torch.device("cpu"), repeats=1)
    assert 0 < short < 5


def test_summary_compares_layer_2_and_marks_failures() -> None:
    rows = [
        gpu.layer2_row({"kind": "run", "scheme": "sq-w8a8", "tool": "llmc", "wall_s": 3.0, "layer_s": [2.0, 1.0, 1.0],
                        "floor_s": 0.1}),
        gpu.layer2_row({"kind": "run", "scheme": "sq-w8a8", "tool": "llm-compressor", "wall_s": 5.0,
                        "layer_s": [2.0, 4.0, 4.0], "floor_s": 0.1}),
        {"kind": "quality", "scheme": "sq-w8a8", "tool": "llmc", "hidden_rel_error": 0.0125},
        {"kind": "run", "scheme": "awq-w4a16", "tool": "llmc", "error": "exit 1: boom\nValueError: bad"},
    ]
    assert rows[0]["layer2_s"] == 1.0 and rows[0]["layer2_x_floor"] == pytest.approx(10.0)
    table = gpu.summary(rows)
    assert "| sq-w8a8 | llmc | 3.00 | 1.000 | 0.1000 | 10.0× | 0.25× |" in table
    assert "0.0125" in table and "failed: ValueError: bad" in table


def test_a_step_past_its_time_limit_keeps_what_it_printed() -> None:
    script = "import json, time; print('not json'); print(json.dumps({'a': 1}), flush=True); time.sleep(30)"
    lines, error = gpu.run_step([sys.executable, "-c", script], 3, dict(os.environ))
    assert lines == [{"a": 1}] and error == "time limit (3 s) reached"
    lines, error = gpu.run_step([sys.executable, "-c", "import sys; print('{}'); sys.exit('boom')"], 30,
                                dict(os.environ))
    assert lines == [{}] and error.startswith("exit 1") and "boom" in error


@pytest.mark.slow
def test_the_whole_run_on_this_cpu_at_tiny_width(tmp_path: Path) -> None:
    """The GPU command's path end to end (llmc only, unless llm-compressor imports in this Python)."""
    peer = importlib.util.find_spec("llmcompressor") is not None
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, str(BENCH / "gpu_calibration.py"), "--out", str(out), "--device", "cpu", "--shape", "tiny",
         "--samples", "2", "--seq-len", "32", "--heldout-samples", "1", "--heldout-seq-len", "32",
         "--schemes", "gptq-w4a16", "fp8-static", "--tools", "llmc", *(["llm-compressor"] if peer else [])],
        capture_output=True, text=True, timeout=900, env={**os.environ, "THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    runs = [r for r in rows if r["kind"] == "run"]
    assert len(runs) == (4 if peer else 2) and not any("error" in r for r in runs), runs
    for run in runs:
        assert len(run["layer_s"]) == 3 and run["floor_s"] > 0 and run["layer2_x_floor"] > 0
    quality = [r for r in rows if r["kind"] == "quality"]
    assert len(quality) == len(runs) and all(0 < q["hidden_rel_error"] < 1 for q in quality)
    assert "| gptq-w4a16 | llmc |" in (out / "summary.md").read_text()
