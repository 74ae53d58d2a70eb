"""The tau2 task's edges: what a spec may say, how a conversation that the user did not end
scores, worlds that fork, the role-played user, and pass^k."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from devtools.provider_replies import reply_for
from rollout.engine import Generation
from rollout.episode import Episode, EpisodeRunner
from rollout.interactions.llm_user import UserSimulatorError
from rollout.interactions.role_play import RolePlayUser, swapped
from rollout.tasks.tau2 import MAX_ERRORS, STOP_MARKER, Tau2Task, termination
from rollout.tau2_eval import interval
from rollout.tools.box import ToolResult, ToolUsage
from services.config import RLJob, RolloutSpec, Tau2Spec, written_location
from services.held_out import pass_hat_k
from services.tokenization import ChatTokenizer

MODEL = {"path": "/models/m"}


@pytest.mark.parametrize(
    "task, tools, error",
    [
        ({"name": "tau2"}, None, "task.domain: Field required"),
        ({"name": "clarify", "domain": "mock"}, None, "task.domain: Extra inputs"),
        ({"name": "tau2", "domain": "telecom"}, None, "task.domain: Input should be"),
        ({"name": "tau2", "domain": "mock", "split": "dev"}, None, "task.split: Input should be"),
        ({"name": "tau2", "domain": "mock", "system_prompt": "Be brief."}, None, "task.system_prompt: Extra inputs"),
        ({"name": "tau2", "domain": "mock", "opening": "simulator"}, None, "task.opening: Extra inputs"),
        ({"name": "tau2", "domain": "mock"}, {"tools": [{"name": "calc", "kind": "calculator"}]}, "own tools"),
        ({"name": "clarify"}, {"max_calls_per_episode": 3}, "inline tools or a file"),
    ],
)
def test_a_spec_that_cannot_be_a_tau2_job_is_refused_naming_the_field(task, tools, error):
    with pytest.raises(ValidationError) as caught:
        RLJob(model=MODEL, task=task, tools=tools)
    [written] = [
        f"{'.'.join(map(str, written_location(e['loc'], e['type'])))}: {e['msg']}" for e in caught.value.errors()
    ]
    assert error in written


def test_a_tau2_job_may_set_only_the_parser_and_limits_of_its_tools():
    spec = RLJob(
        model=MODEL, task={"name": "tau2", "domain": "airline", "split": "test"}, tools={"max_calls_per_episode": 20}
    )
    assert spec.tools.max_calls_per_episode == 20 and not spec.tools.tools


def mock(split: str = "base") -> Tau2Task:
    return Tau2Task(Tau2Spec(domain="mock", split=split))


def test_the_mock_split_holds_out_one_task_of_each_kind():
    train, test = mock("train"), mock("test")
    assert (len(train), len(test), len(mock())) == (6, 3, 9)
    assert not {t.id for t in train.tasks} & {t.id for t in test.tasks}


def episode_of(task: Tau2Task, example: int, end: str, failures: int = 0) -> Episode:
    episode = Episode(
        task.context(example) + [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Done."}],
        [1],
        end=end,
    )
    episode.tool_use = ToolUsage(
        world=task.world(example), results=[ToolResult(None, "error", "malformed") for _ in range(failures)]
    )
    return episode


@pytest.mark.parametrize(
    "end, failures, reason",
    [
        ("user_ended", 0, "user_stop"),
        ("max_turns", 0, "max_steps"),
        ("max_tokens", 0, "max_steps"),
        ("truncated", 0, "agent_error"),
        ("user_ended", MAX_ERRORS, "too_many_errors"),
    ],
)
async def test_only_a_conversation_the_user_ended_is_judged_on_its_merits(end, failures, reason):
    task = mock()
    nothing_expected = [t.id for t in task.tasks].index("create_task_1_nl_eval")  # passes if judged at all
    episode = episode_of(task, nothing_expected, end, failures)
    assert termination(episode) == reason
    assert (await task.verdict(nothing_expected, episode)).reward == (1.0 if reason == "user_stop" else 0.0)


def completed(task_id: str) -> tuple[str, dict]:
    return "update_task_status", {"task_id": task_id, "status": "completed"}


async def test_a_forked_world_changes_apart_from_the_one_it_came_from():
    task = mock()
    world = task.world(0)
    fork = world.fork()
    created = json.loads((await fork.call("create_task", {"user_id": "user_1", "title": "Only in the fork"})).content)
    assert (await fork.call(*completed(created["task_id"]))).error is False
    assert (await world.call(*completed(created["task_id"]))).error is True  # no such task here
    assert len(fork.calls) == 2 and len(world.calls) == 1
    assert world.fork().calls == world.calls and world.fork().process.sock is not world.process.sock


async def test_a_task_with_a_history_starts_from_it_and_its_world_holds_what_the_history_did():
    task = mock()
    example = [t.id for t in task.tasks].index("update_task_with_message_history")
    context = task.context(example)
    assert [m["role"] for m in context] == ["system", "user", "assistant", "tool", "assistant"]
    assert context[2]["content"].startswith('<tool_call>{"name": "create_task"')
    assert (await task.world(example).call(*completed("task_2"))).error is False
    assert (await task.world(0).call(*completed("task_2"))).error is True


class Client:
    """The judge proxy's client as the user sees it: replies in order, prompts kept."""

    def __init__(self, *replies: str) -> None:
        self.replies, self.prompts = list(replies), []

    async def chat(self, messages, **kwargs):
        self.prompts.append(messages)
        return type("Result", (), {"content": self.replies.pop(0)})()


