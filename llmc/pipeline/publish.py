"""The publish stage: artifacts, manifest, report and model card into the registry (`llmc.publish.local`), then
the Hugging Face Hub where the recipe names one. Only a build whose gates passed publishes; the same build id
publishes once (a no-op after)."""

from __future__ import annotations

from pathlib import Path

from llmc.telemetry import events
from llmc.pipeline.stage import Stage
from llmc.pipeline.context import Build, Costing
from llmc.pipeline.ids import Kind, StageId
from llmc.pipeline.ranks import Share
from llmc.telemetry.progress import log
from llmc.publish.local import publish_build
from llmc.storage.store import resource_errors


class Publish(Stage):
    id = StageId(Kind.PUBLISH)

    share = Share.MAIN

    def pending(self, b: Build) -> bool:
        return False  # no row in the plan's disk estimate

    def cost(self, c: Costing) -> None:
        pass  # the registry links the exports' files: `llmc plan` states their size with the disk line

    def run(self, b: Build) -> None:
        result, recipe = b.result, b.recipe
        if not result.passed:
            return
        with resource_errors("the registry entry", Path(recipe.publish.registry).expanduser() / recipe.name):
            result.published, result.publish_noop = publish_build(result, b.runner.store)
        events.emit("publish:done")
        if recipe.publish.hub:  # after the local entry is complete: the Hub gets its verified bytes
            from llmc.publish.hub import publish_to_hub  # huggingface_hub: only for recipes that publish there

            log(f"published to the Hub: {publish_to_hub(result.published, recipe.publish.hub)}")
