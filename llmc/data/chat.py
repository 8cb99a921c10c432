"""Chat samples as text: `messages` rows (and plain text with `wrap_as_user`) go through a chat template.

`chat_template: model` uses the tokenizer's own template (`apply_chat_template`), `none` writes each turn as a
"role: content" line, any other value is the path of a Jinja template file. The template used is identified
by name and content hash (`template_id`), which enters the stage keys and the manifest.

A template is code from the recipe or from the model folder (which the Hub hook downloads): before transformers
renders a row, the same template renders it in a bounded sandbox (`BoundedSandbox`) that stops past
MAX_TEMPLATE_STEPS loop iterations and calls, or past MAX_TEMPLATE_OUTPUT_CHARS of output or of any string or
list it builds (llmc.inputs.caps). Nested loops that took 6 GB, or would run for hours, are an InputError naming
the template and the limit within a second or two.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
from pathlib import Path

from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmc.data.registry import Row
from llmc.errors import InputError
from llmc.inputs.caps import MAX_TEMPLATE_BYTES, MAX_TEMPLATE_OUTPUT_CHARS, MAX_TEMPLATE_STEPS
from llmc.inputs.files import read_input_text, shown


def is_chat(row: Row, source) -> bool:
    return row.messages is not None or source.wrap_as_user


def template_id(source, tokenizer) -> str:
    """'none', 'model:<sha256[:16]>' or 'file:<name>:<sha256[:16]>' for the template this source uses."""
    if source.chat_template == "none":
        return "none"
    text = _template_text(source, tokenizer)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    if source.chat_template == "model":
        return f"model:{digest}"
    return f"file:{Path(source.chat_template).name}:{digest}"


def _template_text(source, tokenizer) -> str:
    if source.chat_template == "model":
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise InputError(
                "the data holds chat samples but the model's tokenizer has no chat template",
                fix="set the source's chat_template to the path of a Jinja template file, or to 'none' "
                "(turns as 'role: content' lines)",
            )
        return template if isinstance(template, str) else template.get("default", next(iter(template.values())))
    return read_input_text(Path(source.chat_template).expanduser(), "chat template file", MAX_TEMPLATE_BYTES,
                           "give the path of a Jinja chat template, or 'model' / 'none'")


def _template_origin(source) -> str:
    if source.chat_template == "model":
        return "the model's chat template (tokenizer_config.json, chat_template.jinja or chat_template.json)"
    return f"chat template file {shown(source.chat_template)}"


def render(row: Row, source, tokenizer) -> str:
    """The text a row contributes: plain text as it is, chat turns through the source's template."""
    if not is_chat(row, source):
        return row.text
    turns = list(row.messages) if row.messages is not None else [{"role": "user", "content": row.text}]
    if source.chat_template == "none":
        return "\n".join(f"{t['role']}: {t['content']}" for t in turns)
    template = _template_text(source, tokenizer)
    try:
        # the bounded render first: transformers' own render (below) has no limits, and takes the same steps
        bounded_render(template, turns, dict(tokenizer.special_tokens_map))
        return tokenizer.apply_chat_template(turns, chat_template=template, tokenize=False)
    except TemplateLimit as e:
        raise InputError(f"{_template_origin(source)} {e} rendering {row.source} row {row.row}",
                         fix="fix the template's loops (a chat template loops over the turns), or set the source's "
                         "chat_template to another template file or to 'none'") from None
    except Exception as e:  # jinja errors: a template that does not fit these turns
        raise InputError(f"the chat template failed on {row.source} row {row.row}: {type(e).__name__}: {e}",
                         fix="check the template and the turns' roles, or set chat_template: none") from None


# --------------------------------------------------------------------------- the bounded sandbox


class TemplateLimit(Exception):
    """A template went past a limit of llmc.inputs.caps; the message says which ("took over N steps ...")."""


