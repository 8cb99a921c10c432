#!/usr/bin/env python3
"""Do the shipped recipes still export byte-identical artifacts? Compares a git revision with the working tree.

Usage (repository root, llmc's venv; PYTHONPATH must name this tree: the venv's editable llmc may point elsewhere):

    PYTHONPATH=$PWD .venv/bin/python scripts/compare_exports.py --base HEAD  # recipes/*.yaml, tiny models: times below
    PYTHONPATH=$PWD .venv/bin/python scripts/compare_exports.py --base main --model real \\
        --recipes recipes/smollm2-fp8-dynamic.yaml         # the recipe's own model: ~2 min (qdq-runtimes: ~12 min)

    --recipes R...  recipe files (default: every recipes/*.yaml)
    --keep DIR      an empty folder to keep the recipes and tiny models run and both caches in (DIR/base-cache,
                    DIR/work-cache: each artifact is under stages/export/<key>); default: a temp dir, removed

Exit status 0 only if every recipe's artifacts are byte-identical (1: some differ or failed to build).

It checks `<rev>` out with `git worktree add --detach` into <tmp>/tree, runs this script there as a child
(`sys.executable`, PYTHONPATH=<tmp>/tree, a fresh LLMC_CACHE at <work>/cache) that builds every recipe up to its
export stage (`llmc.build.build_until(recipe, store, "export")`) and prints {recipe: {target label: {relative path:
sha256}}} over every file of every artifact folder, recursively (the child is always this file, the working tree's
copy, and the recipes and stand-ins are prepared here once, so a base revision older than a stand-in works too);
removes the worktree (`git worktree remove --force`: the repository is never modified), copies the working tree
(tracked + untracked, not ignored, uncommitted edits included) to the same <tmp>/tree and runs the child again with
the same cache path. Then it prints one line per recipe, `identical` or the files that differ, and exits 0 only if
all are identical.

Why one path for both trees: the Q/DQ ONNX graph (onnxruntime/tensorrt Q/DQ targets, llmc/formats/onnx_qdq.py)
is written by torch.onnx's dynamo exporter, which stores a Python stack trace in every node's metadata
(`pkg.torch.onnx.stack_trace`): the absolute path of llmc's checkout and the line number of onnx_qdq.py's
`_Logits.forward`, plus transformers'/torch's paths and lines in the venv. So that model.onnx changed when llmc
was checked out elsewhere, and when a line moved in that file. The exporter has dropped those traces since
(`onnx_qdq.drop_stack_traces`), but revisions before that still write them, so both trees run from one path; a
difference confined to that metadata is reported as such.
Likewise onnxruntime-genai's model builder stamped model.onnx's `producer_version` with the HEAD of whatever git
repository holds the venv (this one's, for .venv): revisions before `onnx_genai.builder_env` differ there whenever a
commit is made while this script runs.

--model tiny (default): each recipe's model.source becomes a tiny random model of the same family built once here,
with fixed seeds, from this tree's tests/conftest.py (Llama for demo:smollm2-135m — llama architecture, as the
GGUF/llama.cpp exporter needs; Gemma3 for demo:gemma3-270m), hidden 128 / intermediate 256, so every Linear input
is a multiple of 128 (W4AFP8's group 128, INT4 groups 32/64/128); its byte-level BPE tokenizer reads the Brown
corpus. Calibration shrinks to 4 windows x 64 tokens. `eval` is left as shipped: it is not run, but its seq_len and
batch_size enter vLLM's and TensorRT-LLM's serve arguments, which are artifact files. Both trees get the very same
model folder and recipe texts. --model real: the recipes exactly as shipped.

A recipe whose model is a Hub id (hf:..., planned offline from its model.config) gets that config.json shrunk
(`shrink`): hidden 128, intermediate 256, 4 layers (DeepSeek/GLM: first_k_dense_replace + 1 at least, so an MoE layer
follows the dense ones), 4 heads or the recipe's widest tensor_parallel (8 for the TP-8 recipes), 2 KV heads (MHA
stays MHA), 4 experts (top-2 at most; experts and shared experts 128 wide), MLA latent ranks 128 with 32-wide
rope/nope/value head dims, gated-DeltaNet 2 key / 4 value heads of 32; kept as published: first_k_dense_replace,
n_shared_experts, grouped routing (2 groups where there were several), Llama-4's MoE interleave, Qwen3-Next's
full_attention_interval (3 linear-attention layers, 1 full), partial rotary, biases, q/k norms, rope scaling, tied
embeddings and the dtype (bf16). tests/unit/families.make_tiny builds it (random weights, seed 0, the tokenizer
above); it is saved in bf16, and FP8 block-wise (F8_E4M3 codes + a weight_scale_inv per 128x128 block for every
decoder-layer projection, by tests/unit/test_source_formats' encoder) where the original ships so: DeepSeek-R1,
DeepSeek-V3, Kimi-K2. Stand-ins: Llama-3.1-8B, Llama-3.3-70B, Llama-3.1-405B (llama), Qwen3-8B, Qwen3-30B-A3B,
Qwen3-Next-80B, Mixtral-8x7B, Llama-4-Scout (llama4_text), GLM-4.5 (glm4_moe), DeepSeek-R1/V3 and Kimi-K2
(deepseek_v3). The recipe's model.config is dropped (the stand-in's own config.json is read). A recipe calibrating
on cuda would calibrate on cpu (none does today); a recipe in SKIPPED is printed as `skipped: <reason>` and not
compared (none is today: every shipped recipe, the plan-only ones included, builds to its export on its stand-in).
Measured 2026-12-03 07:22-07:41 UTC on the shared 2-core Xeon (AVX-512/AMX), `nice -n 19`, load average ~9 falling
to ~3: `PYTHONPATH=$PWD .venv/bin/python scripts/compare_exports.py --base HEAD --recipes $(grep -l "source: hf:"
recipes/*.yaml)` -- the 15 hf: recipes, all identical (13 stand-ins built, 35 artifacts); 1,088 s in all: base tree
712 s (load ~9; DeepSeek-R1 152 s, most of it the fresh cache's rate probes), work tree 309 s (load ~3). The 19
demo recipes took ~3-5 min per tree before. Every recipes/*.yaml (35), `--base a5ea1fe` on main at the end of
2026-12-03's session (08:38-08:55 UTC, quiet but for a compare_plans record beside it, nice 5): 1,019 s in all (work
tree 503 s); 29 identical, 5 DIFFERENT as intended (the per-tensor FP8 weight scales of fused siblings unified,
llmc.quant.runtime_scales: only q/k/v/gate/up weights and weight scales differ), smollm2-search-nvfp4 then failed in
both trees (its bytes budget held the stand-in whole), hence `budget_as_effective_bits`; alone afterwards it built,
DIFFERENT for the same reason.

Not compared: the cache's own `.llmc-complete` marker in each stage folder (stage key + llmc version; never
published). The export stage key is shown when it differs: outputs are identical, but users' caches rebuild.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = {"demo:smollm2-135m": "llama", "demo:gemma3-270m": "gemma3"}  # shipped demo model -> tiny family
# hf: sources: the recipe's own config (model.config) shrunk by `shrink`, built by tests/unit/families.make_tiny
SKIPPED: dict[str, str] = {}  # recipe file stem -> why its tiny build cannot run here (printed; not a failure)
NOT_COMPARED = {".llmc-complete"}  # the store's completion marker (see the docstring)
# widths every stand-in shares: each Linear input a multiple of 128 (block FP8, INT4 groups of 128, W4AFP8)
HIDDEN, INTERMEDIATE, EXPERT_INTERMEDIATE, LAYERS, EXPERTS = 128, 256, 128, 4, 4
# model_type -> tests/unit/families.py's family (its random init, tokenizer and MoE bias draws)
HF_FAMILIES = {"llama": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "qwen3_next": "qwen3_next",
               "deepseek_v3": "deepseek_v3", "glm4_moe": "glm4_moe", "llama4_text": "llama4_text",
               "mixtral": "mixtral", "gpt_oss": "gpt_oss"}


def shrink(config: dict, tensor_parallel: int = 1, group_size: int = 0) -> dict:
    """`config` (a shipped config.json) at tiny widths, its structure kept: MLA ranks, shared experts,
    first_k_dense_replace, MoE interleave/sparse steps, linear-attention interval, partial rotary, biases, q/k norms,
    rope scaling. Heads: 4, or the recipe's widest tensor_parallel (vLLM splits the heads over the ranks). With
    weight groups over several ranks, each row-parallel input (o_proj, down_proj) is wide enough that every rank
    holds whole groups (group_size x tensor_parallel), as vLLM requires and llmc checks."""
    c = {k: v for k, v in config.items() if k not in ("quantization_config", "transformers_version")}
    heads = max(4, tensor_parallel)
    split = group_size * tensor_parallel if group_size and tensor_parallel > 1 else 0  # per-rank whole groups
    mha = config.get("num_key_value_heads", config["num_attention_heads"]) == config["num_attention_heads"]
    c.update(hidden_size=HIDDEN, intermediate_size=max(INTERMEDIATE, split), num_hidden_layers=LAYERS,
             num_attention_heads=heads, num_key_value_heads=heads if mha else 2)
    if "head_dim" in config or config["model_type"] in ("llama", "mixtral"):
        c["head_dim"] = max(HIDDEN, split) // heads
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if key in config:
            c[key] = EXPERTS
    if "num_experts_per_tok" in config:
        c["num_experts_per_tok"] = min(config["num_experts_per_tok"], 2)
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if key in config:
            c[key] = max(EXPERT_INTERMEDIATE, split)
    if config.get("n_group", 1) > 1:  # grouped routing kept: 2 groups of 2 experts, the best group's
        c.update(n_group=2, topk_group=1)
    if "kv_lora_rank" in config:  # MLA: latent ranks 128, rope/nope/value head dims 32 (o_proj input heads x 32)
        c.update(q_lora_rank=128 if config.get("q_lora_rank") else None, kv_lora_rank=128, qk_rope_head_dim=32,
                 qk_nope_head_dim=32, v_head_dim=32)
        c.pop("head_dim", None)
    if "linear_num_value_heads" in config:  # gated DeltaNet: 2 key heads, 4 value heads of 32
        c.update(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32)
    if config["model_type"] == "llama4_text":  # the experts' width is intermediate_size; the dense MLP's is _mlp
        c.update(intermediate_size=max(INTERMEDIATE, split), intermediate_size_mlp=max(INTERMEDIATE, split))
    if "first_k_dense_replace" in config:  # at least one MoE layer after the dense ones
        c["num_hidden_layers"] = max(LAYERS, config["first_k_dense_replace"] + 1)
    if isinstance(config.get("layer_types"), list):  # gpt-oss's sliding/full pattern: its first layers
        c["layer_types"] = config["layer_types"][: c["num_hidden_layers"]]
    return c


def hf_stand_in(recipe: Path, model: dict, tensor_parallel: int, group_size: int, folder: Path) -> Path:
    """The recipe's published config shrunk, random weights (seed 0) in the checkpoint's dtype; FP8 block-wise as
    the original ships where its config says so (DeepSeek-R1/V3, Kimi-K2), by the issue-46 tests' encoder; gpt-oss's
    experts MXFP4 as OpenAI ships them (tests/unit/build_helpers.py's `save_as_mxfp4_original`)."""
    import torch
    from safetensors.torch import load_file, save_file

    sys.path.insert(0, str(REPO))
    from transformers import AutoConfig

    from tests.unit import families

    config = json.loads((recipe.parent / model["config"]).read_text())
    family = HF_FAMILIES.get(config["model_type"])
    if family is None:
        sys.exit(f"{recipe}: no tiny family for model_type {config['model_type']!r}; add it to HF_FAMILIES")
    small = {k: v for k, v in shrink(config, tensor_parallel, group_size).items() if k not in (
        "model_type", "architectures", "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
    # make_tiny's own choices for the test family that the shipped config leaves out go back to the config class's
    # defaults (what the shipped config means); layer_types to None: derived from the shipped interval
    tests_own = {**families._COMMON, **{**families.MOE_FAMILIES, **families.FAMILIES, **families.LLAMA4}[family][1]}
    defaults = AutoConfig.for_model(config["model_type"])
    unset = {k: None if k == "layer_types" else getattr(defaults, k) for k in tests_own if k not in small}
    dtype = getattr(torch, config.get("dtype") or config.get("torch_dtype") or "float32")
    families.make_tiny(family, folder / "float32", seed=0, **{**unset, **small})
    out = folder / "model"
    out.mkdir()
    fp8 = (config.get("quantization_config") or {}).get("quant_method") == "fp8"
    if fp8:
        from tests.unit.test_source_formats import FP8_BLOCK_CONFIG, _fp8_block_encoded
    tensors = {}
    for f in sorted((folder / "float32").glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            # DeepSeek's FP8 originals: every decoder-layer projection, kv_a_proj_with_mqa included; routers and
            # norms stay as stored, e_score_correction_bias in float32 as the Hub files hold it
            if fp8 and ".layers." in name and name.endswith(("_proj.weight", "_mqa.weight")) and t.dim() == 2:
                tensors.update(_fp8_block_encoded(name, t))
            else:
                keep = name.endswith("e_score_correction_bias") or not t.is_floating_point()
                tensors[name] = t if keep else t.to(dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    saved = json.loads((folder / "float32" / "config.json").read_text())
    saved["dtype" if "dtype" in saved else "torch_dtype"] = str(dtype).removeprefix("torch.")
    if fp8:
        saved["quantization_config"] = FP8_BLOCK_CONFIG
    (out / "config.json").write_text(json.dumps(saved, indent=2))
    for f in (folder / "float32").iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    shutil.rmtree(folder / "float32")
    if (config.get("quantization_config") or {}).get("quant_method") == "mxfp4":  # gpt-oss: experts as it ships
        from tests.unit.build_helpers import save_as_mxfp4_original

        original = save_as_mxfp4_original(out, folder / "mxfp4")
        for f in out.iterdir():
            if not (original / f.name).exists():
                shutil.copy(f, original / f.name)
        shutil.rmtree(out)
        original.rename(out)
    return out


def tiny_model(family: str, folder: Path) -> Path:
    """A deterministic tiny model of `family`, built by this tree's test helpers."""
    sys.path.insert(0, str(REPO))
    from tests.conftest import make_tiny_model, make_tokenizer

    if family == "llama":
        return make_tiny_model(folder, hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, seed=0)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = make_tokenizer()  # as tests/unit/test_gemma3.py's make_tiny_gemma3, at W4AFP8-friendly widths
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "gemma3_text", vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08 if p.dim() == 2 else 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def prepare(recipes: list[Path], model: str, work: Path) -> list[Path]:
    """The recipe texts both trees build: as shipped (real) or on tiny models with a small calibration."""
    import yaml

    out, models = [], {}
    for path in recipes:
        r = yaml.safe_load(path.read_text())
        if path.stem in SKIPPED:
            print(f"{path.stem:24s} skipped: {SKIPPED[path.stem]}", flush=True)
            continue
        if model == "tiny":
            source = r["model"]["source"]
            tp = max((t.get("tensor_parallel", 1) for t in r["targets"]), default=1)
            if source in TINY:
                key = TINY[source]
                if key not in models:
                    models[key] = tiny_model(key, work / f"tiny-{key}")
            elif source.startswith("hf:") and r["model"].get("config"):
                group = (r["quantization"].get("weights") or {}).get("group_size") or 0
                split = f"-g{group}" if group and tp > 1 else ""  # widths follow the heads' and groups' split
                key = f"{source.removeprefix('hf:').replace('/', '--')}-tp{max(4, tp)}{split}"
                if key not in models:
                    models[key] = hf_stand_in(path, r["model"], tp, group, work / f"tiny-{key}")
                del r["model"]["config"]  # the stand-in's own config.json is what a local source plans from
            else:
                sys.exit(f"{path}: no tiny stand-in for model.source {source!r}; add it to TINY (or a model.config)")
            r["model"]["source"] = str(models[key])
            r["calibration"] = {**r.get("calibration", {}), "samples": 4, "seq_len": 64}
            budget = ((r.get("quantization") or {}).get("search") or {}).get("budget") or {}
            if "bytes" in budget:  # the same share of the stand-in's Linears as of the shipped model's
                budget["effective_bits"] = budget_as_effective_bits(source, budget.pop("bytes"))
            if r["calibration"].get("device") == "cuda":  # no GPU here: calibrated on the CPU (same code path)
                r["calibration"]["device"] = "cpu"
        (work / "recipes").mkdir(exist_ok=True)
        out.append(work / "recipes" / path.name)
        out[-1].write_text(yaml.safe_dump(r, sort_keys=False) if model == "tiny" else path.read_text())
    return out


def budget_as_effective_bits(source: str, nbytes: int) -> float:
    """A search's bytes budget as effective bits over the shipped model's decoder-layer Linears (what
    `quantization.search.budget.effective_bits` counts): a stand-in's Linears are a thousandth of the model's, so a
    budget in bytes would hold them whole and leave the search nothing to choose."""
    from safetensors import safe_open

    from llmc.model.source import locate_source
    from llmc.storage.store import Store

    weights = 0
    for f in sorted(locate_source(source, Store.default()).folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                if ".layers." in name and name.endswith("_proj.weight"):
                    out_dim, in_dim = st.get_slice(name).get_shape()
                    weights += out_dim * in_dim
    return nbytes * 8 / weights


def child(recipes: list[Path]) -> None:
    """In a tree's own interpreter: build each recipe's export stage and print the hashes of its artifacts."""
    import llmc
    from llmc.build import build_until
    from llmc.recipe.load import load_recipe
    from llmc.storage.store import Store

    tree, cache = Path(os.environ["PYTHONPATH"]).resolve(), Path(os.environ["LLMC_CACHE"])
    assert Path(llmc.__file__).resolve().is_relative_to(tree), f"imported {llmc.__file__}, not from {tree}"
    store, result = Store(cache), {}  # one cache for all recipes, as a user's: equal stage keys share outputs
    for path in recipes:
        t = time.monotonic()
        try:
            built = build_until(load_recipe(path), store, "export")
        except Exception as e:  # one broken recipe still lets the others be compared
            result[path.stem] = {"error": f"{type(e).__name__}: {e}"}
            continue
        result[path.stem] = {}
        for label, a in built.artifacts.items():
            # typed llmc.result.Artifact since the registries; a dict in revisions before them
            folder, key = (Path(a.dir), a.key) if hasattr(a, "dir") else (Path(a["dir"]), a["key"])
            result[path.stem][label] = {"files": hash_tree(folder), "key": key,
                                        "dir": str(folder.relative_to(store.root))}
        print(f"[compare_exports] {path.stem}: {time.monotonic() - t:.1f}s", file=sys.stderr, flush=True)
    print(json.dumps(result, sort_keys=True))


def hash_tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name not in NOT_COMPARED}


def run_tree(name: str, tree: Path, recipes: list[Path], work: Path) -> dict:
    """Run the child on `tree` with a fresh cache at <work>/cache, then move that cache to <work>/<name>-cache."""
    env = {**os.environ, "PYTHONPATH": str(tree), "LLMC_CACHE": str(work / "cache"),
           "LLMC_PROGRESS_JSON": "0", "TOKENIZERS_PARALLELISM": "false"}
    t = time.monotonic()
    proc = subprocess.run([sys.executable, __file__, "--child", "--recipes", *map(str, recipes)], cwd=tree, env=env,
                          stdout=subprocess.PIPE, text=True)
    print(f"{name} tree built in {time.monotonic() - t:.1f}s", flush=True)
    if (work / "cache").exists():
        (work / "cache").rename(work / f"{name}-cache")
    if proc.returncode:
        sys.exit(f"the {name} tree's child failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def why(base_file: Path, work_file: Path) -> str:
    """A hint for a differing .onnx: is it only torch.onnx's per-node stack traces (source paths, line numbers)?"""
    if base_file.suffix != ".onnx" or not base_file.is_file() or not work_file.is_file():
        return ""
    import onnx

    def without_traces(f: Path) -> bytes:
        m = onnx.load(str(f), load_external_data=False)
        for node in m.graph.node:
            keep = [p for p in node.metadata_props if p.key != "pkg.torch.onnx.stack_trace"]
            del node.metadata_props[:]
            node.metadata_props.extend(keep)
        return m.SerializeToString(deterministic=True)

    same = without_traces(base_file) == without_traces(work_file)
    return " [only its pkg.torch.onnx.stack_trace metadata differs]" if same else ""


def compare(base: dict, work: dict, where: Path) -> bool:
    print(f"not compared in any artifact folder: {', '.join(sorted(NOT_COMPARED))} (the cache's stage marker)")
    same = True
    for recipe in sorted(base.keys() | work.keys()):
        b, w = base.get(recipe, {}), work.get(recipe, {})
        if "error" in b or "error" in w or not b:
            line = f"FAILED to build: base: {b.get('error', 'ok')}; work: {w.get('error', 'ok')}"
        else:
            diffs = []
            for label in sorted(b.keys() | w.keys()):
                bf, wf = b.get(label, {}).get("files", {}), w.get(label, {}).get("files", {})
                for f in sorted(bf.keys() | wf.keys()):
                    if f not in bf or f not in wf:
                        diffs.append(f"{label}/{f} (only in {'base' if f in bf else 'work'})")
                    elif bf[f] != wf[f]:
                        diffs.append(f"{label}/{f}" + why(where / "base-cache" / b[label]["dir"] / f,
                                                           where / "work-cache" / w[label]["dir"] / f))
            n = sum(len(t["files"]) for t in w.values())
            line = f"identical ({len(w)} artifacts, {n} files)" if not diffs else "DIFFERENT: " + ", ".join(diffs)
            if not diffs and any(b[t]["key"] != w[t]["key"] for t in b):
                line += "; export stage keys differ (cached builds would rebuild)"
        same &= line.startswith("identical")
        print(f"{recipe:24s} {line}")
    return same


def copy_working_tree(dest: Path) -> None:
    """The working tree as git sees it (tracked and untracked files, not ignored ones), uncommitted edits included."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            check=True, stdout=subprocess.PIPE, text=True).stdout
    for name in filter(None, listed.split("\0")):
        if (REPO / name).is_file():  # a tracked file deleted in the working tree is listed too
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="git revision to compare the working tree with")
    ap.add_argument("--recipes", nargs="+", type=Path, default=sorted((REPO / "recipes").glob("*.yaml")))
    ap.add_argument("--model", choices=["tiny", "real"], default="tiny")
    ap.add_argument("--keep", type=Path, help="keep caches, recipes and tiny models here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.recipes)
    if not args.base:
        ap.error("--base is required")
    if args.keep and args.keep.exists() and any(args.keep.iterdir()):
        ap.error(f"--keep {args.keep} is not empty")
    t = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="compare-exports-") as tmp:
        work = (args.keep or Path(tmp)).resolve()
        work.mkdir(parents=True, exist_ok=True)
        recipes = prepare([p.resolve() for p in args.recipes], args.model, work)
        # Both trees run from one path: torch.onnx writes absolute source paths into the Q/DQ graph (see docstring).
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(tree), args.base],
                       check=True)
        try:
            base = run_tree("base", tree, recipes, work)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=True)
        copy_working_tree(tree)
        current = run_tree("work", tree, recipes, work)
        same = compare(base, current, work)
    for path in args.recipes:  # said again beside the results: a skipped recipe was not compared
        if path.stem in SKIPPED:
            print(f"{path.stem:24s} skipped: {SKIPPED[path.stem]}")
    print(f"{'all identical' if same else 'artifacts differ'}; {time.monotonic() - t:.1f}s in all")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
