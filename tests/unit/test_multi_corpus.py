"""Several evaluation corpora in one build (`eval.corpus` as a list or a mapping label -> source): every artifact
and the baseline scored on each, one report row per (artifact, engine, corpus), every gate on every corpus with
per-corpus overrides, the overlap check against each — and a recipe with one corpus exactly as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from llmc.build import build_until
from llmc.errors import InputError, RecipeError
from llmc.eval.report import render_markdown, render_summary, report_dict
from llmc.recipe.load import parse_recipe
from llmc.result import EvalId
from llmc.storage.store import Store

WORDS = "the jury said it did find that many of the voters had been registered in the county".split()
OTHER = "a truth universally acknowledged that a single man in possession of good fortune must want".split()


def _folder(root: Path, name: str, words: list[str]) -> Path:
    folder = root / name
    folder.mkdir()
    for i in range(4):
        (folder / f"{i}.txt").write_text(" ".join(words[(i * 5 + j) % len(words)] for j in range(400)))
    return folder


def _recipe(model: Path, corpus, gates: dict | None = None, calibration: dict | None = None):
    spec = {
        "name": "tiny-corpora",
        "model": {"source": str(model)},
        "quantization": {"weights": {"format": "fp8_e4m3", "strategy": "channel"},
                         "activations": {"format": "fp8_e4m3", "strategy": "tensor"}},
        "calibration": calibration or {"dataset": "brown", "samples": 4, "seq_len": 48, "seed": 0},
        "targets": [{"runtime": "vllm", "gpu_arch": "sm90"}],
        "eval": {"corpus": corpus, "seq_len": 48, "windows": 4, "decode_tokens": 0, "throughput_repeats": 1,
                 "bootstrap_samples": 200},
    }
    if gates is not None:
        spec["gates"] = gates
    return parse_recipe(yaml.safe_dump(spec))


@pytest.fixture
def corpora(tmp_path: Path) -> dict[str, dict]:
    return {"jury": {"kind": "text", "path": str(_folder(tmp_path, "jury", WORDS))},
            "truth": {"kind": "text", "path": str(_folder(tmp_path, "truth", OTHER))}}


@pytest.mark.heavy
def test_every_artifact_and_baseline_scored_and_gated_on_each_corpus(tiny_model: Path, tmp_path: Path,
                                                                     corpora: dict) -> None:
    store = Store(tmp_path / "cache")
    # a gate no quantization meets on one corpus (perplexity may not rise by 1e-6 %), the recipe-wide one elsewhere
    gates = {"max_ppl_increase_pct": 1000.0, "max_mean_kld": 10.0, "min_top1_agreement_pct": 1.0,
             "corpora": {"truth": {"max_ppl_increase_pct": 1e-6}}}
    result = build_until(_recipe(tiny_model, corpora, gates), store, "gate")

    art = "vllm-sm90-tp1"
    on_jury, on_truth = EvalId("torch", art, "jury"), EvalId("torch", art, "truth")
    assert result.target_evals[art] == [on_jury, on_truth]
    jury, truth = result.evals[on_jury], result.evals[on_truth]
    base_jury, base_truth = result.evals[on_jury.baseline()], result.evals[on_truth.baseline()]
    assert (jury.corpus, truth.corpus, base_jury.corpus) == ("jury", "truth", "jury")
    assert base_jury.perplexity != base_truth.perplexity  # different text, different windows
    assert base_jury.protocol["corpus"]["path"] == corpora["jury"]["path"]
    assert jury.ppl_change is not None and truth.ppl_change is not None and truth.kld is not None

    by_target = {}
    for v in result.verdicts:
        by_target.setdefault(v.target, {})[v.gate] = v
    assert set(by_target) == {on_jury, on_truth}
    assert all(v.passed for v in by_target[on_jury].values())
    truth_ppl = by_target[on_truth]["max_ppl_increase_pct"]
    assert truth_ppl.threshold == "upper bound <= +0.00%" and not truth_ppl.passed
    assert by_target[on_truth]["max_mean_kld"].passed  # the override replaced only what it set
    assert not result.passed
    assert result.plan.gates[""].endswith("; on truth: ppl <= +1e-06%")  # the plan says what the override does

    lines = render_summary(result).splitlines()
    assert lines[0].split()[:3] == ["target", "engine", "corpus"]
    rows = [line.split() for line in lines[2:4]]
    assert [r[2] for r in rows] == ["jury", "truth"] and rows[0][-1] == "pass" and rows[1][-1] == "FAIL"
    md = render_markdown(result)
    assert "2 corpora, each scored and gated on its own" in md and f"| torch:{art}@truth | max_ppl_increase_pct" in md
    report = json.loads(json.dumps(report_dict(result)))
    assert report["evals"][f"torch:{art}@truth"]["corpus"] == "truth"
    # the model card and the MLflow metrics pair each corpus's row with that corpus's baseline
    from llmc.publish.mlflow import variant_metrics
    from llmc.publish.model_card import model_card

    card = model_card(result, art)
    assert f"| torch on jury | {base_jury.perplexity:.3f} | {jury.perplexity:.3f} |" in card
    assert f"| torch on truth | {base_truth.perplexity:.3f} | {truth.perplexity:.3f} |" in card
    metrics = variant_metrics(result, art)
    assert (metrics["torch.jury.ppl_base"], metrics["torch.truth.ppl_base"]) == (base_jury.perplexity,
                                                                               base_truth.perplexity)

    # each corpus keys its evaluations as it would alone: a build on one of them finds them cached
    alone = build_until(_recipe(tiny_model, corpora["jury"]), store, "gate")
    assert list(alone.evals) == [EvalId("torch", "baseline"), EvalId("torch", art)]
    alone_base = alone.evals[EvalId("torch", "baseline")]
    assert alone_base.corpus is None and "corpus" not in alone_base.to_dict()
    assert all(s.cached for s in alone.stages if s.name.startswith("eval:"))
    assert alone.evals[EvalId("torch", art)].perplexity == jury.perplexity
    assert "corpus" not in render_summary(alone).splitlines()[0]


def test_a_list_of_corpora_is_labelled_by_their_names(tiny_model: Path, tmp_path: Path, corpora: dict) -> None:
    recipe = _recipe(tiny_model, [corpora["truth"], corpora["jury"]])
    from llmc.data.sources import corpora_of

    assert list(corpora_of(recipe.eval.corpus)) == ["truth", "jury"]
    dumped = recipe.model_dump(mode="json")["eval"]["corpus"]
    assert [c["path"] for c in dumped] == [corpora["truth"]["path"], corpora["jury"]["path"]]


@pytest.mark.parametrize("corpus, gates, message", [
    ([], None, "empty list"),
    ({}, None, "empty mapping"),
    (["brown", "brown"], None, "several corpora named \\['brown'\\]"),
    ({"two words": "brown"}, None, "are not names"),
    ({"a": "brown"}, {"corpora": {"b": {"max_mean_kld": 0.1}}}, "gates.corpora names \\['b'\\]"),
    ("brown", {"corpora": {"brown": {"max_mean_kld": 0.1}}}, "one unlabelled corpus"),
])
def test_bad_corpus_lists_are_recipe_errors(tiny_model: Path, corpus, gates, message: str) -> None:
    with pytest.raises(RecipeError, match=message):
        _recipe(tiny_model, corpus, gates)


def test_one_corpus_serializes_as_before(tiny_model: Path, corpora: dict) -> None:
    one = _recipe(tiny_model, "brown").model_dump(mode="json")
    assert one["eval"]["corpus"] == "brown" and "corpora" not in one["gates"]
    text = _recipe(tiny_model, corpora["jury"]).model_dump(mode="json")["eval"]["corpus"]
    assert text["kind"] == "text" and text["path"] == corpora["jury"]["path"]


def test_overlap_is_checked_against_each_corpus(tiny_model: Path, tmp_path: Path, corpora: dict) -> None:
    calibration = {"dataset": corpora["truth"], "samples": 4, "seq_len": 48, "seed": 0}
    with pytest.raises(InputError, match="evaluation corpus 'truth'"):
        build_until(_recipe(tiny_model, corpora, calibration=calibration), Store(tmp_path / "cache"), "gate")


# --------------------------------------------------------------------------- `llmc eval` on any data source


@pytest.mark.heavy
def test_standalone_eval_reads_any_source_and_gates_kld_and_top1(tiny_model: Path, tmp_path: Path,
                                                                 corpora: dict) -> None:
    from llmc.eval.standalone import evaluate_artifact

    store = Store(tmp_path / "cache")
    built = build_until(_recipe(tiny_model, corpora["jury"]), store, "gate")
    art = built.artifacts["vllm-sm90-tp1"].dir
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": " ".join(OTHER[(i + j) % len(OTHER)] for j in range(300))}) + "\n"
                            for i in range(6)))
    common = dict(engine="torch", windows=4, seq_len=48, max_ppl_increase_pct=None, threads=None)

    # a folder path is a text source: the same windows as the build's, so the same perplexity
    text, failed = evaluate_artifact(art, str(tiny_model), store, corpus=(corpora["jury"]["path"],), **common)
    built_ppl = built.evals[EvalId("torch", "vllm-sm90-tp1")].perplexity
    assert failed is None and f"{built_ppl:.3f}" in text
    assert f"protocol: text:{corpora['jury']['path']} (whole), 4 windows x 48 tokens" in text

    # two corpora (a folder and a jsonl mapping): a row each; KLD and top-1 gates from the command line
    text, failed = evaluate_artifact(art, str(tiny_model), store, corpus=(
        corpora["jury"]["path"], f"{{kind: jsonl, path: {rows}, field: text}}"),
        max_mean_kld=1e-9, min_top1_agreement_pct=1.0, **{**common, "max_ppl_increase_pct": 1000.0})
    header, _, jury, other = text.splitlines()[:4]
    assert header.split()[:3] == ["artifact", "engine", "corpus"]
    assert jury.split()[2] == "jury" and other.split()[2] == "rows" and "FAIL" in jury and "FAIL" in other
    assert failed.count("max_mean_kld measured") == 2 and f"{art.name}@rows" in failed
    assert "min_top1_agreement_pct" not in failed  # 1% agreement is met; only the KLD gate fails


@pytest.mark.parametrize("value, message", [
    ("nope", "is not a data source"),
    ("{kind: jsonl, path: x.jsonl}", "exactly one of 'field'"),
])
def test_standalone_eval_refuses_what_is_no_data_source(tmp_path: Path, value: str, message: str,
                                                        monkeypatch) -> None:
    from llmc.eval.standalone import parse_corpora

    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError, match=message):
        parse_corpora((value,))


@pytest.mark.parametrize("corpus, key", [
    ("{kind: text}", "missing key 'eval.corpus.text'"),  # one source: the message it always had
    ("[brown, {kind: text}]", "missing key 'eval.corpus[1].text'"),
    ("{a: {kind: jsonl, path: x}}", "'eval.corpus.a.jsonl': a jsonl source needs exactly one of"),
])
def test_recipe_errors_name_the_corpus_key(corpus: str, key: str) -> None:
    text = ("name: x\nmodel: {source: demo:smollm2-135m}\nquantization: {weights: {format: int8, strategy: channel}}\n"
            f"targets: [{{runtime: vllm, gpu_arch: sm90}}]\neval: {{corpus: {corpus}}}\n")
    with pytest.raises(RecipeError) as e:
        parse_recipe(text)
    assert key in str(e.value)
