"""quantization.search's mix against the hand mix, uniform schemes and NVIDIA ModelOpt's AutoQuantize (issue 47).

    bash scripts/setup-peers.sh        # .venv-modelopt (ModelOpt 0.47.0), only for the autoquant rows (found as
                                       # benchmarks/_peer_python.py says: $LLMC_MODELOPT_PYTHON, this checkout's,
                                       # or the main checkout's when run from a git worktree)
    PYTHONPATH=$PWD python benchmarks/search_vs_autoquantize.py --model demo:smollm2-135m \\
        --budgets 94887936 --variants hand searched uniform autoquant --out benchmarks/results/search_vs_autoquantize.jsonl
    PYTHONPATH=$PWD python benchmarks/search_vs_autoquantize.py --table benchmarks/results/search_vs_autoquantize.jsonl
    # another model: budgets named by mix, the same shorter windows on every recipe
    PYTHONPATH=$PWD python benchmarks/search_vs_autoquantize.py --model demo:gemma3-270m --set eval.seq_len=128 \
        --budgets hand uniform:W8A8-FP8 'hand*0.8' --autoquant-bits hand 8.0 --work /tmp/aq-gemma --out ...
    # another model: --model demo:qwen2.5-coder-0.5b --budgets hand ...; smaller windows for every row (ModelOpt's
    # too): --set calibration.samples=8 --set eval.seq_len=128 ...

Every row is scored by llmc's torch reference engine against the unquantized model on the search recipe's eval
windows (Brown, 16 x 512 by default): per-window NLL, exact KL and top-1 kept, so `--table` gives the paired 95%
intervals against the baseline and, with `--pairs A:B`, of one row against another (fp4_calibration.table). llmc's
rows are the builds' own evaluations (`build_until(recipe, store, "eval")`, read from the eval stage's per-token
scores): a mix built before is read from the cache, not rebuilt.

  searched@B   recipes/smollm2-search-nvfp4.yaml (W4A16-NVFP4 / W8A8-FP8 / model dtype, by role) with
               quantization.search.budget.bytes=B on --model; built by llmc's own stages (`build_until(..., "quantize")`:
               the measurement is cached per model and calibration, so a second budget only re-solves)
  hand         recipes/smollm2-mixed-nvfp4.yaml's groups on --model (first/last layer unquantized, attention
               W8A8-FP8, MLP W4A16-NVFP4), the same calibration windows
  uniform-X    every decoder Linear in scheme X (--uniform, default W8A8-FP8)
  autoquant@b  ModelOpt 0.47 `mtq.auto_quantize` at effective bits b over the decoder-layer Linears (ModelOpt's
               accounting: unquantized 16 bits, FP8 8, NVFP4 4.5; handed to ModelOpt as its whole-model figure, which
               counts the disabled lm_head at 16 bits) over W4A16_NVFP4_CFG / FP8_DEFAULT_CFG / none on the same
               calibration windows (or the first --autoquant-windows of them) (its child,
               benchmarks/_modelopt_autoquant_child.py); its fake-quantized forward's lm_head inputs come back and are
               scored here with the baseline's head. b defaults to the bits of each llmc mix in ModelOpt's accounting
               (the hand mix's for the hand mix's bytes, else the searched mix's), so each tool's search has the
               same-cost mix as a feasible point in its own accounting. --autoquant-bits overrides.

Nothing is assumed of the model: the hand mix's roles come from the family's table (llmc.model.families), an
unquantized weight costs the recipe's model.dtype, the head ModelOpt counts is read from the config (a 262,144 x 640
head is 62% of Gemma-3-270M's Linear weights, so ModelOpt's whole-model bits sit near 16 whatever the decoder mix),
and `--set` gives every recipe (hand, searched, uniform) the same calibration and eval windows.

The two tools count an unquantized weight differently: llmc's budget holds it in the model's dtype (float32 here: 32
bits), ModelOpt's at 16 bits. Every row records both: `llmc_bytes` (decoder-layer Linears as llmc stores them) and
`bits16` (ModelOpt's effective bits of the same mix).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from _peer_python import peer_python  # noqa: E402
from fp4_calibration import _emit, _window_means, table  # noqa: E402

PEER_VENV, PEER_VARIABLE = ".venv-modelopt", "LLMC_MODELOPT_PYTHON"
CHILD = REPO / "benchmarks" / "_modelopt_autoquant_child.py"
# ModelOpt's cost of a weight, in bits, per candidate (estimate_quant_compression: NVFP4's effective_bits 4.5,
# FP8's (4+3+1), none 16), by llmc's candidate names (None: unquantized)
BITS16 = {"W4A16-NVFP4": 4.5, "W8A8-FP8": 8.0, None: 16.0}


def load(recipe: Path, model: str, overrides: list[str]):
    from llmc.recipe.load import load_recipe

    return load_recipe(recipe, [f"model.source={model}", *overrides])


def model_type(folder: Path) -> str | None:
    """The source's model_type (a multimodal config's text model's), which picks the family's role table."""
    config = json.loads((Path(folder) / "config.json").read_text())
    return config.get("text_config", config).get("model_type") or config.get("model_type")


def stored_elem(recipe, folder: Path) -> int:
    """Bytes an unquantized weight takes as llmc stores it: the recipe's model dtype (float32: 4, bf16: 2)."""
    from llmc.model.dtype import BYTES, resolve_dtype

    return BYTES[resolve_dtype(recipe.model.dtype, Path(folder))]


