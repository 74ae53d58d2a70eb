"""The pure parts of the judge proxy's limiting: estimates, upstream headers, backoff,
upstream choice, and how an upstream status and reply are handled."""

from __future__ import annotations

import math
import random

import httpx
import pytest
import redis.asyncio as aioredis
from tokenizers import Tokenizer, models, pre_tokenizers

from devtools.provider import count_prompt_tokens
from judge_proxy.budget import Budget, Limits
from judge_proxy.calls import outcome_of
from judge_proxy.circuit import Circuit, CircuitSettings
from judge_proxy.replies import ReplyRefused, decoded_object
from judge_proxy.upstream import (
    Upstream,
    UpstreamConfig,
    estimate_prompt_tokens,
    format_duration,
    parse_duration,
    remaining,
    retry_after_s,
    tokenizer_counter,
    weighted_order,
)
from services.judge_client import backoff_s


def test_the_prompt_estimate_is_characters_over_four_plus_the_chat_overhead():
    messages = [{"role": "system", "content": "abcd" * 10}, {"role": "user", "content": "hello"}]

    # ceil(40 / 4) + 4  +  ceil(5 / 4) + 4  +  3 for the reply's header
    assert estimate_prompt_tokens(messages) == 10 + 4 + 2 + 4 + 3


def test_a_parts_list_counts_its_text_parts_and_empty_content_counts_zero():
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "abcdefgh"}, {"type": "image_url", "image_url": {"url": "x"}}],
        },
        {"role": "assistant", "content": None},
    ]

    assert estimate_prompt_tokens(messages) == (2 + 4) + (0 + 4) + 3


def test_a_configured_tokenizer_replaces_the_character_rule(tmp_path):
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))

    count = tokenizer_counter(str(tmp_path / "tokenizer.json"))

    assert count("hello world, hello") == 4  # hello world , hello
    assert estimate_prompt_tokens([{"role": "user", "content": "hello world, hello"}], count) == 4 + 4 + 3


def test_the_local_upstream_counts_words_and_punctuation_not_characters():
    messages = [{"role": "user", "content": "!!!!!!!!"}, {"role": "user", "content": "extraordinarily"}]

    assert count_prompt_tokens(messages) == (8 + 4) + (1 + 4) + 3
    assert estimate_prompt_tokens(messages) == (2 + 4) + (4 + 4) + 3


@pytest.mark.parametrize(
    "headers, seconds",
    [
        ({"retry-after": "2", "retry-after-ms": "350"}, 0.35),
        ({"retry-after": "2"}, 2.0),
        ({"retry-after": "1.5"}, 1.5),
        ({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, None),
        ({"retry-after": "nan"}, None),
        ({"retry-after": "-3"}, None),
        ({}, None),
    ],
)
def test_retry_after_ms_wins_over_retry_after_seconds(headers, seconds):
    assert retry_after_s(httpx.Headers(headers)) == seconds


def test_remaining_budget_headers_are_read_when_present():
    headers = httpx.Headers({"x-ratelimit-remaining-tokens": "1234", "x-ratelimit-remaining-requests": "oops"})

    assert remaining(headers, "tokens") == 1234.0
    assert remaining(headers, "requests") is None


def test_backoff_doubles_per_attempt_with_jitter_and_stops_at_the_cap():
    rng = random.Random(7)
    for attempt, full in enumerate([0.5, 1.0, 2.0, 4.0, 5.0, 5.0]):
        for _ in range(50):
            assert full / 2 <= backoff_s(attempt, 5.0, rng) <= full


def upstream(name: str, weight: float = 1.0) -> Upstream:
    """An upstream object; nothing here connects to it or to Redis."""
    config = UpstreamConfig(name=name, model="m", base_url="http://127.0.0.1:9/v1", tpm=1000, rpm=10, weight=weight)
    client = aioredis.from_url("redis://127.0.0.1:9")
    circuit = Circuit(client, name, "m", CircuitSettings(5, 120.0, 10.0, 80.0), on_change=lambda: None)
    return Upstream(config, Budget(client, name, Limits(1000, 10, 1, 1.0)), circuit, max_reply_bytes=1 << 20)


def test_the_reservation_is_the_prompt_estimate_at_the_learned_ratio_plus_every_completion_at_its_maximum():
    messages = [{"role": "user", "content": "abcdefgh"}]
    a = upstream("a")
    estimate = a.prompt_estimate(messages)

    fresh = a.budget.cost(3 * 100, estimate)
    a.budget.prompt_ratio = 4 / 3  # as learned from an upstream counting a third more
    learned = a.budget.cost(3 * 100, estimate)

    assert estimate == 2 + 4 + 3
    assert fresh == math.ceil(9 * 1.05) + 300  # the default 5% margin
    assert learned == math.ceil(9 * 4 / 3 * 1.05) + 300


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("20ms", 0.02),
        ("1.5s", 1.5),
        ("6m0s", 360.0),
        ("1h2m3s", 3723.0),
        ("0.25", 0.25),
        ("7", 7.0),
        ("", None),
        ("soon", None),
        ("5x", None),
        ("-1", None),
        (None, None),
    ],
)
def test_reset_durations_read_in_openais_format_or_plain_seconds(text, seconds):
    assert parse_duration(text) == (pytest.approx(seconds) if seconds is not None else None)


@pytest.mark.parametrize("seconds", [0.02, 0.5, 1.5, 42.0, 360.0, 3599.0])
def test_durations_written_for_clients_read_back(seconds):
    assert parse_duration(format_duration(seconds)) == pytest.approx(seconds, rel=0.02, abs=0.001)


def test_upstreams_come_first_in_proportion_to_their_weight():
    heavy, light = upstream("heavy", 3.0), upstream("light", 1.0)
    rng = random.Random(1)

    firsts = [weighted_order([light, heavy], rng)[0].name for _ in range(4000)]

    assert firsts.count("heavy") / 4000 == pytest.approx(0.75, abs=0.03)


@pytest.mark.parametrize(
    "status, outcome",
    [
        (200, "ok"),
        (429, "rate_limited"),
        (400, "client_error"),
        (404, "client_error"),
        (401, "auth_error"),
        (403, "auth_error"),
        (408, "timeout"),
        (500, "server_error"),
        (503, "server_error"),
    ],
)
def test_each_upstream_status_has_one_handling(status, outcome):
    assert outcome_of(status) == outcome


@pytest.mark.parametrize("body", [b"[1, 2]", b'"a verdict"', b"null", b"7"])
def test_a_2xx_reply_whose_json_is_no_object_is_refused_as_the_upstreams_failure(body):
    # A reply the proxy will not read fails over to the next upstream, as a reply that is not JSON does.
    with pytest.raises(ReplyRefused, match="not a JSON object"):
        decoded_object(body)
    assert decoded_object(b'{"choices": []}') == {"choices": []}


def test_reset_durations_are_written_like_openai():
    assert [format_duration(s) for s in (0.0123, 1.5, 17.286, 360.0)] == ["13ms", "1.5s", "17.3s", "6m0s"]
