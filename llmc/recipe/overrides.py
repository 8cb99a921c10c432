"""`--set key.path=value`: change one recipe value from the command line (CI: another checkpoint, another TP).

An override is applied to the recipe's data before validation, so the result is checked exactly like a recipe
that said it: a wrong key, type or value is the same RecipeError (exit 2) naming the key and the fix. The value is
read as a YAML scalar or flow collection (`8` is a number, `true` a boolean, `[torch, vllm]` a list, `'8'` a
string), through the same bounded reader as recipes. Paths are dotted keys with list indices:
`targets[0].tensor_parallel`, `model.source`, `eval.runtimes`. A missing mapping key is created (that is how a
recipe without a `calibration:` section gets `calibration.samples`); a list index must exist.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from llmc.errors import RecipeError
from llmc.inputs.excerpt import excerpt
from llmc.recipe.safe_yaml import YamlLimitError, load_yaml

MAX_OVERRIDES = 64
_STEP = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)((?:\[\d{1,4}\])*)")
_FIX = "write it as key.path=value, e.g. --set model.source=/ckpts/llama70b or --set targets[0].tensor_parallel=8"

PathStep = str | int


def parse_override(text: str) -> tuple[list[PathStep], Any]:
    """'a.b[0].c=value' -> (['a', 'b', 0, 'c'], the value as YAML reads it)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise RecipeError(f"--set {excerpt(text)} has no key=value", fix=_FIX)
    path: list[PathStep] = []
    for part in key.strip().split("."):
        m = _STEP.fullmatch(part)
        if m is None:
            raise RecipeError(f"--set {excerpt(text)}: {excerpt(part)} is not a key (letters, digits, _) with "
                              "optional [index]", fix=_FIX)
        path.append(m.group(1))
        path += [int(i) for i in re.findall(r"\[(\d+)\]", m.group(2))]
    try:
        value = load_yaml(raw) if raw.strip() else ""
    except YamlLimitError as e:
        raise RecipeError(f"--set {excerpt(text)}: the value is not valid YAML ({e.problem})",
                          fix="quote a value holding YAML punctuation, e.g. --set 'model.name=\"a:b\"'") from None
    return path, value


def dotted(path: list[PathStep]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def apply_overrides(data: Any, overrides: list[str] | tuple[str, ...]) -> Any:
    """A copy of the recipe data with every override applied in order (later ones win)."""
    if len(overrides) > MAX_OVERRIDES:
        raise RecipeError(f"{len(overrides)} --set overrides; at most {MAX_OVERRIDES}",
                          fix="put the values in a recipe file instead")
    if not overrides:
        return data
    if not isinstance(data, dict):
        return data  # parse_recipe says what is wrong with the recipe itself
    data = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        _set(data, path, value, text)
    return data


def _set(data: dict, path: list[PathStep], value: Any, text: str) -> None:
    node: Any = data
    for i, step in enumerate(path):
        last = i == len(path) - 1
        where = dotted(path[: i + 1])
        if isinstance(step, int):
            if not isinstance(node, list):
                raise RecipeError(f"--set {excerpt(text)}: {dotted(path[:i]) or 'the recipe'} is not a list",
                                  fix="index only lists, e.g. targets[0]")
            if not 0 <= step < len(node):
                raise RecipeError(f"--set {excerpt(text)}: {where} does not exist ({dotted(path[:i])} has "
                                  f"{len(node)} item(s))", fix=f"use an index below {len(node)}")
        elif not isinstance(node, dict):
            raise RecipeError(f"--set {excerpt(text)}: {dotted(path[:i])} is {type(node).__name__}, not a mapping",
                              fix="set the whole value instead, or check the key path")
        if last:
            node[step] = value
        else:
            if isinstance(node, dict) and node.get(step) is None:
                node[step] = [] if isinstance(path[i + 1], int) else {}
            node = node[step]
