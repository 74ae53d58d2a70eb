"""Process settings as they are logged at start-up: no secret in them."""

from __future__ import annotations

import pytest

from services.config import ApiSettings, JudgeProxySettings, LearnerSettings, RolloutSettings

PROCESSES = [ApiSettings, JudgeProxySettings, RolloutSettings, LearnerSettings]


@pytest.mark.parametrize("settings_class", PROCESSES)
def test_secrets_and_a_redis_password_are_masked(settings_class):
    secrets = {name: f"secret-{name}" for name in settings_class.SECRETS & settings_class.model_fields.keys()}
    settings = settings_class(redis_url="redis://tandem:hunter2@redis:6379/0", **secrets)

    shown = str(settings.loggable())

    assert "hunter2" not in shown and "redis://***@redis:6379/0" in shown
    assert not any(value in shown for value in secrets.values())


@pytest.mark.parametrize("settings_class", PROCESSES)
def test_every_field_that_looks_like_a_secret_is_declared_one(settings_class):
    looks_secret = {
        name
        for name, field in settings_class.model_fields.items()
        if field.annotation is str and any(word in name for word in ("token", "key", "password", "secret"))
    }
    assert looks_secret <= settings_class.SECRETS


@pytest.mark.parametrize("settings_class", PROCESSES)
def test_every_process_reads_its_settings_from_tandem_variables(settings_class, monkeypatch):
    monkeypatch.setenv("TANDEM_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("TANDEM_REDIS_OUTAGE_S", "7")
    monkeypatch.setenv("LOG_LEVEL", "ERROR")  # unprefixed: not ours

    settings = settings_class()

    assert (settings.log_level, settings.redis_outage_s) == ("DEBUG", 7.0)
