"""Mixed precision: which group of a scheme (`Scheme.groups`) each Linear of the decoder layers belongs to.

A group selects Linears by name (exact, a trailing part, or 're:<regex>', as `ignore`), by role (the family's table,
`llmc.model.families.LINEAR_ROLES`) and by decoder layer ("first N", "last N", "I", "I-J"), all of them at once.
Every Linear the scheme does not `ignore` must be selected by exactly one group: a Linear two groups select, or none,
is the recipe's error (RecipeError naming the modules and the fix). The planner resolves the groups on the shapes of
the model (config or checkpoint headers) before any weight loads; the layer stream resolves them again on the model
it builds, so both name the same Linears.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from typing import TypeVar

from llmc.errors import RecipeError
from llmc.model.families import linear_role
from llmc.quant.canonical import module_matches
from llmc.quant.spec import ModuleGroup, ModuleTargets, Scheme

_LAYER_SPEC = re.compile(r"^\s*(?:(?P<edge>first|last)\s+(?P<n>\d+)|(?P<lo>\d+)(?:\s*-\s*(?P<hi>\d+))?)\s*$")
_SITE = re.compile(r"^(?:.*?\.)?layers\.(\d+)\.(.+)$")
SHOWN = 6  # modules named in one error before "and N more"
T = TypeVar("T")


def check_layer_spec(spec: str) -> str:
    """`spec` when it is a layer selector ("first 2", "last 1", "5", "3-7"); ValueError in the recipe's form."""
    m = _LAYER_SPEC.match(spec)
    if m is None or (m["hi"] is not None and int(m["hi"]) < int(m["lo"])):
        raise ValueError(f"layer selector {spec!r} is not 'first N', 'last N', a layer index or a range 'I-J' "
                         "(I <= J); fix: e.g. layers: [first 1, last 1] or layers: [0, 2-5]")
    return spec.strip()


def is_layer_spec(spec: str) -> bool:
    """Whether `spec` is a layer selector ("first 2", "last 1", "5", "3-7") rather than a module name."""
    return _LAYER_SPEC.match(spec) is not None


def layers_of(spec: str, n_layers: int) -> set[int]:
    """The decoder layer indices `spec` names in a model of `n_layers` layers."""
    m = _LAYER_SPEC.match(spec)
    if m is None:
        raise ValueError(check_layer_spec(spec))
    if m["edge"] == "first":
        return set(range(min(int(m["n"]), n_layers)))
    if m["edge"] == "last":
        return set(range(max(n_layers - int(m["n"]), 0), n_layers))
    lo = int(m["lo"])
    hi = int(m["hi"]) if m["hi"] is not None else lo
    return set(range(lo, min(hi, n_layers - 1) + 1))


# A MoE's Linears repeat a few hundred local names over every layer (Kimi-K2: 70k Linears, ~1.2k names), and a plan
# assigns them ~18 times: cached, the role regexes and layer selectors run once per distinct name (Kimi-K2's plan:
# 9.7 -> 6.8 s of CPU on the 2-core EPYC). Both are pure functions of the constant tables and their arguments.
@functools.lru_cache(maxsize=8192)
def _role(model_type: str | None, local: str) -> str | None:
    return linear_role(model_type, local)


@functools.lru_cache(maxsize=1024)
def _layers(spec: str, n_layers: int) -> frozenset[int]:
    return frozenset(layers_of(spec, n_layers))


def site_of(name: str) -> tuple[int, str] | None:
    """(decoder layer index, name inside the layer) of a module named under `...layers.<i>.`; None outside them."""
    m = _SITE.match(name)
    return (int(m[1]), m[2]) if m else None


def selects(targets: ModuleTargets, name: str, layer: int, local: str, n_layers: int, model_type: str | None) -> bool:
    """Whether `targets` select the Linear `name` (in decoder layer `layer`, named `local` there)."""
    if targets.names and not module_matches(name, targets.names):
        return False
    if targets.roles and _role(model_type, local) not in targets.roles:
        return False
    if targets.layers and not any(layer in _layers(s, n_layers) for s in targets.layers):
        return False
    return not any(layer in _layers(s, n_layers) for s in targets.exclude_layers)


def _named(names: list[str]) -> str:
    shown = ", ".join(names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def resolve(scheme: Scheme, linears: Iterable[str], n_layers: int, model_type: str | None) -> dict[str, str | None]:
    """Module name -> the name of the group that quantizes it, or None where it stays unquantized (an `ignore: true`
    group, or the scheme's `ignore`), for every Linear name in `linears` inside the decoder layers. A plain scheme:
    every Linear not ignored -> "". RecipeError when a Linear is in two groups or in none."""
    return {n: g if g is None or not scheme.groups or scheme.group(g).quantized else None
            for n, g in assign(scheme, linears, n_layers, model_type).items()}


def assign(scheme: Scheme, linears: Iterable[str], n_layers: int, model_type: str | None) -> dict[str, str | None]:
    """As `resolve`, but an `ignore: true` group's Linears map to its name (None: the scheme's `ignore` only)."""
    out: dict[str, str | None] = {}
    overlaps: dict[tuple[str, ...], list[str]] = {}
    unmatched: list[str] = []
    for name in linears:
        site = site_of(name)
        if site is None:
            continue
        if module_matches(name, scheme.ignore):
            out[name] = None
            continue
        if not scheme.groups:
            out[name] = ""
            continue
        hits: list[ModuleGroup] = [g for g in scheme.groups if selects(g.targets, name, *site, n_layers, model_type)]
        if len(hits) > 1:
            overlaps.setdefault(tuple(g.name for g in hits), []).append(name)
        elif not hits:
            unmatched.append(name)
        else:
            out[name] = hits[0].name
    problems = [f"groups {' and '.join(groups)} both select {_named(names)}" for groups, names in overlaps.items()]
    if unmatched:
        roles = sorted({str(linear_role(model_type, site_of(n)[1])) for n in unmatched})
        problems.append(f"no group selects {_named(unmatched)} (role {', '.join(roles)})")
    if problems:
        raise RecipeError(
            "quantization.groups must give every Linear exactly one scheme: " + "; ".join(problems),
            fix="narrow the overlapping groups (exclude_layers, roles, names) so each Linear is in one group, and "
                "add a group (or `ignore: true` group, or a quantization.ignore entry) for every Linear none selects")
    return out


def by_group(scheme: Scheme, shapes: Mapping[str, T], n_layers: int,
             model_type: str | None) -> dict[str | None, dict[str, T]]:
    """Group name -> {module: shape} of its decoder-layer Linears, for every group of a mixed scheme in its order
    (empty where a group selects none), and None -> those the scheme's `ignore` leaves out."""
    out: dict[str | None, dict[str, T]] = {g.name: {} for g in scheme.groups}
    for name, group in assign(scheme, shapes, n_layers, model_type).items():
        out.setdefault(group, {})[name] = shapes[name]
    return out


def split_fused(scheme: Scheme, linears: Iterable[str], n_layers: int,
                model_type: str | None) -> list[tuple[list[str], list[str | None]]]:
    """Linears that runtimes fuse into one GEMM (q/k/v, gate/up: `llmc.quant.microscaling.fused_groups`) which a
    mixed scheme puts in different groups (None: unquantized): (the siblings, their groups) for each such set."""
    from llmc.quant.microscaling import fused_groups  # torch; only for mixed schemes

    assignment = resolve(scheme, linears, n_layers, model_type)
    out = []
    for siblings in fused_groups(list(assignment)):
        groups = [assignment[n] for n in siblings]
        if len(set(groups)) > 1:
            out.append((siblings, groups))
    return out
