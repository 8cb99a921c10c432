"""Gates fail loudly on a broken artifact; JUnit and reports say why; evaluation is deterministic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from llmc.build import build
from llmc.recipe import parse_recipe
from llmc.store import COMPLETE_MARKER, Store, record_files

sys.path.insert(0, str(Path(__file__).parent))
from test_build import recipe_text  # noqa: E402


def _cli(args: list[str], cache: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "LLMC_CACHE": str(cache), "LLMC_PROGRESS_JSON": "0"}
    return subprocess.run([sys.executable, "-m", "llmc.cli", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def test_broken_artifact_fails_quality_gate_with_junit(tiny_model: Path, tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    # a random tiny model predicts near-uniformly, so perplexity barely moves when it breaks;
    # the KL divergence from the baseline's distribution is what exposes it
    recipe.write_text(recipe_text(tiny_model, tmp_path / "registry", gates={"max_mean_kld": 0.05}))
    ok = _cli(["build", str(recipe), "--junit", str(tmp_path / "ok.xml")], tmp_path / "c", tmp_path)
    assert ok.returncode == 0, ok.stderr
    suite = ET.parse(tmp_path / "ok.xml").getroot()
    assert suite.get("tests") == "1" and suite.get("failures") == "0"

    # tamper with the exported artifact on disk: zero every weight scale of one layer
    artifact = next((tmp_path / "c" / "stages" / "export").glob("*/model.safetensors"))
    tensors = load_file(str(artifact))
    for k in tensors:
        if k.startswith("model.layers.0.") and k.endswith("weight_scale"):
            tensors[k] = torch.zeros_like(tensors[k])
    save_file(tensors, str(artifact), metadata={"format": "pt"})
    # ...and record it as the export's output, as an exporter that wrote these bytes would (a changed cached output
    # that was not recorded is rebuilt instead of measured: tests/unit/test_integrity.py)
    marker = artifact.parent / COMPLETE_MARKER
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "files": record_files(artifact.parent)}))

    bad = _cli(["build", str(recipe), "--junit", str(tmp_path / "bad.xml")], tmp_path / "c", tmp_path)
    assert bad.returncode == 5, bad.stdout + bad.stderr  # quality gate
    assert "quality gate" in bad.stderr and "max_mean_kld" in bad.stderr
    suite = ET.parse(tmp_path / "bad.xml").getroot()
    failure = suite.find("testcase/failure")
    assert suite.get("failures") == "1" and failure is not None
    msg = failure.get("message")
    assert "max_mean_kld" in msg and "95% CI" in msg and "<= 0.05" in msg
    assert "FAIL" in bad.stdout


def test_crashed_build_is_a_junit_error(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: x\nmodel: {source: /nonexistent}\nquantization: {weights: {format: int8, strategy: channel}}\n"
                      "targets: [{runtime: vllm}]\n")
    r = _cli(["build", str(recipe), "--junit", str(tmp_path / "j.xml")], tmp_path / "c", tmp_path)
    assert r.returncode == 7
    err = ET.parse(tmp_path / "j.xml").getroot().find("testcase/error")
    assert err is not None and err.get("type") == "bad input" and "does not exist" in err.get("message")


def test_same_artifact_same_data_evaluates_identically(tiny_model: Path, tmp_path: Path) -> None:
    recipe = parse_recipe(recipe_text(tiny_model, tmp_path / "r"))
    a = build(recipe, Store(tmp_path / "c1"), publish=False)
    b = build(recipe, Store(tmp_path / "c2"), publish=False)
    for key in a.evals:
        ea, eb = a.evals[key], b.evals[key]
        assert torch.equal(ea.nll, eb.nll)
        assert ea.perplexity == eb.perplexity and ea.ppl_ci95 == eb.ppl_ci95
        if ea.kld is not None:
            assert ea.kld == eb.kld and ea.top1_agreement == eb.top1_agreement


def test_variants_share_calibration_and_report_side_by_side(tiny_model: Path, tmp_path: Path) -> None:
    text = recipe_text(tiny_model, tmp_path / "registry")
    import yaml

    r = yaml.safe_load(text)
    q = r.pop("quantization")
    r["variants"] = [
        {"name": "fp8", "quantization": q},
        {"name": "int4", "quantization": {"weights": {"format": "int4", "strategy": "group", "group_size": 32}}},
    ]
    result = build(parse_recipe(yaml.safe_dump(r)), Store(tmp_path / "c"), publish=True)
    names = [s.name for s in result.stages]
    assert names.count("calibrate") == 1
    assert {"fp8/vllm-sm90-tp1", "int4/vllm-sm90-tp1"} == set(result.artifacts)
    assert result.artifacts["int4/vllm-sm90-tp1"].scheme == "W4A16-INT"
    report = json.loads((result.published / "report.json").read_text())
    assert set(report["variants"]) == {"fp8", "int4"}
    html = (result.published / "report.html").read_text()
    assert "data:image/png;base64," in html and "int4/vllm-sm90-tp1" in html
    assert (result.published / "junit.xml").is_file()


def test_llmc_eval_on_existing_entry_without_rebuilding(tiny_model: Path, tmp_path: Path) -> None:
    result = build(parse_recipe(recipe_text(tiny_model, tmp_path / "registry")), Store(tmp_path / "c"))
    r = _cli(["eval", str(result.published), "--baseline", str(tiny_model), "--windows", "4", "--seq-len", "64",
              "--max-ppl-increase-pct", "0.0001"], tmp_path / "c", tmp_path)
    assert r.returncode == 5, r.stdout + r.stderr  # an absurd gate fails, with the quality-gate code
    assert "vllm-sm90-tp1" in r.stdout and "KLD" in r.stdout and "FAIL" in r.stdout
    ok = _cli(["eval", str(result.published), "--baseline", str(tiny_model), "--windows", "4", "--seq-len", "64"],
              tmp_path / "c", tmp_path)
    assert ok.returncode == 0 and "protocol: brown eval split, 4 windows x 64 tokens" in ok.stdout


def test_gates_apply_only_where_the_engine_measures_the_metric() -> None:
    from llmc.engines import engine_spec
    from llmc.eval.gates import evaluate_gates
    from llmc.quant.canonical import scheme_from_dict
    from llmc.recipe.schema import Gates
    from llmc.result import Evaluation

    gates = Gates(max_mean_kld=0.1, max_ppl_increase_pct=5.0)
    change = {"delta_pct": 1.0, "ci_low_pct": 0.5, "ci_high_pct": 1.5}
    vllm_like = Evaluation("vllm", ppl_change=change, measures=["perplexity", "throughput"])
    assert [v.gate for v in evaluate_gates(gates, "vllm:t", vllm_like)] == ["max_ppl_increase_pct"]
    broken = Evaluation("torch", ppl_change=change, measures=["perplexity", "kld"])  # claims KL but has none: fails
    kld_verdict = [v for v in evaluate_gates(gates, "torch:t", broken) if v.gate == "max_mean_kld"]
    assert kld_verdict and not kld_verdict[0].passed
    failed = evaluate_gates(gates, "torch:t", Evaluation("torch", error="engine crashed"))
    assert [(v.gate, v.passed, v.kind) for v in failed] == [("artifact evaluated", False, "availability")]
    fp8 = scheme_from_dict({"weights": {"format": "fp8_e4m3", "strategy": "channel"},
                            "activations": {"format": "fp8_e4m3", "strategy": "tensor"}})
    int8 = scheme_from_dict({"weights": {"format": "int8", "strategy": "channel"},
                             "activations": {"format": "int8", "strategy": "token", "dynamic": True}})
    assert "W8A8-FP8" in engine_spec("vllm").cannot_run(fp8)
    assert engine_spec("vllm").cannot_run(int8) is None and engine_spec("torch").cannot_run(fp8) is None
