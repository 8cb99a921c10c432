"""The export stage of one scheme for one target: the runtime's artifact written from the canonical quantized form
by the target's artifact format (`llmc.formats`, looked up through `llmc.runtimes`).

Key: the format's name and its stage config (its options, the target where the artifact depends on it), and the
quantize stage's key. Cost: the format's own (`ArtifactFormat.cost`), given the scheme's sizes on this model
(`Quantize.sizes`) and the exports before it in the build (identical files linked, inputs verified once, the
canonical form read from the page cache after the first: `canonical_read_seconds`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from llmc.runtimes import catalog as targets
from llmc.formats.described import check_export
from llmc.formats.files import SERVE_FILE
from llmc.pipeline.stage import Stage
from llmc.pipeline.context import Build, Costing
from llmc.pipeline.ids import Kind, StageId
from llmc.pipeline.ranks import Share
from llmc.planning.machine import mapped_read_seconds, verify_seconds
from llmc.quant.canonical import QuantizedModel, module_matches
from llmc.quant.groups import by_group
from llmc.quant.spec import Scheme
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


class Export(Stage):
    share = Share.MAIN

    def __init__(self, quantize: Quantize, target: Target, earlier: tuple[Export, ...] = (),
                 config: dict | None = None) -> None:
        self.quantize, self.target = quantize, target  # the stage whose output it exports
        self.earlier = earlier  # the exports before this one in the build
        self.variant, self.scheme = quantize.variant, quantize.scheme
        self.label = f"{self.variant}/{target.label}" if self.variant else target.label
        self.id = StageId(Kind.EXPORT, (self.label,))
        self.format = targets.format_for(target, config, self.scheme)  # config: the model's (a family's own format)

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

    def cached_content_key(self, b: Build) -> str | None:
        """The content key of this export's artifact when it is in the cache (from the files the store recorded for
        it: what an evaluation's key names), else None."""
        quant_key = self.quantize.key(b)
        if not b.runner.is_done(self.quantize.id, quant_key):
            return None
        key = self.key(b, QuantizedModel.open(b.runner.output(self.quantize.id, quant_key)), quant_key)[0]
        if not b.runner.is_done(self.id, key):
            return None
        return content_key(b.runner.recorded_files(b.runner.output(self.id, key)))

    def run(self, b: Build) -> None:
        quant_dir, quant_key = b.quantized[self.variant]
        qm = QuantizedModel.open(quant_dir)
        key, cfg, request = self.key(b, qm, quant_key)
        fmt, target, label = self.format, self.target, self.label

        def produce(out: Path) -> None:
            fmt.write(request, out)
            check_export(out, qm.config)  # before the runner records it: a config that misdescribes is a bug
            if target.triton:
                from llmc.formats.triton_repo import model_name, write_triton_repo

                write_triton_repo(out, targets.triton_backend(target),
                                  name=model_name(f"{b.recipe.name}-{label}"), serve=cfg.get("serve"))

        # the export is made from the quantized form's bytes: every one as recorded
        done = b.runner.run(self.id, key, produce, inputs=[qm.root], announce=f"export: {fmt.name} for {label}")
        files = b.runner.recorded_files(done)
        b.result.artifacts[label] = Artifact(
            label=label, dir=done, key=key, files=files, content_key=content_key(files),
            format=fmt.name, target=targets.target_key(target), scheme=qm.scheme.name,
            scheme_detail=qm.scheme.to_dict())

    def cost(self, c: Costing) -> None:
        scheme, sizes = self.scheme, self.quantize.sizes(c)
        # targets share weight files when they export the same quantize stage's output in the same format (and,
        # where the files depend on it, the same tensor-parallel degree)
        shared_with = next((e.label for e in self.earlier if e.same_files() == self.same_files()), None)
        outer_bytes = c.shape.outer_params * c.kept_elem
        # a second format that writes the weights outside the layers as stored adds only its layer shards (identical
        # files are linked): the format asks whether an earlier one of the same scheme wrote them so
        outer_before = any(e.scheme.name == scheme.name and e.format.writes_outer_as_stored(outer_bytes)
                           for e in self.earlier)
        first = not any(e.quantize is self.quantize for e in self.earlier)
        read_s = canonical_read_seconds(sizes.canonical, outer_bytes, c.shape.layers, first=first,
                                        available=c.machine.available)
        work = targets.ExportWork(
            shape=c.shape, written=written_tensors(c, scheme), bits=scheme.weights.bits, packed_bytes=sizes.packed,
            outer_bytes=outer_bytes, read_seconds=read_s, shared_with=shared_with, outer_written_before=outer_before,
            compute=c.compute, machine=c.machine, config=c.config)
        c.rows.append(self.format.cost(self.label, work).named(self.id))

    def artifact_bytes(self, c: Costing) -> float:
        """Every file the artifact holds (what an engine scoring it loads)."""
        return sum(self.format.written_bytes(w) for w in written_tensors(c, self.scheme))

    def same_files(self) -> tuple:
        """What fixes this export's weight files: the quantize stage's output and what the format's files depend on
        (`ArtifactFormat.files_key`)."""
        return (self.quantize.id, *self.format.files_key(self.target))


