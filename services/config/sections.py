"""The job spec's sections that every kind of job shares, except the task and the tools
(`tasks`, `tools`): the model, rollout, reward, training, warm start, generation, health
rules, held-out evaluation, trackers and the spend budget."""

from __future__ import annotations

import os
from typing import Literal, get_args

from pydantic import Field, ValidationInfo, field_validator, model_validator

from services.config.common import MODEL_NAME_CHARS, TEXT_CHARS, Strict, file_field


class ModelSpec(Strict):
    path: str = file_field(..., "Local Hugging Face model folder.", min_length=1)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Serving and weight-transfer dtype. auto: bfloat16 on CUDA, float32 on CPU. On CUDA the "
        "learner keeps fp32 weights and computes in bf16 for bfloat16 and float16 alike (fp16 compute would "
        "need loss scaling); float16 is then only what vLLM serves and the weights travel as.",
    )
    max_model_len: int = Field(1024, ge=64, le=131072)

    def resolved_dtype(self, on_cuda: bool) -> str:
        """`dtype` with auto decided for the device: bfloat16 on CUDA, float32 on CPU."""
        if self.dtype == "auto":
            return "bfloat16" if on_cuda else "float32"
        return self.dtype

    def local_folder(self) -> str:
        """`path`, checked where it is used (the API may not see the same files)."""
        if not os.path.isfile(os.path.join(self.path, "config.json")):
            raise FileNotFoundError(
                f"model.path {self.path!r} is not a model folder on this machine "
                "(Tandem loads local Hugging Face folders; it downloads nothing)"
            )
        return self.path


class RewardSpec(Strict):
    """How a sample is scored. R* = extrinsic_weight * R_ext - min(lambda * tokens, 1)
    + judge_weight * R_llm (+ the tool terms, ARTIST's composite, when the job has tools); `multiturn` mode averages
    R* over the futures of at most
    `window` more turns sampled after the response (window 0 is a next-turn reward):
    `num_futures` of them (`futures: fixed`), or, with `futures: adaptive`, `min_futures`
    first and more while their scores disagree (`rollout.rewards.multiturn.more_futures`),
    never more than `max_futures` for a response nor `num_futures` per response on average
    over its group."""

    preset: Literal["none", "collabllm"] = Field(
        "none",
        description=(
            "Fill in a published recipe's settings wherever the spec does not set them (services/presets.py); "
            "collabllm: the paper's MR (w 2, S 3, lambda by task, interactivity judge, future temperature, "
            "system prompt, person simulator)."
        ),
    )
    mode: Literal["episode", "multiturn"] = "episode"
    window: int = Field(2, ge=0, le=16, description="w: future turns per forward sample.")
    num_futures: int = Field(3, ge=1, le=64, description="S: forward samples per response (the mean, when adaptive).")
    futures: Literal["fixed", "adaptive"] = Field("fixed", description="How many futures each response gets.")
    min_futures: int = Field(2, ge=1, le=64, description="Adaptive: futures every response gets.")
    max_futures: int = Field(8, ge=1, le=64, description="Adaptive: most futures for one response.")
    futures_se_threshold: float = Field(
        0.05, ge=0.0, description="Adaptive: add futures while the standard error of a mean R* is above this."
    )
    adaptive_rule: Literal["others", "own"] = Field(
        "others",
        description=(
            "Adaptive: whose futures decide a response's count. others: the other responses' first futures (MR stays "
            "an unbiased estimate; up to num_futures each); own: its own, while they disagree (up to max_futures, "
            "within the group's allowance), which biases MR towards 0 and 1."
        ),
    )
    judge_mode: Literal["single", "group"] = Field(
        "single",
        description="single: one judge call per conversation; group: one call scores all futures of "
        "a response (falls back to single calls when the judge's list is unusable).",
    )
    judge_cache: bool = Field(True, description="Let the judge proxy answer a verdict it gave this job before.")
    token_penalty: float = Field(0.0, ge=0.0, le=1.0, description="lambda per token.")
    token_count: Literal["policy", "all"] = Field(
        "policy",
        description=(
            "Which tokens the penalty counts: policy, the tokens the policy generated from the scored response on; "
            "all, every token from the scored response on, user (and tool) turns included, as CollabLLM counts."
        ),
    )
    future_temperature: float | None = Field(
        None,
        gt=0.0,
        le=10.0,
        description=(
            "The policy's sampling temperature in forward-sampled futures; rollout.temperature when unset "
            "(CollabLLM: 0.6-0.8)."
        ),
    )
    extrinsic_weight: float = Field(1.0, ge=0.0)
    judge_rubric: str | None = Field(None, max_length=TEXT_CHARS, description="Judge-proxy rubric for R_llm.")
    judge_weight: float = Field(1.0, ge=0.0)
    judge_model: str | None = Field(
        None, max_length=MODEL_NAME_CHARS, description="Model name at the judge proxy; its default if unset."
    )
    judge_reference: bool = Field(
        False,
        description=(
            "Show the judge the task's reference answer with judge_rubric. Off by default, as in CollabLLM: an "
            "interactivity score that sees the answer leaks correctness into it. A rubric that needs a reference "
            "(accuracy) needs this on."
        ),
    )
    user_model: str = Field(
        "user-simulator",
        min_length=1,
        max_length=MODEL_NAME_CHARS,
        description="Model name at the judge proxy that plays the user (LLM-user tasks).",
    )
    tool_format_weight: float = Field(
        0.0,
        ge=0.0,
        description="ARTIST's format term: this much when every tool call of the conversation could be read.",
    )
    tool_success_weight: float = Field(
        0.0,
        ge=0.0,
        description="ARTIST's tool-execution term: this much times the share of the conversation's "
        "tool calls that ran without error (0 without calls).",
    )
    scale_advantage_by_std: bool = True

    @model_validator(mode="after")
    def _futures_bounds(self) -> RewardSpec:
        if self.min_futures > self.max_futures:
            raise ValueError("reward.min_futures must not exceed reward.max_futures")
        return self


