"""The export stage of one scheme for one target: the runtime's artifact written from the canonical quantized form
by the target's artifact format (`llmc.runtimes`).

Key: the format's name and its stage config (its options, the target where the artifact depends on it), and the
quantize stage's key. Cost: `llmc.planning.resources.export_stage` with what the format states about itself (whole
model in memory, repacked layers, 8-bit codes passed through, outer weights written as stored)."""

from __future__ import annotations

from pathlib import Path

from llmc.planning import resources as res
from llmc import runtimes as targets
from llmc.formats.files import MAX_SHARD_BYTES, SERVE_FILE
from llmc.pipeline.context import Build, Costing
from llmc.pipeline.ids import Kind, StageId
from llmc.pipeline.ranks import Share
from llmc.quant.canonical import QuantizedModel
from llmc.pipeline.quantize import Quantize
from llmc.recipe.schema import Target
from llmc.result import Artifact
from llmc.storage.store import stage_key


def served_context(config: dict, eval_seq_len: int) -> int:
    """The context a runtime is configured to serve (vLLM's --max-model-len): the model's trained context,
    `max_position_embeddings` (a multimodal config holds it in text_config), not the evaluation's window, which would
    cut every served request at a few hundred tokens; the window where the config states no usable length."""
    text = config.get("text_config")
    limit = (text if isinstance(text, dict) else {}).get("max_position_embeddings",
                                                          config.get("max_position_embeddings"))
    # `llmc plan` refuses a window past the context, so the window is only a floor here
    return max(limit, eval_seq_len) if type(limit) is int and limit > 0 else eval_seq_len


class Export:
    share = Share.MAIN

    def __init__(self, quantize: Quantize, target: Target) -> None:
        self.quantize, self.target = quantize, target  # the stage whose output it exports
        self.variant, self.scheme = quantize.variant, quantize.scheme
        self.label = f"{self.variant}/{target.label}" if self.variant else target.label
        self.id = StageId(Kind.EXPORT, (self.label,))
        self.format = targets.format_for(target)

    def key(self, b: Build, qm: QuantizedModel, quant_key: str) -> tuple[str, dict, targets.ExportRequest]:
        """(stage key, stage config, the exporter's request)."""
        ev = b.recipe.eval
        request = targets.ExportRequest(quantized=qm, target=self.target,
                                        max_model_len=served_context(qm.config, ev.seq_len),
                                        max_batch_size=ev.batch_size)
        cfg = {"exporter": self.format.name, **self.format.stage_config(request)}
        if self.target.triton:
            cfg.setdefault("target", targets.target_key(self.target))  # the repository is named after the target
        return stage_key("export", cfg, [quant_key]), cfg, request

    def pending(self, b: Build) -> bool:
        """Whether the build still has to write this export (the disk check counts what it will write)."""
        quant_key = self.quantize.key(b)
        if not b.runner.is_done(self.quantize.id, quant_key):
            return True
        qm = QuantizedModel.open(b.runner.output(self.quantize.id, quant_key))
        return not b.runner.is_done(self.id, self.key(b, qm, quant_key)[0])

    def run(self, b: Build) -> None:
        quant_dir, quant_key = b.quantized[self.variant]
        qm = QuantizedModel.open(quant_dir)
        key, cfg, request = self.key(b, qm, quant_key)
        fmt, target, label = self.format, self.target, self.label

        def produce(out: Path) -> None:
            fmt.write(request, out)
            if target.triton:
                from llmc.formats.triton_repo import model_name, write_triton_repo

                write_triton_repo(out, targets.triton_backend(target),
                                  name=model_name(f"{b.recipe.name}-{label}"), serve=cfg.get("serve"))

        # the export is made from the quantized form's bytes: every one as recorded
        done = b.runner.run(self.id, key, produce, inputs=[qm.root], announce=f"export: {fmt.name} for {label}")
        files = b.runner.recorded_files(done)
        b.result.artifacts[label] = Artifact(
            label=label, dir=done, key=key, files=files,
            content_key=stage_key("artifact-content", {k: v for k, v in files.items() if k != SERVE_FILE}),
            format=fmt.name, target=targets.target_key(target), scheme=qm.scheme.name,
            scheme_detail=qm.scheme.to_dict())

    def cost(self, c: Costing) -> None:
        scheme, fmt, sizes = self.scheme, self.format, c.bytes_of[self.quantize.id.of[0]]
        # targets share weight files when they export the same quantize stage's output in the same format (and,
        # where the files depend on it, the same tensor-parallel degree)
        same = (self.quantize.id, fmt.name) + ((self.target.tensor_parallel,) if fmt.shards_by_tp else ())
        shared_with = c.exports_seen.setdefault(same, self.label)
        new_bytes = sizes.artifact
        outer_bytes = c.shape.outer_params * c.elem
        if fmt.outer_weights_as_stored and outer_bytes > MAX_SHARD_BYTES:
            # measured at 70B width: the TensorRT-LLM export after the vLLM one added only its layer shards
            if scheme.name in c.outer_written:
                new_bytes -= outer_bytes
            c.outer_written.add(scheme.name)
        row = res.export_stage(c.shape, label=self.label, artifact_bytes=sizes.artifact, new_bytes=new_bytes,
                               whole_model=fmt.whole_model,
                               shared_with=None if shared_with == self.label else shared_with,
                               compute=c.compute, machine=c.machine, max_shard_bytes=MAX_SHARD_BYTES,
                               passes_codes_through=scheme.weights.bits == 8 and fmt.passes_8bit_codes,
                               repacked_bytes=sizes.packed if fmt.repacks_layers else None,
                               bits=scheme.weights.bits)
        c.rows.append(row.named(self.id))