CONVERSATION = [
    {"role": "system", "content": "policy"},
    {"role": "assistant", "content": "Hi!"},
    {"role": "user", "content": "My order is late."},
    {"role": "assistant", "content": '<tool_call>{"name": "get_order"}</tool_call>'},
    {"role": "tool", "content": '{"status": "shipped"}'},
    {"role": "assistant", "content": "It shipped yesterday."},
]


def test_the_role_played_user_sees_only_what_the_user_saw_with_roles_swapped():
    assert swapped(CONVERSATION) == [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "My order is late."},
        {"role": "user", "content": "It shipped yesterday."},
    ]


async def test_the_role_played_user_ends_on_a_stop_marker_and_retries_a_blank_reply_once():
    client = Client("Thanks! ###STOP###")
    user = RolePlayUser(client, lambda example: f"brief {example}", ("###STOP###",), "sim")
    assert await user.respond(3, CONVERSATION, "t/1") is None
    assert client.prompts[0][0] == {"role": "system", "content": "brief 3"}
    assert (
        await RolePlayUser(Client("  ", "Where is it?"), str, ("###STOP###",), "sim").respond(0, CONVERSATION)
        == "Where is it?"
    )
    with pytest.raises(UserSimulatorError):
        await RolePlayUser(Client("", ""), str, ("###STOP###",), "sim").respond(0, CONVERSATION)


def test_the_stand_in_plays_a_briefed_user_asking_then_stopping():
    task = mock()
    brief = [{"role": "system", "content": task.brief(0)}, {"role": "user", "content": "Hi! How can I help?"}]
    request = reply_for(brief)
    assert "Important Meeting" in request and "###" not in request
    assert (
        reply_for(brief + [{"role": "assistant", "content": request}, {"role": "user", "content": "Done."}])
        == "###STOP###"
    )


def test_pass_hat_k_is_the_chance_that_k_trials_all_succeed_averaged_over_tasks():
    # Task A: 2 of 4 trials; task B: 4 of 4. pass^1 = (0.5 + 1) / 2; pass^2 = (1/6 + 1) / 2.
    assert pass_hat_k([2, 4], 4, 1) == pytest.approx(0.75)
    assert pass_hat_k([2, 4], 4, 2) == pytest.approx((1 / 6 + 1) / 2)
    assert pass_hat_k([2, 4], 4, 4) == pytest.approx(0.5)
    low, high = interval([0, 4, 4], 4, 1)
    assert low < pass_hat_k([0, 4, 4], 4, 1) < high and (low, high) == (0.0, 1.0)


def test_a_tau2_spec_has_as_many_examples_as_its_split_has_tasks_and_no_more():
    assert Tau2Spec(domain="airline", split="test").num_examples == 20
    assert Tau2Spec(domain="mock").num_examples == 6 == len(mock("train"))
    assert Tau2Spec(domain="retail", split="test", num_examples=5).num_examples == 5
    with pytest.raises(ValidationError, match="test split has 3 tasks"):
        Tau2Spec(domain="mock", split="test", num_examples=4)


