"""The cache protocol, once for every stage: look the output up, or produce it under the stage's lock, verify
its inputs first, record it (timing) and say so (progress, events).

Stages hand the runner their id, their key and a function that writes their files into a folder; they never touch
the store's lookup themselves (`git grep "\\.lookup("` finds it here and in `Store.materialized`, which the
model source's own outputs use before the stage walk: a demo's joined parts, an unpacked GGUF).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from llmc.telemetry import events
from llmc.pipeline import ranks
from llmc.pipeline.ids import StageId
from llmc.telemetry.progress import log
from llmc.model.skeleton import return_free_heap_to_os
from llmc.result import StageRecord
from llmc.storage.store import COMPLETE_MARKER, Store


class Runner:
    def __init__(self, store: Store, records: list[StageRecord]) -> None:
        self.store = store
        self.records = records  # the build's stage records, appended in the order the stages complete

    def run(self, id: StageId, key: str, produce: Callable[[Path], None], *, announce: str,
            inputs: Iterable[Path] = (), all_ranks: bool = False,
            outdated: Callable[[Path], list[str]] | None = None) -> Path:
        """The stage's completed output folder: found in the cache, or written by `produce(folder)` now.

        inputs: stage outputs `produce` reads; every byte is checked against its record first (CorruptOutput).
        all_ranks: under torchrun every rank runs `produce` in the same folder, rank 0 commits it; resumable.
        outdated: reasons a cached output no longer stands although its key matches (then it is discarded)."""
        kind = id.kind.value
        done = self.store.lookup(kind, key)
        if done is not None and outdated is not None:
            problems = outdated(done)
            if problems:
                self.store.discard(done, problems)
                done = None
        if all_ranks:
            ranks.check_same_cache(done is not None, self.store)
        cached, started = done is not None, time.monotonic()
        if done is None:
            log(announce)
            for folder in inputs:
                self.store.require_intact(folder)
            writing = (ranks.producing_together(self.store, kind, key) if all_ranks
                       else self.store.produce(kind, key))
            with writing as out:
                produce(out)
                if id.kind.emits_written:
                    events.emit(f"{kind}:written")
            # what the stage freed below glibc's mmap threshold stays resident in the heap until trimmed: the next
            # stage starts from the process's own memory (a 7B-width quantize stage left 0.25 GB otherwise)
            return_free_heap_to_os()
            done = self.store.lookup(kind, key)
        self.records.append(StageRecord(id.record_name, key, cached, round(time.monotonic() - started, 3)))
        return done

    def is_done(self, id: StageId, key: str) -> bool:
        """Whether the stage's output is complete in the cache (not verified: the disk check asks this)."""
        return (self.store.stage_dir(id.kind.value, key) / COMPLETE_MARKER).is_file()

    def output(self, id: StageId, key: str) -> Path:
        """Where a stage's output lives in the cache (for a later stage to name it as an input)."""
        return self.store.stage_dir(id.kind.value, key)

    def recorded_files(self, folder: Path) -> dict[str, str]:
        """sha256 of a stage output's top-level files, as recorded when it was written (reuse checked the sizes;
        whoever reads the bytes checks every one)."""
        return {rel: f["sha256"] for rel, f in sorted(self.store.recorded(folder).items())
                if "/" not in rel and not rel.startswith(".") and "sha256" in f}

    def file_hash(self, path: Path) -> str:
        return self.store.file_hash(path)

    def shared_folder(self, name: str, key: str) -> Path:
        """A folder several stages share outside the stage protocol (the shared calibration statistics)."""
        return self.store.root / name / key


def read_json(folder: Path, name: str) -> dict:
    return json.loads((folder / name).read_text())

