"""Where the out-of-process engines (vLLM, llama.cpp, TensorRT-LLM) find the Python of their own environment."""

from __future__ import annotations

import os
from pathlib import Path

from llmc.errors import EngineUnavailable

REPO = Path(__file__).resolve().parents[2]


def runtime_python(variable: str, venv: str, engine: str, fix: str) -> Path:
    """`$variable` if set, else `<repo>/<venv>/bin/python`; EngineUnavailable with `fix` when it is missing."""
    env = os.environ.get(variable)
    path = Path(env) if env else REPO / venv / "bin" / "python"
    if not path.is_file():
        raise EngineUnavailable(f"the {engine} engine needs its own environment; no interpreter at {path}", fix=fix)
    return path
