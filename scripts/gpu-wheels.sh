#!/usr/bin/env bash
# The wheels a lent GPU machine lacks for benchmarks/gpu_calibration.py, downloaded into .gpu-wheels/ (ignored by
# git) to be carried there: that machine has no network, and its image (Python 3.12, torch 2.11, transformers 5.17,
# accelerate, safetensors, numpy, pandas, pyarrow, fsspec: /work/shared/GPU.md) has no pydantic and no
# llm-compressor. llmc itself runs from the source tree there (PYTHONPATH); of its own dependencies only pydantic
# (and its two helpers) and google-re2 are missing on the calibration, export and torch-evaluation paths. Only exact pins, no
# dependencies resolved, wheels only (cp312 manylinux for the one compiled package), so the set is the same every
# time. Refuses (exit 1) when the folder would exceed LIMIT_MB (default 16; the run tool carries 64 MiB in all).
#
#     bash scripts/gpu-wheels.sh            # then the one command in docs/gpu.md ("The GPU benchmark at Llama-3.1-8B and Llama-3.3-70B width")
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${GPU_WHEELS:-.gpu-wheels}
PY=${PYTHON:-python3}
LIMIT_MB=${LIMIT_MB:-16}
WHEELS=(
  llmcompressor==0.14.0.1    # the peer (requires transformers <= 5.17: the image's)
  compressed-tensors==0.19.0 # llm-compressor 0.14's pin; llmc's export and torch engine read and write it too
  datasets==5.2.0            # llm-compressor's calibration data type
  dill==0.4.1
  multiprocess==0.70.19
  loguru==0.7.3              # llm-compressor's logging
  pydantic==2.11.10          # llmc's recipe and algorithm options, llm-compressor's modifiers
  pydantic-core==2.33.2      # pydantic 2.11.10's pin: cp312 manylinux
  annotated-types==0.7.0
  typing-inspection==0.4.2
  google-re2==1.1.20251105   # llmc's module-name patterns (RE2: linear time), cp312 manylinux_2_28
)
rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --dest "$DEST" "${WHEELS[@]}"
count=$(find "$DEST" -name '*.whl' | wc -l)
if [ "$count" -ne "${#WHEELS[@]}" ]; then
  echo "expected ${#WHEELS[@]} wheels in $DEST, found $count" >&2
  exit 1
fi
bytes=$(du -sb "$DEST" | cut -f1)
if [ "$bytes" -gt $((LIMIT_MB * 1024 * 1024)) ]; then
  echo "$DEST holds $bytes bytes, over LIMIT_MB=$LIMIT_MB" >&2
  exit 1
fi
ls -1 "$DEST"
echo "$count wheels, $bytes bytes in $DEST"
