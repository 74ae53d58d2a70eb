"""A job spec: one model per kind of job (`rl`, `offline`, `generate`), picked by `kind`,
over the sections every kind shares."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, ClassVar, Literal, get_args

from pydantic import BaseModel, Field, Tag, TypeAdapter, model_validator

from services.config.common import FILE_MARK, JOB_NAME, TAG_FIELDS, Strict, discriminator
from services.config.sections import (
    BudgetSpec,
    EvalSpec,
    GenerateSpec,
    HealthRule,
    ModelSpec,
    RewardSpec,
    RolloutSpec,
    TrackingSpec,
    TrainSpec,
    WarmStartSpec,
)
from services.config.tasks import TASK_NAMES, TASK_SPECS, ClarifySpec, TaskSpec, task_name
from services.config.tools import TOOL_KINDS, ToolsSpec
from services.presets import PRESETS


class _JobBase(Strict):
    """What every kind of job names: the model, the task, and how to roll out, score and
    train. A job spec is one of the kinds below, picked by `kind` (`rl` when it is left out)."""

    name: str = Field("job", min_length=1, max_length=128, pattern=rf"^{JOB_NAME}$")
    model: ModelSpec
    task: TaskSpec = Field(
        ClarifySpec(), description="What the job plays: one model per task, picked by `task.name` (clarify if unset)."
    )
    rollout: RolloutSpec = RolloutSpec()
    reward: RewardSpec = RewardSpec()
    train: TrainSpec = TrainSpec()
    warm_start: WarmStartSpec = WarmStartSpec()
    tools: ToolsSpec | None = Field(None, description="Tools the policy may call between its replies.")
    tracking: TrackingSpec | None = Field(None, description="Experiment trackers (TensorBoard, W&B); none when unset.")
    budget: BudgetSpec = Field(BudgetSpec(), description="Caps on what its LLM calls cost; none when unset.")
    judge_weight: float = Field(
        1.0,
        gt=0.0,
        le=1000.0,
        description="This job's share of a judge upstream's budget against other jobs using it at the same time "
        "(2 vs 1: two thirds). Not reward.judge_weight, which weighs R_llm in the reward.",
    )
    uses_rollout_servers: ClassVar[bool] = True
    """Whether rollout servers play this kind's tasks (an offline job trains on a file)."""
    ranked_conversations: ClassVar[bool] = False
    """Whether rollout servers play a task as one conversation carried on by each turn's
    best response (`RankedRollout.ranked_conversation`) instead of a group of episodes."""
    trains_on_file: ClassVar[bool] = False
    """Whether the learner trains on `train.data` (an offline job's pairs)."""

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data):
        """`reward.preset`'s settings for the task, under what the spec sets itself."""
        if not isinstance(data, dict):
            return data
        reward, task = _given(data.get("reward")), _given(data.get("task"))
        preset = reward.get("preset", "none")
        model = TASK_SPECS.get(task_name(task))
        if preset == "none" or not isinstance(preset, str) or preset not in PRESETS or model is None:
            return data
        filled = PRESETS[preset](model, task)
        return data | {"reward": filled["reward"] | reward, "task": filled["task"] | task}

    @model_validator(mode="after")
    def _parts_agree(self) -> _JobBase:
        if self.rollout.max_total_tokens > self.model.max_model_len:
            raise ValueError("rollout.max_total_tokens must not exceed model.max_model_len")
        asks_judge = self.task.judge_model_use()
        if asks_judge is not None and not self.reward.judge_model:
            raise ValueError(f"{asks_judge}: set reward.judge_model")
        brings_tools = self.task.brings_tools
        if self.tools is not None and not brings_tools and not self.tools.tools and self.tools.file is None:
            raise ValueError("tools needs inline tools or a file (only a task with tools of its own, tau2, needs none)")
        if self.tools is not None and brings_tools and (self.tools.tools or self.tools.file):
            raise ValueError(f"a {self.task.name} task brings its own tools: tools sets only the parser and limits")
        if self.train.data and not self.trains_on_file:
            raise ValueError("train.data is read by offline jobs only (kind: offline)")
        return self

    def progress(self) -> tuple[int, str]:
        """How far the job goes and in what (what a progress bar counts)."""
        return self.train.num_steps, "step"

    def evaluation(self) -> EvalSpec | None:
        """The held-out evaluation the job asks for (only an RL job has an `eval` section)."""
        return None


