"""Run one NVIDIA ModelOpt quantization on local files and score it; used by benchmarks/algorithms_vs_modelopt.py.

    .venv-modelopt/bin/python benchmarks/_modelopt_child.py MODEL_DIR CALIB.safetensors EVAL.safetensors SCHEME GROUP [OUT]

Runs in ModelOpt's own venv (scripts/setup-peers.sh); imports nothing from llmc. SCHEME is fp8, int8-sq or
int4-awq: ModelOpt's FP8_DEFAULT_CFG, INT8_SMOOTHQUANT_CFG and INT4_AWQ_CFG unchanged except the INT4 block
size (GROUP: SmolLM2's 576 is not a multiple of ModelOpt's default 128). The model is scored by ModelOpt's
own fake-quantized forward on the eval windows: mean token NLL over all windows. For int4-awq it is scored a
second time after ModelOpt's own export preprocessing (`requantize_resmooth_fused_llm_layers`, what
`export_hf_checkpoint` runs first): awq_lite searches one pre_quant_scale per Linear, and the export averages
them over Linears that share an input (q/k/v, gate/up), re-quantizing their weights, so that one scale can be
folded into the norm; the second score is that of the checkpoint a runtime would load.
SCHEME nvfp4-w4a16-export (benchmarks/fp4_calibration.py's NVFP4 peer row): W4A16_NVFP4_CFG unchanged (E2M1 weights,
an E4M3 scale per 16, weight_scale_2 per tensor, max calibration), run over the calibration windows, then
`export_hf_checkpoint` writes ModelOpt's unified HF checkpoint to OUT; EVAL may be "-" (nothing scored here: the
caller decodes the checkpoint and scores it with its own engine).
Prints one JSON line: perplexity (and ppl_exported for int4-awq), wall time of mtq.quantize alone, versions.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

CONFIGS = {"fp8": "FP8_DEFAULT_CFG", "int8-sq": "INT8_SMOOTHQUANT_CFG", "int4-awq": "INT4_AWQ_CFG",
           "nvfp4-w4a16-export": "W4A16_NVFP4_CFG"}


def main() -> None:
    model_dir, calib_file, eval_file, scheme, group = sys.argv[1:6]
    out = sys.argv[6] if len(sys.argv) > 6 else None
    import modelopt
    import modelopt.torch.quantization as mtq
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    calib = load_file(calib_file)["input_ids"]
    evals = None if eval_file == "-" else load_file(eval_file)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = copy.deepcopy(getattr(mtq, CONFIGS[scheme]))
    for entry in cfg["quant_cfg"]:
        if (entry.get("quantizer_name") == "*weight_quantizer" and "block_sizes" in entry.get("cfg", {})
                and scheme.startswith("int4")):  # NVFP4's blocks of 16 are the format's
            entry["cfg"]["block_sizes"] = {-1: int(group), "type": "static"}

    def forward_loop(m) -> None:
        with torch.no_grad():
            for batch in calib.split(4):
                m(input_ids=batch)

    def perplexity() -> float:
        nll_sum, count = 0.0, 0
        with torch.no_grad():
            for batch in evals.split(4):
                logits = model(input_ids=batch).logits[:, :-1].float()
                nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                        batch[:, 1:].reshape(-1), reduction="sum")
                nll_sum, count = nll_sum + float(nll), count + batch[:, 1:].numel()
        return math.exp(nll_sum / count)

    t = time.monotonic()
    model = mtq.quantize(model, cfg, forward_loop)
    wall = time.monotonic() - t
    result = {"scheme": scheme, "config": CONFIGS[scheme], "wall_s": wall}
    if evals is not None:
        result["ppl"] = perplexity()
    if out is not None:
        from modelopt.torch.export import export_hf_checkpoint

        t = time.monotonic()
        with torch.no_grad():
            export_hf_checkpoint(model, export_dir=out)
        result.update(export_s=time.monotonic() - t, out=out)
    if scheme == "int4-awq":
        from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers

        with torch.no_grad():
            requantize_resmooth_fused_llm_layers(model)
        result["ppl_exported"] = perplexity()
    print(json.dumps({**result, "modelopt": modelopt.__version__, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
