#!/usr/bin/env bash
# Peer tools for the parity/speed benchmarks (benchmarks/algorithms_vs_llmcompressor.py), each in its
# own venv so their pins never touch llmc's: llm-compressor 0.14.0.1 in .venv-llmcompressor (~3 min;
# brings transformers 5.17 and compressed-tensors 0.19). torch stays the local CPU wheel through
# the project's constraint. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if .venv-llmcompressor/bin/python -c "import llmcompressor" 2>/dev/null; then
  echo "llm-compressor venv ready"
  exit 0
fi
[ -x .venv-llmcompressor/bin/python ] || "$PY" -m venv .venv-llmcompressor
.venv-llmcompressor/bin/python -m pip install -q --upgrade pip
.venv-llmcompressor/bin/python -m pip install -q -c constraints.txt torch==2.13.0 llmcompressor==0.14.0.1
.venv-llmcompressor/bin/python -c "import llmcompressor; print('llm-compressor venv ready:', llmcompressor.__version__)"
