"""Wire types of the judge proxy's own endpoints, `POST /v1/judge` and `POST
/v1/judge/group`: the requests rollout servers send (`services.judge_client`) and the
replies the proxy returns (`judge_proxy.app`). Its OpenAI-compatible chat endpoint keeps
OpenAI's shapes, declared where they are read."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

MODEL_NAME_CHARS = 128
"""The most of a provider's model name that is recorded with a reward (`reply_model`)."""


def reply_model(reply: dict) -> str:
    """The model an upstream's reply names, as recorded with a reward: a provider's string,
    so kept short and never anything but a string."""
    model = reply.get("model") if isinstance(reply, dict) else None
    return model[:MODEL_NAME_CHARS] if isinstance(model, str) else ""


class Turn(BaseModel):
    """One message of the conversation to judge."""

    role: str = Field(min_length=1, description="'system', 'user' or 'assistant'.")
    content: str = Field(description="The message's text.")


class JudgeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rubric: str = Field(min_length=1, description="Name of a rubric the proxy knows (judge_proxy/rubrics).")
    messages: list[Turn] = Field(min_length=1, description="The conversation to judge, oldest first.")
    reference: str | None = Field(None, description="The expected answer, for rubrics that need one.")
    model: str | None = Field(None, description="Model group to judge with; the proxy's judge_model when unset.")
    cache: bool = Field(True, description="Answer from the job's earlier verdict on the same conversation, if any.")


class GroupJudgeRequest(BaseModel):
    """Several conversations (the futures of one turn) scored in one judge call."""

    model_config = ConfigDict(extra="forbid")

    rubric: str = Field(min_length=1, description="Name of a rubric the proxy knows (judge_proxy/rubrics).")
    candidates: list[list[Turn]] = Field(
        min_length=1, max_length=64, description="The conversations to judge, each oldest first."
    )
    reference: str | None = Field(None, description="The expected answer, for rubrics that need one.")
    model: str | None = Field(None, description="Model group to judge with; the proxy's judge_model when unset.")
    cache: bool = Field(True, description="Answer candidates from the job's earlier verdicts on them, if any.")


class JudgeResult(BaseModel):
    score: float = Field(ge=0, le=1, description="The rubric's combination of its criteria.")
    criteria: dict[str, float] = Field(description="Each criterion's score in [0, 1].")
    verdict: str = Field(description="The judge's one-sentence verdict.")
    raw: str = Field(description="The judge's reply the scores were read from.")
    usage: dict[str, int] = Field(description="Token counts of every call the verdict took, summed.")
    remembered: bool = Field(False, description="Answered from the proxy's memory: no call was made for it now.")
    model: str = Field("", description="The judge model as the upstream named it in its reply (its `model`).")
    rubric_sha256: str = Field(
        "", description="Digest of the rubric's instructions as sent (judge_proxy.rubrics.prompt_sha256)."
    )


class GroupJudgeResult(BaseModel):
    results: list[JudgeResult] = Field(description="One verdict per candidate, in the request's order.")
    usage: dict[str, int] = Field(description="Token counts of every call this request made, summed.")
    fallback: str | None = Field(
        None, description="Why the group verdict was unusable, when the candidates were then judged one by one."
    )
    remembered: bool = Field(False, description="The whole reply was replayed (same idempotency key).")