def canonical_read_seconds(canonical: float, outer: float, layers: int, *, first: bool,
                           available: int | None) -> float:
    """Seconds an export spends reading the canonical form's files (`canonical` bytes: a file per decoder layer and
    rest.safetensors, `outer` of them). The first export of a quantize stage's output verifies every byte
    (Store.require_intact, once per build), reading the large files around the page cache, then reads them through
    mmap from the disk; a later one finds them in the page cache where it kept them (the whole form smaller than the
    memory available at the plan). Small files were written through the page cache and are read from it."""
    layer_bytes, layer_files = max(canonical - outer, 0.0), max(layers, 1)
    cached = not first and available is not None and canonical < available
    seconds = mapped_read_seconds(layer_bytes, layer_files, cached=cached) + mapped_read_seconds(outer, cached=cached)
    if first:
        seconds += verify_seconds(layer_bytes, files=layer_files) + verify_seconds(outer)
    return seconds


def content_key(files: dict[str, str]) -> str:
    """An artifact's content: its recorded files' sha256 but the serve file's (targets sharing weights differ only
    there), so that one content is scored once."""
    return stage_key("artifact-content", {k: v for k, v in files.items() if k != SERVE_FILE})


def written_tensors(c: Costing, scheme: Scheme) -> list[targets.WrittenTensors]:
    """The counts an export's files are made of (`ArtifactFormat.written_bytes`, summed over the list), from the
    plan's tensor shapes: one entry for a plain scheme; a mixed scheme's first entry holds every tensor but the
    quantized Linears (those of `ignore: true` groups as unquantized layer tensors, the outer weights, the side
    files), then one per quantized group with its Linears at its member's weights."""
    names = tuple(n for n in c.linears if not module_matches(n, scheme.ignore))
    linears = tuple(c.linears[n] for n in names)
    quantized = sum(o * i for o, i in linears)

    def others(weights: set[str]) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """Every tensor of the model by name but the quantized Linears' `weights`."""
        return tuple((k, tuple(s)) for k, s in c.tensor_shapes.items() if k not in weights)

    named = bool(c.tensor_shapes)  # a format typing each tensor on its own reads them (WrittenTensors)
    whole = targets.WrittenTensors(
        linears=linears, weights=scheme.weights, outer=c.shape.outer_params,
        layer_unquantized=c.shape.params - quantized - c.shape.outer_params, elem=c.elem, kept_elem=c.kept_elem,
        side_files=c.side_files, static_input_scales=scheme.activations is not None and not scheme.activations.dynamic,
        linear_names=names if named else (), other_tensors=others({f"{n}.weight" for n in names}) if named else (),
        config=c.config if named else {})
    if not scheme.mixed:
        return [whole]
    members = scheme.members()
    quantized_groups = [(members[name], shapes) for name, shapes in
                        by_group(scheme, c.linears, c.config.get("num_hidden_layers", 0),
                                 c.config.get("model_type")).items() if name in members and shapes]
    in_groups = sum(o * i for _, shapes in quantized_groups for o, i in shapes.values())
    grouped = {f"{n}.weight" for _, shapes in quantized_groups for n in shapes}
    parts = [replace(whole, linears=(), layer_unquantized=c.shape.params - in_groups - c.shape.outer_params,
                     linear_names=(), other_tensors=others(grouped) if named else ())]
    for member, shapes in quantized_groups:
        acts = member.activations
        parts.append(targets.WrittenTensors(
            linears=tuple(shapes.values()), weights=member.weights, outer=0, layer_unquantized=0, elem=c.elem,
            kept_elem=c.kept_elem, static_input_scales=acts is not None and not acts.dynamic,
            linear_names=tuple(shapes) if named else (), config=c.config if named else {}))
    return parts
