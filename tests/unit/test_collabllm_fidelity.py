"""CollabLLM's multiturn-aware reward as the paper defines it, item by item (issue 37).

Each test puts known futures in and checks the paper's number out, computed by hand in the
comments: R* = R_ext - min(lambda * TokenCount, 1) + R_llm, MR the mean over the futures.
The unbiased adaptive estimator has its own file (test_adaptive_futures.py).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from judge_proxy.rubrics import RUBRICS
from judge_proxy.rubrics.base import parse_verdict
from rollout.episode import Episode, EpisodeRunner
from rollout.group import GroupRollout
from rollout.interactions.llm_user import NOT_STARTED, PERSON_RULES, LLMUser, transcript
from rollout.rewards.conversation import conversation_rewards
from rollout.rewards.multiturn import score_response
from rollout.tasks import clarify, load_task
from rollout.tasks.base import Verdict
from rollout.tasks.code_chat import CodeChatTask
from rollout.tasks.contexts import ContextView, turn_contexts
from rollout.tasks.doc_edit_chat import DocEditChatTask, document_bleu
from rollout.tasks.math_chat import MathChatTask
from services import protocol
from services.config import (
    TASK_SPECS,
    ClarifySpec,
    CodeChatSpec,
    DocEditChatSpec,
    JobSpec,
    MathChatSpec,
    RewardSpec,
    RolloutSpec,
    parse_job_spec,
)
from services.presets import COLLABORATIVE_SYSTEM_PROMPT
from services.tokenization import ChatTokenizer
from tests.unit.test_rollout_group import RIGHT, TARGET, TASK, AskingPolicy


def preset(task: str, **reward) -> JobSpec:
    return parse_job_spec({"model": {"path": "m"}, "task": {"name": task}, "reward": {"preset": "collabllm", **reward}})


def chat(*turns: str) -> list[dict]:
    """user, assistant, user, ... from the given texts."""
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]


# ---- 10. the preset: the paper's settings, each departure explicit ----------------------


@pytest.mark.parametrize(
    "task, penalty, temperature",
    [("math_chat", 5e-4, 0.6), ("code_chat", 5e-4, 0.6), ("doc_edit_chat", 1e-4, 0.8), ("clarify", 5e-4, 0.8)],
)
def test_the_collabllm_preset_holds_the_papers_settings_for_each_task(task, penalty, temperature):
    spec = preset(task)
    reward = spec.reward
    assert (reward.mode, reward.window, reward.num_futures, reward.futures) == ("multiturn", 2, 3, "fixed")
    assert (reward.token_penalty, reward.token_count, reward.future_temperature) == (penalty, "all", temperature)
    assert (reward.extrinsic_weight, reward.judge_rubric, reward.judge_weight) == (1.0, "interactivity", 1.0)
    assert reward.judge_reference is False
    assert (spec.task.system_prompt, spec.task.simulator) == (COLLABORATIVE_SYSTEM_PROMPT, "person")


def test_what_a_spec_sets_itself_overrides_the_preset_and_stays_visible():
    spec = parse_job_spec(
        {
            "model": {"path": "m"},
            "task": {"name": "math_chat", "simulator": "cooperative"},
            "reward": {"preset": "collabllm", "num_futures": 5, "token_count": "policy"},
        }
    )
    assert (spec.reward.num_futures, spec.reward.token_count, spec.task.simulator) == (5, "policy", "cooperative")
    assert spec.reward.window == 2  # the rest is the paper's
    assert parse_job_spec(spec.model_dump()) == spec  # a stored spec reads back the same


def test_without_a_preset_the_defaults_are_tandems_own():
    reward = RewardSpec()
    assert (reward.preset, reward.mode, reward.token_penalty, reward.judge_rubric) == ("none", "episode", 0.0, None)


# ---- 1. R_ext over the whole conversation ------------------------------------------------

MATH = MathChatTask(MathChatSpec())


async def test_math_r_ext_keeps_an_answer_followed_by_a_pleasantry():
    # Example 0's answer is 20.5. The old rule read only the last reply: 0.
    future = chat(
        "How much will I pay?",
        "Is that 7 notebooks at $3.50 with a $4 coupon?",
        "yes",
        "You pay \\boxed{20.50} dollars.",
        "thanks!",
        "You're welcome, happy to help!",
    )
    assert await MATH.score(0, future) == 1.0


async def test_math_r_ext_takes_the_last_answer_committed_to():
    boxed_then_corrected = chat("q", "It is \\boxed{24.5}.", "the coupon is $4 off", "Then \\boxed{20.5}.", "ok")
    unboxed = chat("q", "That comes to 20.5 dollars.", "great", "Glad it helps!")
    revised = chat("q", "That comes to 20.5 dollars.", "hm", "Sorry, it is 24.5 dollars.")
    assert [await MATH.score(0, c) for c in (boxed_then_corrected, unboxed, revised)] == [1.0, 1.0, 0.0]


async def test_doc_edit_r_ext_is_the_bleu_of_the_last_document_in_the_conversation():
    task = DocEditChatTask(DocEditChatSpec())
    reference = task.reference(0)
    future = chat("fix this", f"Here it is:\n```\n{reference}\n```", "perfect, thanks", "Anytime!")
    assert await task.score(0, future) == pytest.approx(1.0)
    draft = "Hi team, the planning meeting is on Thursday at 10am in room 4. Bring your notes."
    two_drafts = chat("fix this", f"```\n{draft}\n```", "room 7 and a laptop", f"```\n{reference}\n```", "ok")
    assert await task.score(0, two_drafts) == pytest.approx(1.0)
    assert await task.score(0, chat("fix this", f"```\n{draft}\n```", "thanks", "Bye!")) == pytest.approx(
        document_bleu(draft, reference)
    )


async def test_code_r_ext_runs_the_last_code_block_in_the_conversation():
    task = CodeChatTask(CodeChatSpec())
    solution = f"```python\n{task.reference(0)}```"
    assert await task.score(0, chat("write it", solution, "works, thanks", "Great, enjoy!")) == 1.0
    assert await task.score(0, chat("write it", "Which names?", "a list", "Sure, anything else?")) == 0.0


# ---- 3. the token penalty counts the conversation's tokens, user turns included ---------


class Nothing:
    async def score(self, example: int, messages: list[dict], episode=None) -> float:
        return 0.0

    def reference(self, example: int) -> str:
        return "the answer"


def after_context(policy: int, user: int) -> Episode:
    """A conversation of 10 context tokens, then `policy` tokens of the policy and `user`
    of the user (template tokens included)."""
    return Episode(messages=chat("q", "a"), tokens=[0] * (10 + policy + user), context_len=10, policy_tokens=policy)


@pytest.mark.parametrize(
    "count, expected",
    [
        ("policy", -0.15),
        ("all", -0.4),
    ],
)
async def test_the_token_penalty_counts_what_token_count_names(count, expected):
    # lambda 5e-4: policy 300 tokens -> 0.15; all 300 + 500 = 800 -> 0.4
    spec = RewardSpec(mode="multiturn", token_penalty=5e-4, token_count=count)
    assert await conversation_rewards(Nothing(), 0, [after_context(300, 500)], spec) == [pytest.approx(expected)]


async def test_the_penalty_is_capped_at_one():
    spec = RewardSpec(mode="multiturn", token_penalty=5e-4, token_count="all")
    assert await conversation_rewards(Nothing(), 0, [after_context(1000, 3000)], spec) == [-1.0]


# ---- 4. the interactivity judge sees neither the reference nor the system prompt ---------


class RecordingJudge:
    def __init__(self, score: float = 0.5) -> None:
        self.score, self.seen = score, []

    async def score_all(self, rubric, conversations, reference, call_id=""):
        self.seen.append((rubric, conversations, reference))
        return [Verdict(self.score)] * len(conversations)


async def test_the_judge_is_not_shown_the_reference_or_the_system_prompt_unless_asked():
    conversation = [{"role": "system", "content": COLLABORATIVE_SYSTEM_PROMPT}, *chat("q", "a")]
    episode = Episode(messages=conversation, tokens=[], num_turns=1, policy_tokens=0)
    judge = RecordingJudge()
    spec = preset("math_chat").reward
    await conversation_rewards(Nothing(), 0, [episode], spec, judge)
    await conversation_rewards(Nothing(), 0, [episode], spec.model_copy(update={"judge_reference": True}), judge)
    assert judge.seen == [("interactivity", [chat("q", "a")], None), ("interactivity", [chat("q", "a")], "the answer")]


# ---- 7. binary accuracy -----------------------------------------------------------------


@pytest.mark.parametrize("written, score", [(10, 1.0), (8, 0.0), (5, 0.0), (0, 0.0)])
def test_accuracy_is_binary_whatever_the_judge_writes(written, score):
    verdict = parse_verdict(RUBRICS["accuracy"], json.dumps({"correctness": written, "verdict": "v"}))
    assert verdict.score == score
    assert parse_verdict(RUBRICS["accuracy_graded"], json.dumps({"correctness": 8, "verdict": "v"})).score == 0.8


# ---- MR under the preset, by hand ---------------------------------------------------------


class Futures:
    """Futures from a script: each appends its messages and its token counts, and records
    the temperature it was asked to sample at."""

    def __init__(self, scripted: list[tuple[list[str], int, int]]) -> None:
        self.scripted, self.temperatures = list(scripted), []

    async def extend(self, episode, example, max_turns, trained=True, temperature=None):
        texts, policy, user = self.scripted.pop(0)
        self.temperatures.append(temperature)
        episode.messages += chat(*texts)  # the user answers first
        episode.tokens += [0] * (policy + user)
        episode.policy_tokens += policy
        return episode


async def test_mr_under_the_preset_is_the_mean_of_the_papers_r_star():
    spec = preset("math_chat").reward
    response = Episode(
        messages=[
            {"role": "system", "content": "be collaborative"},
            *chat("How much will I pay?", "How many notebooks, at what price?"),
        ],
        tokens=[0] * 40,
        context_len=30,
        num_turns=1,
        policy_tokens=10,
    )
    runner = Futures(
        [
            (["7 at $3.50, $4 off", "\\boxed{20.5}", "thx", "You're welcome!"], 60, 330),  # R_ext 1, 400 tokens
            (["7 at $3.50", "\\boxed{24.5}"], 40, 550),  # R_ext 0, 600 tokens
            (["7", "And the price?", "3.50", "Any coupon?"], 90, 2900),  # no answer, 3000 tokens
        ]
    )
    judge = RecordingJudge(score=0.6)
    mr, futures = await score_response(runner, response, MATH, 0, spec, judge)
    # R* = R_ext - min(5e-4 * tokens after the context, 1) + 0.6 (the judge), tokens counted
    # from the response on (10 + the future's): 400, 600, 3000.
    #   1 - 0.2 + 0.6 = 1.4;  0 - 0.3 + 0.6 = 0.3;  0 - 1 + 0.6 = -0.4;  MR = 1.3 / 3
    assert mr == pytest.approx(1.3 / 3)
    assert runner.temperatures == [0.6, 0.6, 0.6]  # futures at the paper's temperature for math
    assert all(m["role"] != "system" for _, conversations, _ in judge.seen for c in conversations for m in c)


# ---- 2 and 6. every turn trained, under the collaborative system prompt -----------------


def ranked_file(tmp_path, rows: list[dict]) -> str:
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_every_user_turn_of_a_ranked_conversation_becomes_a_context(tmp_path):
    rows = [
        {"example": 2, "messages": chat("u0", "a0", "u1", "a1", "u2", "a2")},
        {"example": 0, "messages": chat("v0", "b0")},
    ]
    contexts = turn_contexts(ranked_file(tmp_path, rows), limit=100)
    assert [(c.example, c.turn, [m["content"] for m in c.messages]) for c in contexts] == [
        (2, 0, ["u0"]),
        (2, 1, ["u0", "a0", "u1"]),
        (2, 2, ["u0", "a0", "u1", "a1", "u2"]),
        (0, 0, ["v0"]),
    ]
    assert len(turn_contexts(ranked_file(tmp_path, rows), limit=2)) == 2


@pytest.mark.parametrize(
    "row, says",
    [
        ({"example": -1, "messages": []}, "`example`"),
        ({"example": "0", "messages": []}, "`example`"),
        ({"example": 0, "messages": [{"role": "tool", "content": "x"}]}, "`messages`"),
        ({"example": 0, "messages": [{"role": "user", "content": 3}]}, "`messages`"),
        ([1, 2], "`example`"),
    ],
)
def test_a_bad_contexts_row_is_refused_naming_its_line(tmp_path, row, says):
    path = ranked_file(tmp_path, [{"example": 0, "messages": chat("ok")}, row])
    with pytest.raises(ValueError, match=f"line 2: {says}"):
        turn_contexts(path, limit=10)


def test_a_contexts_or_data_path_that_is_no_regular_file_is_refused():
    with pytest.raises(ValueError, match="task.contexts '/dev/zero': not a regular file"):
        turn_contexts("/dev/zero", limit=10)
    with pytest.raises(ValueError, match="task.data '/dev/zero': not a regular file"):
        load_task(MathChatSpec(data="/dev/zero"))


def test_load_task_reads_contexts_and_refuses_too_few_or_unknown_examples(tmp_path):
    path = ranked_file(tmp_path, [{"example": 1, "messages": chat("u0", "a0", "u1")}])
    task = load_task(MathChatSpec(contexts=path, num_examples=2))
    assert len(task) == 2 and task.goal(1) == MATH.goal(1) and task.reference(0) == MATH.reference(1)
    with pytest.raises(ValueError, match="fewer than task.num_examples"):
        load_task(MathChatSpec(contexts=path, num_examples=3))
    far = ranked_file(tmp_path, [{"example": 10_000, "messages": chat("u0")}])
    with pytest.raises(ValueError, match="names example 10000"):
        load_task(MathChatSpec(contexts=far, num_examples=1))


async def test_a_later_turn_is_trained_under_the_system_prompt_with_the_rows_user(tokenizer):
    """A clarify conversation at turn 1: the policy asked, the user answered; the group
    trains the response to that, scored against the row's example by its rule user."""
    asked = [
        {"role": "user", "content": clarify.request(TARGET)},
        {"role": "assistant", "content": clarify.question(TARGET.category)},
        {"role": "user", "content": clarify.clarification(TARGET.target)},
    ]
    view = ContextView(TASK, "be collaborative", [type("T", (), {"example": 0, "messages": asked, "turn": 1})()])
    chat_tokenizer = ChatTokenizer(tokenizer)
    policy = AskingPolicy(chat_tokenizer, [RIGHT])
    runner = EpisodeRunner(
        policy, chat_tokenizer, view.rule_user, RolloutSpec(max_new_tokens=32, max_turns=3, max_total_tokens=400)
    )
    spec = RewardSpec(mode="multiturn", window=1, num_futures=1)
    rollout = GroupRollout(runner, view, spec, None, asyncio.Semaphore(4), "s", "job-turns")
    group = await rollout.group(
        protocol.Task(job_id="job-turns", task_id=1, example=0, group_size=2, dispatched_version=0)
    )
    assert [s.reward for s in group.samples] == [1.0, 1.0]  # answered right at once: the user ends it
    assert all(s.metrics["turn"] == 1.0 for s in group.samples)
    prompt = tokenizer.decode(group.samples[0].tokens[: group.samples[0].mask.index(1)])
    assert prompt.index("be collaborative") < prompt.index(clarify.clarification(TARGET.target))


