"""Where an out-of-process engine (vLLM, llama.cpp, TensorRT-LLM) finds the Python of its own environment.

The first of these that is set wins:
  1. the engine's environment variable (LLMC_VLLM_PYTHON, LLMC_LLAMA_PYTHON, LLMC_TRTLLM_PYTHON);
  2. the user config file, $LLMC_CONFIG or ~/.config/llmc/engines.toml:  [engines.vllm] python = "/path/bin/python"
     (a relative path is taken from the file's folder);
then the engine's conventional venv (.venv-vllm, .venv-llama, .venv-trtllm), as `<folder>/bin/python`,
  3. in the current directory;
  4. in the llmc checkout llmc runs from, when it runs from one (scripts/setup-*.sh create the venvs there).
A setting that points at nothing is an error rather than a reason to look further: it names what is wrong.
"""

from __future__ import annotations

import os
import re
import subprocess
from functools import lru_cache
from pathlib import Path

import llmc
from llmc.engines.registry import EngineSpec
from llmc.errors import EngineUnavailable

CONFIG_VARIABLE = "LLMC_CONFIG"
DEFAULT_CONFIG = "~/.config/llmc/engines.toml"


def config_path() -> Path:
    return Path(os.environ.get(CONFIG_VARIABLE) or DEFAULT_CONFIG).expanduser()


def checkout_root() -> Path | None:
    """The source checkout llmc is imported from (its pyproject.toml names llmc), None when llmc is installed."""
    root = Path(llmc.__file__).resolve().parent.parent
    try:
        return root if _read_toml(root / "pyproject.toml")["project"]["name"] == "llmc" else None
    except (OSError, KeyError, TypeError, ValueError, ModuleNotFoundError):
        return None


def engine_python(spec: EngineSpec) -> Path:
    """The interpreter of `spec`'s environment; EngineUnavailable naming every place looked at and the fix."""
    env = spec.environment
    if env is None:
        raise ValueError(f"{spec.name} runs in llmc's own process")
    set_by_variable = os.environ.get(env.python_variable)
    if set_by_variable:
        return _existing(Path(set_by_variable).expanduser(), f"${env.python_variable}", spec)
    looked = [f"${env.python_variable}: not set"]

    config = config_path()
    entry = f"[engines.{_toml_key(spec.name)}] python"
    configured = _configured_python(config, spec)
    if configured is not None:
        return _existing(configured, f"{entry} in {config}", spec)
    looked.append(f"{entry} in {config}: " + ("no such entry" if config.is_file() else "no such file"))

    for folder in dict.fromkeys(f for f in (Path.cwd(), checkout_root()) if f is not None):
        candidate = folder / env.venv / "bin" / "python"
        if candidate.is_file():
            return candidate
        looked.append(f"{candidate}: absent")
    raise EngineUnavailable(f"the {spec.display} engine needs its own Python environment and none was found; "
                            "looked at:\n    " + "\n    ".join(looked), fix=environment_fix(spec))


def engine_version(spec: EngineSpec) -> str | None:
    """The engine's version as its environment imports it; None when there is no such environment or the
    import fails."""
    try:
        return require_engine(spec)
    except EngineUnavailable:
        return None


def require_engine(spec: EngineSpec) -> str:
    """The engine's version; EngineUnavailable when its environment is missing or cannot import the engine."""
    python = engine_python(spec)
    version = _importable_version(python, spec.environment.module)
    if version is None:
        raise EngineUnavailable(f"{python} cannot import {spec.environment.module}", fix=environment_fix(spec))
    return version


@lru_cache(maxsize=None)
def _importable_version(python: Path, module: str) -> str | None:
    try:
        r = subprocess.run([str(python), "-c", f"import {module}; print({module}.__version__)"],
                           capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = r.stdout.strip().splitlines()
    return lines[-1] if r.returncode == 0 and lines else None  # last line: some engines log on import


def _configured_python(config: Path, spec: EngineSpec) -> Path | None:
    if not config.is_file():
        return None
    try:
        value = _read_toml(config).get("engines", {}).get(spec.name, {}).get("python")
    except (ValueError, ModuleNotFoundError, AttributeError) as e:
        raise EngineUnavailable(f"cannot read the engine settings in {config}: {e}",
                                fix="write it as TOML, e.g. [engines.vllm] python = \"/opt/vllm/bin/python\" "
                                    "(Python 3.10 also needs the tomli package)") from None
    return None if value is None else config.parent / Path(str(value)).expanduser()


def _existing(python: Path, where: str, spec: EngineSpec) -> Path:
    if not python.is_file():
        raise EngineUnavailable(f"the {spec.display} engine's Python, set by {where}, does not exist: {python}",
                                fix=environment_fix(spec))
    return python


def environment_fix(spec: EngineSpec) -> str:
    """How to give `spec` an environment llmc finds."""
    env = spec.environment
    return (f"{env.setup} (from an llmc checkout; it creates {env.venv} there), or point {env.python_variable} "
            f"(or `python` under [engines.{_toml_key(spec.name)}] in {config_path()}) at a Python that can import "
            f"{env.module}; see README, Engine environments")


def _toml_key(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else f'"{name}"'


def _read_toml(path: Path) -> dict:
    try:
        import tomllib  # lazy: TOML only when an engines config exists; Python 3.10 needs tomli
    except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
        import tomli as tomllib  # lazy: TOML only when an engines config exists; Python 3.10 needs tomli
    with path.open("rb") as f:
        return tomllib.load(f)
