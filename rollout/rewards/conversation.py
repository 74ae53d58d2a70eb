"""R*(conversation): the conversation-level reward CollabLLM averages over futures.

R* = extrinsic_weight * R_ext - min(lambda * tokens, 1) + judge_weight * R_llm, where
tokens (`reward.token_count`) counts what the policy generated in the scored conversation
(`policy`), or every token after its context, user and tool turns included (`all`,
CollabLLM's count). The judge sees the conversation without its system prompt, and the
task's reference only with `reward.judge_reference`. With
tools, ARTIST's composite adds tool_format_weight when every call could be read and
tool_success_weight times the share of calls that ran without error (`tool_terms`); the
answer's correctness is R_ext.

The format filter belongs to the text a sample trains. When that text is malformed
(truncated, stopped on the wrong token, empty) the sample gets the lowest reward R* can
take (`minimum_reward`) and no judge call is made, so cutting a reply short never escapes
the token penalty: `episode_reward` applies it to a whole trained conversation,
`rollout.rewards.multiturn.score_response` to a response m_j. A forward-sampled future is
never trained; when the policy cuts one short, that future is an unfinished conversation:
it achieved nothing (R_ext = R_llm = 0, no judge call) and pays for its tokens. It is not
floored, because the response being scored did not write the malformed turn: a floor there
would score every response of a policy drifting into malformed turns -1 alike, a group with
no spread and so no gradient to pull the policy back (DESIGN.md, "Multi-turn episodes").
"""

from __future__ import annotations

from rollout.concurrent import gather_all
from rollout.episode import Episode
from rollout.tasks.base import Judge, TaskSet
from rollout.tools.box import ToolUsage
from services.config import RewardSpec
from services.protocol import RewardParts


def minimum_reward(spec: RewardSpec) -> float:
    """The lowest R* can be: R_ext and R_llm at 0 (their weights are not negative) and the
    token penalty at its cap of 1."""
    return -1.0 if spec.token_penalty > 0 else 0.0


async def conversation_rewards(
    task: TaskSet,
    example: int,
    episodes: list[Episode],
    spec: RewardSpec,
    judge: Judge | None = None,
    call_id: str = "",
) -> list[float]:
    """R* of each conversation, each one's parts left in its `parts`; one the policy left
    unfinished scores only its token penalty. The judge is asked about the finished ones
    together (one call in group mode)."""
    parts = [
        RewardParts(reward=0.0, token_penalty=min(spec.token_penalty * counted_tokens(e, spec), 1.0)) for e in episodes
    ]
    finished = [i for i, e in enumerate(episodes) if e.well_formed()]
    for i in finished:
        parts[i].tool_terms = tool_terms(episodes[i].tool_use, spec)
    if finished and spec.extrinsic_weight:
        scores = await gather_all(*(task.score(example, episodes[i].messages, episodes[i]) for i in finished))
        for i, score in zip(finished, scores):
            parts[i].r_ext = score
    if finished and spec.judge_rubric and spec.judge_weight:
        if judge is None:
            raise RuntimeError(f"rubric {spec.judge_rubric!r} needs a judge client")
        verdicts = await judge.score_all(
            spec.judge_rubric,
            [judged(episodes[i].messages) for i in finished],
            task.reference(example) if spec.judge_reference else None,
            call_id,
        )
        for i, verdict in zip(finished, verdicts):
            parts[i].r_llm, parts[i].verdict = verdict.score, verdict.reason
    for episode, part in zip(episodes, parts):
        part.reward = total(part, spec)
        episode.parts = part
    return [part.reward for part in parts]


def total(parts: RewardParts, spec: RewardSpec) -> float:
    """R* from its parts (a part not asked adds nothing)."""
    reward = -parts.token_penalty + parts.tool_terms
    if parts.r_ext is not None:
        reward += spec.extrinsic_weight * parts.r_ext
    if parts.r_llm is not None:
        reward += spec.judge_weight * parts.r_llm
    return reward


def counted_tokens(episode: Episode, spec: RewardSpec) -> int:
    """The tokens the penalty counts (`reward.token_count`)."""
    return episode.new_tokens() if spec.token_count == "all" else episode.policy_tokens


def judged(messages: list[dict]) -> list[dict]:
    """What the judge reads: the conversation without the assistant's system prompt."""
    return [m for m in messages if m["role"] != "system"]


def tool_terms(usage: ToolUsage, spec: RewardSpec) -> float:
    """ARTIST's format and tool-execution terms of one conversation (0 with both weights 0)."""
    readable = not any(r.failure == "malformed" for r in usage.results)
    success = usage.succeeded / usage.total if usage.total else 0.0
    return spec.tool_format_weight * readable + spec.tool_success_weight * success


async def conversation_reward(
    task: TaskSet, example: int, episode: Episode, spec: RewardSpec, judge: Judge | None = None
) -> float:
    """R* of one conversation."""
    return (await conversation_rewards(task, example, [episode], spec, judge, f"{episode.trace}/judge"))[0]


async def episode_reward(
    task: TaskSet, example: int, episode: Episode, spec: RewardSpec, judge: Judge | None = None
) -> float:
    """R* of a conversation all of whose assistant turns are trained (episode mode): the
    format filter, then R*."""
    if not episode.well_formed():
        return minimum_reward(spec)
    return await conversation_reward(task, example, episode, spec, judge)
