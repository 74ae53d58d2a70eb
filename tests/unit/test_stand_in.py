"""The stand-in provider: its latency model and budget with a clock the test moves, and its
answers to the built-in clarify task's user-simulator and judge prompts, read back by the
same parsers Tandem uses on a real LLM's replies."""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics

import httpx
import pytest

from devtools.provider import Latency, LocalUpstream, LocalUpstreamConfig, count_prompt_tokens, create_app
from devtools.provider_replies import interactivity_scores, reply_for
from judge_proxy.rubrics import RUBRICS, parse_verdict, render
from rollout.interactions.llm_user import COOPERATIVE_RULES, END_MARKER, SYSTEM_PROMPT, parse_user_reply, transcript

GOAL = "You want a fruit, specifically mango."
ASKED = [{"role": "user", "content": "I want a fruit."}, {"role": "assistant", "content": "Which fruit do you mean?"}]
ANSWERED = ASKED + [
    {"role": "user", "content": "I mean mango."},
    {"role": "assistant", "content": "Your fruit is mango."},
]
GUESSED = [{"role": "user", "content": "I want a fruit."}, {"role": "assistant", "content": "Your fruit is apple."}]


def simulator_prompt(messages: list[dict]) -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM_PROMPT.format(goal=GOAL, rules=COOPERATIVE_RULES, end=END_MARKER)},
        {"role": "user", "content": transcript(messages)},
    ]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


# ---- latency -------------------------------------------------------------------------


def test_latency_samples_are_pinned_by_the_seed():
    latency = Latency(median_s=0.6, p99_s=5.0, tokens_per_s=80.0)
    assert latency.sigma == pytest.approx(math.log(5.0 / 0.6) / 2.3263478740408408)
    rng = random.Random(7)
    # 0.6 * exp(sigma * z) + 40 / 80 for the generator's first three normal draws.
    assert [latency.sample_s(rng, 40) for _ in range(3)] == pytest.approx([0.97519, 1.45628, 0.98827], abs=1e-5)


def test_latency_has_the_median_and_tail_it_was_given():
    latency = Latency(median_s=0.6, p99_s=5.0, tokens_per_s=80.0)
    rng = random.Random(0)
    first_token = sorted(latency.sample_s(rng, 0) for _ in range(40_000))
    assert statistics.median(first_token) == pytest.approx(0.6, rel=0.03)
    assert first_token[int(0.99 * len(first_token))] == pytest.approx(5.0, rel=0.08)
    assert latency.sample_s(random.Random(1), 160) - latency.sample_s(random.Random(1), 0) == pytest.approx(2.0)


def test_a_tail_below_the_median_is_refused():
    with pytest.raises(ValueError, match="p99_s"):
        Latency(median_s=2.0, p99_s=1.0)


# ---- budget with a moved clock -------------------------------------------------------


def wait(upstream: LocalUpstream, cost: int) -> float:
    """Seconds until `cost` fits (0 = admitted now, and charged)."""
    return upstream.admit(cost)[1]


def test_the_buckets_refill_continuously_by_the_clock():
    clock = Clock()
    upstream = LocalUpstream(LocalUpstreamConfig(tpm=600, rpm=60), clock=clock)
    assert wait(upstream, 500) == 0.0  # 100 tokens and 59 requests left
    assert wait(upstream, 400) == pytest.approx(30.0)  # 300 short at 10 tokens/s
    clock.now += 15  # +150 tokens, +15 requests (capped at 60)
    assert wait(upstream, 400) == pytest.approx(15.0)
    clock.now += 15
    assert wait(upstream, 400) == 0.0
    headers = upstream.limit_headers()
    assert headers["x-ratelimit-remaining-tokens"] == "0"
    assert headers["x-ratelimit-remaining-requests"] == "59"
    assert headers["x-ratelimit-reset-tokens"] == "1m0s"


def test_a_trailing_window_admits_nothing_more_until_its_oldest_charges_leave():
    clock = Clock()
    upstream = LocalUpstream(LocalUpstreamConfig(tpm=600, rpm=60, limit_model="window", window_s=60), clock=clock)
    first, _ = upstream.admit(300)
    clock.now += 10
    assert wait(upstream, 300) == 0.0
    clock.now += 30  # a bucket would have refilled 400 by now
    assert wait(upstream, 1) == pytest.approx(20.0)  # when the first charge leaves
    upstream.charge(first, 100)  # its reply used 100: 200 come back at once
    assert wait(upstream, 200) == 0.0
    clock.now += 20  # the first charge leaves
    headers = upstream.limit_headers()
    assert headers["x-ratelimit-remaining-tokens"] == "100"
    assert headers["x-ratelimit-reset-tokens"] == "40s"  # the last charge leaves in 40 s
    assert headers["x-ratelimit-remaining-requests"] == "58"


