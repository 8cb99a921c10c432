"""The calibrate stage: the recipe's calibration data as deterministic token windows, with their provenance.

Key: the calibration section as it fixes the windows, and the source. No cost row of its own: its time is in
the quantize stages' (`llmc plan`'s calibration line)."""

from __future__ import annotations

from pathlib import Path

from llmc.data import stages as data
from llmc.data.sources import label
from llmc.pipeline.stage import Stage
from llmc.pipeline.context import Build, Costing
from llmc.pipeline.ids import Kind, StageId
from llmc.pipeline.ranks import Share
from llmc.pipeline.runner import read_json
from llmc.storage.store import atomic_save_safetensors, atomic_write_json, stage_key


class Calibrate(Stage):
    id = StageId(Kind.CALIBRATE)
    share = Share.MAIN_FIRST

    @staticmethod
    def key(b: Build) -> str:
        return stage_key("calibrate", data.calibration_config(b.recipe.calibration, b.calibration),
                         [b.result.source.sha256])

    def pending(self, b: Build) -> bool:
        return False  # the windows' few bytes are not in the plan's disk estimate

    def cost(self, c: Costing) -> None:
        pass

    def run(self, b: Build) -> None:
        c, tokens = b.recipe.calibration, b.calibration
        if tokens is None:  # no scheme calibrates
            return
        cfg = data.calibration_config(c, tokens)

        def produce(out: Path) -> None:
            saved = {"input_ids": tokens.input_ids}
            if tokens.attention_mask is not None:
                saved["attention_mask"] = tokens.attention_mask
            atomic_save_safetensors(out / "tokens.safetensors", saved)
            atomic_write_json(out / "samples.json", {**cfg, **data.provenance(c, tokens)})

        done = b.runner.run(self.id, b.calib_key, produce, announce=f"calibration: {c.samples} {c.packing} of {c.seq_len} "
                                                           f"tokens from {label(c.dataset)} (seed {c.seed})")
        b.result.calibration = read_json(done, "samples.json")
