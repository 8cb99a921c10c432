"""The registry of runtimes (`llmc.registry`), and the lookups over runtimes and the formats they read
(`llmc.formats.registry` holds the formats).

Each runtime module beside this file imports `register_runtime` from here; consumers import
`llmc.runtimes.catalog`, which imports every built-in runtime module (and so the format module each reads) first,
so the lookups they call see all of them. `llmc.build`, `llmc.planning.plan`, `llmc inspect`, the reports, `llmc matrix` and the Triton writer look
targets up there; none of them names a runtime. docs/extending.md shows how to add one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmc.errors import IncompatibleTargetError
from llmc.formats.base import ArtifactFormat, RuntimeTarget
from llmc.formats.registry import FORMATS
from llmc.model.families import expert_count
from llmc.registry import Registry
from llmc.runtimes.base import Runtime, arch_rank, arch_span, scheme_keys

if TYPE_CHECKING:
    from llmc.quant.spec import Scheme

RUNTIMES: Registry[Runtime] = Registry("runtime")  # in the order of docs/compatibility.md


def register_runtime(runtime: Runtime) -> Runtime:
    return RUNTIMES.add(runtime.name, runtime)


def runtime(name: str) -> Runtime:
    return RUNTIMES[name]


def runtimes() -> list[Runtime]:
    """Every registered runtime, in registration order (the order of docs/compatibility.md)."""
    return list(RUNTIMES.values())


def runtime_names() -> tuple[str, ...]:
    return RUNTIMES.names()


def format_for(target: RuntimeTarget, config: dict | None = None,
               scheme: Scheme | None = None) -> ArtifactFormat:
    """The format a recipe target gets (UnknownName, a KeyError, when its runtime's format has no exporter here); for
    the model of `config` (its config.json) where given: a format its runtime reads for that family only
    (`Runtime.family_formats`; of several, the one `family_format` picks for `scheme`)."""
    own = family_format(target, config or {}, scheme)
    return own if own is not None else FORMATS[runtime(target.runtime).format_for(target.version)]


def _family_formats(target: RuntimeTarget, config: dict) -> list[ArtifactFormat]:
    rt = RUNTIMES.get(target.runtime)
    return [FORMATS[n] for n in (rt.family_formats.get(config.get("model_type"), ()) if rt is not None else ())]


def _takes(fmt: ArtifactFormat, scheme: Scheme) -> bool:
    try:
        fmt.check_scheme(scheme)
    except IncompatibleTargetError:
        return False
    return True


def family_format(target: RuntimeTarget, config: dict, scheme: Scheme | None = None) -> ArtifactFormat | None:
    """The format the target's runtime reads for this model's family only (`Runtime.family_formats`), or None: of
    several, the first whose `check_scheme` takes `scheme` (the first where none does, or without a scheme)."""
    formats = _family_formats(target, config)
    return next((f for f in formats if scheme is not None and _takes(f, scheme)), formats[0] if formats else None)


def check_family_format(target: RuntimeTarget, scheme: Scheme, config: dict) -> None:
    """IncompatibleTargetError when the target's runtime reads this family in formats of its own
    (`Runtime.family_formats`) and none can hold this scheme of this model: no format's `check_scheme` takes the
    scheme (the error names each format's refusal and way), or the one that does refuses the model (`ArtifactFormat.check_model`)."""
    formats = _family_formats(target, config)
    if not formats:
        return
    if len(formats) > 1 and not any(_takes(f, scheme) for f in formats):
        errors = []
        for f in formats:
            try:
                f.check_scheme(scheme)
            except IncompatibleTargetError as e:
                try:  # the model-aware check names more (the source, the Linears) where it refuses too
                    f.check_model(target, scheme, config)
                except IncompatibleTargetError as specific:
                    e = specific
                errors.append((f.name, e))
        fixes = [e.fix or "" for _, e in errors]
        last = {f.rpartition("; ")[2] for f in fixes}  # a way out every format names (another runtime): said once
        tail = last.pop() if len(last) == 1 and all("; " in f for f in fixes) else ""
        raise IncompatibleTargetError(
            f"target {target.label}: {target.runtime} reads model_type {config.get('model_type')!r} only as "
            + " or ".join(n for n, _ in errors) + "; " + "; ".join(f"{n}: {e.message}" for n, e in errors),
            fix="; or ".join(f"for {n}: {f.rpartition('; ')[0] if tail else f}" for (n, _), f in zip(errors, fixes))
                + (f"; {tail}" if tail else ""))
    fmt = family_format(target, config, scheme)
    try:
        fmt.check_model(target, scheme, config)
    except IncompatibleTargetError as e:
        message = e.message if e.message.startswith(f"target {target.label}") else f"target {target.label}: {e.message}"
        raise IncompatibleTargetError(message, fix=e.fix) from None


def triton_backend(target: RuntimeTarget) -> str:
    """The Triton backend serving the target's artifact; IncompatibleTargetError naming the targets that have one."""
    fmt = format_for(target)
    if fmt.triton_refusal:
        raise IncompatibleTargetError(*fmt.triton_refusal)
    if fmt.triton_backend is None:
        by_backend: dict[str, list[str]] = {}
        for rt in RUNTIMES.values():
            backend = FORMATS[rt.format].triton_backend if rt.format in FORMATS else None
            if backend:
                by_backend.setdefault(backend, []).append(rt.name)
        options = [f"{'/'.join(names)} (Triton's {backend} backend)" for backend, names in by_backend.items()]
        raise IncompatibleTargetError(
            f"triton: true is not available for {target.runtime} targets ({fmt.name} artifacts)",
            fix="use triton: true with a target of " + "; ".join(options))
    return fmt.triton_backend


def check_moe_scheme(target: RuntimeTarget, scheme: Scheme, config: dict) -> None:
    """IncompatibleTargetError when the model is a Mixture-of-Experts one and the target's runtime has no fused-MoE
    kernel for the scheme (`Runtime.moe_schemes`)."""
    rt = RUNTIMES.get(target.runtime)
    if rt is None or (rt.moe_schemes is None and rt.moe_fp8_layouts is None) or expert_count(config) <= 1:
        return
    for group, member in scheme.members().items():
        if group and scheme.group(group).targets.roles and "experts" not in scheme.group(group).targets.roles:
            continue  # a mixed scheme's group that selects no expert (by role) runs in dense GEMMs
        _check_moe_fp8_layout(target, rt, member, config)
        if rt.moe_schemes is None:
            continue
        key = member.name
        if key == "W8A8-INT8" and not member.activations.dynamic:
            key = "W8A8-INT8 with static activations"
        if key not in rt.moe_schemes:
            raise IncompatibleTargetError(
                f"target {target.label}: {target.runtime} has no fused Mixture-of-Experts kernel for {key} "
                f"(model_type {config.get('model_type')!r}; {rt.moe_schemes_source})",
                fix=f"choose a scheme {target.runtime} runs for MoE experts: {', '.join(sorted(rt.moe_schemes))}"
                    + (" (dynamic per-token activations)" if "W8A8-INT8" in rt.moe_schemes else ""))


def _fp8_layout(layout: tuple[str, str, bool]) -> str:
    """A W8A8-FP8 layout as a recipe's `quantization:` spells it."""
    weights, acts, dynamic = layout
    return (f"weights: {{format: fp8_e4m3, strategy: {weights}}}, activations: {{format: fp8_e4m3, strategy: {acts}"
            + (", dynamic: true}" if dynamic else "}"))


def _check_moe_fp8_layout(target: RuntimeTarget, rt: Runtime, member: Scheme, config: dict) -> None:
    """IncompatibleTargetError when the runtime's fused-MoE FP8 method does not load this W8A8-FP8 layout (weight
    strategy x activation strategy x static/dynamic: `Runtime.moe_fp8_layouts`)."""
    if rt.moe_fp8_layouts is None or member.name != "W8A8-FP8":
        return
    layout = (member.weights.strategy, member.activations.strategy, member.activations.dynamic)
    if layout in rt.moe_fp8_layouts:
        return
    raise IncompatibleTargetError(
        f"target {target.label}: {target.runtime}'s fused Mixture-of-Experts FP8 method does not load W8A8-FP8 with "
        f"{member.weights.strategy} weights and {'dynamic' if layout[2] else 'static'} {layout[1]} activations "
        f"(model_type {config.get('model_type')!r}; {rt.moe_fp8_layouts_source})",
        fix=f"choose a W8A8-FP8 layout {target.runtime} loads for MoE experts: "
            + "; or ".join(_fp8_layout(x) for x in sorted(rt.moe_fp8_layouts)))


def check_family(target: RuntimeTarget, config: dict) -> None:
    """IncompatibleTargetError when the target's artifact format does not cover the model's family
    (config.json's model_type), naming the runtimes whose formats do."""
    family = config.get("model_type")
    fmt = format_for(target)
    own = family_format(target, config)
    if own is not None:  # the runtime reads this family in a format of its own: that format decides (check_model)
        return own.check_config(config)
    # a runtime's own reason for refusing the family first: it names where that was read
    why = RUNTIMES[target.runtime].refused_families.get(family) if target.runtime in RUNTIMES else None
    if why:
        moe = expert_count(config) > 1
        accepting = [rt.name for rt in RUNTIMES.values() if rt.format in FORMATS and family not in rt.refused_families
                     and (family in FORMATS[rt.format].moe_families if moe else
                          FORMATS[rt.format].families is None or family in FORMATS[rt.format].families)]
        raise IncompatibleTargetError(
            f"target {target.label}: {target.runtime} does not load llmc's {fmt.name} artifact of model_type "
            f"{family!r}: {why}",
            fix=f"drop this target for this model, or use a runtime that takes {family!r}: "
                f"{', '.join(accepting) or 'none'}")
    if expert_count(config) > 1 and family not in fmt.moe_families:
        accepting = [rt.name for rt in RUNTIMES.values() if rt.format in FORMATS
                     and family in FORMATS[rt.format].moe_families and family not in rt.refused_families]
        raise IncompatibleTargetError(
            f"target {target.label}: llmc's {fmt.name} export does not write Mixture-of-Experts experts "
            f"(model_type {family!r}): only {', '.join(sorted(f.name for f in FORMATS.values() if f.moe_families))} "
            "artifacts carry per-expert weights, tested by a round-trip",
            fix=f"drop this target for this model, or use a runtime that takes {family!r}: "
                f"{', '.join(accepting) or 'none'}")
    if fmt.families is None or family in fmt.families:
        try:
            fmt.check_config(config)  # what the exporter would refuse of this family's config, before weights load
        except IncompatibleTargetError as e:
            raise IncompatibleTargetError(f"target {target.label}: {e.message}",
                                          fix=_fix_elsewhere(e.fix, family, config, fmt.name)) from None
        return
    accepting = [rt.name for rt in RUNTIMES.values() if rt.format in FORMATS
                 and (FORMATS[rt.format].families is None or family in FORMATS[rt.format].families)]
    raise IncompatibleTargetError(
        f"target {target.label}: {fmt.name} artifacts cover the model families {', '.join(sorted(fmt.families))} "
        f"({fmt.families_source}); this model's model_type is {family!r}",
        fix=f"drop this target for this model, or use a runtime that takes {family!r}: {', '.join(accepting) or 'none'}")


def _fix_elsewhere(fix: str | None, family: str, config: dict, format_name: str) -> str | None:
    """A format's refusal of one model's config sends the user to runtimes of other formats; where every one of those
    refuses the family (gpt-oss: every compressed-tensors runtime), say so instead of naming runtimes that would refuse
    it too (measured: the GGUF exporter's gpt-oss refusal pointed at vllm and sglang)."""
    moe = expert_count(config) > 1
    others = [rt for rt in RUNTIMES.values() if rt.format in FORMATS and rt.format != format_name
              and (family in FORMATS[rt.format].moe_families if moe else
                   FORMATS[rt.format].families is None or family in FORMATS[rt.format].families)]
    if any(family not in rt.refused_families for rt in others):
        return fix
    refusing = sorted(rt.name for rt in others)
    return (f"no runtime of another format takes {family!r} ({', '.join(refusing) or 'none'} refuse it: "
            "`llmc matrix`, 'Model families a runtime refuses'); give the model the value this target computes with "
            "where the model allows it, or use another tool for this model")


def accepting_runtimes(scheme: Scheme, format_name: str | None = None, family: str | None = None) -> list[str]:
    """'runtime (archs)' for each runtime whose rules admit every capability the scheme needs (only those
    reading `format_name`, when given; not those refusing the model_type `family`, when given)."""
    out = []
    keys = scheme_keys(scheme)
    for rt in sorted(RUNTIMES.values(), key=lambda r: r.name):
        rules = [rt.rules.get(k) for k in keys]
        if any(r is None for r in rules) or (format_name and rt.format != format_name) or family in rt.refused_families:
            continue
        native = max((r.native_from for r in rules if r.native_from), default=None, key=arch_rank)
        until = min((r.native_until for r in rules if r.native_until), default=None, key=arch_rank)
        where = arch_span(native, until) if native else ""
        if all(r.cpu for r in rules):
            where += (", " if where else "") + "cpu"
        degraded = [r.degraded_from for r in rules if r.degraded_from]
        if degraded:
            where += f"; degraded from {max(degraded, key=arch_rank)}"
        out.append(f"{rt.name} ({where})")
    return out
