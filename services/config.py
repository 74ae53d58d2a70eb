"""One configuration schema for every process: the job spec users submit and each
process's settings. Pydantic only, importable without torch or vLLM.

Bounds live in `Field(...)` so a bad value is rejected with the field's name (the API
turns that into a 422 that names the field).
"""

from __future__ import annotations

import os
import re
from typing import Annotated, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.presets import PRESETS

JOB_NAME = r"[A-Za-z0-9_.-]{1,128}"
"""A job's name (a job spec's `name`); job ids are a name, a dash and 8 hex digits."""
PATH_CHARS = 4096
"""The longest file path a job spec may name (Linux's PATH_MAX)."""
TEXT_CHARS = 8000
"""The longest free text a job spec may carry in one field (a prompt, a rubric, a description)."""
MODEL_NAME_CHARS = 256
"""The longest model name a job spec may ask the judge proxy for."""


class _Strict(BaseModel):
    """Job-spec sections: unknown fields and coercions (`false` for an integer) are errors,
    so the API accepts exactly what its OpenAPI schema says."""

    model_config = ConfigDict(extra="forbid", strict=True)


class ModelSpec(_Strict):
    path: str = Field(min_length=1, max_length=PATH_CHARS, description="Local Hugging Face model folder.")
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


TAU2_DOMAINS = ("mock", "airline", "retail")
"""The τ²-bench domains a tau2 task plays (telecom's user acts through tools of their own)."""


