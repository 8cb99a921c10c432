"""Recipe loading: YAML text -> typed Recipe, or one RecipeError that names key, value and fix."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from llmc.errors import RecipeError
from llmc.recipe.schema import Recipe


def load_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise RecipeError(
            f"recipe {path} does not exist", fix="pass the path of a recipe YAML, e.g. recipes/smollm2-fp8.yaml"
        ) from None
    return parse_recipe(text, source=str(path))


def parse_recipe(text: str, source: str = "<recipe>") -> Recipe:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise RecipeError(
            f"{source}: not valid YAML{where}: {problem}",
            fix="check indentation and quoting around that line",
        ) from None
    if not isinstance(data, dict):
        raise RecipeError(
            f"{source}: a recipe is a YAML mapping with keys name, model, quantization, targets; "
            f"got {type(data).__name__}",
            fix="see recipes/smollm2-fp8.yaml for the shape",
        )
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(_describe(e, data, source)) from None


def _describe(error: ValidationError, data: dict, source: str) -> str:
    lines = []
    errors = error.errors()
    item_locs = [tuple(e["loc"]) for e in errors]
    for err in errors:
        loc = [p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
        if err["type"] == "too_short" and any(
            len(other) > len(err["loc"]) and other[: len(err["loc"])] == tuple(err["loc"]) for other in item_locs
        ):
            continue  # a list "too short" only because its items failed: the item errors say why
        key = _dotted(loc)
        kind = err["type"]
        value = _lookup(data, loc)
        if kind == "extra_forbidden":
            parent = _model_at(Recipe, loc[:-1])
            known = sorted(parent.model_fields) if parent else []
            guess = difflib.get_close_matches(str(loc[-1]), known, n=1)
            hint = f"did you mean '{guess[0]}'?" if guess else f"known keys here: {', '.join(known)}"
            lines.append(f"unknown key '{key}'; fix: remove it ({hint})")
        elif kind == "missing":
            lines.append(f"missing key '{key}'; fix: add it")
        elif kind == "value_error":
            msg = str(err.get("ctx", {}).get("error", err["msg"]))
            where = f"'{key}'" if key else "recipe"
            lines.append(f"{where}: {msg}")
        elif kind == "literal_error":
            expected = err.get("ctx", {}).get("expected", "")
            lines.append(f"'{key}' = {value!r} is not allowed; fix: use one of {expected}")
        else:
            lines.append(f"'{key}' = {value!r}: {err['msg']}; fix: give a {_expected(kind)}")
    plural = "s" if len(lines) > 1 else ""
    return f"{source}: invalid recipe ({len(lines)} problem{plural}):\n  - " + "\n  - ".join(lines)


def _dotted(loc: list[Any]) -> str:
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
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
