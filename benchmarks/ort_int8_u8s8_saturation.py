"""Does ONNX Runtime's fused int8 GEMM compute a Q/DQ MatMul exactly on this CPU?

    python benchmarks/ort_int8_u8s8_saturation.py

One MatMul with a static int8 Q/DQ input and int8 per-channel weights (random codes over the full
[-128, 127] range, then over 7 bits [-64, 63]), run by onnxruntime with basic graph optimizations
(DequantizeLinear -> float MatMul: the graph's own semantics) and with all optimizations (what a
deployment gets: Q/DQ fused into MatMulIntegerToFloat). The exact result is computed in numpy. On x86
CPUs without VNNI, ORT's u8s8 kernel (vpmaddubsw) saturates pairwise 16-bit sums, so full-range weights
lose accuracy while 7-bit weights do not. Prints the max relative error per case.
"""

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

K, N = 256, 64


def case(rng: np.random.Generator, wmax: int) -> None:
    w = rng.integers(-wmax - 1, wmax + 1, size=(K, N)).astype(np.int8)
    x = rng.normal(0, 1, size=(4, K)).astype(np.float32)
    xs = np.float32(np.abs(x).max() / 127.5)
    ws = np.full((N,), 0.01, np.float32)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(ws, "ws"),
             numpy_helper.from_array(np.zeros(N, np.int8), "wz"), numpy_helper.from_array(np.array(xs), "xs"),
             numpy_helper.from_array(np.array(0, np.int8), "xz")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], axis=1),
             helper.make_node("MatMul", ["xd", "wd"], ["y"])]
    graph = helper.make_graph(nodes, "qdq_matmul", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, N])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    exact = (np.clip(np.rint(x / xs), -128, 127) * xs) @ (w.astype(np.float32) * ws)
    for level in (ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        opts = ort.SessionOptions()
        opts.graph_optimization_level = level
        y = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        print(f"weights in [{-wmax - 1}, {wmax}], {level.name}: max relative error "
              f"{np.abs(y - exact).max() / np.abs(exact).max():.2e}")


if __name__ == "__main__":
    print(f"onnxruntime {ort.__version__}")
    rng = np.random.default_rng(0)
    case(rng, 127)
    case(rng, 63)