# ---- 5. a simulator that plays a person ---------------------------------------------------


class RecordingClient:
    def __init__(self) -> None:
        self.prompts = []

    async def structured_output(self, model):
        return False

    async def chat(self, prompt, **options):
        self.prompts.append(prompt)
        return type(
            "R", (), {"content": json.dumps({"current_answer": "", "thought": "", "response": "hm, 7 of em"})}
        )()


async def test_the_person_simulator_is_briefed_as_a_person_and_never_sees_the_system_prompt():
    client = RecordingClient()
    user = LLMUser(client, MATH.goal, "user-simulator", style="person")
    conversation = [{"role": "system", "content": "SECRET SYSTEM"}, *chat("how much?", "How many notebooks?")]
    assert await user.respond(0, conversation) == "hm, 7 of em"
    system, shown = client.prompts[0][0]["content"], client.prompts[0][1]["content"]
    assert PERSON_RULES in system and MATH.goal(0) in system
    assert "SECRET SYSTEM" not in shown and shown == transcript(conversation)


# ---- 5. the simulator writes the opening -------------------------------------------------


class OpeningClient(RecordingClient):
    async def chat(self, prompt, **options):
        self.prompts.append((prompt, options))
        started = prompt[1]["content"] == NOT_STARTED
        response = "can u fix my note" if started else "[[TERMINATE CHAT]]"
        return type("R", (), {"content": json.dumps({"current_answer": "", "thought": "", "response": response})})()


