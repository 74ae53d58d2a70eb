"""The multi-turn agent loop, token-in/token-out.

The context is rendered once; after that the sequence only grows by the engine's own
output ids and delta-tokenized user turns (`services.tokenization`). Generated text is
decoded for the user simulator and the judge but never re-encoded.

Every turn has a name, the episode's `trace` and the number of messages before it
(`task12/s3/f1/t4`). A policy reply and a reply's tool results are looked up in the task's
journal before they are generated or called, and recorded after; a user turn is asked for
under its name as the idempotency key (`rollout.journal`), so a task taken over from a dead
server replays the same conversation without paying for its calls again. The journal gives
a turn back only after the same tokens it followed when it was recorded.

With a tool box, an assistant turn may take several replies: a reply the tool box's parser
finds calls in is followed by the results as `tool` messages (delta-tokenized like a user
turn, mask 0), and the policy replies again, until a reply without calls, the episode's
call limit, the turn's round limit, or the token limit. Assistant messages keep the text
the policy generated, calls included, so a fresh rendering spells the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

from rollout.engine import Engine, Generation
from rollout.interactions.base import UserSimulator
from rollout.journal import Journal
from rollout.tools.base import World
from rollout.tools.box import ToolBox, ToolResult, ToolUsage, tool_message
from rollout.tools.parsers import Parsed, parse_reply
from services.config import RolloutSpec
from services.protocol import RewardParts
from services.tokenization import ChatTokenizer

End = Literal["user_ended", "max_turns", "max_tokens", "truncated", "wrong_stop", "special_token"]
MALFORMED_ENDS = ("truncated", "wrong_stop", "special_token")
"""Ends that a malformed policy turn causes: cut at the length limit, stopped on a token
other than the chat template's end-of-turn (vLLM also stops on the model's other EOS ids),
or a token the template reserves (a turn marker, end of text) inside the reply. None of
them can be continued as the template would render the conversation, and each is the
policy's doing: it is scored (at R*'s floor when trained), never dead-lettered as bad task
content, which would keep it from ever being penalised."""
MALFORMED_REASONS = (*MALFORMED_ENDS, "empty")


@dataclass
class Episode:
    messages: list[dict]
    tokens: list[int]
    mask: list[int] = field(default_factory=list)
    """1 on the tokens this sample trains (the policy's own turns, or only m_j)."""
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    end: End = "user_ended"
    num_turns: int = 0
    """Assistant turns generated in this episode."""
    policy_tokens: int = 0
    """Tokens the policy generated in this episode, trained or not (the token penalty's count)."""
    context_len: int = 0
    """Tokens of the context the episode started from; what follows is the conversation a
    reward scores (`reward.token_count: all` counts all of it)."""
    trace: str = ""
    """Where this conversation sits in its task (`task12/s3`, a future `task12/s3/f1`)."""
    journal: Journal | None = None
    """The task's journal of policy replies and tool results; None to generate and call
    every turn afresh."""
    tool_use: ToolUsage = field(default_factory=ToolUsage)
    """The tool calls made in this episode and their results."""
    parts: RewardParts | None = None
    """R* of this conversation taken apart, once a reward has scored it (a fork starts without)."""

    @classmethod
    def from_context(
        cls,
        messages: list[dict],
        tokens: list[int],
        trace: str = "",
        journal: Journal | None = None,
        world: World | None = None,
    ) -> Episode:
        n = len(tokens)
        return cls(
            list(messages),
            list(tokens),
            [0] * n,
            [0.0] * n,
            [-1] * n,
            trace=trace,
            journal=journal,
            context_len=n,
            tool_use=ToolUsage(world=world),
        )

    def fork(self, name: str) -> Episode:
        """An independent copy to extend with a sampled future, traced as `name` under this one."""
        return replace(
            self,
            messages=list(self.messages),
            tokens=list(self.tokens),
            mask=list(self.mask),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            trace=f"{self.trace}/{name}",
            tool_use=self.tool_use.copy(),
            parts=None,
        )

    def new_tokens(self) -> int:
        """Tokens after the context: the policy's, the user's, tools' and the template's."""
        return len(self.tokens) - self.context_len

    def turn_name(self) -> str:
        """The name of the turn that comes next."""
        return f"{self.trace}/t{len(self.messages)}"

    def malformed_reason(self) -> str:
        """Why the format filter rejects this episode: `truncated`, `wrong_stop`,
        `special_token` (a policy turn that cannot be continued ended it) or `empty` (the
        policy took no turn after the context, or a reply is blank); "" when it passes. The
        context's own assistant messages (a greeting, a task's history) are not the policy's."""
        if self.end in MALFORMED_ENDS:
            return self.end
        replies = [m["content"] for m in self.messages if m["role"] == "assistant"]
        return "" if self.num_turns and all(r.strip() for r in replies) else "empty"

    def well_formed(self) -> bool:
        return not self.malformed_reason()

    def append(self, tokens: list[int], mask: int, logprobs=None, versions=None) -> None:
        self.tokens += tokens
        self.mask += [mask] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)
        self.versions += versions if versions is not None else [-1] * len(tokens)


