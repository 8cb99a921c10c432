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
from tests.unit.bench_modules import BENCH, benchmark_module

gpu = benchmark_module("gpu_calibration")


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
    modifier = benchmark_module("_llmcompressor_child").recipe("fp8-static")[0]
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


def test_the_llmc_child_predicts_the_quantize_stage_as_llmc_plan_does(tmp_path: Path) -> None:
    """The child's planner prediction (`llmc plan`'s quantize cost for the synthetic checkpoint) runs against the
    stage's current decision: it had built its calibration section from the fields read once, and the stage's decision
    later read one more (`stream_experts`), so every GPU run's llmc rows failed before timing anything."""
    child = benchmark_module("_llmc_gpu_child")
    gpu.write_model(tmp_path, "tiny", 3, "bfloat16")
    predicted = child.planner_prediction(tmp_path, Scheme(TensorSpec("fp8_e4m3", "channel"),
                                                          TensorSpec("fp8_e4m3", "tensor")),
                                         (2, 32), "bfloat16", torch.device("cpu"))
    assert predicted["seconds"] > 0 and predicted["host_mb"] > 0 and predicted["layer_s"] > 0


def test_the_floor_is_one_forward_of_every_token_through_one_layer(tmp_path: Path) -> None:
    floor = benchmark_module("_layer_floor")
    gpu.write_model(tmp_path, "tiny", 3, "float32")
    short = floor.floor_seconds(tmp_path, 2, 32, torch.float32, torch.device("cpu"), repeats=1)
    assert 0 < short < 5


def _run(scheme: str, tool: str, layers: list[float], repeat: int = 0, **kw) -> dict:
    return gpu.layer2_row({"kind": "run", "scheme": scheme, "tool": tool, "repeat": repeat, "wall_s": sum(layers),
                           "layer_s": layers, "floor_s": 0.1, **kw})


def test_summary_compares_layer_2_over_repeats_against_defaults_and_tuned_and_marks_failures() -> None:
    runs = [_run("sq-w8a8", "llmc", [2.0, 1.0, 1.5]), _run("sq-w8a8", "llmc", [2.0, 1.2, 1.5], 1),
            _run("sq-w8a8", "llm-compressor", [2.0, 4.0, 4.0]), _run("sq-w8a8", "llm-compressor", [2.0, 4.4, 4.0], 1),
            _run("sq-w8a8", "llm-compressor-tuned", [2.0, 2.2, 2.0], knobs_missing=["sequential_prefetch"]),
            {"kind": "run", "scheme": "awq-w4a16", "tool": "llmc", "error": "exit 1: boom\nValueError: bad"}]
    assert runs[0]["layer2_s"] == 1.0 and runs[0]["layer3_s"] == 1.5 and runs[0]["layer2_x_floor"] == pytest.approx(10)
    assert "layer1_s" not in runs[0]  # layer 1 carries the embeddings: reported only for a one-layer run
    cells = gpu.cell_rows(runs)
    mine = next(c for c in cells if c["tool"] == "llmc")
    assert mine["repeats"] == 2 and mine["layer2_s"]["median"] == pytest.approx(1.1)
    assert mine["layer2_s"]["spread_pct"] == pytest.approx(100 * 0.2 / 1.1)
    quality = [{"kind": "quality", "scheme": "sq-w8a8", "tool": "llmc", "hidden_rel_error": 0.0125}]
    table = gpu.summary(runs + cells + quality)
    assert "| sq-w8a8 | llmc | 2 | 4.60 | 1.100 [1.000, 1.200] | 1.500 [1.500, 1.500] | 0.1000 | 11.0× |" in table
    assert "| sq-w8a8 | llm-compressor | 2 |" in table and "sq-w8a8: 0.26×" in table  # 1.1 / 4.2
    assert "| sq-w8a8 | llm-compressor-tuned | 1 |" in table and "sq-w8a8: 0.50×" in table  # 1.1 / 2.2
    assert "0.0125" in table and "failed: ValueError: bad" in table and "lacks sequential_prefetch" in table
    one_layer = _run("fp8-static", "llmc", [3.0])
    assert one_layer["layer1_s"] == 3.0 and "| fp8-static | llmc | 1 | 3.00 | 3.000 |" in gpu.summary(
        gpu.cell_rows([one_layer]))