class TaskSpec(_Strict):
    name: Literal["clarify", "math_chat", "doc_edit_chat", "code_chat", "multiply", "tau2"] = Field(
        "clarify",
        description="tau2: a τ²-bench domain (`domain`, `split`), its tools, user and verdict from the "
        "benchmark's package (`rollout.tasks.tau2`).",
    )
    domain: Literal[TAU2_DOMAINS] | None = Field(
        None,
        description="tau2: the benchmark's domain (telecom, whose user acts through tools of their own, is "
        "not supported).",
    )
    split: Literal["train", "test", "base"] = Field(
        "train",
        description="tau2: the domain's task split (base: all its tasks; the mock domain's train and "
        "test are Tandem's, 6 and 3 of its 9 tasks).",
    )
    data: str | None = Field(None, max_length=PATH_CHARS, description="JSONL file; the built-in fixture when unset.")
    num_examples: int = Field(
        512,
        ge=1,
        le=1_000_000,
        description="clarify: examples generated; data tasks: the first N rows of the file.",
    )
    ask_share: float = Field(0.3, ge=0.0, le=1.0, description="clarify: share of asking dialogues in the warm start.")
    followup_share: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="clarify: share of contexts that already hold the question and the user's answer, "
        "so the turn after asking is trained too (CollabLLM trains every turn j).",
    )
    user: Literal["auto", "llm"] = Field(
        "auto",
        description="Who plays the user: `auto` is the task's rule-based user where it has one (clarify) "
        "and the LLM user simulator otherwise; `llm` is always the simulator, through the judge "
        "proxy (reward.user_model).",
    )
    metric: Literal["exact_match", "judge"] = Field(
        "exact_match",
        description="math_chat: exact match of the final answer, or the judge's accuracy rubric "
        "(binary, as the references are).",
    )
    system_prompt: str | None = Field(
        None,
        max_length=TEXT_CHARS,
        description=(
            "A system message before every context (`reward.preset: collabllm` sets CollabLLM's collaborative "
            "prompt); the user simulator and the judge never see it."
        ),
    )
    contexts: str | None = Field(
        None,
        max_length=PATH_CHARS,
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
    extraction: Literal["rule", "llm"] = Field(
        "rule",
        description=(
            "doc_edit_chat and code_chat: how R_ext finds the final document or code in a conversation: rule, the "
            "last fenced block of any assistant reply; llm, an extraction call to reward.judge_model through the "
            "judge proxy (CollabLLM), for replies that do not fence what they deliver."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _tau2_examples_are_its_split(cls, data):
        """A tau2 task's examples are its split's tasks: `num_examples` is the split's size
        unless set lower (the learner draws examples from it), and never more."""
        if (
            not isinstance(data, dict)
            or data.get("name") != "tau2"
            or data.get("domain") not in TAU2_DOMAINS
            or data.get("split", "train") not in ("train", "test", "base")
        ):
            return data  # field validation reports what is wrong
        from services.tau2_splits import task_ids

        size = len(task_ids(data["domain"], data.get("split", "train")))
        if data.get("num_examples", size) > size:
            raise ValueError(
                f"task.num_examples {data['num_examples']}: the {data['domain']} "
                f"{data.get('split', 'train')} split has {size} tasks"
            )
        return {"num_examples": size} | data

    @model_validator(mode="after")
    def _openings_need_a_simulator(self) -> TaskSpec:
        if self.opening == "simulator" and self.user == "auto" and self.name in ("clarify", "multiply"):
            raise ValueError(
                f"task.opening: simulator needs the LLM user simulator; {self.name} plays its "
                "rule-based user unless task.user is llm"
            )
        if self.opening == "simulator" and self.contexts is not None:
            raise ValueError("task.opening: simulator writes openings, task.contexts brings its own: set one")
        if (self.name == "tau2") != (self.domain is not None):
            raise ValueError("task.domain names a τ² domain, and only a tau2 task sets one")
        if self.name == "tau2" and (self.opening != "task" or self.contexts is not None or self.system_prompt):
            raise ValueError(
                "a tau2 task brings its own context (the domain's policy, the benchmark's greeting): "
                "task.opening, task.contexts and task.system_prompt are not for it"
            )
        return self


class RewardSpec(_Strict):
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


class RolloutSpec(_Strict):
    group_size: int = Field(8, ge=1, le=256, description="n responses per context (GRPO).")
    temperature: float = Field(1.0, gt=0.0, le=10.0)
    max_new_tokens: int = Field(48, ge=1, le=32768, description="Per assistant turn.")
    max_turns: int = Field(3, ge=1, le=64, description="Assistant turns per conversation.")
    max_total_tokens: int = Field(512, ge=16, le=131072)
    pause_mode: Literal["abort", "keep"] = "abort"
    tokenization_check: Literal["strict", "ignore_strippable", "off"] = "strict"


class LossSpec(_Strict):
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
    data: str | None = Field(
        None,
        max_length=PATH_CHARS,
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


class WarmStartSpec(_Strict):
    steps: int = Field(0, ge=0, le=100_000, description="SFT steps before RL; 0 = none.")
    batch_size: int = Field(32, ge=1, le=65536)
    lr: float = Field(3e-3, gt=0.0, le=1.0)
    data: str | None = Field(
        None,
        max_length=PATH_CHARS,
        description="JSONL of {messages: [...]}, required when steps > 0 "
        "(`tandem demonstrations` writes a built-in task's).",
    )


class GenerateSpec(_Strict):
    """A `generate` job: simulated conversations played with the job's policy; at each
    assistant turn `rollout.group_size` responses are sampled and scored by the job's reward
    (MR), and the best one carries the conversation on. Written: the best-response
    conversations (SFT data) and, per turn, the best and the worst response as a pair."""

    conversations: int = Field(64, ge=1, le=1_000_000, description="Conversations to play (one task each).")
    pair_margin: float = Field(
        0.0, ge=0.0, description=("The least reward gap for a turn's best and worst response to be written as a pair.")
    )


TOOL_NAME = r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$"
CATALOG_NAME = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$"


class McpServerSpec(_Strict):
    """Where an MCP server is: a command started as a child speaking MCP over stdio, or the
    URL of a streamable-HTTP endpoint. Tools naming the same server share one session."""

    command: list[Annotated[str, Field(max_length=PATH_CHARS)]] | None = Field(
        None, min_length=1, max_length=256, description="stdio: the program and its arguments."
    )
    env: dict[Annotated[str, Field(max_length=256)], Annotated[str, Field(max_length=PATH_CHARS)]] = Field(
        default_factory=dict, max_length=64, description="stdio: extra environment for the program."
    )
    url: str | None = Field(
        None, pattern=r"^https?://", max_length=PATH_CHARS, description="Streamable HTTP: the endpoint's URL."
    )

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerSpec:
        if (self.command is None) == (self.url is None):
            raise ValueError("an MCP server sets exactly one of command (stdio) and url (streamable HTTP)")
        return self


class ToolCatalog(_Strict):
    """The operator's tool catalogue (`TANDEM_TOOL_CATALOG`, `services.tool_catalog`)."""

    mcp_servers: dict[str, McpServerSpec] = Field(default_factory=dict, description="Name -> server.")


class ToolSpec(_Strict):
    """One tool the policy may call: a built-in kind or a tool an MCP server serves."""

    name: str = Field(pattern=TOOL_NAME, description="What the model calls it (for mcp: the server's tool name).")
    kind: Literal["calculator", "python", "search", "mcp"]
    description: str | None = Field(
        None, max_length=TEXT_CHARS, description="Replaces the built-in description shown to the model."
    )
    timeout_s: float = Field(10.0, gt=0, le=3600, description="A call running longer is cut and reported.")
    max_concurrency: int = Field(
        8,
        ge=1,
        le=4096,
        description="Calls of this tool running at once on one rollout server, all episodes "
        "together; a call waits for a free slot.",
    )
    max_calls: int = Field(4, ge=1, le=1024, description="Calls of this tool one episode may make.")
    data: str | None = Field(
        None,
        max_length=PATH_CHARS,
        description="search: JSONL of {id, title, text} documents; the built-in fixture when unset.",
    )
    top_k: int = Field(3, ge=1, le=50, description="search: documents returned per query.")
    server: Annotated[str, Field(pattern=CATALOG_NAME)] | McpServerSpec | None = Field(
        None,
        description="mcp: the server that serves this tool, by its name in the operator's tool catalogue "
        "(TANDEM_TOOL_CATALOG); a command or URL written here only where the operator allows "
        "inline servers (TANDEM_ALLOW_INLINE_MCP).",
    )

    @model_validator(mode="after")
    def _server_for_mcp(self) -> ToolSpec:
        if (self.kind == "mcp") != (self.server is not None):
            raise ValueError("a tool of kind mcp names its server, and only it does")
        return self


class ToolsSpec(_Strict):
    """The tools of a job's episodes and how calls are read from the policy's replies."""

    parser: Literal["hermes", "llama3"] = Field(
        "hermes",
        description="hermes: <tool_call>{json}</tool_call> blocks (Qwen, Hermes); llama3: a reply that "
        "is a JSON call object or list (Llama 3.x).",
    )
    tools: list[ToolSpec] = Field(default_factory=list, max_length=64, description="Inline tools.")
    file: str | None = Field(
        None, max_length=PATH_CHARS, description="YAML or JSON file with a `tools:` list, added to the inline ones."
    )
    max_calls_per_episode: int = Field(8, ge=1, le=4096, description="All tools together, per episode.")
    max_rounds_per_turn: int = Field(
        4, ge=1, le=256, description="Replies with calls in one assistant turn before it must answer."
    )

    @model_validator(mode="after")
    def _some_unique_tools(self) -> ToolsSpec:
        names = [t.name for t in self.tools]
        if len(names) != len(set(names)):
            raise ValueError(f"tool names repeat: {sorted({n for n in names if names.count(n) > 1})}")
        return self


HEALTH_METRICS = (
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
)
"""Per-step history metrics a health rule can watch."""


class HealthRule(_Strict):
    """A condition on one per-step metric; when it has held for `steps` consecutive RL steps
    the learner warns (once per such stretch) or stops the job, saying which rule and why."""

    metric: Literal[HEALTH_METRICS]
    above: float | None = Field(None, description="Holds when the metric is greater than this.")
    below: float | None = Field(None, description="Holds when the metric is less than this.")
    steps: int = Field(5, ge=1, le=10_000, description="Consecutive RL steps it must hold.")
    action: Literal["warn", "stop"] = "warn"

    @model_validator(mode="after")
    def _one_bound(self) -> HealthRule:
        if (self.above is None) == (self.below is None):
            raise ValueError("a health rule sets exactly one of above and below")
        return self


GENERATED_TASKS = ("clarify", "multiply")
"""Tasks whose examples are generated from a seed (the rest read a data file or a split)."""


class EvalSpec(_Strict):
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
        description="Held-out conversations per evaluation (tau2: at most its split's tasks). Its share of the "
        "rollout time is about examples x trials / (every x batch_size x group_size), plus the first and last rounds.",
    )
    trials: int = Field(
        1, ge=1, le=16, description="Plays of each example per evaluation: pass^k is reported for k up to trials."
    )
    seed: int = Field(
        10_000,
        description="clarify and multiply: the seed their held-out examples are generated from (not train.seed).",
    )
    data: str | None = Field(
        None,
        max_length=PATH_CHARS,
        description="math_chat, doc_edit_chat, code_chat: a JSONL file of held-out rows; unset: the rows of "
        "task.data (or the built-in fixture) after the first task.num_examples, which train.",
    )
    split: Literal["train", "test", "base"] = Field(
        "test", description="tau2: the split evaluated (one the job does not train on)."
    )
    timeout_s: float = Field(
        900.0,
        gt=0,
        le=86_400,
        description="The longest the job waits for its final evaluation after its last step; what finished by "
        "then is recorded, marked incomplete.",
    )


class WandbSpec(_Strict):
    project: str = Field("tandem", pattern=r"^[A-Za-z0-9_.-]{1,128}$", description="The W&B project of the run.")
    mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline: the run stays in the job's folder (`wandb sync` uploads it later); online: the "
        "learner sends it as it goes, which the operator allows (TANDEM_ALLOW_ONLINE_TRACKING) and keys.",
    )


class TrackingSpec(_Strict):
    """Experiment trackers the job's numbers also go to, from the learner, in the job's run
    folder (`runs/<job>/tensorboard`, `runs/<job>/wandb`): the spec as config, every step's and
    held-out evaluation's numbers, and held-out conversations as a table."""

    tensorboard: bool = Field(False, description="TensorBoard event files.")
    wandb: WandbSpec | None = Field(None, description="A Weights & Biases run (offline unless allowed).")
    conversations: int = Field(
        8, ge=0, le=256, description="Held-out conversations per evaluation put in the trackers' table."
    )


class BudgetSpec(_Strict):
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


class _JobBase(_Strict):
    """What every kind of job names: the model, the task, and how to roll out, score and
    train. A job spec is one of the kinds below, picked by `kind` (`rl` when it is left out)."""

    name: str = Field("job", min_length=1, max_length=128, pattern=rf"^{JOB_NAME}$")
    model: ModelSpec
    task: TaskSpec = TaskSpec()
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
    best response (`GroupRollout.ranked_conversation`) instead of a group of episodes."""

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data):
        """`reward.preset`'s settings for the task, under what the spec sets itself."""
        if not isinstance(data, dict):
            return data
        reward, task = _given(data.get("reward")), _given(data.get("task"))
        preset = reward.get("preset", "none")
        if preset == "none" or not isinstance(preset, str) or preset not in PRESETS:
            return data
        filled = PRESETS[preset](task)
        return data | {"reward": filled["reward"] | reward, "task": filled["task"] | task}

    @model_validator(mode="after")
    def _parts_agree(self) -> _JobBase:
        if self.rollout.max_total_tokens > self.model.max_model_len:
            raise ValueError("rollout.max_total_tokens must not exceed model.max_model_len")
        if self.task.extraction == "llm" and not self.reward.judge_model:
            raise ValueError("task.extraction: llm asks the judge model by name: set reward.judge_model")
        if self.tools is not None and self.task.name != "tau2" and not self.tools.tools and self.tools.file is None:
            raise ValueError("tools needs inline tools or a file (only a tau2 task brings its own)")
        if self.tools is not None and self.task.name == "tau2" and (self.tools.tools or self.tools.file):
            raise ValueError("a tau2 task brings its domain's tools: tools sets only the parser and limits")
        if self.train.data and not isinstance(self, OfflineJob):
            raise ValueError("train.data is read by offline jobs only (kind: offline)")
        return self

    def progress(self) -> tuple[int, str]:
        """How far the job goes and in what (what a progress bar counts)."""
        return self.train.num_steps, "step"


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
        if self.eval is None:
            return self
        if self.task.name in GENERATED_TASKS and self.eval.seed == self.train.seed:
            raise ValueError("eval.seed must differ from train.seed: the held-out examples would be the trained ones")
        if self.task.name == "tau2" and "base" in (self.task.split, self.eval.split):
            raise ValueError("tau2: the base split holds every task, so nothing in it is held out: evaluate test")
        if self.task.name == "tau2" and self.eval.split == self.task.split:
            raise ValueError(f"eval.split {self.eval.split!r} is the split the job trains on")
        return self


class OfflineJob(_JobBase):
    """The learner alone trains DPO on a pairs file (`train.data`, a generate job's
    pairs.jsonl); no rollout server takes part."""

    kind: Literal["offline"]
    uses_rollout_servers: ClassVar[bool] = False

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
KIND_NAMES = ("rl", "offline", "generate")
"""The `kind` of each, which pydantic puts at the head of an error's location."""


def _kind_of(data: object) -> str:
    """The kind a spec is (`rl` when a mapping leaves it out)."""
    if isinstance(data, dict):
        kind = data.get("kind", "rl")
        return kind if isinstance(kind, str) else repr(kind)
    return getattr(data, "kind", "rl")


JobSpec = Annotated[
    Annotated[RLJob, Tag("rl")] | Annotated[OfflineJob, Tag("offline")] | Annotated[GenerateJob, Tag("generate")],
    Discriminator(
        _kind_of, custom_error_type="invalid_kind", custom_error_message="kind must be 'rl', 'offline' or 'generate'"
    ),
]
"""A job spec: one model per kind, `kind` selecting (see `JOB_KINDS`)."""
_JOB_SPEC = TypeAdapter(JobSpec)


def parse_job_spec(data: object) -> RLJob | OfflineJob | GenerateJob:
    """A job spec from a mapping (or a spec), its kind's model picked by `kind`."""
    return _JOB_SPEC.validate_python(data)


def parse_job_spec_json(text: str | bytes) -> RLJob | OfflineJob | GenerateJob:
    return _JOB_SPEC.validate_json(text)


def _given(section) -> dict:
    """The fields a job-spec section sets itself: a mapping as written, or a model's
    explicitly set fields; {} for anything else (validation reports it)."""
    if isinstance(section, dict):
        return section
    if isinstance(section, BaseModel):
        return {name: getattr(section, name) for name in section.model_fields_set}
    return {}


PATH_FIELDS = (
    ("model", "path"),
    ("task", "data"),
    ("task", "contexts"),
    ("warm_start", "data"),
    ("tools", "file"),
    ("train", "data"),
    ("eval", "data"),
)
"""(section, field) of every job-spec field that names a file or folder the learner or a
rollout server opens. A multi-tenant API confines them to `ApiSettings.path_roots`."""


JUDGE_OUTAGE_S = 1800.0
"""How long a job waits out a judge upstream outage by default (`TANDEM_JUDGE_OUTAGE_S`)."""


class _ProcessSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    log_level: str = "INFO"
    redis_outage_s: float = Field(
        30.0, gt=0, description="How long a Redis call waits out an outage (a restart, a network blip) before it fails."
    )
    job_retention_s: float = Field(
        7 * 86400.0, gt=0, description="How long an ended job's records, streams and history stay in Redis."
    )
    pending_ttl_s: float = Field(
        86400.0,
        gt=0,
        description="A job still PENDING this long after it was submitted ends FAILED, expired in the queue "
        "(the API and the learner both expire them; set both alike).",
    )

    SECRETS: ClassVar[frozenset[str]] = frozenset({"tokens", "client_tokens", "judge_token"})

    def loggable(self) -> dict:
        """The settings with secrets masked: bearer tokens, and a password in the Redis URL."""
        shown = self.model_dump()
        for name in self.SECRETS & shown.keys():
            shown[name] = "***" if shown[name] else ""
        shown["redis_url"] = re.sub(r"//([^@/]*)@", "//***@", self.redis_url)
        return shown


def _require_tokens_off_loopback(host: str, tokens: str, variable: str) -> None:
    """Auth fails closed: a server without tokens may listen on loopback only."""
    from services.auth import is_loopback

    if not tokens.strip() and not is_loopback(host):
        raise ValueError(
            f"{variable} is empty, so this server has no auth and may listen only on loopback "
            f"(127.0.0.1, ::1), not {host!r}: set {variable} or a loopback host"
        )


class _ToolSettings(_ProcessSettings):
    """Who may name which tool servers: read by the job API (to refuse a spec) and by rollout
    servers (which start the servers)."""

    tool_catalog: str = Field(
        "",
        description="YAML file of the operator's tool catalogue: `mcp_servers: {name: {command | url, env}}`; "
        "a job's mcp tools name its entries.",
    )
    allow_inline_mcp: bool = Field(
        False,
        description="Let job specs give an MCP server's command or URL themselves (the tenant then runs "
        "programs on rollout servers); URLs must still reach a public address.",
    )


class ApiSettings(_ToolSettings):
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 1 << 20
    max_spec_bytes: int = Field(
        64 << 10, ge=1024, description="The largest job spec, as stored (JSON bytes), a tenant may submit (413 above)."
    )
    max_pending_jobs: int = Field(
        16, ge=1, description="PENDING jobs one tenant may have queued at once (429 for the next)."
    )
    max_event_streams: int = Field(
        8, ge=1, description="Event streams (`/v1/jobs/{id}/events`) one tenant may hold open at once (429 above)."
    )
    max_tools_file_bytes: int = Field(
        256 << 10, ge=1024, description="The largest `tools.file` the API reads to check a spec (422 above)."
    )
    tokens: str = Field(
        "", description="'token:tenant,...'; empty: no auth, and then the API listens on loopback only (local use)."
    )
    allow_online_tracking: bool = Field(
        False,
        description="Accept jobs whose tracking.wandb.mode is online: the learner then sends their numbers "
        "to W&B with the learner's own key (WANDB_API_KEY).",
    )
    max_judge_weight: float = Field(
        10.0, gt=0, le=1000.0, description="The largest judge_weight a job may ask for (422 above it)."
    )
    tenant_budget_usd: float | None = Field(
        None,
        gt=0,
        description="The most each tenant's jobs' LLM calls may cost in a calendar month (UTC), at the upstreams' "
        "prices; the judge proxy makes no call past it. Set it alike on every API replica. None: no cap.",
    )
    tenant_budget_tokens: int | None = Field(
        None, gt=0, description="The most provider tokens each tenant's jobs may use in a calendar month. None: no cap."
    )
    operators: str = Field(
        "",
        description="Comma-separated tenants allowed the rollout-server routes (list, drain); "
        "without tokens everyone is.",
    )
    path_roots: str = Field(
        "/models",
        description="Comma-separated folders a tenant's job spec may name files under (PATH_FIELDS), "
        "symlinks and '..' resolved; enforced when `tokens` is set. Keep the runs folder "
        "(every job's checkpoints) out of it.",
    )

    @model_validator(mode="after")
    def _auth_or_loopback(self) -> ApiSettings:
        _require_tokens_off_loopback(self.host, self.tokens, "TANDEM_TOKENS")
        return self

    @property
    def tenant_budget(self) -> BudgetSpec:
        """The cap on every tenant's month (`services.bills`)."""
        return BudgetSpec(usd=self.tenant_budget_usd, tokens=self.tenant_budget_tokens)


class _ReplaySettings(_ProcessSettings):
    """How long a taken-over episode can be replayed: read by the judge proxy (its replay
    memory) and by rollout servers (their task journals), so that a journal never outlives
    the simulator and judge replies its turns followed."""

    idempotency_ttl_s: float = Field(
        3600.0,
        ge=0,
        description="How long the judge proxy keeps a reply for a retry with the same Idempotency-Key, and a "
        "rollout server a task's journal (its policy replies and tool results) after the last write; set the "
        "proxy and the rollout servers alike. 0 = off: a taken-over task plays afresh.",
    )


class JudgeProxySettings(_ReplaySettings):
    host: str = "127.0.0.1"
    port: int = 8001
    upstreams: str = Field("", description="YAML/JSON file listing upstreams; empty = none.")
    client_tokens: str = Field(
        "",
        description="Comma-separated tokens; a caller presents one, or a job's credential made with one "
        "(services.auth.job_credential). Empty: no auth, loopback only, and X-Tandem-Job is "
        "believed as sent.",
    )
    queue_deadline_s: float = Field(30.0, gt=0, description="Longest wait for budget before a 429.")
    judge_model: str = Field("judge", min_length=1, description="Model /v1/judge asks when a request names none.")
    default_max_tokens: int = Field(
        1024, ge=1, description="Reserved and sent upstream when a chat request sets no max_tokens."
    )
    max_attempts: int = Field(4, ge=1, le=16, description="Upstream calls per request (failover, 429 retries).")
    max_backoff_s: float = Field(30.0, gt=0, description="Cap on the pause after an upstream 429.")
    failure_cooldown_s: float = Field(
        5.0, ge=0, description="How long a replica avoids an upstream after a 5xx, timeout or refused connection."
    )
    circuit_failures: int = Field(
        5,
        ge=1,
        description="Consecutive failed calls (connection error, timeout, 5xx, 401/403, a reply that is not "
        "JSON), across replicas, that open an upstream's circuit: no call is sent to it until a probe succeeds.",
    )
    rate_limit_outage_s: float = Field(
        60.0,
        gt=0,
        description="An upstream that has answered nothing but 429 for this long is down (an exhausted "
        "quota), and its circuit opens; shorter runs of 429 are pacing. A minute: twice the longest pause "
        "a 429 buys (max_backoff_s), and a job waiting on it shows PAUSED within the minute it is down.",
    )
    circuit_open_s: float = Field(
        10.0, gt=0, description="How long an open circuit sends nothing before one call probes the upstream."
    )
    judge_priority_weight: int = Field(
        3, ge=1, le=100, description="Judge requests admitted per simulator request while both wait."
    )
    cache_ttl_s: float = Field(
        3600.0,
        ge=0,
        description="How long a job's verdicts (and temperature-0 chat replies) are remembered for "
        "identical requests; 0 = no cache.",
    )
    max_reply_bytes: int = Field(
        8 << 20,
        ge=1 << 16,
        description="The most of an upstream's reply (of a stream: of one line or event) the proxy reads; a "
        "reply over it is the upstream's failure, a 502 naming the cap. 8 MiB: a reply of 1,024 tokens with 20 "
        "top logprobs each is about 1.3 MB.",
    )
    max_request_bytes: int = Field(
        8 << 20,
        ge=1 << 10,
        description="The largest request body the proxy reads; a larger one is refused with 413 before the rest "
        "of it is read.",
    )
    job_models: str = Field(
        "",
        description="Comma-separated model groups a call charged to a job (a job's credential, or X-Tandem-Job "
        "without client_tokens) may use; others get 403. Empty: every group this proxy serves. Calls with a "
        "plain client token (the operator's own) may use every group.",
    )

    @model_validator(mode="after")
    def _auth_or_loopback(self) -> JudgeProxySettings:
        _require_tokens_off_loopback(self.host, self.client_tokens, "TANDEM_CLIENT_TOKENS")
        return self


class RolloutSettings(_ToolSettings, _ReplaySettings):
    server_id: str = ""
    metrics_port: int = 8002
    judge_url: str = "http://127.0.0.1:8001"
    judge_token: str = Field("", description="Bearer token for the judge proxy, if it requires one.")
    max_concurrent_tasks: int = Field(16, ge=1)
    max_concurrent_rewards: int = Field(
        128,
        ge=1,
        description="Samples scoring at once (their futures and judge calls). Below max_concurrent_tasks x "
        "group_size it throttles a judge-bound job: at 32, with 32 tasks of 4 in flight, groups "
        "queued here doubled their latency (bench/async_speedup.py).",
    )
    judge_max_connections: int = Field(
        256, ge=1, description="Calls to the judge proxy in flight at once (user simulator and judge together)."
    )
    judge_timeout_s: float = Field(
        120.0, gt=0, description="One call to the judge proxy, its wait for budget and the upstream included."
    )
    judge_max_retries: int = Field(
        2, ge=0, le=100, description="Retries of a call the proxy could not answer (unreachable, 429, 502-504)."
    )
    judge_max_retry_wait_s: float = Field(60.0, gt=0, description="The longest wait before one such retry.")
    judge_outage_s: float = Field(
        JUDGE_OUTAGE_S,
        gt=0,
        description="The learner's judge_outage_s (set both alike): a call waits a minute longer than this "
        "while the proxy says every upstream of its model is down, so the learner names the outage as "
        "the job's reason before any task fails.",
    )
    kv_cache_gib: float = Field(1.0, gt=0, description="CPU only: KV cache size (VLLM_CPU_KVCACHE_SPACE).")
    memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="vLLM's gpu_memory_utilization (on CPU: share of RAM); default 0.85 on GPU, 0.3 on CPU. "
        "Lower it to share one GPU with the learner.",
    )
    heartbeat_s: float = Field(2.0, gt=0)
    task_reclaim_idle_s: float = Field(15.0, gt=0, description="Take over tasks another server left idle this long.")
    drain_timeout_s: float = Field(
        120.0,
        ge=0,
        description="A draining server (SIGTERM, `tandem drain`) finishes its tasks for at most this long, "
        "then hands the rest back to the other servers (their journals keep the turns played).",
    )
    engine_stall_s: float = Field(
        300.0,
        gt=0,
        description="A vLLM engine that produces nothing this long with requests in flight is wedged: the "
        "server exits with status 1 (its supervisor starts a new one) and its tasks are reclaimed. Long, "
        "because a big model's prefill on a busy GPU is not a wedge; `/healthz` says degraded at half.",
    )


class LearnerSettings(_ProcessSettings):
    metrics_port: int = 8003
    runs_dir: str = "runs"
    history_keep: int = Field(
        10_000,
        ge=100,
        description="Step records a job keeps in Redis (its history endpoint), newest first; the "
        "run folder's metrics.jsonl keeps them all.",
    )
    keep_checkpoints: int = Field(
        3,
        ge=1,
        description="Complete checkpoints kept per job, newest first; older ones are deleted once a "
        "newer one is complete (a job resumes from the newest).",
    )
    weight_bucket_mib: int = Field(512, ge=1)
    weight_timeout_s: float = Field(120.0, gt=0)
    min_rollout_servers: int = Field(1, ge=0, description="0: train on whatever arrives (tests, replays).")
    rollout_wait_s: float = Field(600.0, gt=0)
    collective_timeout_s: float = Field(1800.0, gt=0)
    advertise_host: str = Field("127.0.0.1", description="Address rollout servers reach us at.")
    weight_store_port: int = Field(0, ge=0, description="Rendezvous port; 0 picks a free one.")
    server_timeout_s: float = Field(10.0, gt=0, description="Heartbeat age that drops a server.")
    judge_outage_s: float = Field(
        JUDGE_OUTAGE_S,
        gt=0,
        description="How long a job stays PAUSED waiting on a judge or simulator model whose every "
        "upstream is down before it fails with the proxy's reason.",
    )
    resume: bool = Field(False, description="Continue RUNNING jobs from their last checkpoint.")
    lease_ttl_s: float = Field(
        30.0,
        ge=1.0,
        description="How long a learner's hold on its job lasts unless renewed (every third of it, at most "
        "every 5 s): another learner takes a job over this long after its learner died or froze.",
    )
    max_crashes_per_step: int = Field(
        3,
        ge=1,
        description="A job whose learner died this many times at the same step (no step completed between) "
        "ends FAILED with the last exit reason instead of resuming again; a SIGTERM stop is no crash.",
    )
