"""The judge proxy's upstreams file: what a model group must agree on."""

import pytest
from pydantic import ValidationError

from judge_proxy.upstream import UpstreamsFile


def upstream(name: str, model: str, structured: bool) -> dict:
    return {
        "name": name,
        "model": model,
        "base_url": "http://127.0.0.1:1/v1",
        "tpm": 1000,
        "rpm": 10,
        "structured_output": structured,
    }


def test_upstreams_of_one_model_must_agree_on_structured_output():
    with pytest.raises(ValidationError, match="upstreams of model 'judge' disagree on structured_output"):
        UpstreamsFile.model_validate({"upstreams": [upstream("a", "judge", True), upstream("b", "judge", False)]})
    agreed = UpstreamsFile.model_validate(
        {"upstreams": [upstream("a", "judge", True), upstream("b", "judge", True), upstream("c", "simulator", False)]}
    )
    assert [u.structured_output for u in agreed.upstreams] == [True, True, False]
