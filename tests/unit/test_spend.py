"""What a call costs its job (`judge_proxy.spend.call_cost`), by hand."""

from __future__ import annotations

import time

import pytest

from judge_proxy.app import proxy_error
from judge_proxy.calls import _usage
from judge_proxy.errors import ProxyError
from judge_proxy.spend import Bill, CallCost, Prices, Refusal, call_cost, hold_caps, role_of
from services.config import BudgetSpec

PRICES = Prices(input_per_mtok=3.0, output_per_mtok=15.0, cached_input_per_mtok=0.3)


def test_cached_prompt_tokens_are_billed_at_the_cached_price():
    usage = {"prompt_tokens": 10_000, "completion_tokens": 500, "total_tokens": 10_500, "cached_tokens": 8_000}
    # 2,000 fresh at $3, 8,000 cached at $0.30, 500 out at $15, per million.
    assert call_cost(PRICES, usage, billed=10_500) == CallCost(10_500, 8_000, pytest.approx(0.0159))


def test_without_a_cached_price_cached_tokens_cost_the_input_price():
    prices = Prices(input_per_mtok=2.0, output_per_mtok=8.0)
    usage = {"prompt_tokens": 1_000, "completion_tokens": 100, "cached_tokens": 600}
    assert call_cost(prices, usage, billed=1_100).usd == pytest.approx((1_000 * 2 + 100 * 8) / 1e6)


@pytest.mark.parametrize(
    "details",
    [{"cached_tokens": -400}, {"cached_tokens": "400"}, {"cached_tokens": True}, {"cached_tokens": 1.5}, "400", None],
)
def test_a_providers_cached_count_that_is_no_count_is_no_discount(details):
    # What the proxy reads from a reply, then prices: nothing believed cached but a count.
    usage = _usage({"usage": {"prompt_tokens": 1_000, "completion_tokens": 10, "prompt_tokens_details": details}})
    cost = call_cost(PRICES, usage, billed=1_010)
    assert cost == CallCost(1_010, 0, pytest.approx((1_000 * 3 + 10 * 15) / 1e6))


def test_more_cached_than_prompt_tokens_counts_the_prompt_at_most():
    usage = {"prompt_tokens": 100, "completion_tokens": 10, "cached_tokens": 5_000}
    assert call_cost(PRICES, usage, billed=110) == CallCost(110, 100, pytest.approx((100 * 0.3 + 10 * 15) / 1e6))


@pytest.mark.parametrize(
    "usage",
    [
        {},  # no usage reported
        {"prompt_tokens": 10**9, "completion_tokens": 1},  # more than the budget billed
        {"prompt_tokens": -50, "completion_tokens": 10},
        {"prompt_tokens": 40},  # half a report
    ],
)
def test_usage_that_cannot_be_believed_costs_the_billed_tokens_at_the_dearer_price(usage):
    assert call_cost(PRICES, usage, billed=300) == CallCost(300, 0, pytest.approx(300 * 15 / 1e6))


def test_an_upstream_without_prices_costs_tokens_only():
    usage = {"prompt_tokens": 70, "completion_tokens": 30, "cached_tokens": 20}
    assert call_cost(None, usage, billed=100) == CallCost(100, 20, 0.0)
    assert call_cost(None, {}, billed=100) == CallCost(100, 0, 0.0)


def test_the_role_is_the_header_or_the_priority_and_nothing_else():
    assert role_of("", "simulator") == "simulator"
    assert role_of("EVAL", "judge") == "eval"
    with pytest.raises(
        ValueError, match=r"X-Tandem-Role must be one of \['simulator', 'judge', 'extraction', 'eval'\]"
    ):
        role_of("free", "judge")


def test_the_steps_a_cap_leaves_are_what_the_money_left_buys_at_the_mean_step_cost():
    from learner.cost import planned_steps

    # At step 4, $0.45 spent at $0.10 a step, cap $1: 5 more steps are paid for.
    assert planned_steps(4, per_step=0.1, spent=0.45, cap=1.0, admitted_steps=6, num_steps=20) == 9
    # Tasks already admitted fill 6 steps: they are trained even when the money runs short.
    assert planned_steps(4, per_step=0.1, spent=0.95, cap=1.0, admitted_steps=6, num_steps=20) == 6
    # Never more than the job's steps; nothing spent per step yet leaves them all.
    assert planned_steps(4, per_step=0.01, spent=0.1, cap=1.0, admitted_steps=6, num_steps=20) == 20
    assert planned_steps(0, per_step=0.0, spent=0.0, cap=1.0, admitted_steps=2, num_steps=20) == 20


async def test_a_call_that_waits_past_its_deadline_for_held_caps_is_told_to_retry_after_whole_seconds():
    # Retry-After takes a whole number of seconds (RFC 9110's delay-seconds): "1", never "1.0".
    bill = Bill("tandem:spend:job-0", BudgetSpec(usd=1.0), "the job's spend cap (usd 1.0)")

    class CapsHeldInFlight:
        async def hold(self, owed, usd, tokens, ttl_s):
            return Refusal(wait=True, bill=bill, spent_usd=0.9, spent_tokens=900)

    async def fresh():
        return [bill]

    with pytest.raises(ProxyError) as refused:
        await hold_caps(CapsHeldInFlight(), "job-0", [bill], 0.2, 200, time.monotonic() - 1, 30.0, fresh)
    assert refused.value.status == 429
    assert (await proxy_error(None, refused.value)).headers["retry-after"] == "1"