class RolloutSpec(Strict):
    group_size: int = Field(8, ge=1, le=256, description="n responses per context (GRPO).")
    temperature: float = Field(1.0, gt=0.0, le=10.0)
    max_new_tokens: int = Field(48, ge=1, le=32768, description="Per assistant turn.")
    max_turns: int = Field(3, ge=1, le=64, description="Assistant turns per conversation.")
    max_total_tokens: int = Field(512, ge=16, le=131072)
    pause_mode: Literal["abort", "keep"] = "abort"
    tokenization_check: Literal["strict", "ignore_strippable", "off"] = "strict"


class LossSpec(Strict):
    """The policy loss's settings (learner/loss.py). A section of its own in code only: the
    job spec holds them flat in `train`, which inherits them."""

    algorithm: Literal["grpo", "reinforce", "dpo"] = Field(
        "grpo",
        description=(
            "dpo: each group's best and worst response by reward form a preference pair (online DPO); "
            "an `offline` job trains on a pairs file instead."
        ),
    )
    eps_low: float = Field(0.2, ge=0.0, le=1.0)
    eps_high: float = Field(0.28, ge=0.0, le=10.0)
    correction: Literal["tis", "mis", "none"] = "tis"
    correction_level: Literal["token", "sequence"] = "token"
    correction_cap: float = Field(2.0, gt=1.0)
    kl_coef: float = Field(0.0, ge=0.0)
    kl_estimator: Literal["k1", "k3"] = "k3"
    normalise: Literal["token", "sequence"] = "token"
    dpo_beta: float = Field(0.1, gt=0.0, le=100.0, description="DPO: the implicit reward's scale.")
    dpo_loss: Literal["sigmoid", "ipo"] = "sigmoid"
    pair_margin: float = Field(
        0.0,
        ge=0.0,
        description=(
            "DPO: the least reward gap between the chosen and the rejected response for a pair; "
            "groups without one train nothing."
        ),
    )


