"""The job spec's `task` section: one model per task, picked by `name` (`clarify` when it is
left out). Each model holds the fields its task reads and nothing else, and declares what
the rest of the system needs to know about the task as class-level facts (`TaskFacts`
below, and the held-out examples it evaluates on), so that no other module asks a task's
name. The rollout server finds the code that plays a task by the same name
(`rollout.tasks.TASKS`).

Adding a task: a model here (a subclass of one of the bases, `name` a one-value Literal)
added to `TaskSpec`, and its folder under `rollout/tasks/`, named in `rollout.tasks.TASKS`.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, NamedTuple, get_args

from pydantic import Field, Tag, model_validator

from services.config.common import TEXT_CHARS, Strict, discriminator, file_field, tag_reader
from services.config.sections import EvalSpec

Tau2Domain = Literal["mock", "airline", "retail"]
"""A τ²-bench domain a tau2 task plays (telecom's user acts through tools of their own)."""
TAU2_DOMAINS: tuple[str, ...] = get_args(Tau2Domain)


class CollabDefaults(NamedTuple):
    """What `reward.preset: collabllm` sets for a task (`services.presets`), from the paper's
    per-task settings."""

    token_penalty: float = 5e-4
    """lambda per token (document editing's lengths vary most: 1e-4)."""
    future_temperature: float = 0.8
    """The policy's temperature in forward-sampled futures (math and code: 0.6)."""
    simulator_opens: bool = False
    """Whether the simulator writes the opening request (the paper's three tasks)."""


class HeldOutTask(NamedTuple):
    """Where a job's held-out examples come from (`services.held_out`)."""

    task: TaskBase
    """The task section the held-out task set is loaded from."""
    seed: int
    """The seed it is loaded with (generated tasks draw their examples from it)."""
    examples: tuple[int, ...]
    """The held-out examples' numbers in that task set."""


class TaskBase(Strict):
    """What every task declares. The class-level facts are read by the job spec's checks,
    the presets and the rollout server; none is a field a spec sets."""

    name: str
    num_examples: int = Field(512, ge=1, le=1_000_000, description="Examples the job trains on.")

    needs_sandbox: ClassVar[bool] = False
    """Whether its score runs model-written code (the rollout server checks its sandbox first)."""
    brings_tools: ClassVar[bool] = False
    """Whether the task has tools of its own (the job's `tools` section then sets only the
    parser and limits)."""
    demonstrated: ClassVar[bool] = False
    """Whether the task writes its own warm-start demonstrations (`tandem demonstrations`,
    `rollout.tasks.demonstrations`)."""
    collabllm: ClassVar[CollabDefaults] = CollabDefaults()

    def judge_model_use(self) -> str | None:
        """What in the task asks `reward.judge_model` by name (None: nothing does)."""
        return None

    def system_message(self) -> str | None:
        """The system prompt put before every context the policy answers (None: the task's own)."""
        return None

    def simulator_opens(self) -> bool:
        """Whether the LLM user simulator writes each training conversation's first request."""
        return False

    def simulator_style(self) -> Literal["cooperative", "person"]:
        """How the LLM user simulator plays the goal, where it plays the user."""
        return "cooperative"

    def check_held_out(self, evaluation: EvalSpec, train_seed: int) -> None:
        """ValueError when the job's `eval` section would evaluate on what it trains on."""

    def held_out(self, evaluation: EvalSpec, train_seed: int) -> HeldOutTask:
        """The held-out examples a job with this task and `evaluation` plays."""
        raise NotImplementedError


class ChatTaskBase(TaskBase):
    """A task whose conversations open from its data and whose user is played from its goal:
    its contexts can be seen through a system prompt or other conversations' turns, and the
    LLM user simulator's manner and openings can be chosen."""

    system_prompt: str | None = Field(
        None,
        max_length=TEXT_CHARS,
        description=(
            "A system message before every context (`reward.preset: collabllm` sets CollabLLM's collaborative "
            "prompt); the user simulator and the judge never see it."
        ),
    )
    contexts: str | None = file_field(
        None,
        description=(
            "JSONL of conversations ({messages, example}, e.g. a generate job's sft.jsonl): every prefix ending "
            "with a user turn becomes a context, so every turn j is trained; num_examples caps how many."
        ),
    )
    simulator: Literal["cooperative", "person"] = Field(
        "cooperative",
        description=(
            "How the LLM user simulator plays the goal: cooperative (truthful, forthcoming when asked) or person "
            "(CollabLLM's: minimal effort, preferences, occasional mistakes, ends when satisfied)."
        ),
    )
    opening: Literal["task", "simulator"] = Field(
        "task",
        description=(
            "Who writes a training conversation's first request: the task's data, or the LLM user simulator from "
            "the goal (CollabLLM), once per group; the task's own material (a document to edit) is attached. "
            "Evaluation keeps the task's openings."
        ),
    )

    @model_validator(mode="after")
    def _one_source_of_openings(self) -> ChatTaskBase:
        if self.opening == "simulator" and self.contexts is not None:
            raise ValueError("task.opening: simulator writes openings, task.contexts brings its own: set one")
        return self

    def system_message(self) -> str | None:
        return self.system_prompt

    def simulator_opens(self) -> bool:
        return self.opening == "simulator"

    def simulator_style(self) -> Literal["cooperative", "person"]:
        return self.simulator

    def bare(self) -> dict:
        """The fields that make its held-out copy play the task's own openings (a job's
        contexts and simulator-written openings are for training; its system prompt stays,
        since the policy is trained under it)."""
        return {"contexts": None, "opening": "task"}


class GeneratedTaskBase(ChatTaskBase):
    """A synthetic task: its examples are generated from a seed, and a rule-based user that
    knows each example's answer plays the user unless `user: llm` says otherwise."""

    num_examples: int = Field(512, ge=1, le=1_000_000, description="Examples generated from train.seed.")
    demonstrated: ClassVar[bool] = True
    user: Literal["auto", "llm"] = Field(
        "auto",
        description="Who plays the user: auto, the task's rule-based user; llm, the LLM user simulator through "
        "the judge proxy (reward.user_model).",
    )

    @model_validator(mode="after")
    def _openings_need_a_simulator(self) -> GeneratedTaskBase:
        if self.opening == "simulator" and self.user == "auto":
            raise ValueError(
                f"task.opening: simulator needs the LLM user simulator; {self.name} plays its "
                "rule-based user unless task.user is llm"
            )
        return self

    def check_held_out(self, evaluation: EvalSpec, train_seed: int) -> None:
        if evaluation.seed == train_seed:
            raise ValueError("eval.seed must differ from train.seed: the held-out examples would be the trained ones")

    def held_out(self, evaluation: EvalSpec, train_seed: int) -> HeldOutTask:
        """`eval.examples` examples generated from `eval.seed`. Two seeds can still draw the
        same request by chance, as two draws of a benchmark's split can; the examples are
        never the trained list itself."""
        held = self.model_copy(update=self.bare() | {"num_examples": evaluation.examples})
        return HeldOutTask(held, evaluation.seed, tuple(range(evaluation.examples)))


class ClarifySpec(GeneratedTaskBase):
    """Vague requests whose hidden goal a rule-based user reveals when asked: the policy
    learns to ask before it answers (`rollout.tasks.clarify`)."""

    name: Literal["clarify"] = "clarify"
    ask_share: float = Field(0.3, ge=0.0, le=1.0, description="Share of asking dialogues in the warm start.")
    followup_share: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Share of contexts that already hold the question and the user's answer, "
        "so the turn after asking is trained too (CollabLLM trains every turn j).",
    )

    def bare(self) -> dict:
        return super().bare() | {"followup_share": 0.0}


