"""Judge rubrics (`base`: prompts and verdict parsing; `catalog`: the rubrics by name)."""

from judge_proxy.rubrics.base import (
    Criterion,
    GroupParseError,
    Rubric,
    Verdict,
    group_schema,
    parse_group_verdicts,
    parse_verdict,
    prompt_sha256,
    render,
    render_group,
    response_format,
    verdict_schema,
)
from judge_proxy.rubrics.catalog import RUBRICS

__all__ = [
    "RUBRICS",
    "Criterion",
    "GroupParseError",
    "Rubric",
    "Verdict",
    "group_schema",
    "parse_group_verdicts",
    "parse_verdict",
    "prompt_sha256",
    "render",
    "render_group",
    "response_format",
    "verdict_schema",
]