class RLJob(_JobBase):
    """Rollout servers play episodes; the learner trains on them as they arrive (GRPO,
    REINFORCE, or online DPO with `train.algorithm: dpo`)."""

    kind: Literal["rl"] = "rl"
    health: list[HealthRule] = Field(
        default_factory=list,
        max_length=64,
        description="Rules on per-step metrics that warn or stop the job (e.g. zero_spread_share above 0.9 "
        "for 5 steps: the job trains on nothing).",
    )
    eval: EvalSpec | None = Field(
        None, description="Held-out evaluation every few steps and at the end; none when unset."
    )

    @model_validator(mode="after")
    def _held_out_is_held_out(self) -> RLJob:
        """Held-out examples the job could also train on are refused where the spec shows it."""
        if self.eval is not None:
            self.task.check_held_out(self.eval, self.train.seed)
        return self

    def evaluation(self) -> EvalSpec | None:
        return self.eval


class OfflineJob(_JobBase):
    """The learner alone trains DPO on a pairs file (`train.data`, a generate job's
    pairs.jsonl); no rollout server takes part."""

    kind: Literal["offline"]
    uses_rollout_servers: ClassVar[bool] = False
    trains_on_file: ClassVar[bool] = True

    @model_validator(mode="after")
    def _trains_dpo_on_a_file(self) -> OfflineJob:
        if self.train.algorithm != "dpo" or not self.train.data:
            raise ValueError("an offline job trains DPO on a pairs file: set train.algorithm: dpo and train.data")
        return self


class GenerateJob(_JobBase):
    """Rollout servers play simulated conversations, ranking each turn's responses by MR;
    the learner writes the best-response conversations (SFT data) and preference pairs."""

    kind: Literal["generate"]
    generate: GenerateSpec = GenerateSpec()
    ranked_conversations: ClassVar[bool] = True

    @model_validator(mode="after")
    def _ranks_by_mr(self) -> GenerateJob:
        if self.reward.mode != "multiturn":
            raise ValueError("a generate job ranks each turn's responses: reward.mode must be multiturn")
        return self

    def progress(self) -> tuple[int, str]:
        return self.generate.conversations, "conv"


JOB_KINDS = (RLJob, OfflineJob, GenerateJob)
KIND_NAMES = tuple(get_args(kind.model_fields["kind"].annotation)[0] for kind in JOB_KINDS)
"""The `kind` of each, which pydantic puts at the head of an error's location."""


JobSpec = Annotated[
    Annotated[RLJob, Tag("rl")] | Annotated[OfflineJob, Tag("offline")] | Annotated[GenerateJob, Tag("generate")],
    discriminator("kind", "rl", KIND_NAMES, "invalid_kind", "kind"),
]
"""A job spec: one model per kind, `kind` selecting (see `JOB_KINDS`)."""
_JOB_SPEC = TypeAdapter(JobSpec)


def parse_job_spec(data: object) -> RLJob | OfflineJob | GenerateJob:
    """A job spec from a mapping (or a spec), its kind's model picked by `kind`."""
    return _JOB_SPEC.validate_python(data)


def parse_job_spec_json(text: str | bytes) -> RLJob | OfflineJob | GenerateJob:
    return _JOB_SPEC.validate_json(text)


def written_location(loc: tuple[str | int, ...], error_type: str = "") -> tuple[str | int, ...]:
    """A validation error's location in a job spec as the spec is written. Pydantic puts the
    tag of the model a union picked after the field that holds it (the job's kind at the
    head, the task's name after `task`, a tool's kind after its index in `tools.tools`):
    those are left out. An error that the tag itself is wrong names the tag's field."""
    written = [
        part
        for i, part in enumerate(loc)
        if not (
            (i == 0 and part in KIND_NAMES)
            or (i > 0 and loc[i - 1] == "task" and part in TASK_NAMES)
            or (i > 0 and isinstance(loc[i - 1], int) and part in TOOL_KINDS)
        )
    ]
    tag = TAG_FIELDS.get(error_type)
    return (*written, tag) if tag else tuple(written)


def _given(section) -> dict:
    """The fields a job-spec section sets itself: a mapping as written, or a model's
    explicitly set fields; {} for anything else (validation reports it)."""
    if isinstance(section, dict):
        return section
    if isinstance(section, BaseModel):
        return {name: getattr(section, name) for name in section.model_fields_set}
    return {}


def file_fields(
    section: BaseModel, loc: tuple[str | int, ...] = ()
) -> Iterator[tuple[tuple[str | int, ...], BaseModel, str]]:
    """Every field set in `section` (a job spec) or in the sections inside it that names a file
    or folder the learner or a rollout server opens (declared with `file_field`): its
    location as the spec is written, the model holding it, and its name. A multi-tenant API
    confines them to `ApiSettings.path_roots`."""
    for name, info in type(section).model_fields.items():
        value = getattr(section, name)
        if isinstance(info.json_schema_extra, dict) and info.json_schema_extra.get(FILE_MARK):
            if value is not None:
                yield (*loc, name), section, name
        elif isinstance(value, BaseModel):
            yield from file_fields(value, (*loc, name))
        elif isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, BaseModel):
                    yield from file_fields(item, (*loc, name, index))