class MultiplySpec(GeneratedTaskBase):
    """Multiplications the policy may work out with the calculator tool, one answer each
    (`rollout.tasks.multiply`)."""

    name: Literal["multiply"] = "multiply"


class FixtureTaskBase(ChatTaskBase):
    """A task read from a JSONL file of openings, goals and references (or its built-in
    fixture); the LLM user simulator plays the goal."""

    data: str | None = file_field(None, "JSONL file; the built-in fixture when unset.")
    num_examples: int = Field(512, ge=1, le=1_000_000, description="The first N rows of the file train.")
    collabllm: ClassVar[CollabDefaults] = CollabDefaults(simulator_opens=True)

    def held_out(self, evaluation: EvalSpec, train_seed: int) -> HeldOutTask:
        """The rows of `eval.data`, or, without it, the rows of the training file after the
        first `num_examples` (those train)."""
        if evaluation.data is not None:
            held = self.model_copy(update=self.bare() | {"data": evaluation.data, "num_examples": evaluation.examples})
            return HeldOutTask(held, train_seed, tuple(range(evaluation.examples)))
        first = self.num_examples
        held = self.model_copy(update=self.bare() | {"num_examples": first + evaluation.examples})
        return HeldOutTask(held, train_seed, tuple(range(first, first + evaluation.examples)))


class MathChatSpec(FixtureTaskBase):
    """MATH-Chat: a maths problem asked vaguely, scored on its final answer (`rollout.tasks.math_chat`)."""

    name: Literal["math_chat"] = "math_chat"
    metric: Literal["exact_match", "judge"] = Field(
        "exact_match",
        description="Exact match of the final answer, or the judge's accuracy rubric (binary, as the references are).",
    )
    collabllm: ClassVar[CollabDefaults] = CollabDefaults(future_temperature=0.6, simulator_opens=True)


