"""Where a peer benchmark finds a peer tool's own venv (scripts/setup-peers.sh: .venv-modelopt, .venv-llmcompressor).

The first of these wins:
  1. the tool's variable (LLMC_MODELOPT_PYTHON, as tests/integration/test_modelopt_*.py read it); set but pointing
     at nothing is an error naming it, not a reason to look further (llmc.engines.environments' rule);
  2. <venv>/bin/python in the checkout the benchmark runs from;
  3. the same in the main checkout when that checkout is a git worktree: setup-peers.sh is run once, in the main
     checkout, and a worktree (a helper's branch) has no venvs of its own.

Standard library only: the benchmarks import it before llmc.
"""

from __future__ import annotations

import os
from pathlib import Path


def main_checkout(repo: Path) -> Path | None:
    """The main checkout of `repo` when `repo` is a git worktree (its .git is a file naming
    <main>/.git/worktrees/<name>, whose commondir leads to <main>/.git); None otherwise."""
    dot_git = repo / ".git"
    try:
        gitdir = Path(dot_git.read_text().strip().removeprefix("gitdir:").strip()) if dot_git.is_file() else None
        if gitdir is None:
            return None
        gitdir = gitdir if gitdir.is_absolute() else repo / gitdir
        common = (gitdir / (gitdir / "commondir").read_text().strip()).resolve()
    except OSError:
        return None
    return common.parent if common.name == ".git" else None


def peer_python(repo: Path, venv: str, variable: str, setup: str = "bash scripts/setup-peers.sh") -> Path:
    """The interpreter of the peer venv `venv`; SystemExit naming every place looked at and the fix."""
    set_by_variable = os.environ.get(variable)
    if set_by_variable:
        python = Path(set_by_variable).expanduser()
        if not python.is_file():
            raise SystemExit(f"${variable} names {python}, which does not exist (fix: point it at the bin/python "
                             f"of the {venv} venv, or unset it to use {repo / venv})")
        return python
    looked = [f"${variable}: not set"]
    for folder in dict.fromkeys(f for f in (repo, main_checkout(repo)) if f is not None):
        python = folder / venv / "bin" / "python"
        if python.is_file():
            return python
        looked.append(f"{python}: absent")
    raise SystemExit(f"no {venv} venv found; looked at:\n    " + "\n    ".join(looked)
                     + f"\n  fix: run {setup} in the main checkout, or set {variable}")
