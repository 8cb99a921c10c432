#!/usr/bin/env bash
# Peer tools for the parity/speed benchmarks (benchmarks/algorithms_vs_llmcompressor.py), each in its
# own venv so their pins never touch llmc's: llm-compressor 0.14.0.1 in .venv-llmcompressor (~3 min;
# brings transformers 5.17 and compressed-tensors 0.19), and NVIDIA ModelOpt 0.47 in .venv-modelopt
# for the TensorRT-LLM conformance tests (tests/integration/test_modelopt_conformance.py). torch stays
# the local CPU wheel through the project's constraint. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

peer_venv() {  # peer_venv <venv> <import name> <pip requirement...>
  local venv=$1 module=$2; shift 2
  if "$venv/bin/python" -c "import $module" 2>/dev/null; then
    echo "$venv ready"
    return
  fi
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -c constraints.txt torch==2.13.0 "$@"
  "$venv/bin/python" -c "import $module; print('$venv ready:', $module.__version__)"
}

peer_venv .venv-llmcompressor llmcompressor llmcompressor==0.14.0.1
peer_venv .venv-modelopt modelopt "nvidia-modelopt[hf]==0.47.0"