class TrainSpec(LossSpec):
    num_steps: int = Field(40, ge=1, le=1_000_000)
    batch_size: int = Field(8, ge=1, le=65536, description="Trajectory groups per step.")
    num_minibatches: int = Field(1, ge=1, le=1024, description="Optimizer steps per batch.")
    lr: float = Field(1e-3, gt=0.0, le=1.0)
    weight_decay: float = Field(0.0, ge=0.0)
    max_grad_norm: float = Field(1.0, gt=0.0)
    max_staleness: int = Field(1, ge=0, le=1024, description="eta; 0 is synchronous RL.")
    stragglers: Literal["drop", "wait", "admit"] = Field(
        "admit",
        description=(
            "A group older than max_staleness when the learner gets to it: `admit` it late, its tokens weighted by "
            "the behaviour correction (`correction`) like any other's (the default: no finished group and none of "
            "its judge spend is thrown away, and the slow, long conversations are trained as often as the fast); "
            "`drop` it and dispatch its task again; or `wait` for it (batches keep places for groups about to pass "
            "the bound, so none passes it)."
        ),
    )
    max_token_staleness: int | None = Field(
        None,
        ge=0,
        le=1024,
        description=(
            "`stragglers: admit` only: a trained token sampled more than this many versions before the step that "
            "trains it is masked out of the loss, the rest of its group trained; a group left with no trained "
            "token is refused as stale and its task dispatched again. None: no token is too old."
        ),
    )
    max_tokens_per_rank: int = Field(
        16384, ge=64, description="Tokens in one micro-batch; padded rows count rows x their longest sequence."
    )
    packing: Literal["varlen", "mask", "padded"] = Field(
        "varlen",
        description=(
            "How a micro-batch's sequences share the learner: `varlen` packs them into one row and attends within "
            "each sequence (torch's varlen kernel on CUDA in 16-bit, per-sequence SDPA elsewhere); `mask` packs them "
            "and lets transformers build a dense block-diagonal mask over the row (costs the row's square); "
            "`padded` gives each its own row, padded to the longest. A model whose packed logprobs differ from its "
            "unpacked ones beyond the compute dtype's tolerance is trained padded, with a warning."
        ),
    )
    checkpoint_every: int = Field(0, ge=0, description="Steps between checkpoints; 0 = off.")
    checkpoint_every_s: float = Field(
        1800.0,
        ge=0.0,
        allow_inf_nan=False,  # infinity would read as "by time" and never be due: 0 says off
        description=(
            "Seconds between checkpoints, written after the first step that ends this long after the last one "
            "(whichever of this and checkpoint_every comes first); 0 = off. RL and offline jobs honour both (a "
            "generate job commits every batch instead). A FAILED or CANCELLED job resumes from its newest "
            "checkpoint (`tandem resume`)."
        ),
    )
    export_every: int = Field(
        0,
        ge=0,
        description=(
            "Steps between servable policy folders (runs/<job>/policies/step-<N>), to evaluate the policy as it "
            "trains; 0 = only the final one (runs/<job>/policy)."
        ),
    )
    stall_timeout_s: float = Field(
        1800.0,
        gt=0,
        le=7 * 86400,
        description="With no step and no admitted group for this long (paused time aside), the job fails, "
        "naming what the learner saw meanwhile (task failures, dead letters, rollout servers).",
    )
    max_dead_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="The job fails when more than this share of its latest max(8, 2 x batch_size) tasks to end "
        "went to the dead stream (a failure no retry fixes); 1 = never.",
    )
    seed: int = 0
    data: str | None = file_field(
        None,
        description=(
            "offline jobs: the JSONL of preference pairs to train on (a generate job's pairs.jsonl); "
            "batch_size pairs per step, reshuffled every pass."
        ),
    )

    @field_validator("max_token_staleness")
    @classmethod
    def _token_bound_applies(cls, limit: int | None, info: ValidationInfo) -> int | None:
        """`max_token_staleness` acts in `admit` mode only, and never below eta: a token
        within the bound the dispatcher keeps is never too old. (A field validator, so a
        422 names this field; the two it reads are declared before it.)"""
        if limit is not None and info.data.get("stragglers") != "admit":
            raise ValueError("max_token_staleness applies only with stragglers: admit")
        eta = info.data.get("max_staleness")
        if limit is not None and eta is not None and limit < eta:
            raise ValueError(f"max_token_staleness {limit} is below max_staleness {eta}")
        return limit


class WarmStartSpec(Strict):
    steps: int = Field(0, ge=0, le=100_000, description="SFT steps before RL; 0 = none.")
    batch_size: int = Field(32, ge=1, le=65536)
    lr: float = Field(3e-3, gt=0.0, le=1.0)
    data: str | None = file_field(
        None,
        description="JSONL of {messages: [...]}, required when steps > 0 "
        "(`tandem demonstrations` writes a built-in task's).",
    )


class GenerateSpec(Strict):
    """A `generate` job: simulated conversations played with the job's policy; at each
    assistant turn `rollout.group_size` responses are sampled and scored by the job's reward
    (MR), and the best one carries the conversation on. Written: the best-response
    conversations (SFT data) and, per turn, the best and the worst response as a pair."""

    conversations: int = Field(64, ge=1, le=1_000_000, description="Conversations to play (one task each).")
    pair_margin: float = Field(
        0.0, ge=0.0, description=("The least reward gap for a turn's best and worst response to be written as a pair.")
    )


