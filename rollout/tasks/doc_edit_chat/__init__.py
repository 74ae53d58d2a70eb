"""MediumDocEdit-Chat: the user asks for edits to a short document without saying all of
them; the user simulator knows every edit. Scored by sentence BLEU of the conversation's
final document (`conversation_document`) against the reference edit.

Fixture rows: {"request": the user's opening words, "document": the text to edit, "goal":
every edit the user wants, "reference": the document with those edits made}.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import sacrebleu

from rollout.tasks import extraction
from rollout.tasks.base import FixtureTask, Judge, TaskSet
from rollout.tasks.common import fenced_blocks, final_reply, is_question, last_found, read_examples
from services.config import DocEditChatSpec

FIXTURE = Path(__file__).parent / "examples.jsonl"
"""The built-in examples, used when the spec names no `task.data` file."""


@dataclass(frozen=True)
class DocEditExample:
    request: str
    document: str
    goal: str
    reference: str


def final_document(reply: str) -> str:
    """The document a reply delivers: the body of its last ``` fenced block if it has one
    (so prose around the document does not count), else the whole reply; stripped."""
    blocks = fenced_blocks(reply)
    return (blocks[-1][1] if blocks else reply).strip()


def conversation_document(messages: list[dict]) -> str:
    """The document the conversation ends with: the last fenced block of any assistant
    reply (a reply after it that holds none, a thank-you, leaves it standing); without any,
    the whole latest reply."""
    found = last_found(messages, lambda text: final_document(text) if fenced_blocks(text) else None)
    return found if found is not None else final_document(final_reply(messages))


def document_bleu(hypothesis: str, reference: str) -> float:
    """sacreBLEU sentence BLEU (13a tokens, exponential smoothing) / 100, in [0, 1]."""
    return sacrebleu.sentence_bleu(hypothesis, [reference]).score / 100


class DocEditChatTask(FixtureTask):
    name = "doc_edit_chat"

    def __init__(self, spec: DocEditChatSpec, judge: extraction.Completer | None = None) -> None:
        if spec.extraction == "llm" and judge is None:
            raise ValueError("doc_edit_chat with extraction='llm' needs a judge client")
        self.examples = [DocEditExample(**row) for row in read_examples(spec, FIXTURE)]
        self.judge = judge if spec.extraction == "llm" else None

    def context(self, example: int) -> list[dict]:
        return [{"role": "user", "content": f"{self.examples[example].request}\n\n{self.attachment(example)}"}]

    def attachment(self, example: int) -> str:
        """The document, in a fence, which invites a fenced edit back."""
        return f"```\n{self.examples[example].document}\n```"

    async def score(self, example: int, messages: list[dict], episode=None) -> float:
        document = (
            conversation_document(messages)
            if self.judge is None
            else await extraction.extract(self.judge, "document", messages)
        )
        return document_bleu(document, self.examples[example].reference)

    def metrics(self, example: int, messages: list[dict]) -> dict[str, float]:
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        return {
            "bleu": document_bleu(conversation_document(messages), self.examples[example].reference),
            "asked": float(is_question(replies[0])),
        }


def load(spec: DocEditChatSpec, seed: int, judge: Judge | None = None) -> TaskSet:
    """The task set of a job's `task` section (`rollout.tasks.TASKS`)."""
    return DocEditChatTask(spec, judge)
