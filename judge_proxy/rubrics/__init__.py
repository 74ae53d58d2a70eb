"""Judge rubrics (`base`: prompts and verdict parsing; `catalog`: the rubrics by name)."""

from judge_proxy.rubrics.base import Criterion, Rubric, Verdict, parse_verdict, render
from judge_proxy.rubrics.catalog import RUBRICS

__all__ = ["RUBRICS", "Criterion", "Rubric", "Verdict", "parse_verdict", "render"]
