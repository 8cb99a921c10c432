"""The webhook payloads the hook reads, as schemas: every delivery is parsed and validated here before any field is
used, and anything else is a `PayloadError` (answered 400, naming the field and the problem).

Parsing is pydantic-core's JSON parser, which refuses nesting deeper than 200 as soon as it meets it (no Python
recursion, nothing built from the rest of the body). Only the fields the hook uses are declared; others are ignored.

MLflow 3.x (`mlflow/webhooks/types.py`) sends `{"entity", "action", "timestamp", "data"}`; for
`model_version.created`, `data` holds `name`, `version` (a string), `tags` (an object of string values) and more.
Tags are also accepted in the REST API's form, a list of `{"key", "value"}`; any other shape (a string, a list of
something else, non-string values) is refused, never read loosely. The Hub sends
`{"event": {"action", "scope"}, "repo": {"type", "name", "headSha"}, ...}`.
"""

from __future__ import annotations

from typing import Any

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError, field_validator

MAX_ERRORS_SHOWN = 3
MAX_DEPTH = 200  # pydantic-core's (jiter's) parser limit; MLflow's and the Hub's payloads nest 3 deep


class PayloadError(ValueError):
    """A delivery that is not the payload its receiver reads; `message` says which field and why."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _Payload(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class MlflowEvent(_Payload):
    entity: StrictStr = Field(max_length=100)
    action: StrictStr = Field(max_length=100)
    data: Any  # read by the schema of the event it belongs to; other events are ignored unread

    @property
    def kind(self) -> str:
        return f"{self.entity}.{self.action}"


class _Tag(_Payload):
    key: StrictStr
    value: StrictStr


class ModelVersionCreated(_Payload):
    name: StrictStr = Field(min_length=1, max_length=256)
    version: StrictStr | StrictInt
    tags: dict[StrictStr, StrictStr] | list[_Tag] | None = None

    @field_validator("tags", mode="before")
    @classmethod
    def _tags_shape(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, (dict, list)):
            raise ValueError("tags are an object of string values or a list of {key, value}, "
                             f"not {type(value).__name__}")
        return value

    @field_validator("version")
    @classmethod
    def _version_text(cls, value: str | int) -> str:
        return str(value)

    @property
    def tag_map(self) -> dict[str, str]:
        if isinstance(self.tags, list):
            return {t.key: t.value for t in self.tags}
        return dict(self.tags or {})


class _HfEventKind(_Payload):
    action: StrictStr = Field(max_length=100)
    scope: StrictStr = Field(max_length=100)


class _HfRepo(_Payload):
    type: StrictStr = "model"
    name: StrictStr = Field(min_length=1, max_length=200)
    headSha: StrictStr | None = Field(default=None, max_length=100)  # noqa: N815 (the Hub's field name)


class HfEvent(_Payload):
    event: _HfEventKind
    repo: _HfRepo


def _describe(error: ValidationError, prefix: str) -> str:
    parts = []
    for e in error.errors(include_url=False)[:MAX_ERRORS_SHOWN]:
        where = ".".join(map(str, [prefix, *e["loc"]] if prefix else e["loc"]))
        parts.append(f"{where or 'the payload'}: {e['msg']}")
    more = error.error_count() - MAX_ERRORS_SHOWN
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def parse_json(body: bytes) -> Any:
    """The body as JSON values; PayloadError for bytes that are not JSON, or nest deeper than the parser allows."""
    try:
        return pydantic_core.from_json(body)
    except ValueError as e:
        raise PayloadError(f"the body is not JSON (or nests deeper than {MAX_DEPTH}): {str(e)[:200]}") from None


def validate(schema: type[_Payload], value: Any, where: str = "") -> Any:
    """`value` as `schema`; PayloadError naming the fields that do not fit (`where` prefixes their paths)."""
    try:
        return schema.model_validate(value)
    except ValidationError as e:
        raise PayloadError(_describe(e, where)) from None


def mlflow_event(body: bytes) -> MlflowEvent:
    return validate(MlflowEvent, parse_json(body))


def model_version_created(event: MlflowEvent) -> ModelVersionCreated:
    return validate(ModelVersionCreated, event.data, "data")


def hf_event(body: bytes) -> HfEvent:
    return validate(HfEvent, parse_json(body))