class Polite:
    """An engine double that always says the same short thing."""

    def __init__(self, chat_tokenizer: ChatTokenizer) -> None:
        self.chat, self.prompts = chat_tokenizer, []

    async def generate(self, prompt, max_tokens, temperature, stop_ids):
        from rollout.engine import Generation

        self.prompts.append(self.chat.tokenizer.decode(prompt))
        tokens = self.chat.tokenizer.encode("Sure.", add_special_tokens=False) + [self.chat.eot_id]
        return Generation(tokens, [-0.5] * len(tokens), [0] * len(tokens), "stop")


async def test_a_simulated_opening_is_written_once_per_group_with_the_tasks_attachment(tokenizer):
    task = ContextView(DocEditChatTask(DocEditChatSpec()), "be collaborative")
    client = OpeningClient()
    user = LLMUser(client, task.goal, "user-simulator", style="person")
    chat_tokenizer = ChatTokenizer(tokenizer)
    engine = Polite(chat_tokenizer)
    runner = EpisodeRunner(
        engine, chat_tokenizer, user, RolloutSpec(max_new_tokens=16, max_turns=2, max_total_tokens=600)
    )
    rollout = GroupRollout(
        runner,
        task,
        RewardSpec(mode="multiturn", window=1, num_futures=1),
        None,
        asyncio.Semaphore(4),
        "s",
        "job-open",
        openings=True,
    )
    await rollout.group(protocol.Task(job_id="job-open", task_id=3, example=0, group_size=3, dispatched_version=0))
    openings = [(p, o) for p, o in client.prompts if p[1]["content"] == NOT_STARTED]
    assert len(openings) == 1 and openings[0][1]["idempotency_key"] == "task3/opening"
    first_prompts = engine.prompts[:3]  # the three responses, before any future
    assert len(set(first_prompts)) == 1
    assert (
        first_prompts[0].index("be collaborative")
        < first_prompts[0].index("can u fix my note")
        < first_prompts[0].index(task.base.examples[0].document)
    )


