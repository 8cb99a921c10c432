#!/usr/bin/env bash
# GPTQModel (CPU) in its own venv (.venv-gptqmodel, or $VENV): the `gptqmodel` evaluation engine, which loads
# llmc's GPTQ-format (exllamav2 target) and AutoAWQ-format (lmdeploy target) checkpoints with GPTQModel's own
# CPU kernels. 7.6.0 is the newest release that accepts torch 2.13 (7.7.0 wants torch>=2.14.1, a CUDA wheel
# on PyPI); the sdist builds no extension at install time. Idempotent. Measured: docs/formats-and-runtimes.md, "Runtimes".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv-gptqmodel}
GPTQMODEL_VERSION=7.6.0
if "$VENV/bin/python" -c "import gptqmodel" 2>/dev/null; then
  echo "GPTQModel venv ready: $("$VENV/bin/python" -c 'import gptqmodel; print(gptqmodel.__version__)')"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip
pip install -q torch==2.13.0            # the CPU wheel (this machine's local wheel, or download.pytorch.org/whl/cpu)
# keep that torch: GPTQModel's dependencies (torchao, accelerate) would otherwise be free to move it
echo "torch==$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')" > "$VENV/torch-pin.txt"
pip install -q -c "$VENV/torch-pin.txt" "gptqmodel==$GPTQMODEL_VERSION"
"$VENV/bin/python" -c "import gptqmodel; print('GPTQModel venv ready:', gptqmodel.__version__)"