def evaluated(recipe, store) -> tuple[dict, dict | None, dict, Path]:
    """`recipe` built through llmc's own stages up to its evaluation (each stage cached: a mix built before costs
    nothing): the torch engine's per-window scores of its artifact ({window_nll, window_kl, window_top1}), its
    searched mix's summary (None for groups), the stage timings and the folder of the build's baseline scoring."""
    from safetensors.torch import load_file

    from llmc.build import build_until

    result = build_until(recipe, store, "eval")
    (eid,) = [e for e in result.evals if not e.is_baseline and e.engine == "torch"]
    scores = load_file(str(store.stage_dir("eval", result.evals[eid].key) / "scores.safetensors"))
    times = {r.name: {"seconds": round(r.seconds, 1), "cached": r.cached} for r in result.stages}
    (bid,) = [e for e in result.evals if e.is_baseline and e.engine == "torch"]
    return (_windows(scores), next(iter(result.search.values()), None), times,
            store.stage_dir("eval", result.evals[bid].key))


def decoder_linears(folder: Path) -> dict[str, int]:
    """Every decoder-layer Linear's parameter count (name -> params), read from the source's safetensors headers."""
    from safetensors import safe_open

    from llmc.quant.groups import site_of

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                if k.endswith(".weight") and site_of(k.removesuffix(".weight")) is not None:
                    shape = h.get_slice(k).get_shape()
                    if len(shape) == 2:
                        out[k.removesuffix(".weight")] = shape[0] * shape[1]
    return out


def mix_costs(assignment: dict[str, str | None], params: dict[str, int], specs: dict, elem: int = 4) -> dict:
    """A mix's bytes as llmc's search counts them (`llmc.quant.search.unit_bytes`: each candidate's stored bits,
    `elem` bytes a weight left unquantized) and its effective bits in ModelOpt's accounting."""
    from llmc.quant.search import unit_bytes

    total = sum(params.values())
    stored = sum(unit_bytes(p, None if assignment.get(n) is None else specs[assignment[n]], elem)
                 for n, p in params.items())
    return {"llmc_bytes": float(stored), "bits16": sum(BITS16[assignment.get(n)] * p for n, p in params.items()) / total}


def head_params(folder: Path) -> int:
    """The output head's weights (vocab x hidden; tied to the embeddings or not, ModelOpt counts lm_head's)."""
    config = json.loads((folder / "config.json").read_text())
    config = config.get("text_config", config)
    return int(config["vocab_size"]) * int(config["hidden_size"])