async def test_calls_the_benchmark_refuses_or_the_schema_rejects_are_errors_that_leave_the_world_as_it_was():
    from rollout.assembly import TASK_TOOLS
    from rollout.tools.base import ToolCall
    from rollout.tools.box import ToolBox
    from rollout.tools.parsers import Parsed

    task = mock()
    box = ToolBox.of_task(TASK_TOOLS, task.tools())
    usage = ToolUsage(world=task.world(0))
    results = await box.run(
        Parsed(
            calls=[
                ToolCall("update_task_status", {"task_id": "task_999", "status": "completed"}),  # no such task
                ToolCall("create_task", {"user_id": 5, "title": ["not", "a", "title"]}),  # wrong types
                ToolCall("drop_database", {}),  # no such tool
            ]
        ),
        usage,
    )
    assert [r.failure for r in results] == ["tool_error", "bad_arguments", "unknown_tool"]
    assert results[0].content.startswith("error: ") and "task_999" in results[0].content
    assert len(usage.world.calls) == 1
    (created,) = await box.run(Parsed(calls=[ToolCall("create_task", {"user_id": "user_1", "title": "t"})]), usage)
    assert created.ok and json.loads(created.content)["task_id"] == "task_2"  # the database held one task still


@pytest.mark.parametrize(
    "argv",
    [
        ["--trials", "0"],
        ["--concurrency", "0"],
        ["--domains", "telecom"],
        ["--domains", "mock,../etc"],
        ["--num-tasks", "-1"],
    ],
)
def test_tandem_eval_refuses_arguments_it_cannot_run_with(argv, capsys):
    from tandem.cli import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["eval", "/models/m", *argv])
    assert exited.value.code == 2 and argv[0] in capsys.readouterr().err


class StandIn:
    """The judge proxy's client answering as the stand-in provider does (`reply_for`)."""

    async def chat(self, messages, **kwargs):
        return type("Result", (), {"content": reply_for(messages)})()


class ScriptedEngine:
    """The policy: every reply is `text` and the end-of-turn token."""

    version = 0

    def __init__(self, chat: ChatTokenizer, text: str) -> None:
        tokens = chat.tokenizer.encode(text, add_special_tokens=False) + [chat.eot_id]
        self.generation = Generation(tokens, [-0.5] * len(tokens), [0] * len(tokens), "stop")

    async def generate(self, prompt, max_tokens, temperature, stop_ids) -> Generation:
        return self.generation


def runner(tokenizer, user) -> EpisodeRunner:
    chat = ChatTokenizer(tokenizer)
    spec = RolloutSpec(max_new_tokens=16, max_turns=3, max_total_tokens=8192)
    return EpisodeRunner(ScriptedEngine(chat, "It is marked completed."), chat, user, spec)


HISTORY_TASKS = ["update_task_with_message_history", "update_task_with_history_and_env_assertions"]


@pytest.mark.parametrize("task_id", HISTORY_TASKS)
async def test_a_task_that_starts_from_a_history_has_the_stand_ins_user_ask_before_it_stops(tokenizer, task_id):
    task = mock("train")
    example = [t.id for t in task.tasks].index(task_id)
    context = task.context(example)
    user = RolePlayUser(StandIn(), task.brief, (STOP_MARKER,), "judge")

    episode = await runner(tokenizer, user).run(example, context)

    said = episode.messages[len(context) :]
    assert [m["role"] for m in said] == ["user", "assistant"]
    assert "completed" in said[0]["content"] and STOP_MARKER not in said[0]["content"]
    assert episode.end == "user_ended" and episode.num_turns == 1 and episode.well_formed()


async def test_an_episode_the_user_ends_before_the_policy_speaks_is_malformed_as_empty(tokenizer):
    """The history's assistant messages are the context's, not the policy's."""
    task = mock("train")
    example = [t.id for t in task.tasks].index(HISTORY_TASKS[0])
    user = RolePlayUser(Client("Thanks! ###STOP###"), task.brief, (STOP_MARKER,), "judge")

    episode = await runner(tokenizer, user).run(example, task.context(example))

    assert episode.end == "user_ended" and episode.num_turns == 0
    assert episode.malformed_reason() == "empty"
