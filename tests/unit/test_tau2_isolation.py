"""τ²-bench's code runs in worker processes that a deadline can stop, never on the rollout
server's event loop: a call the policy writes neither stalls the loop nor runs on past its
deadline, and the verdict that replays the conversation's calls ends in time too.

Each test runs a ticker coroutine beside the work and measures the longest the loop went
without running it. The ticker sleeps 10 ms; the bound on the gap is a quarter of the
call's deadline (0.5 s), fifty ticks, so only a blocked loop, not a busy machine, misses
it. The spinning tests start a worker whose tool or verdict spins (this file, run as the
worker: the benchmark's own worker with one function replaced), so the real processes,
pipes and kills are what stop it.
"""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from rollout.assembly import TASK_TOOLS
from rollout.episode import Episode
from rollout.tasks.tau2 import Tau2Task, worlds
from rollout.tasks.tau2.arithmetic import _guarded
from rollout.tools.base import ToolCall
from rollout.tools.box import TaskToolLimits, ToolBox, ToolUsage
from rollout.tools.parsers import Parsed
from services.config import Tau2Spec

DEADLINE_S = 2.0
"""The tool box's timeout for each call in these tests."""
MAX_STALL_S = DEADLINE_S / 4
SPIN_EMAIL = "spin@example.com"
"""The spinning worker's `find_user_id_by_email` never returns for this address."""


def retail() -> Tau2Task:
    return Tau2Task(Tau2Spec(domain="retail", split="test", num_examples=1))


def box_of(task: Tau2Task) -> ToolBox:
    tools = task.tools()
    return ToolBox(TASK_TOOLS, tools, {t.name: TaskToolLimits(max_calls=30, timeout_s=DEADLINE_S) for t in tools})


async def longest_stall(work):
    """What `work` returns, and the longest gap between two ticks of a ticker beside it."""
    gaps, running = [0.0], True

    async def tick() -> None:
        last = time.monotonic()
        while running:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)  # the ticker holds its first time before the work starts
    try:
        result = await work
    finally:
        running = False
        await ticker
    return result, max(gaps)


async def calls(box: ToolBox, usage: ToolUsage, *called: tuple[str, dict]):
    return await box.run(Parsed(calls=[ToolCall(name, arguments) for name, arguments in called]), usage)


def conversation(task: Tau2Task, usage: ToolUsage, results) -> Episode:
    """An episode the user ended after one reply that made `results`' calls."""
    asked = [{"role": "user", "content": "Please work it out."}, {"role": "assistant", "content": "<calls>"}]
    answers = [{"role": "tool", "content": r.content} for r in results]
    done = [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "###STOP###"}]
    episode = Episode(task.context(0) + asked + answers + done, [1], end="user_ended")
    episode.tool_use = usage
    return episode


@pytest.mark.parametrize("power", ["9**9**7", "9**9**8"])  # 2 s on the loop before; the second never ends
async def test_a_power_too_large_to_compute_is_refused_at_once_and_the_world_goes_on(power):
    task = retail()
    box, usage = box_of(task), ToolUsage(world=task.world(0))
    (refused,), stall = await longest_stall(calls(box, usage, ("calculate", {"expression": power})))
    assert stall < MAX_STALL_S and refused.seconds < MAX_STALL_S
    assert refused.failure == "tool_error" and "too large" in refused.content
    (fine,) = await calls(box, usage, ("calculate", {"expression": "2**10 / (3 - 1)"}))
    assert (fine.failure, fine.content) == ("", "512.0")  # the benchmark's own answer


async def test_the_verdict_replays_a_refused_power_in_time():
    task = retail()
    box, usage = box_of(task), ToolUsage(world=task.world(0))
    results = await calls(box, usage, ("calculate", {"expression": "9**9**8"}))
    verdict, stall = await longest_stall(asyncio.wait_for(task.verdict(0, conversation(task, usage, results)), 30))
    assert stall < MAX_STALL_S
    assert verdict.info is None or "error" not in verdict.info, verdict.info  # the evaluators ran to the end
    assert verdict.db_check is not None and verdict.reward == 0.0  # the task expects changes none made


