"""NVFP4 / MXFP4 weight-only calibration on a real model: round to nearest, the data-free block-scale search and GPTQ
(and AWQ), each quantized by llmc's layer stream (`quantize_model`), exported as compressed-tensors and scored by the
torch reference engine against the unquantized model on the same Brown eval windows: perplexity change with a paired
bootstrap 95% interval, exact mean KLD and top-1 agreement (with intervals), and the change against RTN of the same
format (paired over the same windows).

The other rows of issue 34's results table, on the same windows (`SCHEMES_8BIT`, `mixed`, `PEERS`):
  fp8        W8A8-FP8: weights per output channel, activations dynamic per token (compressed-tensors' FP8_DYNAMIC)
  fp8_block  128x128 weight blocks; activations dynamic 1x128 groups where every quantized Linear's input width is a
             multiple of 128, weight-only otherwise (SmolLM2: 576), as llmc's torch engine runs them
  mxfp8      W8A8-MXFP8: E4M3 weights and dynamic activations, an E8M0 scale per 32
  mixed      the `quantization:` of --mixed-recipe (default recipes/smollm2-mixed-nvfp4.yaml: attention W8A8-FP8,
             MLP W4A16-NVFP4, first and last decoder layer unquantized), round to nearest
  nvfp4-llmcompressor_gptq / nvfp4-llmcompressor_rtn / nvfp4-modelopt: a peer's NVFP4 weight-only checkpoint
             (llm-compressor 0.14's GPTQModifier / QuantizationModifier with its NVFP4A16 preset; ModelOpt 0.47's
             W4A16_NVFP4_CFG, exported by export_hf_checkpoint), made in the peer's own venv (scripts/setup-peers.sh)
             from the same float32 weights and the same calibration windows, scored here by the same torch engine:
             llm-compressor's compressed-tensors checkpoint loaded as it is, ModelOpt's NVFP4 tensors decoded
             (code x weight_scale x weight_scale_2) into the float32 model.
Every row records the artifact's safetensors bytes (`--bytes-only`: quantize and export without scoring, for rows
measured before bytes were recorded; a calibrated variant writes the same tensors as RTN of its scheme).

    PYTHONPATH=$PWD python benchmarks/fp4_calibration.py --model demo:smollm2-135m \\
        --variants nvfp4-rtn nvfp4-scale_search nvfp4-gptq mxfp4-rtn mxfp4-scale_search mxfp4-gptq \\
        --samples 32 --seq-len 512 --eval-windows 16 --out benchmarks/results/fp4_calibration.jsonl
    PYTHONPATH=$PWD python benchmarks/fp4_calibration.py --table benchmarks/results/fp4_calibration.jsonl
    PYTHONPATH=$PWD python benchmarks/fp4_calibration.py --variants fp8 fp8_block mxfp8 mixed \
        nvfp4-llmcompressor_gptq nvfp4-modelopt --samples 64 --out benchmarks/results/fp4_calibration.jsonl

One JSON line per variant (per-window NLL, KL and top-1 means kept, so `--table` pairs rows measured in separate
runs on the same windows); `--table` prints the markdown table of a results file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# variant name -> (weight format, block size, algorithm)
FORMATS = {"nvfp4": 16, "mxfp4": 32}
ALGORITHMS = ("rtn", "scale_search", "gptq", "gptq+scale_search_scales", "gptq_act_order",
              "gptq_act_order+scale_search_scales", "awq")
SCHEMES_8BIT = ("fp8", "fp8_block", "mxfp8")
REPO = Path(__file__).resolve().parents[1]
# peer variant -> (venv, child script, the child's scheme argument)
PEERS = {
    "nvfp4-llmcompressor_gptq": (".venv-llmcompressor", "_llmcompressor_child.py", "gptq-nvfp4a16"),
    "nvfp4-llmcompressor_rtn": (".venv-llmcompressor", "_llmcompressor_child.py", "rtn-nvfp4a16"),
    "nvfp4-modelopt": (".venv-modelopt", "_modelopt_child.py", "nvfp4-w4a16-export"),
}


def linear_input_widths(config: dict) -> set[int]:
    """The input widths of a dense decoder layer's Linears: hidden (q/k/v, gate/up), heads x head_dim (o), MLP (down)."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return {config["hidden_size"], heads * head_dim, config["intermediate_size"]}


