"""A training group as people read it: the context, each response with its reward, its
advantage and the parts of R*, and each response's futures with the judge's verdict.

The rollout server writes one `protocol.GroupView` per trained group to the job's capped
`groups` stream (`services.queues.GROUPS_KEPT` newest); the API serves them (`GET /v1/jobs/{id}/groups`)
and the job page browses them. A view holds text only (role and content of each message,
each cut at `TEXT_CHARS`), never tokens: it costs Redis a bounded amount whatever the
policy writes, and nothing reads it back into training.
"""

from __future__ import annotations

import re

from rollout.episode import Episode
from services import protocol
from services.config import RewardSpec

TEXT_CHARS = 4000
"""A message's text in a view is cut here (the page names how much was cut)."""


CUT = re.compile(r"\n\[\.\.\. \d+ more characters\]\Z")
"""How a cut message's text ends."""


def text(message: dict) -> dict[str, str]:
    """A message's role and content, its content cut at `TEXT_CHARS`."""
    content = str(message.get("content") or "")
    if len(content) > TEXT_CHARS:
        content = f"{content[:TEXT_CHARS]}\n[... {len(content) - TEXT_CHARS} more characters]"
    return {"role": str(message.get("role", "")), "content": content}


def was_cut(content: str) -> bool:
    """Whether `text` cut this content (a view's reader then holds less than was said)."""
    return len(content) > TEXT_CHARS and CUT.search(content) is not None


def after(episode: Episode, start: int) -> list[dict[str, str]]:
    """The episode's messages from index `start` on, as text."""
    return [text(m) for m in episode.messages[start:]]


def future_view(future: Episode, start: int) -> protocol.FutureView:
    """A future the response's reward scored, from message `start` (the response's end) on."""
    if future.parts is None:
        raise ValueError(f"future {future.trace} has no reward parts: a view shows only scored futures")
    return protocol.FutureView(messages=after(future, start), parts=future.parts, malformed=future.malformed_reason())


def response_view(
    index: int, sample: protocol.Sample, episode: Episode, scored: list[Episode], context_len: int
) -> protocol.ResponseView:
    """Sample `index` of a group: `episode` is what the policy played from a context of
    `context_len` messages, `scored` the conversations its reward averaged (the episode
    itself, or its futures; none when the format filter floored it)."""
    return protocol.ResponseView(
        index=index,
        messages=after(episode, context_len),
        reward=sample.reward,
        advantage=sample.advantage,
        malformed=episode.malformed_reason(),
        parts=episode.parts,  # set only when a reward scored the conversation itself
        futures=[future_view(future, len(episode.messages)) for future in scored if future is not episode],
        metrics=sample.metrics,
    )


def group_view(
    group: protocol.TrajectoryGroup,
    task: protocol.Task,
    context: list[dict],
    played: list[tuple[Episode, list[Episode]]],
    spec: RewardSpec,
) -> protocol.GroupView:
    """The view of `task`'s `group`, whose samples were played from `context` as `played`
    (each sample's episode and the conversations its reward scored), in sample order."""
    oldest = group.min_version()
    return protocol.GroupView(
        job_id=group.job_id,
        task_id=group.task_id,
        example=task.example,
        server_id=group.server_id,
        mode=spec.mode,
        dispatched_version=task.dispatched_version,
        versions=[] if oldest is None else [oldest, group.max_version()],
        weights={"extrinsic_weight": spec.extrinsic_weight, "judge_weight": spec.judge_weight},
        context=[text(m) for m in context],
        responses=[
            response_view(i, sample, episode, scored, len(context))
            for i, (sample, (episode, scored)) in enumerate(zip(group.samples, played))
        ],
        reward_source=next((s.reward_source for s in group.samples if s.reward_source), {}),
    )
