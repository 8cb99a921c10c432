#!/usr/bin/env bash
# llama.cpp (llama-cpp-python 0.3.36, built from source: ~8-10 min on a quiet 2-core machine) in its own
# venv (.venv-llama), for the GGUF runtime check (tests marked `llama`). Idempotent. 0.3.36 vendors ggml 0.25.3,
# which has the MXFP4 (39) and NVFP4 (40) types llmc's FP4 GGUF files use (docs/formats-microscaling.md); 14 min
# here under a load average of 3-9.
#
# Built portable (AVX2/FMA/F16C, no AVX-512/AMX): a native build on a VM whose CPU advertises AMX
# segfaults in the first llama_decode (measured here: the shipped SmolLM2 GGUF crashed with -11 under
# the native build and runs with this one), and CI machines are AVX2-only.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if .venv-llama/bin/python -c "import llama_cpp" 2>/dev/null; then
  echo "llama.cpp venv ready: $(.venv-llama/bin/python -c 'import llama_cpp; print(llama_cpp.__version__)')"
  exit 0
fi
[ -x .venv-llama/bin/python ] || "$PY" -m venv .venv-llama
.venv-llama/bin/python -m pip install -q --upgrade pip
.venv-llama/bin/python -m pip install -q numpy
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF" \
  .venv-llama/bin/python -m pip install -q --no-cache-dir llama-cpp-python==0.3.36
.venv-llama/bin/python -c "import llama_cpp; print('llama.cpp venv ready:', llama_cpp.__version__)"