def modelopt_bits(decoder_bits: float, decoder_params: int, head: int) -> float:
    """ModelOpt's effective_bits for a mix of `decoder_bits` (its accounting) over the decoder-layer Linears, lm_head
    kept at 16 bits: AutoQuantize's figure covers every quantizable Linear, lm_head included even when disabled."""
    return (decoder_bits * decoder_params + 16 * head) / (decoder_params + head)


def candidate_specs(recipe) -> dict:
    """The search recipe's scheme candidates' weight specs, by name."""
    q = recipe.quantization
    return {name: group.weights for name, group in q.search.members(q.algorithm).items()}


def role_of(name: str, family: str | None) -> str | None:
    """A decoder-layer Linear's role by the family's table (llmc.model.families.LINEAR_ROLES), as groups select."""
    from llmc.model.families import linear_role
    from llmc.quant.groups import site_of

    return linear_role(family, site_of(name)[1])


def hand_assignment(params: dict[str, int], family: str | None = None) -> dict[str, str | None]:
    """recipes/smollm2-mixed-nvfp4.yaml's groups on any model: first/last decoder layer unquantized, the attention
    role W8A8-FP8, the mlp role W4A16-NVFP4 (roles by the family's table, as the recipe's groups select them)."""
    from llmc.quant.groups import site_of

    layers = sorted({site_of(n)[0] for n in params})
    edges = {layers[0], layers[-1]}
    scheme = {"attention": "W8A8-FP8", "mlp": "W4A16-NVFP4"}
    out = {n: None if site_of(n)[0] in edges else scheme.get(role_of(n, family)) for n in params}
    odd = sorted(n for n in params if site_of(n)[0] not in edges and role_of(n, family) not in scheme)
    if odd:  # the recipe's two groups select attention and mlp only: another role would be left out of the mix
        sys.exit(f"the hand mix has no group for {len(odd)} decoder Linears of role other than attention/mlp, "
                 f"e.g. {odd[0]} ({role_of(odd[0], family)}); compare on a dense model")
    return out


def searched_assignment(summary: dict, params: dict[str, int], family: str | None = None) -> dict[str, str | None]:
    """Each Linear's candidate in a searched mix (units -> candidate; a unit names a layer's role or Linear)."""
    out: dict[str, str | None] = {}
    for unit, cand in summary["units"].items():
        for n in params:
            if n == unit or n.startswith(unit + ".") or _in_unit(n, unit, family) or n in unit.split("+"):
                out[n] = None if cand == "bf16" else cand
    return out


def _in_unit(name: str, unit: str, family: str | None = None) -> bool:
    """'layers.3.attention' holds model.layers.3.self_attn.q_proj, 'layers.3.mlp' model.layers.3.mlp.up_proj,
    'layers.3' both (role and layer granularity; roles by the family's table, as llmc.quant.search.make_units)."""
    from llmc.quant.groups import site_of

    parts = unit.split(".")
    site = site_of(name)
    if parts[0] != "layers" or len(parts) not in (2, 3) or site is None or site[0] != int(parts[1]):
        return False
    return len(parts) == 2 or (role_of(name, family) or site[1]) == parts[2]


def autoquant_assignment(chosen: dict[str, str], params: dict[str, int]) -> dict[str, str | None]:
    """ModelOpt's choice per Linear (its recipe's printed name) in llmc's candidate names; "none": None."""
    names = {"W4A16_NVFP4_CFG": "W4A16-NVFP4", "FP8_DEFAULT_CFG": "W8A8-FP8"}
    missing = sorted(set(params) - set(chosen))
    if missing:
        sys.exit(f"AutoQuantize chose nothing for {len(missing)} decoder Linears, e.g. {missing[0]}")
    return {n: next((v for k, v in names.items() if k in chosen[n]), None) for n in params}