def test_the_stand_in_user_opens_a_clarify_chat_vaguely():
    from devtools.provider_replies import reply_for

    system = "Your hidden goal (the assistant has not seen it):\nYou want a fruit, specifically mango."
    reply = reply_for([{"role": "system", "content": system}, {"role": "user", "content": NOT_STARTED}])
    assert json.loads(reply)["response"] == "I want a fruit."


@pytest.mark.parametrize(
    "task, says",
    [
        ({"name": "clarify", "opening": "simulator"}, "needs the LLM user simulator"),
        ({"name": "math_chat", "opening": "simulator", "contexts": "/x.jsonl"}, "set one"),
    ],
)
def test_simulated_openings_need_a_simulator_and_no_contexts_file(task, says):
    with pytest.raises(ValueError, match=says):
        TASK_SPECS[task["name"]].model_validate(task)


def test_the_preset_lets_the_simulator_open_only_where_it_plays_the_user_and_no_contexts_are_given():
    assert preset("math_chat").task.opening == "simulator"
    assert preset("clarify").task.opening == "task"
    with_contexts = parse_job_spec(
        {
            "model": {"path": "m"},
            "reward": {"preset": "collabllm"},
            "task": {"name": "code_chat", "contexts": "/c.jsonl"},
        }
    )
    assert with_contexts.task.opening == "task"