HealthMetric = Literal[
    "reward_mean",
    "success",
    "zero_spread_share",
    "well_formed",
    "futures_malformed",
    "malformed_truncated",
    "malformed_wrong_stop",
    "malformed_special_token",
    "malformed_empty",
    "entropy",
    "is_capped_tokens",
    "is_weight_max",
    "mismatch_kl",
    "clip_fraction",
    "grad_norm",
    "skipped_updates",
    "nonfinite_updates",
    "kl_ref",
    "staleness_mean",
]
"""A per-step history metric a health rule can watch."""
HEALTH_METRICS: tuple[str, ...] = get_args(HealthMetric)


class HealthRule(Strict):
    """A condition on one per-step metric; when it has held for `steps` consecutive RL steps
    the learner warns (once per such stretch) or stops the job, saying which rule and why."""

    metric: HealthMetric
    above: float | None = Field(None, description="Holds when the metric is greater than this.")
    below: float | None = Field(None, description="Holds when the metric is less than this.")
    steps: int = Field(5, ge=1, le=10_000, description="Consecutive RL steps it must hold.")
    action: Literal["warn", "stop"] = "warn"

    @model_validator(mode="after")
    def _one_bound(self) -> HealthRule:
        if (self.above is None) == (self.below is None):
            raise ValueError("a health rule sets exactly one of above and below")
        return self


class EvalSpec(Strict):
    """Held-out evaluation inside an RL job (`services.held_out` says which examples): rollout
    servers play each held-out example as one whole conversation with the policy being
    trained, never training on it, and the learner records the means per policy version."""

    every: int = Field(
        10,
        ge=0,
        le=1_000_000,
        description="RL steps between evaluations, the warm start's (version 0) first; 0: only the final one.",
    )
    final: bool = Field(True, description="Evaluate the final policy before the job ends.")
    examples: int = Field(
        32,
        ge=1,
        le=100_000,
        description="Held-out conversations per evaluation (at most a split's tasks). Its share of the "
        "rollout time is about examples x trials / (every x batch_size x group_size), plus the first and last rounds.",
    )
    trials: int = Field(
        1, ge=1, le=16, description="Plays of each example per evaluation: pass^k is reported for k up to trials."
    )
    seed: int = Field(
        10_000,
        description="The seed a generated task's held-out examples are generated from (not train.seed).",
    )
    data: str | None = file_field(
        None,
        description="A task read from a file: a JSONL file of held-out rows; unset: the rows of task.data (or "
        "the built-in fixture) after the first task.num_examples, which train.",
    )
    split: Literal["train", "test", "base"] = Field(
        "test",
        description="A task played from a benchmark's split: the split evaluated (one the job does not train on).",
    )
    timeout_s: float = Field(
        900.0,
        gt=0,
        le=86_400,
        description="The longest the job waits for its final evaluation after its last step; what finished by "
        "then is recorded, marked incomplete.",
    )


class WandbSpec(Strict):
    project: str = Field("tandem", pattern=r"^[A-Za-z0-9_.-]{1,128}$", description="The W&B project of the run.")
    mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline: the run stays in the job's folder (`wandb sync` uploads it later); online: the "
        "learner sends it as it goes, which the operator allows (TANDEM_ALLOW_ONLINE_TRACKING) and keys.",
    )


class TrackingSpec(Strict):
    """Experiment trackers the job's numbers also go to, from the learner, in the job's run
    folder (`runs/<job>/tensorboard`, `runs/<job>/wandb`): the spec as config, every step's and
    held-out evaluation's numbers, and held-out conversations as a table."""

    tensorboard: bool = Field(False, description="TensorBoard event files.")
    wandb: WandbSpec | None = Field(None, description="A Weights & Biases run (offline unless allowed).")
    conversations: int = Field(
        8, ge=0, le=256, description="Held-out conversations per evaluation put in the trackers' table."
    )


class BudgetSpec(Strict):
    """A cap on what the job's LLM calls may cost (the judge proxy's bill, `judge_proxy.spend`).
    The proxy makes no call whose dearest cost would take the bill past a cap (402
    `spend_cap_reached`); an RL job stops admitting tasks once the ones it has admitted would
    spend what is left, trains them, and ends SUCCEEDED with the reason."""

    usd: float | None = Field(None, gt=0, description="At most this many US dollars (upstreams' prices).")
    tokens: int | None = Field(None, gt=0, description="At most this many provider tokens, prompt and completion.")

    @property
    def limits(self) -> dict[str, float | int]:
        """The caps set, by the bill's field they hold (`usd`, `tokens`); empty: no cap."""
        return {name: value for name, value in (("usd", self.usd), ("tokens", self.tokens)) if value is not None}