def test_the_same_grid_awq_pair_is_compared_against_the_awq_peer_rows() -> None:
    runs = [_run("awq-w4a16", "llmc", [1.0, 1.0, 1.0]), _run("awq-w4a16-grid", "llmc", [1.0, 2.0, 1.0]),
            _run("awq-w4a16", "llm-compressor", [1.0, 5.0, 1.0])]
    assert gpu.PAIRS["awq-w4a16-grid"][1] == gpu.PAIRS["awq-w4a16"][1]  # one peer recipe for both
    assert "awq-w4a16: 0.20×, awq-w4a16-grid: 0.40×" in gpu.summary(gpu.cell_rows(runs))


def test_tuned_llm_compressor_gets_llmcs_batch_device_prefetch_and_one_pass_where_llmc_makes_one() -> None:
    from llmc.quant.stream import CALIBRATION_BATCH_SIZE

    assert gpu.LLMC_BATCH == CALIBRATION_BATCH_SIZE
    assert gpu.tuned_knobs("fp8-static", "cuda") == {"batch_size": CALIBRATION_BATCH_SIZE, "propagate_error": False,
                                                     "sequential_offload_device": "cuda:0", "sequential_prefetch": True}
    assert gpu.tuned_knobs("sq-w8a8", "cpu")["sequential_offload_device"] == "cpu"
    assert "propagate_error" not in gpu.tuned_knobs("gptq-w4a16", "cuda")  # both tools propagate quantized outputs
    assert "propagate_error" not in gpu.tuned_knobs("awq-w4a16", "cuda:1")


def test_the_paired_interval_is_zero_for_equal_outputs_and_excludes_zero_for_a_consistent_gap() -> None:
    import random

    rng = random.Random(0)
    ref = [rng.uniform(90, 110) for _ in range(64)]
    a = [0.01 * r * rng.uniform(0.5, 1.5) for r in ref]
    same = gpu.paired_interval(a, a, ref)
    assert same["diff"] == 0 and same["ci95"] == [0.0, 0.0] and same["blocks"] == 64
    worse = gpu.paired_interval([1.21 * x for x in a], a, ref)  # every block's error 10% larger (sqrt 1.21)
    assert worse["diff"] == pytest.approx(0.1 * (sum(a) / sum(ref)) ** 0.5)
    assert 0 < worse["ci95"][0] < worse["diff"] < worse["ci95"][1]
    noisy = gpu.paired_interval([x * rng.uniform(0.5, 1.5) for x in a], a, ref)  # no consistent gap
    assert noisy["ci95"][0] < noisy["diff"] < noisy["ci95"][1] and noisy["ci95"][1] - noisy["ci95"][0] > 0


def test_quality_diffs_pair_llmc_with_each_llm_compressor_row_of_its_peer_recipe() -> None:
    blocks = {"block_ref2": [1.0, 1.0], "block_tokens": 128}
    quality = [{"kind": "quality", "scheme": "awq-w4a16", "tool": "llmc", "block_err2": [0.04, 0.04], **blocks},
               {"kind": "quality", "scheme": "awq-w4a16-grid", "tool": "llmc", "block_err2": [0.01, 0.01], **blocks},
               {"kind": "quality", "scheme": "awq-w4a16", "tool": "llm-compressor", "block_err2": [0.09, 0.09],
                **blocks},
               {"kind": "quality", "scheme": "gptq-w4a16", "tool": "llm-compressor", "block_err2": [1, 1], **blocks}]
    diffs = gpu.quality_diff_rows(quality)
    assert [(d["scheme"], d["against"], d["against_scheme"]) for d in diffs] == [
        ("awq-w4a16", "llm-compressor", "awq-w4a16"), ("awq-w4a16-grid", "llm-compressor", "awq-w4a16")]
    assert [d["diff"] for d in diffs] == [pytest.approx(0.2 - 0.3), pytest.approx(0.1 - 0.3)]