def scheme_of(variant: str, config: dict | None = None, mixed_recipe: Path | None = None):
    from llmc.quant.spec import BLOCK_SHAPE, Scheme, TensorSpec

    if variant == "fp8":
        return Scheme(TensorSpec("fp8_e4m3", "channel"), TensorSpec("fp8_e4m3", "token", dynamic=True))
    if variant == "fp8_block":
        fits = config is not None and all(w % BLOCK_SHAPE[1] == 0 for w in linear_input_widths(config))
        acts = TensorSpec("fp8_e4m3", "group", group_size=BLOCK_SHAPE[1], dynamic=True) if fits else None
        return Scheme(TensorSpec("fp8_e4m3", "block"), acts)
    if variant == "mxfp8":
        return Scheme(TensorSpec("mxfp8", "group", group_size=32), TensorSpec("mxfp8", "group", group_size=32,
                                                                              dynamic=True))
    if variant == "mixed":
        import yaml
        from llmc.recipe.schema import QuantizationSection

        recipe = yaml.safe_load((mixed_recipe or REPO / "recipes" / "smollm2-mixed-nvfp4.yaml").read_text())
        return QuantizationSection.model_validate(recipe["quantization"]).to_scheme()
    fmt, algorithm = variant.split("-", 1)
    options: tuple = ()
    if algorithm.startswith("gptq_act_order"):  # static activation order: every block's scale fixed first
        algorithm, options = algorithm.replace("gptq_act_order", "gptq"), (("act_order", True),)
    if algorithm == "gptq+scale_search_scales":  # GPTQ choosing each block's scale by the search (at its first
        # column, or before any column in activation order)
        algorithm, options = "gptq", (*options, ("block_scales", "search"))
    return Scheme(TensorSpec(fmt, "group", group_size=FORMATS[fmt]), algorithm=algorithm, algorithm_options=options)


def describe(scheme) -> str:
    """The weights' spec (as the first rows recorded it), or each group's scheme for a mixed one."""
    if not scheme.mixed:
        return scheme.weights.describe()
    return "; ".join(f"{g.name}: {scheme.member(g).name if g.quantized else 'unquantized'}" for g in scheme.groups)


def safetensors_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).rglob("*.safetensors"))


def _window_means(x: torch.Tensor) -> list[float]:
    return x.double().mean(dim=1).tolist()


