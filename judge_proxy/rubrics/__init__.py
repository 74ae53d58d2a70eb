"""Judge rubrics (`base`: prompts and verdict parsing; `catalog`: the rubrics by name)."""

from judge_proxy.rubrics.base import (
    Criterion, GroupParseError, Rubric, Verdict, parse_group_verdicts, parse_verdict, render, render_group,
)
from judge_proxy.rubrics.catalog import RUBRICS

__all__ = ["RUBRICS", "Criterion", "GroupParseError", "Rubric", "Verdict", "parse_group_verdicts", "parse_verdict",
           "render", "render_group"]
