"""What the fault tests (full disk, kill anywhere) share: a recipe that passes through every stage and write site
of a build on a tiny model, a small corpus so a build takes seconds, and the hashes that say two builds
published the same bytes; and (`stored`) every tensor of a checkpoint folder, as the source-format tests read them,
and (`save_as_mxfp4_original`) a tiny gpt-oss stored as OpenAI ships it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file

from llmc.storage.store import COMPLETE_MARKER

def stored(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's *.safetensors files, as stored (packed codes, scales), by name."""
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def save_as_mxfp4_original(dense: Path, folder: Path) -> Path:
    """`dense` (a tiny gpt-oss as transformers saves it) stored in `folder` as OpenAI ships gpt-oss: the experts'
    fused gate_up_proj / down_proj as MXFP4 `_blocks` [E, out, in/32, 16] + E8M0 `_scales` [E, out, in/32] (llmc's
    MXFP4 quantizer; tests/unit/test_source_formats.py checks that layout against transformers' own dequantizing
    load), quantization_config as the Hub's config.json has it, its tokenizer files copied; everything else as it
    was."""
    import shutil

    from llmc.quant.microscaling import MXFP4, pack_e2m1, quantize_blocks

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in load_file(str(dense / "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # held [E, in, out]; stored [E, out, in]
            q = quantize_blocks(t.transpose(1, 2).contiguous(), MXFP4)
            experts, rows, cols = q.codes.shape
            tensors[name + "_blocks"] = pack_e2m1(q.codes).reshape(experts, rows, cols // 32, 16)
            tensors[name + "_scales"] = q.scale
        else:
            tensors[name] = t
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    for f in dense.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, folder / f.name)
    return folder


REPORT_FILES = ("report.json", "report.md", "report.html", "junit.xml")
CORPUS_DOCS = 4  # documents per split: plenty for 8 calibration and 4 evaluation windows of 64 tokens


def every_stage_recipe(model: Path, registry: Path) -> str:
    """Static INT8 (calibration, shared statistics, activations spilled to disk), two targets (compressed-tensors
    safetensors and GGUF), evaluation in the torch engine, a gate, publication."""
    return yaml.safe_dump({
        "name": "tiny-int8",
        "model": {"source": str(model)},
        "quantization": {"weights": {"format": "int8", "strategy": "channel"},
                         "activations": {"format": "int8", "strategy": "tensor"}},
        "calibration": {"samples": 8, "seq_len": 64, "seed": 0, "spill_activations": "always"},
        "targets": [{"runtime": "vllm", "gpu_arch": "sm90"}, {"runtime": "llama.cpp"}],
        "eval": {"seq_len": 64, "windows": 4, "decode_tokens": 2, "throughput_repeats": 1, "bootstrap_samples": 100},
        "gates": {"max_ppl_increase_pct": 50.0, "allow_unevaluated": True},  # llama.cpp is not installed everywhere
        "publish": {"registry": str(registry)},
    })


def small_corpus_file(path: Path) -> Path:
    """The first CORPUS_DOCS Brown documents of each split as JSON, for builds that read them through
    `use_corpus_file` (in this process or a child) instead of parsing all 500 files each time."""
    from llmc.calibration.corpora import load_corpus

    docs = {split: [[d.id, d.text] for d in load_corpus("brown", split)[:CORPUS_DOCS]]
            for split in ("calibration", "eval")}
    path.write_text(json.dumps(docs))
    return path


def use_corpus_file(path: Path, setattr_=None) -> None:
    """Make the build's `brown` source read its documents from `small_corpus_file`'s JSON (`setattr_`: pytest's
    monkeypatch.setattr, or plain setattr in a child process)."""
    import llmc.data.loaders
    from llmc.calibration.corpora import Document

    docs = {split: [Document(i, t) for i, t in items] for split, items in json.loads(Path(path).read_text()).items()}
    (setattr_ or setattr)(llmc.data.loaders, "brown_documents", lambda split: docs[split])


def published_artifact_hashes(registry: Path) -> dict[str, str]:
    """sha256 of every artifact file in every complete registry entry, by path inside the registry (a publish
    killed just before its rename leaves a `.<build id>.tmp-<pid>` folder: not an entry)."""
    out = {}
    for entry in sorted(registry.glob("*/*")):
        if not entry.name.startswith(".") and not entry.parent.name.startswith(".") and (entry / COMPLETE_MARKER).is_file():
            for f in sorted((entry / "artifacts").rglob("*")):
                if f.is_file():
                    out[f.relative_to(registry).as_posix()] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def nothing_half_written_looks_complete(cache: Path, registry: Path) -> list[str]:
    """Stage folders and registry entries under their final names that lack their completion marker, and build
    report folders without their whole set of files."""
    bad = [str(d) for d in (cache / "stages").glob("*/*")
           if not d.name.endswith(".partial") and not (d / COMPLETE_MARKER).is_file()]
    bad += [str(e) for e in registry.glob("*/*")  # dot-named: temp folders and the registry's lock files
            if not e.name.startswith(".") and not e.parent.name.startswith(".") and not (e / COMPLETE_MARKER).is_file()]
    bad += [str(b) for b in (cache / "builds").glob("*")  # a build's reports: the whole set or none
            if not b.name.startswith(".") and not all((b / f).is_file() for f in REPORT_FILES)]
    return bad


def tiny_text_recipe(root: Path, name: str, eval_section: dict) -> Path:
    """A tiny model, 12 documents of random words as calibration and evaluation text (3 held out), INT8 W8A8 for one
    vLLM target, permissive gates, publishing under `root/registry`: the torchrun build tests' recipe. `eval_section`
    adds to eval's corpus and 32-token windows (windows, batch size, throughput settings)."""
    import random

    from tests.conftest import make_tiny_model

    model = make_tiny_model(root / "model")
    words = ["the", "jury", "said", "it", "did", "find", "that", "many", "of", "voters", "had", "been", "registered"]
    rng = random.Random(0)
    (root / "text").mkdir()
    for d in range(12):
        (root / "text" / f"doc{d:02d}.txt").write_text(" ".join(rng.choice(words) for _ in range(400)))
    source = {"kind": "text", "path": str(root / "text"), "holdout": 3}
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "name": name, "model": {"source": str(model)},
        "quantization": {"weights": {"format": "int8", "strategy": "channel"},
                         "activations": {"format": "int8", "strategy": "tensor"}},
        "calibration": {"dataset": source, "samples": 8, "seq_len": 32, "seed": 0},
        "targets": [{"runtime": "vllm", "gpu_arch": "sm90"}],
        "eval": {"corpus": source, "seq_len": 32, **eval_section},
        "gates": {"max_ppl_increase_pct": 50.0, "allow_unevaluated": True},
        "publish": {"registry": str(root / "registry")},
    }))
    return path


def layer_loop(pipe, *, windows: int = 0, seq_len: int = 0, batch: int = 1, activations: str = "none",
               device: str = "cpu"):
    """A layer-loop decision as a test states it: the quantize stage's cost prices whatever decision it is given
    (llmc.quant.loop_plan.decide_layer_loop makes the real ones)."""
    from llmc.quant.loop_plan import LayerLoopPlan, LoopFacts

    facts = LoopFacts(calibrates=activations != "none", windows=windows, seq_len=seq_len, masked=False,
                      batch_size=batch, spill_mode="auto", hidden=0, intermediate=0, heads=1, elem=2, moe=False,
                      device=device, host_available=None, device_free=None, shared_stats=False, shared_covered=False)
    flow = ("data-free" if activations == "none" else "true-sequential" if pipe.true_sequential else "sequential")
    traces = activations != "none" and (bool(pipe.transforms) or pipe.true_sequential)
    return LayerLoopPlan(flow=flow, activations=activations, one_forward=False, shared="none", traces_structure=traces,
                         batch_size=batch, resume_every_s=0.0, device=device, why=(), facts=facts)
