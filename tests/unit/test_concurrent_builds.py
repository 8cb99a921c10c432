"""Two builds of one recipe on one stage cache and one registry at the same time, as two hook workers or two CI jobs
on one runner would run them (real processes): both succeed, one set of stage outputs (the clean build's), one
registry entry, artifacts identical to a clean build's."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from llmc.publish.local import verify_entry
from tests.unit.build_helpers import every_stage_recipe, published_artifact_hashes, small_corpus_file

pytestmark = pytest.mark.heavy  # two whole builds in child processes

REPO = Path(__file__).resolve().parents[2]

# `llmc build` in a child that records the events it emits (one file per process)
_CHILD = """
import sys
sys.path.insert(0, sys.argv.pop(1))
from llmc.telemetry import events
from tests.unit.build_helpers import use_corpus_file
use_corpus_file(sys.argv.pop(1))
log = open(sys.argv.pop(1), "w")
events.subscribe(lambda event: (log.write(event + "\\n"), log.flush()))
from llmc.cli import main
main()
"""


_PRODUCING = ("calibrate:written", "export:written", "eval:written", "quantize:layer:")


def _start(tmp_path: Path, corpus: Path, recipe: Path, cache: str, events: str) -> subprocess.Popen:
    env = {**os.environ, "LLMC_PROGRESS_JSON": "0"}
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(REPO), str(corpus), str(tmp_path / events),
                             "build", str(recipe), "--cache-dir", str(tmp_path / cache)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _produced(path: Path) -> Counter:
    return Counter(e for e in path.read_text().split() if e.startswith(_PRODUCING))


def test_two_concurrent_builds_of_one_recipe_share_one_cache(tmp_path: Path, tiny_model_session: Path) -> None:
    corpus = small_corpus_file(tmp_path / "corpus.json")
    for name in ("shared", "clean"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "recipe.yaml").write_text(every_stage_recipe(tiny_model_session, tmp_path / name / "registry"))
    recipe = tmp_path / "shared" / "recipe.yaml"
    procs = [_start(tmp_path, corpus, recipe, "shared/cache", f"events-{i}") for i in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    alone = _start(tmp_path, corpus, tmp_path / "clean" / "recipe.yaml", "clean/cache", "events-clean")
    assert alone.wait(timeout=900) == 0, alone.communicate()[1][-2000:]

    # each process produced a stage at most once, and nothing a build alone does not produce. Not "once in all":
    # two processes that both looked a stage up before either produced it both produce it (the second waits on the
    # lock, works, then keeps the first's output: Store.produce) — wasted work, never a second or mixed output.
    clean = _produced(tmp_path / "events-clean")
    per_process = [_produced(tmp_path / f"events-{i}") for i in range(2)]
    assert clean and all(set(p) <= set(clean) and all(n <= clean[e] for e, n in p.items()) for p in per_process)
    assert set(per_process[0] + per_process[1]) == set(clean)
    stage_dirs = list((tmp_path / "shared" / "cache" / "stages").glob("*/*"))
    assert sorted(d.relative_to(tmp_path / "shared" / "cache").as_posix() for d in stage_dirs) == sorted(
        d.relative_to(tmp_path / "clean" / "cache").as_posix() for d in (tmp_path / "clean" / "cache" / "stages").glob("*/*"))

    # one registry entry, intact, with the clean build's bytes; both builds name the same artifacts
    entries = [e for e in (tmp_path / "shared" / "registry" / "tiny-int8").iterdir() if not e.name.startswith(".")]
    assert len(entries) == 1 and verify_entry(entries[0]) == []
    shared = published_artifact_hashes(tmp_path / "shared" / "registry")
    assert shared and shared == published_artifact_hashes(tmp_path / "clean" / "registry")
    artifacts = [sorted(line for line in out.splitlines() if line.startswith("artifact ")) for out, _ in outs]
    assert artifacts[0] == artifacts[1] and artifacts[0]
