"""Schemathesis against the API's own /openapi.json: every operation, generated inputs,
no 5xx and no response that violates the schema (real Redis behind it)."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from services.api.app import create_app
from services.config import ApiSettings

TOKEN = "schema-token-0123456789"
APP = create_app(ApiSettings(tokens=f"{TOKEN}:schemathesis"))
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)
# A 413 refuses invalid input too: a generated body past a field's maxLength (8,000 characters
# for a prompt, more in total) can be over the body or spec limit before any field is read.
schema.config.checks.negative_data_rejection.expected_statuses.append("413")


@pytest.fixture(autouse=True)
def real_redis(redis_url):
    """The app is built at import (schemathesis reads its schema then); point it at the
    session's Redis before any request."""
    APP.state.redis = aioredis.from_url(redis_url)


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_schema(case):
    # All default checks (no 5xx, responses and headers match the schema, invalid input is
    # rejected) except "schema-valid input is accepted": a JobSpec has cross-field rules
    # OpenAPI cannot state (rollout.max_total_tokens <= model.max_model_len), answered 422.
    case.call_and_validate(headers={"Authorization": f"Bearer {TOKEN}"}, excluded_checks=[positive_data_acceptance])
