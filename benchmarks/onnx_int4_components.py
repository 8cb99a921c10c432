"""The int4 export's per-weight terms against the real steps they predict, interleaved in one process so that each
pair sees the same moment of a shared machine: llmc's GPTQ repack (`gptq_format.repack_rate` probe vs `repack_linear` over
the first LAYERS decoder layers of SmolLM2's canonical form, as export_gptq runs it) and the builder's GPTQ loader
(`builder_repack_rate` probe vs `QuantModel.from_pretrained` on the real GPTQ intermediate, repacking LAYERS layers).

    nice -n 19 python benchmarks/onnx_int4_components.py QUANTIZE_DIR GPTQ_INTERMEDIATE_DIR OUT.jsonl [LAYERS] [ROUNDS]"""
import contextlib, io, json, os, sys, time
import torch
from llmc.formats import onnx_genai as og
from llmc.formats import files
from llmc.formats.files import repack_linear
from llmc.formats.gptq_format import OUTPUT_DIMS, gptq_codec
from llmc.planning import probes
from llmc.quant.canonical import QuantizedModel
from onnxruntime_genai.models.loaders.quant_model import QuantModel

qdir, gdir, out = sys.argv[1:4]
layers = int(sys.argv[4]) if len(sys.argv) > 4 else 2
rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 2
qm = QuantizedModel.open(qdir)
spec = qm.scheme.weights
files = []
for t in qm.iter_files():
    if any(f"{m}.weight" in t for m in qm.quantized_modules):
        files.append(t)
    if len(files) == layers:
        break
repack, decode = gptq_codec(spec.bits)
cfg = json.load(open(f"{gdir}/config.json"))
attrs = {"config": cfg["quantization_config"], "use_g_idx": False}
heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])

def real_gptq():
    n, s = 0, time.perf_counter()
    for t in files:
        for m in [m for m in qm.quantized_modules if f"{m}.weight" in t]:
            repack_linear(t[f"{m}.weight"], t[f"{m}.weight_scale"], t.get(f"{m}.weight_zero_point"), spec,
                          repack=repack, decode=decode, output_dims=OUTPUT_DIMS)
            n += t[f"{m}.weight"].numel()
    return n, time.perf_counter() - s

def real_loader():
    n = sum(t[f"{m}.weight"].numel() for t in files for m in qm.quantized_modules if f"{m}.weight" in t)
    s = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        QuantModel.from_pretrained("gptq", input_path=gdir, quant_attrs=attrs, q_size=heads * hd, kv_size=kv * hd,
                                   intermediate_size=cfg["intermediate_size"], num_layers=layers)
    return n, time.perf_counter() - s

for r in range(rounds):
    for name, timer, real in (("gptq repack", files._repack_timer(spec, *gptq_codec(spec.bits, v1_zeros_checked=False), OUTPUT_DIMS), real_gptq),
                              ("builder loader", og._builder_repack_timer(spec), real_loader)):
        load0 = os.getloadavg()[0]
        probe = probes.RateBook().probe(name, timer)  # a fresh book: measured now, as a plan with no cached rate
        rate = probe.read("median")
        n, secs = real()
        row = {"round": r, "step": name, "at": time.strftime("%H:%M:%S UTC", time.gmtime()),
               "load": [round(load0, 1), round(os.getloadavg()[0], 1)], "elements": n,
               "probe_rates_M_per_s": [round(x / 1e6, 3) for x in probe.samples],
               "planned_s": round(n / rate, 2), "range_s": [round(n / max(probe.samples), 2), round(n / min(probe.samples), 2)],
               "measured_s": round(secs, 2), "error": round((n / rate - secs) / secs, 3)}
        print(json.dumps(row), flush=True)
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
