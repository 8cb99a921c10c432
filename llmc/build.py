"""`llmc build`: recipe -> plan -> calibrate -> quantize -> export -> evaluate -> tasks -> gate -> publish.

The stages are objects (`llmc.pipeline.stages`); this module prepares what they share (the plan, the source, the
token windows) and walks them, each through the runner's cache protocol (`llmc.pipeline.runner`), as the ranks of
a torchrun job share them (`llmc.pipeline.ranks`). Each stage is a function of its inputs, stored under a key that
hashes its config, its inputs' keys and the llmc version (`llmc.storage.store`): rerunning an unchanged recipe finds every
stage done; changing a field recomputes exactly the stages whose keys it enters (gates enter none: they are
re-applied on every run from cached evaluations).
"""

from __future__ import annotations

from llmc.data import stages as data
from llmc.data.bos import bos_decision
from llmc.model.dtype import resolve_dtype, source_dtype
from llmc.model.source import resolve_source
from llmc.model.tokenizer_files import load_tokenizer
from llmc.pipeline import ranks
from llmc.pipeline.calibrate import Calibrate
from llmc.pipeline.context import Build
from llmc.pipeline.export import Export
from llmc.pipeline.ids import Kind
from llmc.pipeline.runner import Runner
from llmc.pipeline.search import resolve_search
from llmc.pipeline.stages import pending_ids, stages
from llmc.planning import probes
from llmc.planning.plan import check_budget, check_disk, make_plan, source_cache_note, unpacked_sources
from llmc.telemetry.progress import log
from llmc.quant.device import cpu_threads, resolve_device
from llmc.recipe.schema import Recipe
from llmc.formats.registry import import_libraries
from llmc.result import BuildResult
from llmc.storage.store import CorruptOutput, Store, stage_key


def build(recipe: Recipe, store: Store, *, publish: bool = True, threads: int | None = None,
          overrides: tuple[str, ...] = ()) -> BuildResult:
    """The whole pipeline. A cached output found changed when a later stage reads it or when it is published is
    discarded (CorruptOutput) and the build runs once more, rebuilding exactly that output and what depends on
    its bytes: exports are deterministic, so the rebuilt bytes are the recorded ones and their evaluations stand."""
    for attempt in (1, 2):
        try:
            return build_until(recipe, store, Kind.PUBLISH if publish else Kind.GATE, threads=threads,
                               overrides=overrides)
        except CorruptOutput as e:
            if attempt == 2:
                raise
            log(f"warning: {e.message}; rebuilding it")
    raise AssertionError("unreachable")


def build_until(recipe: Recipe, store: Store, last: Kind | str, *, threads: int | None = None,
                overrides: tuple[str, ...] = ()) -> BuildResult:
    """Run the stages up to and including `last` (Kind.QUANTIZE, EXPORT, GATE or PUBLISH; or its value)."""
    with cpu_threads(threads):
        return _build_until(recipe, store, Kind(last), overrides)


def _build_until(recipe: Recipe, store: Store, last: Kind, overrides: tuple[str, ...]) -> BuildResult:
    make_plan(recipe)  # recipe + capability checks fail here, before anything is loaded
    device = resolve_device(recipe.calibration.device)
    ranks.start(device)  # torchrun: every rank calibrates and quantizes its block of windows
    if ranks.is_main():
        store.sweep()  # leftovers of processes that are gone
    probes.use_cache(store.root)  # this machine's rates, as earlier plans probed them (or probed now)
    unpacked = unpacked_sources(store.root)
    source = ranks.main_first(lambda: resolve_source(recipe.model.source, store, source_dtype(recipe.model.dtype)))
    # + model shape checks and memory, from headers only; the time budget once the cached stages are known (below)
    plan = ranks.probed_once(lambda: make_plan(recipe, source.folder, check_time=False, last=last))  # probes: rank 0 alone
    plan.cache_writes += source_cache_note(source.folder, store.root, unpacked)
    result = BuildResult(recipe=recipe, build_id=build_id_for(recipe, source), plan=plan, source=source,
                         dtype=resolve_dtype(recipe.model.dtype, source.folder), overrides=tuple(overrides))

    tokenizer = load_tokenizer(source.folder)  # size-capped files; a refused tokenizer is exit 7
    searches = {name: q for name, q in recipe.variant_sections() if q.search is not None}
    # a search measures on the calibration windows whatever its candidates need
    needs_calibration = bool(searches) or any(s.needs_calibration for s in plan.schemes.values())
    # Both token sets first: a source that is missing, too small or shared with the other fails before any work.
    calib_tokens = data.calibration_tokens(recipe.calibration, tokenizer) if needs_calibration else None
    eval_tokens = data.eval_tokens(recipe.eval, tokenizer) if not Kind.EVAL.comes_after(last) else None
    if calib_tokens is not None and eval_tokens is not None:
        data.check_calibration_eval_overlap(calib_tokens, eval_tokens, recipe.eval)
    result.bos = bos_decision(tokenizer).record()
    b = Build(recipe=recipe, runner=Runner(store, result.stages), result=result, device=device, tokenizer=tokenizer,
              calibration=calib_tokens, evaluation=eval_tokens)
    b.calib_key = Calibrate.key(b) if needs_calibration else None
    if searches:  # measured (or found cached) and solved: then planned again with the chosen mixes
        resolved = {name: resolve_search(b, name, q, plan.search[name], plan.schemes[name])
                    for name, q in searches.items()}
        plan = make_plan(recipe, source.folder, check_time=False, resolved=resolved, last=last)
        result.search = plan.searched
        plan.cache_writes += source_cache_note(source.folder, store.root, unpacked)
        result.plan = plan

    walk = stages(recipe, plan.schemes, last, searched=result.search, config=source.config())
    pending = pending_ids(walk, b)
    plan.mark_cached(pending, [s.id for s in walk])  # rows of cached stages say so; the totals count the rest
    log(plan.render())
    check_budget(plan, pending)  # before any weight loads: the time of what is not cached yet
    check_disk(plan, store.root, pending)  # what is cached needs no new disk
    if any(i.kind in (Kind.EXPORT, Kind.EVAL) for i in pending):  # exporting or reading the targets' formats
        import_libraries(s.format for s in walk if isinstance(s, Export))
    ranks.run_stages(walk, lambda stage: stage.run(b))
    return result


def build_id_for(recipe: Recipe, source) -> str:
    """The build id: the recipe (less where it publishes and its time budget) and the model source's hash (a Hub
    commit included)."""
    return stage_key("build", recipe.model_dump(mode="json", exclude={"publish", "resources"}), [source.sha256])
