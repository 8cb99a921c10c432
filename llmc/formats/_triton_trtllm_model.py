"""Triton Python-backend model that serves its version folder's TensorRT-LLM checkpoint through the LLM API.

llmc copies this file verbatim to `<repository>/<model>/1/model.py` beside the ModelOpt-style checkpoint
(config.json, hf_quant_config.json, safetensors, tokenizer) and `llmc-trtllm.yaml`, whose keys become the
`tensorrt_llm.LLM` arguments (tensor_parallel_size, max_batch_size, max_num_tokens, kv_cache_config), as
`trtllm-serve <dir> --extra_llm_api_options llmc-trtllm.yaml` would take them. It runs inside Triton's
TensorRT-LLM container (nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3), so it imports nothing from
llmc. Tensors (config.pbtxt): text_input STRING [1]; optional max_tokens INT32, temperature FP32,
top_p FP32, top_k INT32, seed UINT64 (each [1]) -> text_output STRING [1].
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
import yaml

LLM_API_OPTIONS = "llmc-trtllm.yaml"
# optional request input -> (SamplingParams field, Python type)
SAMPLING_INPUTS = {"max_tokens": ("max_tokens", int), "temperature": ("temperature", float),
                   "top_p": ("top_p", float), "top_k": ("top_k", int), "seed": ("seed", int)}
DEFAULT_MAX_TOKENS = 64


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        from tensorrt_llm import LLM

        folder = Path(args["model_repository"]) / str(args["model_version"])
        options_file = folder / LLM_API_OPTIONS
        options = (yaml.safe_load(options_file.read_text()) or {}) if options_file.is_file() else {}
        self.llm = LLM(model=str(folder), **options)

    def execute(self, requests: list) -> list:
        from tensorrt_llm import SamplingParams

        prompts, params, responses = [], [], [None] * len(requests)
        for i, request in enumerate(requests):
            try:
                text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
                prompts.append((i, text.decode() if isinstance(text, bytes) else str(text)))
                fields = {"max_tokens": DEFAULT_MAX_TOKENS}
                for name, (field, kind) in SAMPLING_INPUTS.items():
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    if tensor is not None:
                        fields[field] = kind(tensor.as_numpy().reshape(-1)[0])
                params.append(SamplingParams(**fields))
            except Exception as e:  # a malformed request fails alone, not the batch
                prompts = [p for p in prompts if p[0] != i]
                responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(f"bad request: {e}"))
        if prompts:
            # one generate call for every request Triton handed over: the LLM API batches them in flight
            outputs = self.llm.generate([text for _, text in prompts], params)
            for (i, _), out in zip(prompts, outputs):
                text = np.array([out.outputs[0].text.encode()], dtype=np.object_)
                responses[i] = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("text_output", text)])
        return responses

    def finalize(self) -> None:
        self.llm.shutdown()
