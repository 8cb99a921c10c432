"""Chat samples as text: `messages` rows (and plain text with `wrap_as_user`) go through a chat template.

`chat_template: model` uses the tokenizer's own template (`apply_chat_template`), `none` writes each turn as a
"role: content" line, any other value is the path of a Jinja template file. The template used is identified
by name and content hash (`template_id`), which enters the stage keys and the manifest.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from llmc.data.registry import Row
from llmc.errors import InputError


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
    path = Path(source.chat_template).expanduser()
    if not path.is_file():
        raise InputError(f"chat template file '{source.chat_template}' does not exist",
                         fix="give the path of a Jinja chat template, or 'model' / 'none'")
    return path.read_text()


def render(row: Row, source, tokenizer) -> str:
    """The text a row contributes: plain text as it is, chat turns through the source's template."""
    if not is_chat(row, source):
        return row.text
    turns = list(row.messages) if row.messages is not None else [{"role": "user", "content": row.text}]
    if source.chat_template == "none":
        return "\n".join(f"{t['role']}: {t['content']}" for t in turns)
    try:
        return tokenizer.apply_chat_template(turns, chat_template=_template_text(source, tokenizer), tokenize=False)
    except Exception as e:  # jinja errors: a template that does not fit these turns
        raise InputError(f"the chat template failed on {row.source} row {row.row}: {type(e).__name__}: {e}",
                         fix="check the template and the turns' roles, or set chat_template: none") from None