def _size(value, limit: int = MAX_TEMPLATE_OUTPUT_CHARS) -> int:
    """Characters of text (and elements) a value holds, counted until past `limit`: strings by length, containers by
    their items, so [big] * n or a dict of n references to one long string count as what they would render."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, range):
        return len(value)
    if isinstance(value, dict):
        value = [x for kv in value.items() for x in kv]
    if isinstance(value, (list, tuple, set, frozenset)):
        total = 0
        for item in value:
            total += 1 + _size(item, limit)
            if total > limit:
                break
        return total
    return 1


_LARGE_NUMBER = re.compile(r"\d{9,}")  # a width or precision in a format string past the output cap


def _format_width_ok(fmt) -> bool:
    return not (isinstance(fmt, str) and any(int(n) > MAX_TEMPLATE_OUTPUT_CHARS for n in _LARGE_NUMBER.findall(fmt)))


class _CountingCodeGenerator(CodeGenerator):
    def visit_Concat(self, node, frame) -> None:
        self.write("environment.llmc_sized(")  # `a ~ b` in a loop doubles a string: checked like every result
        super().visit_Concat(node, frame)
        self.write(")")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' chat-template sandbox with limits: every loop iteration and every call (functions, methods,
    macros, filters) is a step, at most MAX_TEMPLATE_STEPS a render; no string or list a template builds (`*`, `+`,
    `~`, `**`, a call's or filter's result) may exceed MAX_TEMPLATE_OUTPUT_CHARS, checked before the allocation
    where the size is known in advance (`'x' * n`, `[s] * n`, `2 ** n`, a width in a format string)."""

    code_generator_class = _CountingCodeGenerator
    intercepted_binops = frozenset(["*", "**", "+", "%"])

    def __init__(self, like=None) -> None:
        extensions = [type(e) for e in like.extensions.values()] if like is not None else ["jinja2.ext.loopcontrols"]
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=extensions)
        if like is not None:
            self.filters.update(like.filters)
            self.globals.update(like.globals)
        self.filters = {name: self._counted_filter(f) for name, f in self.filters.items()}
        self.filters["llmc_steps"] = self._counted_loop
        self.steps = 0

    def _parse(self, source, name, filename):
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):  # every `for` iterates through _counted_loop
            loop.iter = nodes.Filter(loop.iter, "llmc_steps", [], [], None, None, lineno=loop.lineno)
        return tree

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_TEMPLATE_STEPS:
            raise TemplateLimit(f"took over {MAX_TEMPLATE_STEPS:,} steps (loop iterations and calls)")

    def llmc_sized(self, value):
        if _size(value) > MAX_TEMPLATE_OUTPUT_CHARS:
            raise TemplateLimit(f"built a string or list of over {MAX_TEMPLATE_OUTPUT_CHARS:,} characters")
        return value

    def _counted_loop(self, iterable):
        for item in iterable:
            self.step()
            yield item

    def _counted_filter(self, f):
        @functools.wraps(f)  # keeps jinja's pass_context / pass_environment marks
        def counted(*args, **kwargs):
            self.step()
            self._check_arguments(args, kwargs, f.__name__ == "do_format")
            return self.llmc_sized(f(*args, **kwargs))
        return counted

    def _check_arguments(self, args, kwargs, formats: bool) -> None:
        values = (*args, *kwargs.values())
        if any(type(v) is int and abs(v) > MAX_TEMPLATE_OUTPUT_CHARS for v in values):  # a width, a count
            raise TemplateLimit(f"passed a number over {MAX_TEMPLATE_OUTPUT_CHARS:,} to a call")
        if formats and not all(_format_width_ok(v) for v in values):
            raise TemplateLimit(f"formatted with a width over {MAX_TEMPLATE_OUTPUT_CHARS:,}")

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
        __self.step()
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)  # jinja wraps str.format
        __self._check_arguments(args, kwargs, False)
        if isinstance(owner, str) and not _format_width_ok(owner):  # '{:>999999999}'.format(x)
            raise TemplateLimit(f"formatted with a width over {MAX_TEMPLATE_OUTPUT_CHARS:,}")
        return __self.llmc_sized(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and type(n) is int and _size(seq) * n > MAX_TEMPLATE_OUTPUT_CHARS:
                    raise TemplateLimit(f"built a string or list of over {MAX_TEMPLATE_OUTPUT_CHARS:,} characters")
        elif operator == "**" and type(left) is int and type(right) is int and right > 0 and abs(left) > 1:
            if right * math.log2(abs(left)) > 8 * MAX_TEMPLATE_OUTPUT_CHARS:
                raise TemplateLimit("raised a number to a power of over a few million digits")
        elif operator == "%" and not _format_width_ok(left):
            raise TemplateLimit(f"formatted with a width over {MAX_TEMPLATE_OUTPUT_CHARS:,}")
        elif operator == "+" and _size(left) + _size(right) > MAX_TEMPLATE_OUTPUT_CHARS:
            raise TemplateLimit(f"built a string or list of over {MAX_TEMPLATE_OUTPUT_CHARS:,} characters")
        return self.llmc_sized(super().call_binop(context, operator, left, right))


@functools.lru_cache(maxsize=16)
def _bounded_template(text: str):
    try:  # transformers' own filters, globals and extensions ({% generation %}, tojson, raise_exception, ...), from
        # an empty template: transformers' unbounded sandbox folds constants as it compiles ('x' * 10**9 included)
        from transformers.utils.chat_template_utils import _compile_jinja_template  # lazy: transformers (~2 s)

        like = _compile_jinja_template("").environment
    except ImportError:
        like = None
    return BoundedSandbox(like).from_string(text)


def bounded_render(template: str, turns: list[dict], variables: dict) -> str:
    """`template` rendered for `turns` as transformers renders a chat template, within the limits of
    llmc.inputs.caps: TemplateLimit past them (jinja's own errors pass through)."""
    compiled = _bounded_template(template)
    env = compiled.environment
    env.steps = 0
    out, size = [], 0
    for chunk in compiled.generate(messages=turns, tools=None, documents=None, add_generation_prompt=False,
                                   **variables):
        size += len(chunk)
        if size > MAX_TEMPLATE_OUTPUT_CHARS:
            raise TemplateLimit(f"wrote over {MAX_TEMPLATE_OUTPUT_CHARS:,} characters")
        out.append(chunk)
    return "".join(out)
