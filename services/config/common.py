"""What every job-spec section shares: strict validation and the bounds on names, paths and text."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

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


class Strict(BaseModel):
    """Job-spec sections: unknown fields and coercions (`false` for an integer) are errors,
    so the API accepts exactly what its OpenAPI schema says."""

    model_config = ConfigDict(extra="forbid", strict=True)
