"""A judge upstream's health as any process reads it back from its Redis hash
(`services.upstream_health`), bytes as redis-py returns them."""

import pytest

from services.upstream_health import UpstreamHealth


def test_a_record_reads_back_with_its_numbers_and_no_record_is_a_closed_circuit() -> None:
    record = {b"state": b"open", b"failures": b"7", b"since": b"100.5", b"probe_until": b"130", b"reason": b"HTTP 503"}
    health = UpstreamHealth.from_hash("stand-in", "judge", record)

    assert (health.state, health.failures, health.since, health.probe_until) == ("open", 7, 100.5, 130.0)
    assert health.describe() == "stand-in: HTTP 503 since 1970-01-01T00:01:40Z (7 failures)"
    assert health.down and health.next_probe_s(now=120.0) == 10.0
    assert UpstreamHealth.from_hash("stand-in", "judge", {}) == UpstreamHealth("stand-in", "judge")


def test_a_state_no_proxy_writes_is_refused_not_read_as_down() -> None:
    with pytest.raises(ValueError, match="upstream 'stand-in': unknown circuit state 'ajar'"):
        UpstreamHealth.from_hash("stand-in", "judge", {b"state": b"ajar"})