class DeliverableTaskBase(FixtureTaskBase):
    """A task whose conversation delivers a document or a program, which R_ext compares with
    the reference once it is found in the conversation."""

    extraction: Literal["rule", "llm"] = Field(
        "rule",
        description=(
            "How R_ext finds the final document or code in a conversation: rule, the last fenced block of any "
            "assistant reply; llm, an extraction call to reward.judge_model through the judge proxy (CollabLLM), "
            "for replies that do not fence what they deliver."
        ),
    )

    def judge_model_use(self) -> str | None:
        return "task.extraction: llm asks the judge model by name" if self.extraction == "llm" else None


class DocEditChatSpec(DeliverableTaskBase):
    """Document editing: the user wants a document rewritten to a goal; scored by BLEU
    against the reference (`rollout.tasks.doc_edit_chat`)."""

    name: Literal["doc_edit_chat"] = "doc_edit_chat"
    collabllm: ClassVar[CollabDefaults] = CollabDefaults(token_penalty=1e-4, simulator_opens=True)


class CodeChatSpec(DeliverableTaskBase):
    """Programming: the delivered program is run against the reference's tests in the
    sandbox (`rollout.tasks.code_chat`)."""

    name: Literal["code_chat"] = "code_chat"
    needs_sandbox: ClassVar[bool] = True
    collabllm: ClassVar[CollabDefaults] = CollabDefaults(future_temperature=0.6, simulator_opens=True)


class Tau2Spec(TaskBase):
    """A τ²-bench domain: its tasks, tools, user brief and verdict from the benchmark's package
    (`rollout.tasks.tau2`). It brings its own context (the domain's policy, the benchmark's
    greeting), so it has no system prompt, contexts or simulator-written openings."""

    name: Literal["tau2"] = "tau2"
    domain: Tau2Domain = Field(
        description="The benchmark's domain (telecom, whose user acts through tools of their own, is not supported)."
    )
    split: Literal["train", "test", "base"] = Field(
        "train",
        description="The domain's task split (base: all its tasks; the mock domain's train and test are "
        "Tandem's, 6 and 3 of its 9 tasks).",
    )
    num_examples: int = Field(
        512, ge=1, le=1_000_000, description="Tasks of the split played: all of them unless set lower."
    )
    brings_tools: ClassVar[bool] = True

    @model_validator(mode="before")
    @classmethod
    def _examples_are_its_split(cls, data):
        """The examples are the split's tasks: `num_examples` is the split's size unless set
        lower (the learner draws examples from it), and never more."""
        if not isinstance(data, dict) or data.get("domain") not in TAU2_DOMAINS:
            return data  # field validation reports what is wrong
        split = data.get("split", "train")
        if split not in ("train", "test", "base"):
            return data
        from services.tau2_splits import task_ids

        size = len(task_ids(data["domain"], split))
        given = data.get("num_examples", size)
        if isinstance(given, int) and not isinstance(given, bool) and given > size:
            raise ValueError(
                f"task.num_examples {data['num_examples']}: the {data['domain']} {split} split has {size} tasks"
            )
        return {"num_examples": size} | data

    def check_held_out(self, evaluation: EvalSpec, train_seed: int) -> None:
        if "base" in (self.split, evaluation.split):
            raise ValueError("tau2: the base split holds every task, so nothing in it is held out: evaluate test")
        if evaluation.split == self.split:
            raise ValueError(f"eval.split {evaluation.split!r} is the split the job trains on")

    def held_out(self, evaluation: EvalSpec, train_seed: int) -> HeldOutTask:
        """The tasks of `eval.split`, a split the job does not train on."""
        held = Tau2Spec.model_validate({"domain": self.domain, "split": evaluation.split})
        count = min(evaluation.examples, held.num_examples)
        return HeldOutTask(held.model_copy(update={"num_examples": count}), train_seed, tuple(range(count)))


task_name = tag_reader("name", "clarify")
"""The task a section is (`clarify` when a mapping leaves `name` out)."""

_TASK_MODELS = (ClarifySpec, MultiplySpec, MathChatSpec, DocEditChatSpec, CodeChatSpec, Tau2Spec)
TASK_NAMES = tuple(model.model_fields["name"].default for model in _TASK_MODELS)
"""Every task's name, which pydantic puts after `task` in an error's location."""

TaskSpec = Annotated[
    Annotated[ClarifySpec, Tag("clarify")]
    | Annotated[MultiplySpec, Tag("multiply")]
    | Annotated[MathChatSpec, Tag("math_chat")]
    | Annotated[DocEditChatSpec, Tag("doc_edit_chat")]
    | Annotated[CodeChatSpec, Tag("code_chat")]
    | Annotated[Tau2Spec, Tag("tau2")],
    discriminator("name", "clarify", TASK_NAMES, "invalid_task_name", "task.name"),
]
"""A job's task section: the model of the task `name` picks."""
TASK_SPECS: dict[str, type[TaskBase]] = dict(zip(TASK_NAMES, _TASK_MODELS, strict=True))
