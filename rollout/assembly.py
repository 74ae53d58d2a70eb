"""What a job's conversations are played with, assembled from its spec: the task set, who
plays the user, the tools, the tokenizer and the episode runner over an engine; and, for a
job with `eval`, the same for its held-out examples. The rollout server assembles a job this
way when it takes one up, and `tandem eval` does for a policy it evaluates on its own engine.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

from rollout.engine import Engine
from rollout.episode import EpisodeRunner
from rollout.evaluate import HeldOutPlayer
from rollout.group import GroupRollout, RankedRollout
from rollout.interactions.base import UserSimulator
from rollout.interactions.llm_user import LLMUser
from rollout.judging import ProxyJudge
from rollout.tasks import load_task
from rollout.tasks.base import TaskSet
from rollout.tools.box import ToolBox
from services.config import JobSpec, ToolCatalog, ToolsSpec
from services.held_out import check_loaded, held_out
from services.judge_client import JudgeClient
from services.tokenization import ChatTokenizer
from services.tool_catalog import with_file_tools

TASK_TOOLS = ToolsSpec(max_calls_per_episode=30, max_rounds_per_turn=8)
"""The parser and limits of a task's own tools when the job sets none: room for the calls
one τ² conversation makes (the benchmark bounds a conversation by its steps and errors)."""


@dataclass
class Played:
    """A job's training conversations: what plays them and what scores them."""

    runner: EpisodeRunner
    task_set: TaskSet
    judge: ProxyJudge


async def check_sandbox(spec: JobSpec) -> None:
    """RuntimeError when the job runs model-written code (the code task, a python tool) and
    this machine's sandbox refuses to: every score would otherwise be a silent 0."""
    tools = with_file_tools(spec.tools).tools if spec.tools is not None else []
    if not spec.task.needs_sandbox and not any(tool.needs_sandbox for tool in tools):
        return
    from rollout.tools.sandbox import refusal

    refused = await asyncio.to_thread(refusal)
    if refused is not None:
        raise RuntimeError(f"this rollout server cannot run model-written code: {refused}")


async def assemble(
    engine: Engine, spec: JobSpec, job_id: str, client: JudgeClient, catalog: ToolCatalog, allow_inline_mcp: bool
) -> Played:
    """The job's task set, user, tools and runner on `engine` (its model loaded)."""
    chat = ChatTokenizer(load_tokenizer(spec.model.path), spec.rollout.tokenization_check)
    judge = ProxyJudge(client, job_id, spec.reward)
    task_set = load_task(spec.task, spec.train.seed, judge=judge)
    user = task_user(task_set, client, spec, job_id)
    tools = await open_tools(task_set, spec, job_id, catalog, allow_inline_mcp)
    if tools is not None:
        chat = chat.with_tools(tools.schemas(), tools.spec.parser)
    runner = EpisodeRunner(engine, chat, user, spec.rollout, tools, task_set.world)
    return Played(runner, task_set, judge)


async def held_out_player(
    played: Played, spec: JobSpec, job_id: str, client: JudgeClient, server_id: str
) -> HeldOutPlayer:
    """The player of the job's held-out conversations (ValueError without `eval`): the
    training runner with the held-out task set's user and worlds (its tools are the same kind)."""
    held = held_out(spec)
    task_set = await asyncio.to_thread(load_task, held.task, held.seed, played.judge)
    check_loaded(held, len(task_set))
    runner = replace(played.runner, user=task_user(task_set, client, spec, job_id), worlds=task_set.world)
    rubric = spec.reward.judge_rubric if spec.reward.judge_weight else None
    return HeldOutPlayer(runner, task_set, played.judge, rubric, server_id, job_id)


def group_rollout(
    played: Played, spec: JobSpec, job_id: str, reward_slots: asyncio.Semaphore, server_id: str
) -> GroupRollout:
    """What turns the job's tasks into groups on `played`'s runner: its rewards under
    `reward_slots` (the server's bound on rewards computed at once)."""
    kind = RankedRollout if spec.ranked_conversations else GroupRollout
    return kind(
        played.runner,
        played.task_set,
        spec.reward,
        played.judge,
        reward_slots,
        server_id,
        job_id,
        seed=spec.train.seed,
        openings=spec.task.simulator_opens(),
    )


def task_user(task_set: TaskSet, client: JudgeClient, spec: JobSpec, job_id: str) -> UserSimulator:
    """Who plays the user: the task's own (a rule-based user, or τ²-bench's role-played
    brief), else the LLM user simulator playing the task's goal."""
    own = task_set.own_user(client, spec.reward.user_model, job_id, spec.train.seed)
    if own is not None:
        return own
    style = spec.task.simulator_style()
    return LLMUser(client, task_set.goal, spec.reward.user_model, job=job_id, seed=spec.train.seed, style=style)


async def open_tools(
    task_set: TaskSet, spec: JobSpec, job_id: str, catalog: ToolCatalog, allow_inline_mcp: bool
) -> ToolBox | None:
    """The task's own tools where it brings them, else the job's (None without)."""
    own = await asyncio.to_thread(task_set.tools)
    if own is not None:
        return ToolBox.of_task(spec.tools or TASK_TOOLS, own, job_id)
    if spec.tools is None:
        return None
    return await ToolBox.open(spec.tools, job_id, catalog, allow_inline_mcp)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