def score_hidden(hidden: torch.Tensor, eval_ids: torch.Tensor, reference: dict) -> dict:
    """Scores of another tool's model from its lm_head inputs [n, seq, hidden], through the baseline's head."""
    from llmc.engines.agreement import OutputHead, reference_rows, score_logits

    head = OutputHead.from_reference(reference)
    parts: dict[str, list] = {}
    for i in range(eval_ids.shape[0]):
        logits = head.logits(hidden[i : i + 1, :-1])
        for k, v in score_logits(logits, eval_ids[i : i + 1, 1:], 256, reference_rows(reference, i, i + 1)).items():
            parts.setdefault(k, []).append(v)
    return _windows({k: torch.cat(v) for k, v in parts.items()})


def _windows(scores: dict) -> dict:
    return {"window_nll": _window_means(scores["nll"]), "window_kl": _window_means(scores["kl"]),
            "window_top1": _window_means(scores["top1"].double())}


def run_autoquant(source_folder: Path, calib: torch.Tensor, eval_ids: torch.Tensor, bits: list[float], work: Path,
                  score_steps: int, threads: int) -> Iterator[dict]:
    from safetensors.torch import save_file

    python = peer_python(REPO, PEER_VENV, PEER_VARIABLE)
    work.mkdir(parents=True, exist_ok=True)  # its scores.pth is reused by a later run on the same calibration
    save_file({"input_ids": calib.contiguous()}, str(work / "calib.safetensors"))
    save_file({"input_ids": eval_ids.contiguous()}, str(work / "eval.safetensors"))
    cmd = [str(python), str(CHILD), str(source_folder), str(work / "calib.safetensors"),
           str(work / "eval.safetensors"), str(work), str(score_steps), *[f"{b:.4f}" for b in bits]]
    log = work / "child.log"
    with log.open("w") as err:  # one JSON line per budget, handed on as it comes (a search takes minutes)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**os.environ, "THREADS": str(threads)})
        for line in proc.stdout:
            if line.startswith("{"):
                yield json.loads(line)
    if proc.wait():
        sys.exit(f"{CHILD.name} failed ({proc.returncode}):\n{log.read_text()[-6000:]}")