@dataclass
class EpisodeRunner:
    """Everything that plays out conversations for one task: the policy's engine, the
    tokenizer, the user and the rollout limits."""

    engine: Engine
    chat: ChatTokenizer
    user: UserSimulator
    spec: RolloutSpec
    tools: ToolBox | None = None
    """The job's tools; `chat` must render with their schemas (`ChatTokenizer.with_tools`)."""
    worlds: Callable[[int], World | None] | None = None
    """The task's fresh world for an example, when its tools act on one (`rollout.tasks.tau2`;
    `TaskSet.world`, None for a task without worlds)."""

    def start(
        self, context: list[dict], trace: str = "", journal: Journal | None = None, example: int | None = None
    ) -> Episode:
        """An episode at `context`, with a fresh world of `example` when the task has worlds."""
        world = self.worlds(example) if self.worlds is not None and example is not None else None
        return Episode.from_context(context, self.chat.prompt(context), trace, journal, world)

    async def policy_turn(self, episode: Episode, trained: bool = True, temperature: float | None = None) -> bool:
        """Generate one assistant turn into `episode`, tool rounds included, at `temperature`
        (the rollout's when None); False if it ended the episode (cut at a length limit)."""
        rounds = 1 + (self.tools.spec.max_rounds_per_turn if self.tools else 0)
        for round_ in range(rounds):
            if not await self.reply(episode, trained, first=round_ == 0, temperature=temperature):
                return False
            if self.tools is None or round_ == rounds - 1:
                return True
            calls = await parse_reply(self.tools.parse, episode.messages[-1]["content"])
            if not calls or episode.tool_use.total >= self.tools.spec.max_calls_per_episode:
                return True
            results = await self.run_tools(self.tools, episode, calls)
            if not self.append_turn(episode, [tool_message(r) for r in results]):
                return False
        return True

    async def reply(
        self, episode: Episode, trained: bool, first: bool = True, temperature: float | None = None
    ) -> bool:
        """One policy reply into `episode` (`first` of its turn, or after tool results);
        False if it ended the episode."""
        budget = min(self.spec.max_new_tokens, self.spec.max_total_tokens - len(episode.tokens))
        if budget <= 0:
            episode.end = "max_tokens"
            return False
        gen = await self.generate(episode, budget, temperature)
        episode.append(gen.tokens, int(trained), gen.logprobs, gen.versions)
        episode.policy_tokens += len(gen.tokens)
        text = self.chat.tokenizer.decode(gen.tokens, skip_special_tokens=True)
        episode.messages.append({"role": "assistant", "content": text})
        episode.num_turns += first
        if gen.finish_reason != "stop":
            episode.end = "truncated"
        elif not gen.tokens or gen.tokens[-1] != self.chat.eot_id:
            episode.end = "wrong_stop"
        elif self.chat.special_ids.intersection(gen.tokens[:-1]):
            episode.end = "special_token"
        return episode.end not in MALFORMED_ENDS

    def append_turn(self, episode: Episode, messages: list[dict]) -> bool:
        """Messages of the user or the tools, delta-tokenized and never trained; False (the
        episode ends at `max_tokens`) when they do not fit."""
        delta = self.chat.delta(messages)
        if len(episode.tokens) + len(delta) >= self.spec.max_total_tokens:
            episode.end = "max_tokens"
            return False
        episode.messages += messages
        episode.append(delta, 0)
        return True

    async def generate(self, episode: Episode, budget: int, temperature: float | None = None) -> Generation:
        """The next policy reply: the journal's, when it recorded one after these very
        tokens, or else the engine's (then recorded)."""
        name, journal = episode.turn_name(), episode.journal
        if journal is not None and (recorded := journal.recall(name, episode.tokens, Generation)) is not None:
            return recorded
        temperature = self.spec.temperature if temperature is None else temperature
        gen = await self.engine.generate(episode.tokens, budget, temperature, [self.chat.eot_id])
        if journal is not None:
            await journal.record(name, episode.tokens, gen)
        return gen

    async def run_tools(self, tools: ToolBox, episode: Episode, calls: Parsed) -> list[ToolResult]:
        """The results of the calls in the episode's last reply, run by `tools` (the runner's)
        and recorded in its journal; the results it recorded after these very tokens stand in
        for calls to tools that do not act on the episode's world (`ToolBox.run`)."""
        name, journal = episode.turn_name(), episode.journal
        recorded = journal.recall(name, episode.tokens, list[ToolResult]) if journal is not None else None
        results = await tools.run(calls, episode.tool_use, recorded)
        if journal is not None:
            await journal.record(name, episode.tokens, results)
        return results

    async def user_turn(self, episode: Episode, example: int) -> bool:
        """Append the simulated user's reply; False when the conversation is over."""
        reply = await self.user.respond(example, episode.messages, call_id=episode.turn_name())
        if reply is None:
            episode.end = "user_ended"
            return False
        return self.append_turn(episode, [{"role": "user", "content": reply}])

    async def extend(
        self, episode: Episode, example: int, max_turns: int, trained: bool = True, temperature: float | None = None
    ) -> Episode:
        """Alternate user and policy turns after an assistant turn, at most `max_turns` more
        policy turns (at `temperature`, the rollout's when None), then run the tokenization
        sanity check. An episode a malformed turn ended stays as it is."""
        if episode.end in MALFORMED_ENDS:
            return episode
        episode.end = "max_turns"
        for _ in range(max_turns):
            if not await self.user_turn(episode, example) or not await self.policy_turn(episode, trained, temperature):
                break
        if episode.end not in MALFORMED_ENDS:
            self.chat.check(episode.tokens, episode.messages)
        return episode

    async def run(self, example: int, context: list[dict], trace: str = "", journal: Journal | None = None) -> Episode:
        """A whole conversation from `context`: at most `spec.max_turns` assistant turns. A
        context that ends with an assistant message (a greeting) has the user speak first."""
        episode = self.start(context, trace, journal, example)
        if context[-1]["role"] == "assistant":
            await self.extend(episode, example, self.spec.max_turns)
        elif await self.policy_turn(episode):
            await self.extend(episode, example, self.spec.max_turns - 1)
        return episode
