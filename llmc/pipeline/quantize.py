"""The quantize stage of one scheme: the model streamed one decoder layer at a time through the scheme's
algorithm (`llmc.quant.stream`), written in llmc's canonical quantized form.

Key: the scheme, the compute dtype, the algorithm's key entries, the device type where it is not the CPU, the MoE
calibration mode where set, the number of ranks where sums over windows depend on it; the source and the
calibration windows. Cost: `llmc.planning.resources.quantize_stage` with what the scheme's algorithm states about
itself (`Pipeline`): Hessians, replayed module calls, transforms, search sizes, calibration passes."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from llmc.telemetry import events
from llmc.planning import resources as res
from llmc.pipeline import ranks
from llmc.pipeline.context import Build, Costing, SchemeBytes
from llmc.pipeline.ids import Kind, StageId
from llmc.quant.algorithms import Pipeline, calibration_passes, quantize_stage_config
from llmc.quant.canonical import module_matches
from llmc.quant.spec import Scheme
from llmc.quant.stream import CALIBRATION_BATCH_SIZE, quantize_model
from llmc.storage.store import stage_key


class Quantize:
    share = ranks.Share.ALL

    def __init__(self, variant: str, scheme: Scheme) -> None:
        self.variant, self.scheme = variant, scheme
        self.id = StageId(Kind.QUANTIZE, (variant or scheme.name,))  # as the plan names it
        self.record_id = StageId(Kind.QUANTIZE, (scheme.name,))  # as the build's records always named it

    def key(self, b: Build) -> str:
        scheme, device = self.scheme, b.device
        cfg = {"scheme": scheme.to_dict(), "dtype": b.result.dtype, **quantize_stage_config(scheme)}
        if device.type != "cpu":  # float rounding differs by device; CPU keys stay as they were
            cfg["device"] = device.type
        if b.recipe.calibration.moe_calibrate_all_experts:  # MoE statistics from every token (keys without: as were)
            cfg["moe_calibrate_all_experts"] = True
        summing = ranks.ranks_summing(Pipeline.of(scheme).sums_over_windows)
        if summing:  # sums over windows associate differently on N ranks (maxima do not)
            cfg["ranks"] = summing
        return stage_key("quantize", cfg, [b.result.source.sha256, self._calib_key(b) or ""])

    def pending(self, b: Build) -> bool:
        return not b.runner.is_done(self.id, self.key(b))

    def _calib_key(self, b: Build) -> str | None:
        return b.calib_key if self.scheme.needs_calibration else None

    def run(self, b: Build) -> None:
        scheme, device, calib_key = self.scheme, b.device, self._calib_key(b)
        calibration = b.runner.output(StageId(Kind.CALIBRATE), calib_key) if calib_key else None
        c = b.recipe.calibration

        def produce(out: Path) -> None:
            tokens = mask = None
            if calibration is not None:
                saved = load_file(str(calibration / "tokens.safetensors"))
                tokens, mask = saved["input_ids"], saved.get("attention_mask")
            quantize_model(
                b.result.source, scheme, out, calibration=tokens, calibration_mask=mask,
                dtype=getattr(torch, b.result.dtype),
                extra_meta={"calibration_key": calib_key, "device": device.type},
                on_layer_done=lambda i: events.emit(f"quantize:layer:{i}"),
                spill_activations=c.spill_activations, shared_stats=self._shared_stats(b, calib_key),
                device=device, moe_calibrate_all_experts=c.moe_calibrate_all_experts,
                moe_min_tokens=c.moe_min_tokens)

        key = self.key(b)
        done = b.runner.run(
            self.record_id, key, produce, all_ranks=True, inputs=[calibration] if calibration else [],
            announce=f"quantize: {scheme.name} with {scheme.algorithm}, one decoder layer at a time on {device}")
        b.quantized[self.variant] = (done, key)
        b.result.quantized_dirs[self.variant] = done

    @staticmethod
    def _shared_stats(b: Build, calib_key: str | None) -> Path | None:
        """Where schemes calibrated on original outputs share statistics: one folder per model, data and dtype
        (and the stream's batch size, which fixes the exact arithmetic of the calibration forwards)."""
        if calib_key is None:
            return None
        cfg = {"dtype": b.result.dtype, "batch_size": CALIBRATION_BATCH_SIZE}
        if b.device.type != "cpu":
            cfg["device"] = b.device.type
        return b.runner.shared_folder("shared-stats", stage_key("shared-stats", cfg, [b.result.source.sha256,
                                                                                      calib_key]))

    def cost(self, c: Costing) -> None:
        scheme, shape, e = self.scheme, c.shape, c.elem
        quantized = sum(a * b for n, (a, b) in c.linears.items() if not module_matches(n, scheme.ignore))
        rest = shape.params - quantized
        packed = quantized * scheme.weights.bits / 8  # the quantized weights' codes, packed
        sizes = SchemeBytes(quantized_params=quantized, canonical=quantized * 1 + rest * e,  # int4: one code a byte
                            packed=packed, artifact=packed + rest * e)
        c.bytes_of[self.id.of[0]] = sizes
        pipe = Pipeline.of(scheme)
        kwargs = dict(compute=c.compute, stored_elem=c.stored_elem, calibrated=scheme.needs_calibration,
                      tokens=c.tokens, seq_len=c.recipe.calibration.seq_len, batch=CALIBRATION_BATCH_SIZE,
                      hessians=pipe.observes_hessians, replays_module_calls=pipe.replays_module_calls, passes=calibration_passes(scheme),
                      whole_weight_copies=bool(pipe.transforms) or pipe.observes_hessians,
                      discovers_pairs=bool(pipe.transforms) or pipe.true_sequential,
                      search=pipe.search_cost, code_bytes=1.0, machine=c.machine,
                      weight_key=(scheme.weights.format, scheme.weights.strategy, scheme.weights.group_size))
        row = res.quantize_stage(shape, spill=c.spill, **kwargs)
        row.disk_bytes = sizes.canonical
        c.rows.append(row.named(self.id))
        if scheme.needs_calibration and not c.spill:
            spilled = res.quantize_stage(shape, spill=True, **kwargs)
            if spilled.host_bytes < 0.95 * row.host_bytes:  # only a strategy that saves something is named
                c.cheaper[row.name] = ("set calibration.spill_activations: always (or auto) to keep one batch of "
                                       "activations in memory", spilled.host_bytes / 1e9)