def measure(args) -> None:
    from transformers import AutoTokenizer

    from llmc.data import stages as data
    from llmc.model.source import resolve_source
    from llmc.storage.store import Store

    torch.set_num_threads(args.threads)
    store = Store.default()
    sets = list(args.set or [])  # the same calibration and eval settings on every recipe: the rows pair per window
    base_recipe = load(args.search_recipe, args.model, sets)
    source = resolve_source(args.model, store)
    tok = AutoTokenizer.from_pretrained(source.folder)
    calib = data.calibration_tokens(base_recipe.calibration, tok).input_ids
    eval_ids = data.eval_tokens(base_recipe.eval, tok)[None].input_ids
    params = decoder_linears(Path(source.folder))
    family = model_type(Path(source.folder))
    specs = candidate_specs(base_recipe)
    elem = stored_elem(base_recipe, source.folder)
    common = {"model": args.model, "calibration": f"{calib.shape[0]}x{calib.shape[1]}", **({"set": sets} if sets else {})}

    def costs_of(assignment: dict[str, str | None]) -> dict:
        return mix_costs(assignment, params, specs, elem)

    t = time.monotonic()
    cached = None if args.work is None else args.work / f"reference-{_slug(args.model)}-{eval_ids.shape[0]}x{eval_ids.shape[1]}.safetensors"

    def baseline(reference: dict, how: str, seconds: float = 0.0) -> dict:
        _emit({"model": args.model, "variant": "baseline", "seq_len": eval_ids.shape[1], "eval_windows": eval_ids.shape[0],
               "window_nll": _window_means(reference["nll"]), "eval_s": round(seconds, 1), "reference": how,
               "load_avg": os.getloadavg()[0], **costs_of({})}, args.out)
        return reference

    # the baseline's scores: kept from a run before, else the first llmc build's own baseline scoring (the same
    # windows: not scored twice), else scored here
    reference = _reference(source.folder, eval_ids, cached, score=False)
    if reference is not None:
        baseline(reference, "kept")
    anchors: dict[int, float] = {}  # budget -> ModelOpt bits of the mix that defines it
    with tempfile.TemporaryDirectory(prefix="llmc-search-vs-aq-") as tmp:
        work = Path(tmp)
        keep = args.work or work
        for variant in args.variants:
            if variant == "hand":
                recipe = load(args.hand_recipe, args.model, sets)
                rows = [("hand", recipe, hand_assignment(params, family), None)]
            elif variant == "searched":
                budgets = [budget_bytes(b, params, family, costs_of) for b in args.budgets]
                rows = [(f"searched@{b}", load(args.search_recipe, args.model,
                                               [*sets, f"quantization.search.budget.bytes={b}"]), None, b)
                        for b in budgets]
            elif variant == "uniform":
                rows = [(f"uniform-{s}", _uniform(args.hand_recipe, args.model, s, sets), {n: s for n in params}, None)
                        for s in args.uniform]
            else:
                continue
            for name, recipe, assignment, budget in rows:
                t = time.monotonic()
                windows, summary, times, baseline_dir = evaluated(recipe, store)
                build_s = time.monotonic() - t
                if reference is None and (built := _build_reference(baseline_dir, eval_ids, cached)) is not None:
                    reference = baseline(built, "the build's baseline scoring")
                if summary is not None:
                    assignment = searched_assignment(summary, params, family)
                costs = costs_of(assignment)
                if name == "hand":
                    anchors.setdefault(-1, costs["bits16"])
                if budget is not None:
                    anchors[budget] = costs["bits16"]
                row = {**common, "variant": name, "scheme": name, "quantize_s": round(build_s, 1), **costs,
                       "stages": times, **windows,
                       **({"search": {k: summary.get(k) for k in ("bytes", "effective_bits", "predicted_damage", "groups", "proxy")}}
                          if summary else {})}
                _emit({**row, "load_avg": os.getloadavg()[0]}, args.out)
        if reference is None:
            t = time.monotonic()
            reference = baseline(_reference(source.folder, eval_ids, cached), "scored here", time.monotonic() - t)
        if "autoquant" in args.variants:
            given = [costs_of(hand_assignment(params, family))["bits16"] if b == "hand" else float(b)
                     for b in args.autoquant_bits or []]
            bits = [round(b, 4) for b in given] or list(dict.fromkeys(round(v, 4) for v in anchors.values()))
            # ModelOpt's effective bits count lm_head too, kept out of the search at 16 bits (disabled_layers keeps
            # it in the numerator and the denominator): the child gets the whole figure for each decoder-layer one
            head = head_params(Path(source.folder))
            whole = {round(modelopt_bits(b, sum(params.values()), head), 4): b for b in bits}
            if not bits:
                sys.exit("autoquant: no bits given and no llmc mix measured to take them from (--autoquant-bits)")
            t = time.monotonic()
            aq_calib = calib[: args.autoquant_windows or calib.shape[0]]
            for r in run_autoquant(Path(source.folder), aq_calib, eval_ids, list(whole),
                                   keep / f"autoquant-{_slug(args.model)}-{aq_calib.shape[0]}x{aq_calib.shape[1]}-s{args.score_steps}",
                                   args.score_steps, args.threads):
                hidden = _load_hidden(Path(r["hidden"]))
                assignment = autoquant_assignment(r["chosen"], params)
                row = {**common, "calibration": f"{aq_calib.shape[0]}x{aq_calib.shape[1]}",
                       "variant": f"autoquant@{whole.get(r['bits'], r['bits']):g}", "scheme": "modelopt auto_quantize",
                       "modelopt_effective_bits": r["bits"],
                       "peer": {k: v for k, v in r.items() if k != "hidden"}, "quantize_s": r["search_s"],
                       "linears_assigned": len(assignment), **costs_of(assignment),
                       "score_steps": args.score_steps, **score_hidden(hidden, eval_ids, reference)}
                _emit({**row, "wall_s": round(time.monotonic() - t, 1), "load_avg": os.getloadavg()[0]}, args.out)


