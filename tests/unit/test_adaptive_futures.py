"""Adaptive futures as an estimator: the exact expectation of MR for a 0/1 R*.

Each future's R* is a Bernoulli draw with the response's true rate p. Enumerating every
outcome of every future (with its exact probability, as Fractions) gives E[MR] under each
rule, computed by the rules' own functions. `own` (stop when a response's own futures
agree) is biased: the figures the issue quoted (0.2 -> 0.136, 0.7 -> 0.756 for min 2,
max 6) come out exactly. `others` (the count decided by the other responses' first
futures) is unbiased for every response of the group, whatever the rates.
"""

from __future__ import annotations

import asyncio
import itertools
from fractions import Fraction

import pytest

from rollout.episode import Episode
from rollout.rewards.multiturn import GroupFutures, extra_from_others, more_futures, score_response
from services.config import RewardSpec

OWN = RewardSpec(
    mode="multiturn",
    futures="adaptive",
    adaptive_rule="own",
    num_futures=3,
    min_futures=2,
    max_futures=6,
    futures_se_threshold=0.05,
)
OTHERS = OWN.model_copy(update={"adaptive_rule": "others"})


def probability(outcomes: tuple[int, ...], p: Fraction) -> Fraction:
    result = Fraction(1)
    for outcome in outcomes:
        result *= p if outcome else 1 - p
    return result


def expected_mr_own(p: Fraction) -> Fraction:
    """One response, an unbounded allowance: draw `max_futures` outcomes up front (the ones
    never looked at sum out) and stop where `more_futures` says."""
    expectation = Fraction(0)
    for outcomes in itertools.product((0, 1), repeat=OWN.max_futures):
        n = OWN.min_futures
        while more := more_futures([float(o) for o in outcomes[:n]], OWN):
            n += more
        expectation += probability(outcomes, p) * Fraction(sum(outcomes[:n]), n)
    return expectation


def expected_mr_others(rates: list[Fraction]) -> list[Fraction]:
    """Every response of a group: enumerate all first rounds; a response's extra futures
    each contribute its rate in expectation."""
    m = OTHERS.min_futures
    expectations = [Fraction(0)] * len(rates)
    for firsts in itertools.product(itertools.product((0, 1), repeat=m), repeat=len(rates)):
        weight = Fraction(1)
        for outcomes, p in zip(firsts, rates):
            weight *= probability(outcomes, p)
        rounds = [[float(o) for o in outcomes] for outcomes in firsts]
        for i, p in enumerate(rates):
            extra = extra_from_others(rounds, i, OTHERS)
            expectations[i] += weight * (sum(firsts[i]) + extra * p) / (m + extra)
    return expectations


@pytest.mark.parametrize("p, biased", [(Fraction(1, 5), Fraction(17, 125)), (Fraction(7, 10), Fraction(189, 250))])
def test_stopping_on_a_responses_own_futures_biases_its_mr(p, biased):
    assert expected_mr_own(p) == biased  # 0.136 and 0.756
    assert float(biased) == pytest.approx({Fraction(1, 5): 0.136, Fraction(7, 10): 0.756}[p])


@pytest.mark.parametrize(
    "rates",
    [
        [Fraction(1, 5)] * 3,
        [Fraction(7, 10), Fraction(1, 5), Fraction(1, 2)],
        [Fraction(0), Fraction(1), Fraction(9, 10), Fraction(1, 3)],
    ],
)
def test_deciding_by_the_other_responses_futures_leaves_every_mr_unbiased(rates):
    assert expected_mr_others(rates) == rates


def test_the_others_rule_spends_the_fixed_count_only_where_the_group_disagrees():
    agreeing, split = [1.0, 1.0], [1.0, 0.0]
    assert extra_from_others([agreeing, agreeing, split], 2, OTHERS) == 0  # its own split is not looked at
    assert extra_from_others([agreeing, split, agreeing], 0, OTHERS) == 1  # pooled sd 0.41 / sqrt 2 > 0.05
    assert extra_from_others([split, [], []], 0, OTHERS) == 1  # nobody else to learn from: num_futures


class FixedFutures:
    """An EpisodeRunner stand-in whose futures score from a script, by trace."""

    def __init__(self, rewards: dict[str, float]) -> None:
        self.rewards = rewards

    async def extend(
        self, episode: Episode, example: int, max_turns: int, trained: bool, temperature: float | None = None
    ) -> Episode:
        episode.messages.append({"role": "assistant", "content": str(self.rewards[episode.trace])})
        return episode


class ScoreTask:
    """R_ext is the number the future's last reply holds."""

    async def score(self, example: int, messages: list[dict], episode=None) -> float:
        return float(messages[-1]["content"])

    def reference(self, example: int) -> str:
        return ""


async def test_a_group_waits_for_every_first_round_and_a_wait_holds_no_reward_slot():
    """Three responses, one reward slot: each must give the slot back while it waits for the
    others' first rounds, or the group would deadlock. Response 0 and 1 agree, 2 splits."""
    script = {
        "/s0/f0": 1,
        "/s0/f1": 1,
        "/s1/f0": 0,
        "/s1/f1": 0,
        "/s2/f0": 1,
        "/s2/f1": 0,
        "/s2/f2": 1,
        "/s0/f2": 1,
        "/s1/f2": 0,
    }
    runner, slots = FixedFutures(script), asyncio.Semaphore(1)
    plan = GroupFutures(OTHERS, 3, slots)
    spec = OTHERS.model_copy(update={"judge_rubric": None})
    responses = [
        Episode(messages=[{"role": "assistant", "content": "m"}], tokens=[], num_turns=1, trace=f"/s{i}")
        for i in range(3)
    ]
    results = await asyncio.wait_for(
        asyncio.gather(
            *(score_response(runner, r, ScoreTask(), 0, spec, futures=plan, index=i) for i, r in enumerate(responses))
        ),
        timeout=5,
    )
    counts = [len(futures) for _, futures in results]
    assert counts == [3, 3, 2]  # 0 and 1 see response 2's split; 2 sees two agreeing responses
    assert [reward for reward, _ in results] == [1.0, 0.0, 0.5]