# ---- 2. R_ext by an LLM's extraction -------------------------------------------------------


class StandInCompleter:
    """The judge model played by the stand-in provider's reply function; counts calls."""

    def __init__(self, replies: list[str] | None = None) -> None:
        self.replies, self.calls = replies, []

    async def structured(self) -> bool:
        return False

    async def complete(self, messages, max_tokens, response_format):
        from devtools.provider_replies import reply_for

        self.calls.append(messages)
        return self.replies.pop(0) if self.replies is not None else reply_for(messages)


async def test_llm_extraction_reads_the_final_document_from_the_whole_conversation():
    judge = StandInCompleter()
    task = DocEditChatTask(DocEditChatSpec(extraction="llm"), judge)
    reference = task.reference(0)
    conversation = [
        {"role": "system", "content": "SECRET"},
        *chat("fix this", f"Here:\n```\n{reference}\n```", "thanks", "You're welcome!"),
    ]
    assert await task.score(0, conversation) == pytest.approx(1.0)
    ((system, request),) = judge.calls
    assert system["content"].startswith("You read a conversation") and "SECRET" not in request["content"]


async def test_llm_extraction_of_code_and_of_nothing():
    judge = StandInCompleter()
    task = CodeChatTask(CodeChatSpec(extraction="llm"), judge)
    solution = f"```python\n{task.reference(0)}```"
    assert await task.score(0, chat("write it", solution, "works", "Great!")) == 1.0
    assert await task.score(0, chat("write it", "Which names?", "a list", "Sure.")) == 0.0  # nothing delivered


