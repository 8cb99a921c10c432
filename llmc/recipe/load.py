"""Recipe loading: a recipe file -> typed Recipe, or one RecipeError that names key, value and fix.

Only a regular file of at most MAX_RECIPE_BYTES of UTF-8 is read (a FIFO, /dev/zero or a directory is
refused from its stat, before any read); the YAML goes through `safe_yaml` (depth, alias expansion and
key limits; values that cannot be built are errors at their line); messages quote at most a short,
escaped excerpt of the input and list at most MAX_LISTED problems.
"""

from __future__ import annotations

import difflib
import errno
import os
import stat
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from llmc.errors import RecipeError
from llmc.excerpt import excerpt, shorten
from llmc.recipe.safe_yaml import YamlLimitError, load_yaml
from llmc.recipe.schema import Recipe

MAX_RECIPE_BYTES = 1 << 20  # recipes are a few KB
MAX_LISTED = 10  # problems listed in one message; the count says how many more

_EXAMPLE_FIX = "pass the path of a recipe YAML, e.g. recipes/smollm2-fp8.yaml"
_KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}


def file_kind(mode: int) -> str:
    """What a stat mode is, in words ("a directory", "a FIFO (named pipe)", ...)."""
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def load_recipe(path: str | Path) -> Recipe:
    return parse_recipe(read_recipe_text(path), source=shorten(str(path), 200))


def read_recipe_text(path: str | Path) -> str:
    """The text of a recipe file: a regular file, at most MAX_RECIPE_BYTES, UTF-8; RecipeError otherwise."""
    shown = shorten(str(path), 200)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise RecipeError(f"recipe {shown} does not exist", fix=_EXAMPLE_FIX) from None
    except (OSError, ValueError) as e:  # ELOOP, ENOTDIR, EACCES, ENAMETOOLONG, an embedded NUL
        what = "is a symlink loop" if getattr(e, "errno", None) == errno.ELOOP else f"cannot be read ({shorten(str(e), 100)})"
        raise RecipeError(f"recipe {shown} {what}", fix=_EXAMPLE_FIX) from None
    if not stat.S_ISREG(st.st_mode):
        raise RecipeError(f"recipe {shown} is {file_kind(st.st_mode)}, not a regular file", fix=_EXAMPLE_FIX)
    if st.st_size > MAX_RECIPE_BYTES:
        raise RecipeError(f"recipe {shown} is {st.st_size:,} bytes; a recipe is at most {MAX_RECIPE_BYTES:,}",
                          fix="a recipe is a few KB of YAML; check that this is the file you meant")
    try:
        # O_NONBLOCK: should the path have become a FIFO since the stat, open() does not wait for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise RecipeError(f"recipe {shown} cannot be read ({shorten(str(e), 100)})", fix=_EXAMPLE_FIX) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RecipeError(f"recipe {shown} is not a regular file", fix=_EXAMPLE_FIX)
        chunks, size = [], 0
        while size <= MAX_RECIPE_BYTES and (chunk := os.read(fd, MAX_RECIPE_BYTES + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise RecipeError(f"recipe {shown} cannot be read ({shorten(str(e), 100)})", fix=_EXAMPLE_FIX) from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > MAX_RECIPE_BYTES:
        raise RecipeError(f"recipe {shown} is over {MAX_RECIPE_BYTES:,} bytes",
                          fix="a recipe is a few KB of YAML; check that this is the file you meant")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise RecipeError(
            f"recipe {shown} is not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start} (line {line})",
            fix="save the recipe as UTF-8 (e.g. iconv -f latin1 -t utf-8), or check that this is the recipe you meant",
        ) from None


def parse_recipe(text: str, source: str = "<recipe>") -> Recipe:
    try:
        data = load_yaml(text)
    except YamlLimitError as e:
        raise RecipeError(f"{source}: not valid YAML{e.where}: {e.problem}", fix=e.fix) from None
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