def budget_bytes(spec: str, params: dict[str, int], family: str | None, costs_of) -> int:
    """A bytes budget from --budgets: a number; 'hand' (the hand mix's bytes on this model), 'hand*F' (F times
    them); 'uniform:SCHEME' (every decoder Linear in SCHEME, one of the search's candidates)."""
    base, _, factor = spec.partition("*")
    if base == "hand":
        value = costs_of(hand_assignment(params, family))["llmc_bytes"]
    elif base.startswith("uniform:"):
        value = costs_of({n: base.removeprefix("uniform:") for n in params})["llmc_bytes"]
    else:
        value = float(base)
    return int(value * float(factor or 1))


def _slug(model: str) -> str:
    return model.replace(":", "-").replace("/", "-")


def _reference(folder: Path, eval_ids: torch.Tensor, cached: Path | None, score: bool = True) -> dict | None:
    """The baseline's scores that serve as the reference (its top-k log-probs and output head), kept in `cached`
    (the eval windows' tokens checked) so a second run scores no baseline; None when none is kept and not `score`."""
    from safetensors.torch import load_file

    from llmc.engines.torch_ref import TorchEngine
    from llmc.engines.torch_stream import decide_torch_loading_of

    if cached is not None and cached.is_file():
        reference = load_file(str(cached))
        if torch.equal(reference.pop("eval_ids"), eval_ids):
            return reference
    if not score:
        return None
    reference = TorchEngine(folder, streamed=decide_torch_loading_of(folder, "float32").streamed).score(eval_ids)
    _keep(reference, eval_ids, cached)
    return reference


def _build_reference(folder: Path, eval_ids: torch.Tensor, cached: Path | None) -> dict | None:
    """The reference from an llmc build's own baseline scoring (its eval stage's scores and head) of the same
    windows, kept in `cached` as one scored here; None (said) when it holds no head or other windows."""
    from llmc.engines.agreement import HEAD_INPUT, load_reference

    reference = load_reference(folder)
    if HEAD_INPUT not in reference or tuple(reference["nll"].shape) != (eval_ids.shape[0], eval_ids.shape[1] - 1):
        print(f"the build's baseline scoring in {folder} holds no output head or other windows than "
              f"{tuple(eval_ids.shape)}: the baseline is scored here", file=sys.stderr)
        return None
    _keep(reference, eval_ids, cached)
    return reference


def _keep(reference: dict, eval_ids: torch.Tensor, cached: Path | None) -> None:
    from safetensors.torch import save_file

    if cached is not None:  # written whole, then renamed: another run may be waiting for it
        cached.parent.mkdir(parents=True, exist_ok=True)
        part = cached.with_name(cached.name + ".part")
        save_file({**{k: v.contiguous() for k, v in reference.items() if isinstance(v, torch.Tensor)},
                   "eval_ids": eval_ids.contiguous()}, str(part))
        os.replace(part, cached)


def _load_hidden(path: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(path))["hidden"]


def _uniform(hand_recipe: Path, model: str, scheme: str, sets: list[str] = ()):
    """The hand recipe with one group: every decoder Linear (attention and MLP roles) in `scheme`."""
    import yaml

    from llmc.recipe.load import parse_recipe

    raw = yaml.safe_load(hand_recipe.read_text())
    raw["name"] = f"uniform-{scheme.lower()}"
    raw["model"]["source"] = model
    raw["quantization"]["groups"] = [{"name": "all", "roles": ["attention", "mlp"], "scheme": scheme}]
    return parse_recipe(yaml.safe_dump(raw), f"<uniform {scheme}>", overrides=list(sets))


