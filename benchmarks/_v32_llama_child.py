"""Child of benchmarks/v32_indexer_agreement.py, run under the llama.cpp venv's Python (numpy and llama_cpp only):
scores token windows with a DeepSeek-V3.2 (`deepseek32`) GGUF and records, per window and layer, the lightning
indexer's masked scores (`indexer_score-N`) and the keys it keeps (`top_k-N`), read from llama.cpp's graph through
its eval callback.

    python _v32_llama_child.py <model.gguf> <windows.npy> <f16|f32 (the KV cache's K type)> <out.npz>
"""

import ctypes
import re
import sys

import numpy as np


class _Tensor(ctypes.Structure):  # ggml.h `struct ggml_tensor`, up to its name (GGML_MAX_DIMS 4, MAX_SRC 10)
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]


_NP = {0: np.float32, 26: np.int32}  # GGML_TYPE_F32, GGML_TYPE_I32


def main(gguf: str, windows_path: str, cache: str, out: str) -> None:
    import llama_cpp
    import llama_cpp.llama_cpp as lc

    seen: dict[str, np.ndarray] = {}

    def observe(t_ptr, ask, _user):
        t = _Tensor.from_address(t_ptr)
        name = t.name.decode()
        wanted = re.fullmatch(r"(indexer_score|top_k)-\d+", name) is not None  # not their views
        if ask:
            return wanted
        if wanted and t.type in _NP:  # the CPU backend: data is host memory; both tensors are contiguous
            ne = list(t.ne)
            n = int(np.prod(ne))
            arr = np.ctypeslib.as_array(ctypes.cast(t.data, ctypes.POINTER(ctypes.c_int32 if t.type == 26
                                                                           else ctypes.c_float)), (n,))
            seen[name] = np.array(arr, dtype=_NP[t.type]).reshape(ne[::-1])  # numpy order: [ne3, ne2, ne1, ne0]
        return True

    callback = lc.ggml_backend_sched_eval_callback(observe)
    default = lc.llama_context_default_params

    def with_callback():
        p = default()
        p.cb_eval = callback
        p.cb_eval_user_data = None
        return p

    lc.llama_context_default_params = with_callback  # Llama() builds its context from these
    windows = np.load(windows_path).astype(np.int64)
    n_tok = windows.shape[1]
    type_k = {"f16": 1, "f32": 0}[cache]
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=n_tok + 8, n_batch=n_tok + 8, n_ubatch=n_tok + 8, logits_all=True,
                          n_threads=2, seed=0, verbose=False, type_k=type_k, type_v=type_k)
    logits, scores, topk = [], [], []
    for ids in windows:
        seen.clear()
        llm.reset()
        llm.eval(ids.tolist())
        logits.append(np.array(llm.scores[:n_tok], dtype=np.float32))  # a copy: llm.scores is reused
        layers = sorted(int(k.split("-")[1]) for k in seen if k.startswith("top_k-"))
        # indexer_score: [1, 1, n_tokens, n_kv] -> [n_tokens, n_tok]; top_k: [1, 1, n_tokens, k]
        scores.append(np.stack([seen[f"indexer_score-{il}"].reshape(n_tok, -1)[:, :n_tok] for il in layers]))
        topk.append(np.stack([seen[f"top_k-{il}"].reshape(n_tok, -1) for il in layers]))
    np.savez(out, logits=np.stack(logits), scores=np.stack(scores), topk=np.stack(topk),
             version=np.array(llama_cpp.__version__))


if __name__ == "__main__":
    main(*sys.argv[1:5])
