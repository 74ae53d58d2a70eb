"""Conversations to token ids, the same way for rollout (RL) and the learner (SFT).

Generated text is never re-tokenized: an episode's token sequence is the engine's own
output ids plus *delta-tokenized* non-assistant turns. A delta is rendered against a fixed
base history (`BASE`), so templates that rewrite earlier turns (Qwen3 drops old `<think>`
blocks) give the same delta whatever the real history is. The delta starts right after
the end-of-turn token that closed the assistant's message, so the template's separator
after it (ChatML's newline) is kept, a classic source of train/inference drift.

`check` compares an episode with a fresh rendering of the whole conversation, as text: the
policy's own token ids need not be the canonical encoding of what they spell (a sampled
model often picks another segmentation, which is exactly why nothing is re-tokenized), but
every template token around them must match. `strict` requires the decoded texts to be
equal, `ignore_strippable` compares them with `<think>` blocks and whitespace removed (for
templates that rewrite earlier reasoning), `off` skips the check.

With tools, every rendering passes the same function schemas as the template's `tools`
argument (templates show them in the system turn), and tool results are delta-tokenized
like user turns: whatever the template makes of a `tool` message (its own turn, or a user
turn wrapping `<tool_response>`), the delta holds exactly that. A template that does not show
tools at all (SmolLM2's) gets them in the system turn instead, with how to call them in the
job's parser's format (`TOOL_PROMPTS`), in every rendering alike.

Every rendering has a deadline (`services.chat_template`): the template comes with the
model folder, and one that loops is refused instead of holding the process.

Every message but the assistant's is rendered `neutralised` (`services.quoting`): a user
simulator's turn or a tool result that spells a special token (`<|im_start|>user`) is
tokenized as text, never as the token, so it cannot open a turn in the policy's context.
The assistant's own turns are the policy's sampled tokens, never re-tokenized.
"""

from __future__ import annotations

import json
import re
from typing import Literal

from services.chat_template import within_deadline
from services.quoting import neutralised

CheckMode = Literal["strict", "ignore_strippable", "off"]
BASE = [{"role": "user", "content": "base"}, {"role": "assistant", "content": "base"}]
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
_SPACE = re.compile(r"\s+")


TOOL_PROMPTS = {
    "hermes": (
        "You can call these tools, each given as its JSON schema:\n{tools}\n\nTo call one, write "
        '<tool_call>{{"name": "<tool name>", "arguments": {{<the arguments as a JSON object>}}}}</tool_call>; '
        "several calls are several blocks. The results come back in tool messages."
    ),
    "llama3": (
        "You can call these tools, each given as its JSON schema:\n{tools}\n\nTo call one, reply with "
        'only {{"name": "<tool name>", "parameters": {{<the arguments as a JSON object>}}}}; several calls '
        "are a JSON list of them. The results come back in tool messages."
    ),
}
"""How tools are shown to a model whose chat template ignores them (by the tool parser)."""


class TokenizationMismatch(ValueError):
    """The episode's tokens differ from a fresh rendering of the same conversation."""