async def test_an_unreadable_extraction_is_asked_again_then_raised_never_scored():
    from rollout.tasks.extraction import ExtractionError, extract

    again = StandInCompleter(["I think the document is fine.", '{"final": "the doc"}'])
    assert await extract(again, "document", chat("q", "a")) == "the doc" and len(again.calls) == 2
    with pytest.raises(ExtractionError, match="unreadable, twice"):
        await extract(StandInCompleter(["no", "still no"]), "document", chat("q", "a"))


def test_llm_extraction_needs_a_named_judge_model():
    with pytest.raises(ValueError, match="set reward.judge_model"):
        parse_job_spec({"model": {"path": "m"}, "task": {"name": "code_chat", "extraction": "llm"}})


def test_the_warm_start_fine_tunes_under_the_system_prompt_too(tiny_model, tokenizer, tmp_path):
    from learner.warm_start import load_demonstrations
    from services.config import ModelSpec, RLJob

    data = tmp_path / "warm.jsonl"
    rows = [
        chat("u", "a"),
        [{"role": "system", "content": "be collaborative"}, *chat("u", "a")],
        [{"role": "system", "content": "own prompt"}, *chat("u", "a")],
    ]
    data.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    spec = RLJob(model=ModelSpec(path=str(tiny_model)), task=ClarifySpec(system_prompt="be collaborative"))
    bare, written, own = load_demonstrations(str(data), spec)
    assert bare.tokens == written.tokens and bare.mask == written.mask  # as if the row had the prompt
    assert "own prompt" in tokenizer.decode(own.tokens) and "collaborative" not in tokenizer.decode(own.tokens)