def outcome(calculate, expression: str) -> tuple:
    try:
        return ("answer", calculate(None, expression))
    except Exception as exc:  # noqa: BLE001 - the benchmark's errors are what is compared
        return ("error", type(exc).__name__, str(exc))


@pytest.mark.parametrize(
    "expression",
    ["2 + 2", "2**10 / (3 - 1)", "7 // 2", "1.05**3 * 100", "-(3 - 10) * .5", "9**-9**8", "2**4095", "3**2000"]
    + ["1/0", "2 +", "abc", "2.0**5000", "1/0 + 9**9**8", "+".join(["1"] * 2000)],
)
def test_calculate_answers_as_the_benchmark_does_where_it_computes_in_bounded_time(expression):
    from tau2.domains.retail.tools import RetailTools

    assert outcome(_guarded(RetailTools.calculate), expression) == outcome(RetailTools.calculate, expression)


@pytest.mark.parametrize(
    "expression", ["9**9**8", "2**4096", "3**2585", "(9**300) * 9**300 * 9**300 * 9**300 * 9**300"]
)
def test_calculate_refuses_an_integer_over_4096_bits_before_computing_it(expression):
    from tau2.domains.retail.tools import RetailTools

    started = time.monotonic()
    assert outcome(_guarded(RetailTools.calculate), expression)[2].startswith("the result is too large")
    assert time.monotonic() - started < MAX_STALL_S


@pytest.fixture
def spinning(monkeypatch):
    """Tau2 tasks whose worker is this file: its tool and verdict spin."""
    monkeypatch.setattr(worlds, "WORKER", (__file__,))


async def test_a_call_that_spins_is_cut_at_its_deadline_and_loses_its_world(spinning):
    task = retail()
    box, usage = box_of(task), ToolUsage(world=task.world(0))
    spin = ("find_user_id_by_email", {"email": SPIN_EMAIL})
    (cut,), stall = await longest_stall(calls(box, usage, spin))
    assert stall < MAX_STALL_S
    assert cut.failure == "timeout" and f"within {DEADLINE_S:g} s" in cut.content
    assert DEADLINE_S <= cut.seconds < DEADLINE_S + MAX_STALL_S
    (after,) = await calls(box, usage, ("calculate", {"expression": "1 + 1"}))
    assert after.failure == "exception" and "environment is gone" in after.content and after.seconds < MAX_STALL_S
    fork = usage.copy()  # a future sampled from here has no world either
    (forked,) = await calls(box, fork, ("calculate", {"expression": "1 + 1"}))
    assert "environment is gone" in forked.content
    verdict = await asyncio.wait_for(task.verdict(0, conversation(task, usage, [cut, after])), MAX_STALL_S)
    assert verdict.reward == 0.0 and "find_user_id_by_email" in verdict.info["error"]


async def test_a_verdict_that_runs_past_its_deadline_scores_0_naming_it(spinning, monkeypatch):
    monkeypatch.setattr(worlds, "VERDICT_TIMEOUT_S", DEADLINE_S)
    task = retail()
    usage = ToolUsage(world=task.world(0))
    started = time.monotonic()
    verdict, stall = await longest_stall(task.verdict(0, conversation(task, usage, [])))
    assert stall < MAX_STALL_S and time.monotonic() - started < DEADLINE_S + MAX_STALL_S
    assert verdict.reward == 0.0 and f"within {DEADLINE_S:g} s" in verdict.info["error"]


def spin_in_worker() -> None:
    """Replace the retail tool `find_user_id_by_email` (for SPIN_EMAIL) and the benchmark's
    environment evaluator with loops that never end."""
    from tau2.domains.retail.tools import RetailTools
    from tau2.evaluator.evaluator_env import EnvironmentEvaluator

    find = RetailTools.find_user_id_by_email

    def spinning_find(self, email: str) -> str:
        while email == SPIN_EMAIL:
            pass
        return find(self, email)

    def spinning_evaluator(*args, **kwargs):
        while True:
            pass

    RetailTools.find_user_id_by_email = spinning_find
    EnvironmentEvaluator.calculate_reward = spinning_evaluator


if __name__ == "__main__":  # run as the worker of the `spinning` tests
    from rollout.tasks.tau2 import worker

    spin_in_worker()
    worker.main(sys.argv[1:])
