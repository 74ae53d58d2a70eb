"""The multi-turn agent loop, token-in/token-out.

The context is rendered once; after that the sequence only grows by the engine's own
output ids and delta-tokenized user turns (`services.tokenization`). Generated text is
decoded for the user simulator and the judge but never re-encoded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rollout.engine import Engine
from rollout.interactions.base import UserSimulator
from services.config import RolloutSpec
from services.tokenization import ChatTokenizer

End = Literal["user_ended", "max_turns", "max_tokens", "truncated"]


@dataclass
class Episode:
    messages: list[dict]
    tokens: list[int]
    mask: list[int] = field(default_factory=list)
    """1 on tokens this episode's policy turns produced (the trained ones)."""
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    end: End = "user_ended"
    num_turns: int = 0
    """Assistant turns generated in this episode."""

    @classmethod
    def from_context(cls, messages: list[dict], tokens: list[int]) -> "Episode":
        n = len(tokens)
        return cls(list(messages), list(tokens), [0] * n, [0.0] * n, [-1] * n)

    @property
    def num_generated(self) -> int:
        return sum(self.mask)

    def well_formed(self) -> bool:
        """The format filter: no truncated turn, no empty reply."""
        replies = [m["content"] for m in self.messages if m["role"] == "assistant"]
        return self.end != "truncated" and bool(replies) and all(r.strip() for r in replies)

    def append(self, tokens: list[int], mask: int, logprobs=None, versions=None) -> None:
        self.tokens += tokens
        self.mask += [mask] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)
        self.versions += versions if versions is not None else [-1] * len(tokens)


async def policy_turn(episode: Episode, engine: Engine, chat: ChatTokenizer, spec: RolloutSpec,
                      trained: bool = True) -> bool:
    """Generate one assistant turn into `episode`; False if it was cut at a length limit."""
    budget = min(spec.max_new_tokens, spec.max_total_tokens - len(episode.tokens))
    if budget <= 0:
        episode.end = "max_tokens"
        return False
    gen = await engine.generate(episode.tokens, budget, spec.temperature, [chat.eot_id])
    episode.append(gen.tokens, int(trained), gen.logprobs, gen.versions)
    text = chat.tokenizer.decode(gen.tokens, skip_special_tokens=True)
    episode.messages.append({"role": "assistant", "content": text})
    episode.num_turns += 1
    if gen.finish_reason != "stop":
        episode.end = "truncated"
        return False
    return True


async def user_turn(episode: Episode, user: UserSimulator, example: int, chat: ChatTokenizer,
                    spec: RolloutSpec) -> bool:
    """Append the simulated user's reply; False when the conversation is over."""
    reply = await user.respond(example, episode.messages)
    if reply is None:
        episode.end = "user_ended"
        return False
    message = {"role": "user", "content": reply}
    delta = chat.delta([message])
    if len(episode.tokens) + len(delta) >= spec.max_total_tokens:
        episode.end = "max_tokens"
        return False
    episode.messages.append(message)
    episode.append(delta, 0)
    return True


async def continue_episode(episode: Episode, engine: Engine, chat: ChatTokenizer,
                           user: UserSimulator, example: int, spec: RolloutSpec,
                           max_turns: int, trained: bool = True) -> Episode:
    """Alternate user and policy turns after an assistant turn, up to `max_turns` more
    policy turns, then run the tokenization sanity check."""
    for _ in range(max_turns):
        if not await user_turn(episode, user, example, chat, spec):
            break
        if not await policy_turn(episode, engine, chat, spec, trained):
            break
    else:
        if episode.end == "user_ended":
            episode.end = "max_turns"
    if episode.end != "truncated":
        chat.check(episode.tokens, episode.messages)
    return episode


async def run_episode(engine: Engine, chat: ChatTokenizer, user: UserSimulator, example: int,
                      context: list[dict], spec: RolloutSpec) -> Episode:
    """A whole conversation from `context`: at most `spec.max_turns` assistant turns."""
    episode = Episode.from_context(context, chat.prompt(context))
    if not await policy_turn(episode, engine, chat, spec):
        return episode
    return await continue_episode(episode, engine, chat, user, example, spec, spec.max_turns - 1)
