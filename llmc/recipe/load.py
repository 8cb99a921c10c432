"""Recipe loading: a recipe file -> typed Recipe, or one RecipeError that names key, value and fix.

Only a regular file of at most MAX_RECIPE_BYTES of UTF-8 is read (a FIFO, /dev/zero or a directory is
refused from its stat, before any read); the YAML goes through `safe_yaml` (depth, alias expansion and
key limits; values that cannot be built are errors at their line); messages quote at most a short,
escaped excerpt of the input and list at most MAX_LISTED problems.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from llmc.errors import RecipeError
from llmc.inputs.excerpt import excerpt, shorten
from llmc.inputs.files import decode_utf8, read_input_bytes, shown
from llmc.recipe.overrides import apply_overrides
from llmc.recipe.safe_yaml import YamlLimitError, load_yaml
from llmc.recipe.schema import Recipe

MAX_RECIPE_BYTES = 1 << 20  # recipes are a few KB
MAX_LISTED = 10  # problems listed in one message; the count says how many more

_EXAMPLE_FIX = "pass the path of a recipe YAML, e.g. recipes/smollm2-fp8.yaml"


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """The recipe at `path`, with `--set key.path=value` overrides applied before validation (llmc.recipe.overrides)."""
    return parse_recipe(read_recipe_text(path), source=shown(path), overrides=overrides)


def read_recipe_text(path: str | Path) -> str:
    """The text of a recipe file: a regular file, at most MAX_RECIPE_BYTES, UTF-8; RecipeError otherwise."""
    data = read_input_bytes(path, "recipe", MAX_RECIPE_BYTES, _EXAMPLE_FIX, error=RecipeError)
    return decode_utf8(data, path, "recipe", "save the recipe as UTF-8 (e.g. iconv -f latin1 -t utf-8 r.yaml), or "
                       "check that this is the recipe you meant", error=RecipeError)


def parse_recipe(text: str, source: str = "<recipe>", overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    try:
        data = load_yaml(text)
    except YamlLimitError as e:
        raise RecipeError(f"{source}: not valid YAML{e.where}: {e.problem}", fix=e.fix) from None
    data = apply_overrides(data, overrides)
    if overrides:
        source = f"{source} with --set {', '.join(excerpt(o) for o in overrides[:4])}"
    if not isinstance(data, dict):
        raise RecipeError(
            f"{source}: a recipe is a YAML mapping with keys name, model, quantization, targets; "
            f"got {'nothing' if data is None else type(data).__name__}",
            fix="see recipes/smollm2-fp8.yaml for the shape",
        )
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(_describe(e, data, source)) from None
    except RecursionError:  # safe_yaml bounds depth; kept so that no input reaches the user as a traceback
        raise RecipeError(f"{source}: the recipe nests too deeply", fix="remove the extra nesting") from None


def _describe(error: ValidationError, data: dict, source: str) -> str:
    lines = []
    errors = error.errors()
    item_locs = [tuple(e["loc"]) for e in errors]
    said: set[str] = set()
    for err in errors:
        if len(lines) > MAX_LISTED:
            break
        loc = _in_data(data, [p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))])
        if len(loc) < len(err["loc"]) and _dotted(loc) in said:
            continue  # another member of the same union (float | int | str ...): its first complaint says it
        said.add(_dotted(loc))
        if err["type"] == "too_short" and any(
            len(other) > len(err["loc"]) and other[: len(err["loc"])] == tuple(err["loc"]) for other in item_locs
        ):
            continue  # a list "too short" only because its items failed: the item errors say why
        key = shorten(_dotted(loc), 80)
        kind = err["type"]
        value = _lookup(data, loc)
        if kind == "extra_forbidden":
            parent = _model_at(Recipe, loc[:-1])
            known = sorted(parent.model_fields) if parent else []
            guess = difflib.get_close_matches(str(loc[-1])[:100], known, n=1)
            hint = f"did you mean '{guess[0]}'?" if guess else f"known keys here: {', '.join(known)}"
            lines.append(f"unknown key '{key}'; fix: remove it ({hint})")
        elif kind == "missing":
            lines.append(f"missing key '{key}'; fix: add it")
        elif kind == "value_error":
            msg = shorten(str(err.get("ctx", {}).get("error", err["msg"])), 400)
            where = f"'{key}'" if key else "recipe"
            lines.append(f"{where}: {msg}")
        elif kind == "literal_error":
            expected = err.get("ctx", {}).get("expected", "")
            lines.append(f"'{key}' = {excerpt(value)} is not allowed; fix: use one of {expected}")
        else:
            lines.append(f"'{key}' = {excerpt(value)}: {shorten(err['msg'], 200)}; fix: give a {_expected(kind)}")
    total = len(lines) if len(lines) <= MAX_LISTED else len(errors)
    if len(lines) > MAX_LISTED:
        lines = lines[:MAX_LISTED] + [f"... and more ({len(errors)} in all); fix the ones above first"]
    plural = "s" if total > 1 else ""
    return f"{source}: invalid recipe ({total} problem{plural}):\n  - " + "\n  - ".join(lines)


def _dotted(loc: list[Any]) -> str:
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _in_data(data: Any, loc: list[Any]) -> list[Any]:
    """loc up to the value it names: what pydantic appends past a scalar are union members' tags ('float', 'int')."""
    out: list[Any] = []
    for p in loc:
        if isinstance(data, dict):
            out.append(p)
            if p not in data:
                break
            data = data[p]
        elif isinstance(data, (list, tuple)) and isinstance(p, int):
            out.append(p)
            if not 0 <= p < len(data):
                break
            data = data[p]
        else:
            break
    return out


def _lookup(data: Any, loc: list[Any]) -> Any:
    for p in loc:
        try:
            data = data[p]
        except (KeyError, IndexError, TypeError):
            return None
    return data


def _model_at(model: type[BaseModel], loc: list[Any]) -> type[BaseModel] | None:
    for p in loc:
        if isinstance(p, int):
            continue
        field = model.model_fields.get(str(p))
        if field is None:
            return None
        ann = field.annotation
        candidates = [ann, *getattr(ann, "__args__", ())]
        nested = [
            c
            for c in candidates + [a for c in candidates for a in getattr(c, "__args__", ())]
            if isinstance(c, type) and issubclass(c, BaseModel)
        ]
        if not nested:
            return None
        model = nested[0]
    return model


def _expected(kind: str) -> str:
    return {
        "int_parsing": "whole number",
        "int_type": "whole number",
        "float_parsing": "number",
        "float_type": "number",
        "finite_number": "finite number",
        "bool_parsing": "true or false",
        "bool_type": "true or false",
        "string_type": "string",
        "string_pattern_mismatch": "name of letters, digits, '.', '_' or '-'",
        "greater_than_equal": "larger value",
        "greater_than": "larger value",
        "less_than_equal": "smaller value",
        "too_short": "non-empty list",
        "model_type": "mapping",
        "dict_type": "mapping",
        "tuple_type": "list",
    }.get(kind, "valid value")
