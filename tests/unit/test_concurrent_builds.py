"""Two builds of one recipe on one stage cache and one registry at the same time, as two hook workers or two CI jobs
on one runner would run them (real processes): both succeed, every stage is produced once (the other waits on its
lock and reuses it), one registry entry, identical artifacts."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from llmc.registry.local import verify_entry
from tests.unit.build_helpers import every_stage_recipe, published_artifact_hashes, small_corpus_file

REPO = Path(__file__).resolve().parents[2]

# `llmc build` in a child that records the events it emits (one file per process)
_CHILD = """
import sys
sys.path.insert(0, sys.argv.pop(1))
from llmc import events
from tests.unit.build_helpers import use_corpus_file
use_corpus_file(sys.argv.pop(1))
log = open(sys.argv.pop(1), "w")
events.subscribe(lambda event: (log.write(event + "\\n"), log.flush()))
from llmc.cli import main
main()
"""


def test_two_concurrent_builds_of_one_recipe_share_one_cache(tmp_path: Path, tiny_model_session: Path) -> None:
    corpus = small_corpus_file(tmp_path / "corpus.json")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(every_stage_recipe(tiny_model_session, tmp_path / "registry"))
    env = {**os.environ, "LLMC_PROGRESS_JSON": "0"}
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(REPO), str(corpus), str(tmp_path / f"events-{i}"),
                               "build", str(recipe), "--cache-dir", str(tmp_path / "cache")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]

    # every stage produced once: its output-writing events appear once across both processes
    produced = Counter()
    for i in range(2):
        produced.update(e for e in (tmp_path / f"events-{i}").read_text().split()
                        if e in ("calibrate:written", "export:written", "eval:written") or e.startswith("quantize:layer:"))
    assert produced and set(produced.values()) == {1}, produced
    stage_dirs = [d for d in (tmp_path / "cache" / "stages").glob("*/*")]
    assert stage_dirs and not [d for d in stage_dirs if d.name.endswith(".partial") or d.name.startswith(".")]

    # one registry entry, intact, and both builds name the same artifacts
    entries = [e for e in (tmp_path / "registry" / "tiny-int8").iterdir() if not e.name.startswith(".")]
    assert len(entries) == 1 and verify_entry(entries[0]) == []
    assert published_artifact_hashes(tmp_path / "registry")
    artifacts = [sorted(line for line in out.splitlines() if line.startswith("artifact ")) for out, _ in outs]
    assert artifacts[0] == artifacts[1] and artifacts[0]
