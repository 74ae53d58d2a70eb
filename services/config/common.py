"""What every job-spec section shares: strict validation and the bounds on names, paths and text."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Discriminator, Field

JOB_NAME = r"[A-Za-z0-9_.-]{1,128}"
"""A job's name (a job spec's `name`); job ids are a name, a dash and 8 hex digits."""
PATH_CHARS = 4096
"""The longest file path a job spec may name (Linux's PATH_MAX)."""
TEXT_CHARS = 8000
"""The longest free text a job spec may carry in one field (a prompt, a rubric, a description)."""
MODEL_NAME_CHARS = 256
"""The longest model name a job spec may ask the judge proxy for."""


FILE_MARK = "x-tandem-file"
"""The JSON-schema key that marks a field naming a file or folder (`file_field`)."""


def file_field(default: Any = None, description: str = "", **bounds: Any) -> Any:
    """A field naming a file or folder the learner or a rollout server opens. A multi-tenant
    API confines every such field of a spec to `ApiSettings.path_roots` (`job.file_fields`
    finds them), so a new one is confined by being declared with this."""
    return Field(default, max_length=PATH_CHARS, description=description, json_schema_extra={FILE_MARK: True}, **bounds)


def one_of(names: tuple[str, ...]) -> str:
    """`'a', 'b' or 'c'`: the values a field takes, as an error message lists them."""
    quoted = [repr(name) for name in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


TAG_FIELDS: dict[str, str] = {}
"""The field each union's tag is read from, by the error type its discriminator raises (the
job API's 422 names that field: `job.written_location`)."""


def tag_reader(field: str, default: str) -> Callable[[object], str]:
    """What picks a union's model: a mapping's `field` (`default` when it leaves it out; any
    value but a string as its repr, which no model's tag matches) or a model's attribute."""

    def tag(data: object) -> str:
        if isinstance(data, dict):
            value = data.get(field, default)
            return value if isinstance(value, str) else repr(value)
        return getattr(data, field, default)

    return tag


def discriminator(field: str, default: str, tags: tuple[str, ...], error_type: str, label: str) -> Discriminator:
    """A union's discriminator on `field`, whose error for a tag not in `tags` says which
    ones there are (`<label> must be ...`)."""
    TAG_FIELDS[error_type] = field
    return Discriminator(
        tag_reader(field, default), custom_error_type=error_type, custom_error_message=f"{label} must be {one_of(tags)}"
    )


class Strict(BaseModel):
    """Job-spec sections: unknown fields and coercions (`false` for an integer) are errors,
    so the API accepts exactly what its OpenAPI schema says."""

    model_config = ConfigDict(extra="forbid", strict=True)
