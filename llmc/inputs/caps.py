"""Every input cap in one place: what a reader of user data, a chat template or a model folder's tokenizer files
reads at most. docs/data.md ("Input caps") lists them for users; each refusal is an InputError (exit 7) naming the
file (and line, row, column or template) and the cap.

Why these numbers: tokenizing costs ~300 bytes of memory per byte of text (measured, benchmarks/input_memory.py),
so what reaches the tokenizer is bounded by the read budget (llmc.data.tokens) rather than by these caps; the caps
bound what is held before that (a row, a cell, a rendered template) and are several times any real document.
"""

from __future__ import annotations

# --- data sources (llmc.data.loaders)
MAX_ROW_BYTES = 16 << 20  # a jsonl/csv line, a parquet or saved-dataset cell (a row's turns together), read whole
MAX_JSON_FILE_BYTES = 64 << 20  # a .json array file, parsed whole
ARROW_BATCH_ROWS = 16  # parquet / saved-dataset rows per Arrow batch: at most 16 x MAX_ROW_BYTES held at once
# a text file whose first characters are more than this share undecodable bytes (U+FFFD) or NULs is binary, not text
MAX_UNDECODABLE_SHARE = 0.01
UNDECODABLE_SAMPLE_CHARS = 1 << 16  # how many characters of a text document that share is judged on

# --- chat templates (llmc.data.chat): the recipe's `chat_template:` file and a model folder's template
MAX_TEMPLATE_BYTES = 4 << 20  # a template file (chat_template.jinja in a model folder: TOKENIZER_OTHER_CAPS)
MAX_TEMPLATE_OUTPUT_CHARS = 2 * MAX_ROW_BYTES  # one rendered row, and any string or list a template builds
MAX_TEMPLATE_STEPS = 250_000  # loop iterations + calls per rendered row (real templates: tens per turn; ~2 s at most)

# --- a model folder's tokenizer files (llmc.model.tokenizer_files), read before transformers reads them whole.
# The largest real files seen: tokenizer.json 33 MB (Gemma 3, 262k tokens), tokenizer_config.json 1.2 MB.
TOKENIZER_JSON_CAPS = {
    "tokenizer.json": 128 << 20,
    "tokenizer_config.json": 16 << 20,
    "special_tokens_map.json": 1 << 20,
    "added_tokens.json": 16 << 20,
    "vocab.json": 64 << 20,
    "generation_config.json": 1 << 20,
    "chat_template.json": MAX_TEMPLATE_BYTES,
}
TOKENIZER_OTHER_CAPS = {"tokenizer.model": 64 << 20, "merges.txt": 64 << 20, "chat_template.jinja": MAX_TEMPLATE_BYTES}
