"""quantization.search in the build: each unit's damage under each candidate measured in the layer stream's
calibration pass (`llmc.quant.stream.measure_model`), stored like calibration statistics, then solved for the
recipe's budget (`llmc.quant.search`) into a mixed scheme of plain groups that the quantize stage quantizes like any
other.

Key of the measurement: the candidates' formats, the units (granularity, protect, ignore, fused siblings), the
compute dtype, the KV cache, the device type where it is not the CPU, the calibration batch; the source and the
calibration windows. Not the budget: a new budget re-solves the cached measurement without a forward pass. The pass
also records the ranges later schemes share (`Quantize._shared_stats`), so the chosen mix's quantize stage runs no
calibration forward of its own where it only needs ranges (rtn)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from llmc.errors import RecipeError
from llmc.pipeline.context import Build
from llmc.pipeline.ids import Kind, StageId
from llmc.pipeline.quantize import Quantize
from llmc.pipeline.runner import read_json
from llmc.quant.groups import site_of
from llmc.quant.search import BF16, SearchSpace, assignment_groups, layer_damage, solve_space, summary
from llmc.quant.spec import Scheme
from llmc.quant.stream import CALIBRATION_BATCH_SIZE, Calibration, StreamOptions, measure_model
from llmc.recipe.schema import QuantizationSection
from llmc.storage.store import atomic_write_json, stage_key
from llmc.telemetry import events

SENSITIVITY_FILE = "sensitivity.json"
PROXY_MEANING = {  # what sensitivity.json says its numbers are (llmc.quant.search.layer_damages)
    "output": "layer-output relative squared error",
    "update": "layer-output squared error relative to the layer's update (output - input)",
    "token": "layer-output relative squared error per token, averaged",
    "fisher": "diagonal-Fisher estimate of the end-to-end KL divergence per token (1/2 sum g^2 dy^2 / tokens)",
}


def search_id(variant: str) -> StageId:
    """The measurement's id in the build's records: 'quantize:<variant, or search>:sensitivity'."""
    return StageId(Kind.QUANTIZE, (variant or "search", "sensitivity"))


def measurement_key(b: Build, section: QuantizationSection, space: SearchSpace, stand_in: Scheme) -> str:
    members = section.search.members(section.algorithm)
    cfg = {"candidates": {c: (stand_in.member(members[c]).to_dict() if c != BF16 else None)
                          for c in space.candidates},
           "units": [list(u.linears) for u in space.units], "dtype": b.result.dtype,
           "kv_cache": stand_in.kv_cache.format if stand_in.kv_cache else None, "batch_size": CALIBRATION_BATCH_SIZE,
           "moe_calibrate_all_experts": b.recipe.calibration.moe_calibrate_all_experts}
    if section.search.proxy != "output":  # the key of a measurement made before proxies had a name stays valid
        cfg["proxy"] = section.search.proxy
    if b.device.type != "cpu":
        cfg["device"] = b.device.type
    return stage_key("search-sensitivity", cfg, [b.result.source.sha256, b.calib_key or ""])


def resolve_search(b: Build, variant: str, section: QuantizationSection, space: SearchSpace,
                   stand_in: Scheme) -> tuple[Scheme, dict]:
    """The searched mix of `variant`: (its scheme, with one group per chosen candidate, and what quantized.json and
    the report record of it). Measures (or finds the measurement cached), then solves for the budget."""
    if b.calib_key is None or b.calibration is None:
        raise RecipeError("quantization.search measures on calibration data, and none was prepared",
                          fix="keep the calibration section (its defaults serve)")
    members = section.search.members(section.algorithm)
    candidates = {c: (stand_in.member(members[c]) if c != BF16 else None) for c in space.candidates}
    by_layer: dict[int, list] = {}
    for unit in space.units:
        by_layer.setdefault(site_of(unit.linears[0])[0], []).append(unit)
    key = measurement_key(b, section, space, stand_in)
    proxy = section.search.proxy
    tokens = b.calibration
    c = b.recipe.calibration

    def produce(out: Path) -> None:
        damage: dict[str, list[float]] = {}

        def measure(i, layer, linears, inputs, extras, outputs, stats, grads) -> None:
            damage.update(layer_damage(layer, linears, by_layer.get(i, []), candidates, inputs, extras, outputs,
                                       stats.input_absmax, proxy=proxy, grads=grads))
            events.emit(f"search:layer:{i}")

        cal = Calibration(tokens.input_ids, mask=tokens.attention_mask, spill=c.spill_activations,
                          shared_stats=Quantize._shared_stats(b, b.calib_key),
                          moe_all_experts=c.moe_calibrate_all_experts, moe_min_tokens=c.moe_min_tokens)
        measure_model(b.result.source, stand_in, cal, out / "work", measure,
                      StreamOptions(dtype=getattr(torch, b.result.dtype), device=b.device),
                      gradients=proxy == "fisher")
        atomic_write_json(out / SENSITIVITY_FILE, {
            "candidates": list(space.candidates), "measure": PROXY_MEANING[proxy], "proxy": proxy,
            "units": {u.name: {"linears": list(u.linears), "damage": damage[u.name]} for u in space.units}})

    done = b.runner.run(search_id(variant), key, produce,
                        announce=f"search: {len(space.units)} units x {len(space.candidates)} candidates measured in "
                                 "one calibration pass, one decoder layer at a time")
    measured = read_json(done, SENSITIVITY_FILE)["units"]
    damage = {name: entry["damage"] for name, entry in measured.items()}
    solution = solve_space(space, damage)
    if solution is None:  # the plan refuses such a budget first (llmc.planning.plan._search_space)
        raise RecipeError("quantization.search.budget admits no mix", fix="raise the budget")
    groups = assignment_groups(space.units, space.candidates, solution.choice, lambda name: members[name],
                               space.protected)
    quantized = [g for g in groups if g.quantized]
    lead = min(quantized, key=lambda g: g.weights.bits) if quantized else None
    scheme = replace(stand_in, groups=tuple(groups),
                     **({"weights": lead.weights, "activations": lead.activations} if lead else {}))
    return scheme, {**summary(space, solution, damage), "measurement_key": key}