def labelled_table(paths: list[Path], pairs: list[str] | None) -> str:
    """fp4_calibration's table of these rows, each mix labelled by its own name and ModelOpt-accounted bits (that
    table calls a row without a scheme name weight-only)."""
    rows = [json.loads(line) for p in paths for line in p.read_text().splitlines() if line.strip()]
    for r in rows:
        if r["variant"] != "baseline":
            r["scheme_name"] = f"{r['scheme']}, {r['bits16']:.2f} bits16"
    with tempfile.TemporaryDirectory(prefix="llmc-search-vs-aq-table-") as tmp:
        merged = Path(tmp) / "rows.jsonl"
        merged.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return table([merged], None, pairs) + predicted_lines(rows)


def predicted_lines(rows: list[dict]) -> str:
    """Each searched build's predicted damage (the search's summed proxy: KLD in nats under the fisher proxy) beside
    its measured mean KLD (95% interval over the windows); the last row of each variant, as the table takes."""
    from llmc.eval.metrics import mean_interval

    latest = {(r["model"], r["variant"]): r for r in rows if r.get("search")}
    lines = [f"- {model} {variant}: predicted {r['search']['predicted_damage']:.4f}, measured mean KLD "
             f"{kl['mean']:.4f} [{kl['ci_low']:.4f}, {kl['ci_high']:.4f}]"
             for (model, variant), r in latest.items()
             for kl in [mean_interval(torch.tensor(r["window_kl"])[:, None])]]
    return ("\n\nPredicted (the search's summed damage) against measured KLD:\n" + "\n".join(lines)) if lines else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo:smollm2-135m")
    ap.add_argument("--search-recipe", type=Path, default=REPO / "recipes" / "smollm2-search-nvfp4.yaml")
    ap.add_argument("--hand-recipe", type=Path, default=REPO / "recipes" / "smollm2-mixed-nvfp4.yaml")
    ap.add_argument("--budgets", nargs="+", default=["94887936"], help="searched mixes' bytes budgets (decoder-layer "
                    "Linears as llmc stores them); 'hand': the hand mix's on --model, 'hand*0.8' 0.8 times them, "
                    "'uniform:W8A8-FP8' every decoder Linear in that candidate")
    ap.add_argument("--set", action="append", metavar="KEY=VALUE", help="a recipe override for every recipe (hand, "
                    "searched, uniform) and the windows of every row, ModelOpt's too (e.g. eval.seq_len=256), "
                    "repeatable")
    ap.add_argument("--variants", nargs="+", default=["hand", "searched", "uniform", "autoquant"],
                    choices=["hand", "searched", "uniform", "autoquant"], help="in this order (autoquant last)")
    ap.add_argument("--uniform", nargs="+", default=["W8A8-FP8"], help="uniform schemes (of the budget's size or "
                    "larger: uniform W4A16-NVFP4 is fp4_calibration.py's nvfp4-rtn row)")
    ap.add_argument("--work", type=Path, help="keep the baseline's reference and AutoQuantize's scores here across "
                    "runs (default: a temporary folder)")
    ap.add_argument("--autoquant-bits", nargs="+", help="effective bits of the decoder-layer Linears in "
                    "ModelOpt's accounting (the bits16 column; converted to ModelOpt's whole-model figure, lm_head at "
                    "16 bits), or 'hand' (the hand mix's on --model); default: the llmc mixes' own")
    ap.add_argument("--score-steps", type=int, default=16, help="calibration windows AutoQuantize scores on")
    ap.add_argument("--autoquant-windows", type=int, help="AutoQuantize calibrates on only the first N of the "
                    "calibration windows (default: all; its CPU cost is ~2 forwards a window per candidate)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--table", type=Path, nargs="+", help="print the markdown table of these results files and exit")
    ap.add_argument("--pairs", nargs="+", help="with --table: A:B, the paired change of variant A against B")
    args = ap.parse_args()
    if args.table:
        print(labelled_table(args.table, args.pairs))
        return
    measure(args)


if __name__ == "__main__":
    main()