class ChatTokenizer:
    def __init__(
        self, tokenizer, check_mode: CheckMode = "strict", tools: list[dict] | None = None, parser: str = "hermes"
    ) -> None:
        self.tokenizer = tokenizer
        self.check_mode = check_mode
        self.tools = tools or None
        """OpenAI function schemas shown to the model in every rendering; None without tools."""
        self.parser = parser
        self._tool_prompt = None
        """The system text that shows the tools, for a template that ignores `tools`."""
        if self.tools and self._template_ignores_tools():
            shown = "\n".join(json.dumps(tool.get("function", tool)) for tool in self.tools)
            self._tool_prompt = TOOL_PROMPTS[parser].format(tools=shown)
        self.eot_id: int = tokenizer.eos_token_id
        specials = {i: token.content for i, token in tokenizer.added_tokens_decoder.items() if token.special}
        self.special_ids: frozenset[int] = frozenset(tokenizer.all_special_ids) | frozenset(specials)
        """Tokens the template reserves (turn markers, end of text): never inside a reply.
        Added tokens not marked special (Qwen's `<tool_call>`, `<think>`) are text."""
        self.special_texts: tuple[str, ...] = tuple(sorted(set(tokenizer.all_special_tokens) | set(specials.values())))
        """How the special tokens are spelled, broken in every message but the assistant's."""
        self._base = self.render(BASE)
        self._cut = _after_last(self._base, self.eot_id)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
        messages = [self._neutral(m) for m in messages]
        tools = self.tools
        if self._tool_prompt is not None:
            messages, tools = _with_system_text(messages, self._tool_prompt), None
        ids = within_deadline(
            lambda: self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
            )
        )
        return list(ids)

    def _neutral(self, message: dict) -> dict:
        """`message` with the special tokens its text spells broken, unless it is the
        assistant's (whose tokens are its own, and whose text `check` compares)."""
        content = message.get("content")
        if message["role"] == "assistant" or not isinstance(content, str):
            return message
        return {**message, "content": neutralised(content, self.special_texts)}

    def with_tools(self, tools: list[dict] | None, parser: str = "hermes") -> ChatTokenizer:
        """The same tokenizer and check, rendering with `tools` (read back by `parser`)."""
        if (tools or None) == self.tools and parser == self.parser:
            return self
        return ChatTokenizer(self.tokenizer, self.check_mode, tools, parser)

    def _template_ignores_tools(self) -> bool:
        plain = within_deadline(lambda: self.tokenizer.apply_chat_template(BASE, tokenize=False))
        with_tools = within_deadline(lambda: self.tokenizer.apply_chat_template(BASE, tools=self.tools, tokenize=False))
        return plain == with_tools

    def prompt(self, messages: list[dict]) -> list[int]:
        """Tokens of a context that the assistant answers next; of one that ends with an
        assistant message (the user speaks first, as after τ²'s greeting), the rendering up
        to that message's end-of-turn token, where `delta` goes on."""
        if messages and messages[-1]["role"] == "assistant":
            rendered = self.render(messages)
            return rendered[: _after_last(rendered, self.eot_id)]
        return self.render(messages, add_generation_prompt=True)

    def delta(self, new_messages: list[dict]) -> list[int]:
        """Tokens to append after an assistant turn that ended with the end-of-turn token:
        the template's separator, `new_messages` and the generation prompt."""
        full = self.render(BASE + new_messages, add_generation_prompt=True)
        if full[: self._cut] != self._base[: self._cut]:
            raise TokenizationMismatch("template renders the base history differently")
        return full[self._cut :]

    def check(self, tokens: list[int], messages: list[dict]) -> None:
        """Raise `TokenizationMismatch` if `tokens` do not spell `messages` under the mode."""
        if self.check_mode == "off":
            return
        expected = self.render(messages)
        expected = expected[: _after_last(expected, self.eot_id)] if tokens[-1] == self.eot_id else expected
        ours, theirs = self.tokenizer.decode(tokens), self.tokenizer.decode(expected)
        if self.check_mode == "ignore_strippable":
            ours, theirs = _strip(ours), _strip(theirs)
        if ours != theirs:
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            raise TokenizationMismatch(
                f"{self.check_mode}: character {at} differs: episode {ours[at : at + 40]!r} "
                f"vs rendering {theirs[at : at + 40]!r}"
            )

    def encode_demonstration(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """A complete conversation as (tokens, mask), mask 1 on assistant content + end token:
        the SFT view of exactly what RL episodes produce."""
        tokens: list[int] = []
        mask: list[int] = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            context = (
                self.prompt(messages[:i])
                if not tokens
                else tokens + self.delta([m for m in messages[_last_assistant(messages, i) + 1 : i]])
            )
            mask += [0] * (len(context) - len(tokens))
            with_reply = self.render(messages[: i + 1])
            reply = with_reply[len(self.prompt(messages[:i])) : _after_last(with_reply, self.eot_id)]
            tokens = context + reply
            mask += [1] * len(reply)
        return tokens, mask


def _with_system_text(messages: list[dict], text: str) -> list[dict]:
    """`messages` with `text` after the system message's content (a new system message first
    when there is none)."""
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _after_last(ids: list[int], token: int) -> int:
    """Index just past the last occurrence of `token` in `ids`."""
    return len(ids) - ids[::-1].index(token)


def _last_assistant(messages: list[dict], before: int) -> int:
    return max(i for i in range(before) if messages[i]["role"] == "assistant")


def _strip(text: str) -> str:
    return _SPACE.sub("", _THINK.sub("", text))