def test_every_row_is_stamped_with_the_code_hash_dirty_flag_filesystem_and_disk_rates(tmp_path: Path) -> None:
    stamp_mod = benchmark_module("_bench_stamp")
    repo = tmp_path / "repo"
    (repo / "llmc" / "__pycache__").mkdir(parents=True)
    (repo / "llmc" / "a.py").write_text("x = 1\n")
    (repo / "llmc" / "__pycache__" / "a.cpython-312.pyc").write_bytes(b"cache")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / ".gitignore").write_text("__pycache__/\n")  # as the project's
    subprocess.run([*git, "add", "llmc/a.py", ".gitignore"], check=True)
    subprocess.run([*git, "commit", "-qm", "a"], check=True)
    stamp = stamp_mod.environment_stamp(repo, tmp_path, "cpu", probe_mb=4)
    assert stamp["llmc_dirty"] is False and len(stamp["llmc_commit"]) >= 7 and len(stamp["llmc_sha256"]) == 64
    assert stamp["gpu"] is None and stamp["driver"] is None
    assert stamp["fs_type"] in Path("/proc/mounts").read_text().split() and stamp["work_dir"] == str(tmp_path)
    assert stamp["disk_write_mb_s"] > 0 and stamp["disk_read_mb_s"] > 0 and stamp["disk_probe_mb"] == 4
    assert not list(tmp_path.glob(".disk-probe-*"))
    (repo / "llmc" / "__pycache__" / "a.cpython-312.pyc").write_bytes(b"other cache")  # not code: same hash
    assert stamp_mod.tree_sha256(repo / "llmc") == stamp["llmc_sha256"]
    (repo / "llmc" / "a.py").write_text("x = 2\n")
    edited = stamp_mod.environment_stamp(repo, tmp_path, "cpu", probe_mb=0)
    assert edited["llmc_dirty"] is True and edited["llmc_sha256"] != stamp["llmc_sha256"]
    assert "disk_read_mb_s" not in edited
    row = stamp_mod.stamp_row({"kind": "run", "wall_s": 1.0}, stamp)
    assert row["kind"] == "run" and row["stamp"] == stamp


def test_the_70b_width_mode_is_one_layer_fp8_and_gptq_on_tmpfs_and_every_default_can_be_set() -> None:
    wide = gpu.parse_args(["--out", "x", "--width-70b"])
    assert (wide.shape, wide.layers, wide.schemes, wide.tools, wide.repeats, wide.heldout_samples) == (
        "llama-70b", 1, ["fp8-static", "gptq-w4a16"], ["llmc"], 1, 0)
    assert gpu.SHAPES["llama-70b"][:4] == (8192, 28672, 64, 8)
    tiny = gpu.parse_args(["--out", "x", "--width-70b", "--shape", "tiny", "--tools", "llmc", "llm-compressor"])
    assert tiny.shape == "tiny" and tiny.tools == ["llmc", "llm-compressor"] and tiny.layers == 1
    default = gpu.parse_args(["--out", "x"])
    assert default.layers == 3 and default.repeats == 2 and default.heldout_samples * default.heldout_seq_len >= 8192
    assert set(default.tools) == {"llmc", "llm-compressor", "llm-compressor-tuned"} and "awq-w4a16-grid" in \
        default.schemes
    assert gpu.expected_kinds(default) == {"setup", "model", "run", "cell", "quality", "quality-diff"}
    assert gpu.expected_kinds(wide) == {"setup", "model", "run", "cell"}
    # a 70B-width layer in bf16 plus the tied embeddings: 0.86 B + 1.05 B parameters
    assert gpu.checkpoint_bytes("llama-70b", 1, 2) == pytest.approx(2 * (855_654_400 + 1_050_681_344), rel=1e-3)


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
         "--samples", "2", "--seq-len", "32", "--heldout-samples", "2", "--heldout-seq-len", "128", "--repeats", "2",
         "--disk-probe-mb", "4", "--schemes", "gptq-w4a16", "fp8-static", "--tools", "llmc",
         *(["llm-compressor", "llm-compressor-tuned"] if peer else [])],
        capture_output=True, text=True, timeout=900, env={**os.environ, "THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert all(row["stamp"]["llmc_sha256"] and row["stamp"]["fs_type"] for row in rows)
    runs = [r for r in rows if r["kind"] == "run"]
    assert len(runs) == 2 * (6 if peer else 2) and not any("error" in r for r in runs), runs
    for run in runs:
        assert len(run["layer_s"]) == 3 and run["floor_s"] > 0 and run["layer2_x_floor"] > 0 and "layer3_s" in run
    quality = [r for r in rows if r["kind"] == "quality"]
    assert len(quality) == len(runs) // 2 and all(0 < q["hidden_rel_error"] < 1 for q in quality)
    assert all(len(q["block_err2"]) == 2 for q in quality)  # 2 x 128 held-out tokens in blocks of 128
    assert rows[-1]["kind"] == "check" and rows[-1]["missing_kinds"] == []
    assert "| gptq-w4a16 | llmc | 2 |" in (out / "summary.md").read_text()
