"""The judge proxy's upstreams file: what a model group must agree on, and prices."""

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


@pytest.mark.parametrize(
    "prices, field",
    [
        ({"input_per_mtok": -1.0, "output_per_mtok": 1.0}, "input_per_mtok"),  # a refund for every call
        ({"input_per_mtok": 1.0, "output_per_mtok": 1.0, "cached_input_per_mtok": -0.1}, "cached_input_per_mtok"),
        ({"input_per_mtok": 1.0}, "output_per_mtok"),
        ({"input_per_mtok": 1.0, "output_per_mtok": "free"}, "output_per_mtok"),
        ({"input_per_mtok": 1.0, "output_per_mtok": 1.0, "currency": "EUR"}, "currency"),
    ],
)
def test_prices_that_are_negative_missing_or_unknown_are_refused_naming_the_field(prices, field):
    entry = upstream("a", "judge", False) | {"prices": prices}
    with pytest.raises(ValidationError, match=field):
        UpstreamsFile.model_validate({"upstreams": [entry]})