def weight_only_block_fp8(folder: Path) -> None:
    """Block FP8 without activation quantization: llmc exports block FP8 as compressed-tensors' FP8_BLOCK preset,
    which always carries dynamic 1x128 activation groups (what vLLM's W8A8 block kernels run; "W8A16-FP8-BLOCK" is
    not a scheme of llmc's recipes); on widths 128 does not divide (SmolLM2: 576) the benchmark drops them from the
    config, the weights unchanged, as a weight-only FP8 kernel (vLLM's Marlin) would run them."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["input_activations"] = None
    path.write_text(json.dumps(config, indent=2))


def run_peer(variant: str, source_folder: Path, calib_ids: torch.Tensor, work: Path, threads: int) -> tuple[Path, dict]:
    """The peer's checkpoint for `variant` (made in its own venv by its child script) and the child's JSON line."""
    from safetensors.torch import save_file

    venv, child, scheme = PEERS[variant]
    python = REPO / venv / "bin" / "python"
    if not python.exists():
        sys.exit(f"no {venv} at {python}; run: bash scripts/setup-peers.sh")
    tokens = work / "calibration.safetensors"
    save_file({"input_ids": calib_ids.contiguous()}, str(tokens))
    out = work / "peer"
    cmd = [str(python), str(REPO / "benchmarks" / child)]
    cmd += ([str(source_folder), str(tokens), scheme, str(out)] if "llmcompressor" in variant
            else [str(source_folder), str(tokens), "-", scheme, "16", str(out)])
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "THREADS": str(threads)})
    if proc.returncode:
        sys.exit(f"{child} {scheme} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return out, json.loads(proc.stdout.strip().splitlines()[-1])


def decode_modelopt_nvfp4(checkpoint: Path, source_folder: Path, out: Path) -> int:
    """The float32 model with ModelOpt's NVFP4 weights decoded as ModelOpt defines them (E2M1 code x E4M3
    weight_scale x float32 weight_scale_2, the reciprocal of compressed-tensors' global scale), every other tensor
    the source's; written to `out` as a plain checkpoint. Returns how many Linears were decoded."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from llmc.quant.microscaling import MICROSCALING_FORMATS, decode_elements, unpack_e2m1

    nvfp4 = MICROSCALING_FORMATS["nvfp4"]
    theirs = {}
    for f in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            theirs.update({k: h.get_tensor(k) for k in h.keys()})
    state = load_file(str(source_folder / "model.safetensors"))
    decoded = 0
    for name in [k for k in theirs if k.endswith(".weight_scale_2")]:
        module = name.removesuffix(".weight_scale_2")
        packed, scale = theirs[f"{module}.weight"], theirs[f"{module}.weight_scale"]
        values = decode_elements(unpack_e2m1(packed), nvfp4)
        rows, cols = values.shape
        block_scale = scale.float() * theirs[name].float()
        w = (values.reshape(rows, cols // nvfp4.block_size, nvfp4.block_size) * block_scale.unsqueeze(-1))
        key = f"{module}.weight"
        if key not in state or state[key].shape != (rows, cols):
            sys.exit(f"ModelOpt's {key} {tuple(w.shape)} has no match in the source")
        state[key] = w.reshape(rows, cols).to(state[key].dtype)
        decoded += 1
    out.mkdir(parents=True)
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text((source_folder / "config.json").read_text())
    return decoded


def measure(args) -> None:
    from llmc.calibration.corpora import load_corpus
    from llmc.calibration.windows import make_windows
    from llmc.engines.torch_ref import TorchEngine
    from llmc.engines.torch_stream import decide_torch_loading_of
    from llmc.formats.compressed_tensors import export_compressed_tensors
    from llmc.model.source import resolve_source
    from llmc.quant.canonical import QuantizedModel
    from llmc.quant.stream import Calibration, quantize_model
    from llmc.storage.store import Store
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    source = resolve_source(args.model, Store.default())
    config = json.loads((Path(source.folder) / "config.json").read_text())
    config = config.get("text_config", config)
    tok = AutoTokenizer.from_pretrained(source.folder)
    eval_ids = make_windows(tok, load_corpus("brown", "eval"), args.seq_len, args.eval_windows, seed=None).ids
    calib_ids = make_windows(tok, load_corpus("brown", "calibration"), args.seq_len, args.samples, seed=0).ids
    reference = None
    if not args.bytes_only:
        t = time.monotonic()
        base = TorchEngine(source.folder, streamed=decide_torch_loading_of(source.folder, "float32").streamed)
        reference = base.score(eval_ids)
        head = {"model": args.model, "variant": "baseline", "seq_len": args.seq_len, "eval_windows": args.eval_windows,
                "window_nll": _window_means(reference["nll"]), "eval_s": round(time.monotonic() - t, 1),
                "load_avg": os.getloadavg()[0], "weights_bytes": safetensors_bytes(Path(source.folder))}
        _emit(head, args.out)
        del base
    for variant in args.variants:
        with tempfile.TemporaryDirectory(prefix="llmc-fp4cal-") as tmp:
            t = time.monotonic()
            if variant in PEERS:
                artifact, peer = run_peer(variant, Path(source.folder), calib_ids, Path(tmp), args.threads)
                quantize_s = time.monotonic() - t
                row = {"scheme": "nvfp4/g16/sym/static", "peer": peer,  # llm-compressor's RTN reads no data
                       "calibration": None if variant.endswith("_rtn") else f"{args.samples}x{args.seq_len}"}
                scored = artifact
                if "modelopt" in variant:
                    scored = Path(tmp) / "decoded"
                    row["decoded_linears"] = decode_modelopt_nvfp4(artifact, Path(source.folder), scored)
            else:
                scheme = scheme_of(variant, config, args.mixed_recipe)
                calibration = Calibration(calib_ids) if scheme.needs_calibration else None
                quantize_model(source, scheme, Path(tmp) / "canonical", calibration)
                quantize_s = time.monotonic() - t
                artifact = scored = Path(tmp) / "export"
                export_compressed_tensors(QuantizedModel.open(Path(tmp) / "canonical"), artifact)
                if variant == "fp8_block" and scheme.activations is None:
                    weight_only_block_fp8(artifact)
                row = {"scheme": describe(scheme), "scheme_name": scheme.name,
                       "activations": scheme.activations.describe() if scheme.activations and not scheme.mixed
                       else None, "algorithm": scheme.algorithm, "algorithm_options": dict(scheme.algorithm_options),
                       "calibration": f"{args.samples}x{args.seq_len}" if calibration is not None else None}
            row = {"model": args.model, "variant": variant, **row, "quantize_s": round(quantize_s, 1),
                   "weights_bytes": safetensors_bytes(artifact)}
            if args.bytes_only:
                _emit({**row, "bytes_only": True, "load_avg": os.getloadavg()[0]}, args.out)
                continue
            t = time.monotonic()
            scores = TorchEngine(scored, streamed=decide_torch_loading_of(scored, "float32").streamed).score(eval_ids, reference=reference)
            eval_s = time.monotonic() - t
        row.update({"eval_s": round(eval_s, 1), "load_avg": os.getloadavg()[0],
                    "window_nll": _window_means(scores["nll"]), "window_kl": _window_means(scores["kl"]),
                    "window_top1": _window_means(scores["top1"].double())})
        _emit(row, args.out)


def _emit(row: dict, out: Path | None) -> None:
    print(json.dumps({k: v for k, v in row.items() if not k.startswith("window_")}), flush=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")


def table(paths: list[Path], order: list[str] | None = None, pairs: list[str] | None = None) -> str:
    """The markdown table of the results files' rows per model (`order`: these variants, in this order), then for
    each "A:B" in `pairs` the paired change of A against B over the same windows (perplexity and mean KLD)."""
    from llmc.eval.metrics import mean_interval, paired_ppl_change

    rows = [json.loads(line) for path in paths for line in path.read_text().splitlines() if line.strip()]
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        base = [r for r in mine if r["variant"] == "baseline"][-1]
        # a variant measured twice: the last; bytes-only rows give the bytes of their scheme's tensors
        latest = {r["variant"]: r for r in mine if r["variant"] != "baseline" and not r.get("bytes_only")}
        stored = {r["scheme"]: r["weights_bytes"] for r in mine
                  if r.get("weights_bytes") and r["variant"] != "baseline" and r["variant"] not in PEERS}
        if order:
            latest = {v: latest[v] for v in order if v in latest}
        base_nll = torch.tensor(base["window_nll"])[:, None]
        base_bytes = next((r["weights_bytes"] for r in reversed(mine) if r["variant"] == "baseline"
                           and r.get("weights_bytes")), None)
        lines += [f"{model}: baseline ppl {math.exp(base_nll.mean()):.2f}, {base['eval_windows']} windows of "
                  f"{base['seq_len']} tokens" + (f", {base_bytes:,} safetensors bytes" if base_bytes else ""), "",
                  "| variant | scheme | calibration | ppl | Δ ppl vs unquantized (95% CI) | Δ ppl vs RTN (95% CI) "
                  "| mean KLD (95% CI) | top-1 agreement (95% CI) | safetensors bytes | quantize s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        if order and "baseline" in order:
            lines.append(f"| unquantized | float32 | - | {math.exp(base_nll.mean()):.2f} | 0 | | 0 | 100% | "
                         f"{'-' if base_bytes is None else f'{base_bytes:,}'} | - |")
        for variant, r in latest.items():
            nll = torch.tensor(r["window_nll"])[:, None]
            ch = paired_ppl_change(base_nll, nll)
            rtn = latest.get(variant.split("-")[0] + "-rtn") or next(
                (x for x in mine if x["variant"] == variant.split("-")[0] + "-rtn" and "window_nll" in x), None)
            vs_rtn = ("" if rtn is None or rtn["variant"] == variant or "-" not in variant
                      else _pct(paired_ppl_change(torch.tensor(rtn["window_nll"])[:, None], nll)))
            kl = mean_interval(torch.tensor(r["window_kl"])[:, None])
            top1 = mean_interval(torch.tensor(r["window_top1"])[:, None])
            size = r.get("weights_bytes") or stored.get(r["scheme"])
            scheme = r.get("scheme_name") or r["scheme"]
            if r.get("activations"):
                scheme += f" (acts {r['activations']})"
            elif "scheme_name" not in r and not r.get("peer"):
                scheme += " (weight-only)"
            lines.append(f"| {variant} | {scheme} | {r['calibration'] or '-'} | {math.exp(nll.mean()):.2f} | {_pct(ch)} | "
                         f"{vs_rtn} | {kl['mean']:.4f} [{kl['ci_low']:.4f}, {kl['ci_high']:.4f}] | "
                         f"{top1['mean'] * 100:.1f}% [{top1['ci_low'] * 100:.1f}, {top1['ci_high'] * 100:.1f}] | "
                         f"{'-' if size is None else f'{size:,}'}"
                         f"{'' if r.get('weights_bytes') or size is None else '*'} | {r['quantize_s']:.0f} |")
        lines.append("")
        for pair in pairs or []:
            a, b = pair.split(":")
            if a in latest and b in latest:
                ra, rb = latest[a], latest[b]
                ch = paired_ppl_change(torch.tensor(rb["window_nll"])[:, None], torch.tensor(ra["window_nll"])[:, None])
                dkl = mean_interval((torch.tensor(ra["window_kl"]) - torch.tensor(rb["window_kl"]))[:, None])
                lines.append(f"- {a} against {b}: Δ ppl {_pct(ch)}, Δ mean KLD {dkl['mean']:+.4f} "
                             f"[{dkl['ci_low']:+.4f}, {dkl['ci_high']:+.4f}]")
        if pairs:
            lines.append("")
    return "\n".join(lines)


def _pct(ch: dict) -> str:
    return f"{ch['delta_pct']:+.2f}% [{ch['ci_low_pct']:+.2f}, {ch['ci_high_pct']:+.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo:smollm2-135m")
    ap.add_argument("--variants", nargs="+", default=[f"{f}-{a}" for f in FORMATS for a in ("rtn", "scale_search", "gptq")],
                    help=f"<format>-<algorithm>: formats {', '.join(FORMATS)}; algorithms {', '.join(ALGORITHMS)}")
    ap.add_argument("--samples", type=int, default=32, help="calibration windows (GPTQ, AWQ)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, help="append the JSON lines here")
    ap.add_argument("--mixed-recipe", type=Path, help="the recipe whose quantization: is the `mixed` variant "
                    "(default recipes/smollm2-mixed-nvfp4.yaml)")
    ap.add_argument("--bytes-only", action="store_true", help="quantize and export the variants, record their "
                    "safetensors bytes, score nothing")
    ap.add_argument("--table", type=Path, nargs="+", help="print the markdown table of these results files and exit")
    ap.add_argument("--rows", nargs="+", help="with --table: these variants, in this order")
    ap.add_argument("--pairs", nargs="+", help="with --table: A:B, the paired change of variant A against B")
    args = ap.parse_args()
    if args.table:
        print(table(args.table, args.rows, args.pairs))
        return
    measure(args)
    if args.out and not args.bytes_only:
        print(table([args.out]))


if __name__ == "__main__":
    main()
