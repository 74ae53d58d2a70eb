"""τ²-bench through Tandem's episode loop gets the benchmark's own verdict.

Two agents play each task through `EpisodeRunner` with the task's tools, worlds and context
(`rollout.tasks.tau2`): an oracle that makes the task's expected calls and then says what
the task expects to hear, and an agent that does nothing. The verdict Tandem rewards with is
compared, task by task, with `tau2.evaluator.evaluator.evaluate_simulation` (the benchmark's
evaluation `all`) on the same conversation: every mock task, the airline test split (20)
and 20 retail test tasks.

The agents are scripts in place of the policy's engine (what they say is the point), the
user a script that asks once and ends the conversation when answered; the tokenizer is
SmolLM2's, so the calls go through the real rendering, parser and tool box. The benchmark's
`evaluator` module imports litellm (its hosted-LLM client, which Tandem does not install)
at import time; `benchmark_evaluate` loads it against a module that fails any call, so
the reference verdict is shown to need no LLM.
"""

from __future__ import annotations

import json
import sys
import types

import pytest

from rollout.assembly import TASK_TOOLS
from rollout.engine import Generation
from rollout.episode import EpisodeRunner
from rollout.tasks.tau2 import Tau2Task
from rollout.tools.box import ToolBox
from services.config import RolloutSpec, Tau2Spec
from services.tokenization import ChatTokenizer

pytestmark = pytest.mark.slow

SAMPLES = {"mock": 9, "airline": 20, "retail": 20}
ORACLE_SHORT_OF_ONE = {
    "update_task_with_history_and_env_assertions": (
        "lists no expected action, only an end state (task_2 completed) checked by an environment assertion, "
        "so the oracle, which makes the listed calls, never reaches it"
    ),
}
"""Tasks where the oracle does not score 1.0, and why."""


class ScriptedAgent:
    """The policy's engine, replying from a script of texts (each ends its turn)."""

    version = 0

    def __init__(self, chat: ChatTokenizer, replies: list[str], then: str) -> None:
        self.chat, self.replies, self.then = chat, list(replies), then

    async def generate(self, prompt, max_tokens, temperature, stop_ids) -> Generation:
        text = self.replies.pop(0) if self.replies else self.then
        tokens = self.chat.tokenizer.encode(text, add_special_tokens=False) + [self.chat.eot_id]
        return Generation(tokens, [0.0] * len(tokens), [0] * len(tokens), "stop")


class AsksOnceUser:
    """One conversation's user: asks once, and ends the conversation at the agent's answer."""

    def __init__(self) -> None:
        self.asked = False

    async def respond(self, example: int, messages: list[dict], call_id: str = "") -> str | None:
        if self.asked:
            return None
        self.asked = True
        return "Hello, I need help with my account."


def oracle_replies(task) -> list[str]:
    """The expected calls (all in one reply), then one reply saying every expected fact."""
    criteria = task.evaluation_criteria
    calls = [
        f"<tool_call>{json.dumps({'name': a.name, 'arguments': a.arguments})}</tool_call>"
        for a in criteria.actions or []
    ]
    said = " ".join(f"{info}." for info in criteria.communicate_info or []) or "It is done."
    return ([" ".join(calls)] if calls else []) + [said]


def benchmark_evaluate(monkeypatch):
    """`evaluate_simulation`, imported with a litellm that refuses every call."""

    def refuse(*args, **kwargs):
        raise AssertionError("the benchmark's verdict made an LLM call")

    class Refused:
        def __init__(self, *args, **kwargs):
            refuse()

    for name, attrs in {
        "litellm": dict(completion=refuse, completion_cost=refuse, disable_cache=lambda: None),
        "litellm.caching": {},
        "litellm.caching.caching": dict(Cache=Refused),
        "litellm.main": dict(ModelResponse=Refused, Usage=Refused),
    }.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation

    return lambda simulation, task, domain: evaluate_simulation(simulation, task, EvaluationType.ALL, False, domain)


@pytest.fixture(scope="module")
def chat(real_model):
    from transformers import AutoTokenizer

    return ChatTokenizer(AutoTokenizer.from_pretrained(real_model))


async def play(task_set: Tau2Task, chat: ChatTokenizer, example: int, replies: list[str], then: str):
    box = ToolBox.of_task(TASK_TOOLS, task_set.tools())
    runner = EpisodeRunner(
        ScriptedAgent(chat, replies, then),
        chat.with_tools(box.schemas()),
        AsksOnceUser(),
        RolloutSpec(max_new_tokens=1024, max_turns=4, max_total_tokens=32768),
        box,
        task_set.world,
    )
    return await runner.run(example, task_set.context(example))


def reference(evaluate, task_set: Tau2Task, example: int, episode):
    """The benchmark's verdict; where its evaluator raises, what its runner records for a
    failed sample (reward 0, the error)."""
    from tau2.data_model.simulation import RewardInfo, SimulationRun

    run = SimulationRun(
        id="t",
        task_id=task_set.tasks[example].id,
        start_time="",
        end_time="",
        duration=0.0,
        termination_reason="user_stop",
        messages=task_set.trajectory(example, episode),
    )
    try:
        return evaluate(run, task_set.tasks[example], task_set.domain)
    except Exception as exc:  # noqa: BLE001
        return RewardInfo(reward=0.0, info={"error": f"{type(exc).__name__}: {exc}"})


def checks(info) -> dict:
    """What a verdict found, part by part."""
    return {
        "reward": info.reward,
        "error": (info.info or {}).get("error"),
        "db": info.db_check and info.db_check.db_match,
        "actions": [c.action_match for c in info.action_checks or []],
        "said": [c.met for c in info.communicate_checks or []],
        "env_assertions": [c.met for c in info.env_assertions or []],
    }


@pytest.mark.parametrize("domain", list(SAMPLES))
async def test_the_oracle_and_a_do_nothing_agent_get_the_benchmarks_verdict(domain, chat, monkeypatch):
    evaluate = benchmark_evaluate(monkeypatch)
    task_set = Tau2Task(
        Tau2Spec(domain=domain, split="base" if domain == "mock" else "test", num_examples=SAMPLES[domain])
    )
    assert len(task_set) == SAMPLES[domain]
    short, idle_rewards = {}, []
    for example, task in enumerate(task_set.tasks):
        oracle = await play(task_set, chat, example, oracle_replies(task), "Anything else?")
        idle = await play(task_set, chat, example, [], "I am sorry, I cannot help with that.")
        verdicts = []
        for episode in (oracle, idle):
            assert episode.end == "user_ended" and episode.well_formed(), (task.id, episode.end)
            ours = checks(await task_set.verdict(example, episode))
            assert ours == checks(reference(evaluate, task_set, example, episode)), task.id
            verdicts.append(ours)
        # Every expected call reached the benchmark's environment: none was refused by the
        # tool box (some are expected to fail there: a refund to a method policy forbids).
        assert oracle.tool_use.total == len(task.evaluation_criteria.actions or []), task.id
        assert set(oracle.tool_use.failures()) <= {"tool_error"}, (task.id, oracle.tool_use.failures())
        if verdicts[0]["reward"] != 1.0:
            short[task.id] = verdicts[0]
        idle_rewards.append(verdicts[1]["reward"])
    assert await task_set.score(example, idle.messages, idle) == verdicts[1]["reward"]  # the reward's own path
    assert short.keys() == {t.id for t in task_set.tasks} & ORACLE_SHORT_OF_ONE.keys(), short
    # Doing nothing fails every task that expects a change to the database.
    assert sum(idle_rewards) < len(idle_rewards) / 2, idle_rewards
