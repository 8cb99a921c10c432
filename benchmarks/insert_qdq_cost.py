"""insert_qdq on a real canonical form (issue 44) against its probed rate (`llmc.formats.onnx_qdq.insert_qdq_rate`): a
float graph of one MatMul per quantized Linear holding its dequantized weight (as the exporters' graphs hold it), plus
the embedding, then `insert_qdq` timed once. One JSON line: measured and planned seconds, the error, the load.

    nice -n 10 python benchmarks/insert_qdq_cost.py QUANTIZE_STAGE_FOLDER CACHE    # CACHE: where the rates are kept
"""
import sys, time, os, json
from pathlib import Path
import torch
from onnx import TensorProto, helper, numpy_helper
from llmc.quant.canonical import QuantizedModel
from llmc.formats import onnx_qdq
from llmc.planning import probes

qm = QuantizedModel.open(Path(sys.argv[1]))
probes.use_cache(Path(sys.argv[2]))
inits, nodes, weights = [], [], {}
for tensors in qm.iter_files():
    for m in qm.quantized_modules:
        if f"{m}.weight" in tensors:
            w = qm.dequantized_weight(tensors, m).float().t().contiguous().numpy()
            inits.append(numpy_helper.from_array(w, f"{m}.w"))
            nodes.append(helper.make_node("MatMul", [f"x{len(nodes)}", f"{m}.w"], [f"y{len(nodes)}"]))
            weights[f"{m}.w"] = [m]
    for k, v in tensors.items():
        if "embed_tokens" in k:
            inits.append(numpy_helper.from_array(v.float().numpy(), k))
graph = helper.make_graph(nodes, "g", [], [], inits)
model = helper.make_model(graph)
elements = sum(int(torch.tensor(i.dims).prod()) for i in inits if i.name in weights)
load = os.getloadavg()[0]
t = time.perf_counter()
counts = onnx_qdq.insert_qdq(model, qm, weights)
measured = time.perf_counter() - t
spec = qm.scheme.weights
rate = onnx_qdq.insert_qdq_rate(spec, qm.scheme.activations is not None)
print(json.dumps({"at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "load": [round(load, 1), round(os.getloadavg()[0], 1)],
                  "scheme": qm.scheme.name, "elements": elements, "counts": counts, "measured_s": round(measured, 3),
                  "planned_s": round(elements / rate, 3), "probe_rate": rate,
                  "error": round((elements / rate - measured) / measured, 3)}))