def test_a_denser_prompt_count_is_characters_over_the_set_ratio():
    messages = [{"role": "system", "content": "x" * 30}, {"role": "user", "content": "y" * 31}]
    assert count_prompt_tokens(messages, chars_per_token=3) == (10 + 4) + (11 + 4) + 3


def test_a_reply_waits_its_sampled_latency_and_settles_its_usage():
    clock = Clock()
    config = LocalUpstreamConfig(
        tpm=6000, rpm=600, models=["judge"], seed=3, latency=Latency(median_s=0.6, p99_s=5.0, tokens_per_s=80.0)
    )
    app = create_app(config)
    upstream: LocalUpstream = app.state.upstream
    upstream.clock, upstream.sleep = clock, clock.sleep
    upstream.reset()
    body = {"model": "judge", "max_tokens": 200, "messages": simulator_prompt(ASKED)}

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://stand-in") as client:
            return await client.post("/v1/chat/completions", json=body)

    reply = asyncio.run(call())
    assert reply.status_code == 200
    data = reply.json()
    assert parse_user_reply(data["choices"][0]["message"]["content"]).response == "I mean mango."
    usage = data["usage"]
    assert usage["prompt_tokens"] == count_prompt_tokens(body["messages"])
    expected = config.latency.sample_s(random.Random(3), usage["completion_tokens"])
    assert clock.slept == [pytest.approx(expected)]
    # Charged prompt + 200 on arrival, refilled at 100 tokens/s while the reply took, and
    # given back all but what the reply used.
    assert upstream.tokens.level == pytest.approx(6000 - usage["total_tokens"] + expected * 100)
    assert upstream.stats["recognised"] == 1


# ---- the user simulator's answers ----------------------------------------------------


def test_the_simulated_user_names_the_target_when_asked_and_ends_after_an_answer():
    asked = parse_user_reply(reply_for(simulator_prompt(ASKED)))
    answered = parse_user_reply(reply_for(simulator_prompt(ANSWERED)))
    assert asked.response == "I mean mango."
    assert answered.response == END_MARKER


def test_a_prompt_it_does_not_know_gets_none():
    assert reply_for([{"role": "user", "content": "hello"}]) is None
    assert reply_for([{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "hi"}]) is None


# ---- the judge's answers -------------------------------------------------------------


def verdict(messages: list[dict], rubric: str = "interactivity"):
    text = reply_for(render(RUBRICS[rubric], messages, "Your fruit is mango."))
    return parse_verdict(RUBRICS[rubric], text)


def test_asking_then_answering_right_scores_above_guessing():
    asked, guessed = verdict(ANSWERED), verdict(GUESSED)
    assert asked.criteria == {"understanding": 1.0, "clarification": 1.0, "suggestions": 0.5}
    assert guessed.criteria == {"understanding": 0.5, "clarification": 0.0, "suggestions": 0.5}
    assert asked.score == pytest.approx(2.5 / 3)
    assert guessed.score == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    "turns, expected",
    [
        # An explicit request answered at once, and needlessly asked about.
        (
            [("user", "I want a fruit: mango."), ("assistant", "Your fruit is mango.")],
            {"understanding": 10, "clarification": 10, "suggestions": 5},
        ),
        (
            [
                ("user", "I want a fruit: mango."),
                ("assistant", "Which fruit do you mean?"),
                ("user", "I mean mango."),
                ("assistant", "Your fruit is mango."),
            ],
            {"understanding": 10, "clarification": 3, "suggestions": 5},
        ),
        # Asked twice, then answered something else than what the user said.
        (
            [
                ("user", "Pick a city for me."),
                ("assistant", "Which city do you mean?"),
                ("user", "I mean oslo."),
                ("assistant", "Which city?"),
                ("user", "I mean oslo."),
                ("assistant", "Your city is lima."),
            ],
            {"understanding": 3, "clarification": 7, "suggestions": 5},
        ),
        # Still asking when the conversation ends.
        (
            [("user", "I want a fruit."), ("assistant", "Which fruit do you mean?")],
            {"understanding": 3, "clarification": 10, "suggestions": 0},
        ),
    ],
)
def test_interactivity_follows_the_rubric_anchors(turns, expected):
    assert interactivity_scores(turns) == expected


def test_accuracy_checks_the_final_answer_against_the_reference():
    assert verdict(ANSWERED, "accuracy").score == 1.0
    assert verdict(GUESSED, "accuracy").score == 0.0


def test_the_judge_reply_is_a_rationale_and_one_json_object():
    text = reply_for(render(RUBRICS["interactivity"], ANSWERED, None))
    rationale, obj = text.split("\n", 1)
    assert rationale and set(json.loads(obj)) == {"understanding", "clarification", "suggestions", "verdict"}
