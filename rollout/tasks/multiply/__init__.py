"""The built-in *multiply* task: a task the tiny model can solve with a tool and not without.

The user asks for the product of a 4-digit and a 3-digit number. No model of the tiny
size computes that from its weights, but the calculator does: a reply
`<tool_call>{"name": "calculator", "arguments": {"expression": "4821 * 397"}}</tool_call>`
gets `1913937` back as a tool turn, and the answer copies it. The warm start shows that
call on a minority of its demonstrations (`tool_share`); the others answer at once, as a
model that trusts its own arithmetic would (with the right number, which it cannot learn
to produce). RL has to discover that calling pays.

Success: the last number of the final reply is the product. The user is rule-based and
says nothing after the answer; the conversation is one assistant turn with its tool rounds.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

from rollout.tasks.base import Judge, TaskSet
from rollout.tasks.common import final_reply
from rollout.tools.calculator import Calculator
from services.config import MultiplySpec

QUESTIONS = ("What is {a} * {b}?", "Compute {a} times {b}.", "Multiply {a} by {b}.", "How much is {a} x {b}?")
ANSWER = "The answer is {n}."
_NUMBER = re.compile(r"-?\d[\d,]*")


@dataclass(frozen=True)
class Product:
    a: int
    b: int
    template: int

    @property
    def value(self) -> int:
        return self.a * self.b


def make_examples(num_examples: int, seed: int) -> list[Product]:
    rng = random.Random(seed)
    return [
        Product(rng.randrange(1000, 10000), rng.randrange(100, 1000), rng.randrange(len(QUESTIONS)))
        for _ in range(num_examples)
    ]


def question(example: Product) -> str:
    return QUESTIONS[example.template].format(a=example.a, b=example.b)


def call(example: Product) -> str:
    """The calculator call a demonstration makes, in the hermes form."""
    arguments = {"expression": f"{example.a} * {example.b}"}
    return f"<tool_call>{json.dumps({'name': 'calculator', 'arguments': arguments})}</tool_call>"


def answer(n: int) -> str:
    return ANSWER.format(n=n)


def last_number(text: str) -> int | None:
    numbers = _NUMBER.findall(text)
    return int(numbers[-1].replace(",", "")) if numbers else None


def demonstration(example: Product, with_tool: bool) -> dict:
    """A warm-start row: the conversation and the tool schemas it is rendered with."""
    messages = [{"role": "user", "content": question(example)}]
    if with_tool:
        messages += [
            {"role": "assistant", "content": call(example)},
            {"role": "tool", "name": "calculator", "content": str(example.value)},
        ]
    messages.append({"role": "assistant", "content": answer(example.value)})
    return {"messages": messages, "tools": [Calculator().schema()]}


def demonstrations(num: int, tool_share: float, seed: int) -> list[dict]:
    """`num` warm-start rows, a `tool_share` of them calling the calculator."""
    rng = random.Random(seed)
    return [demonstration(example, rng.random() < tool_share) for example in make_examples(num, seed)]


def corpus(chat_template: str) -> list[str]:
    """Text a tiny tokenizer is trained on: demonstrations as `chat_template` (a Jinja chat
    template) renders them, the tool list included, and the tool box's usual error
    messages. Train it with `individual_digits` so every number is spelled digit by digit."""
    from jinja2 import Template

    template = Template(chat_template)
    lines = [template.render(messages=row["messages"], tools=row["tools"]) for row in demonstrations(300, 0.5, seed=99)]
    return lines + [
        "error: there is no tool named",
        "error: bad arguments for calculator",
        "error: could not read the tool call (invalid JSON)",
    ]


class OneAnswerUser:
    """Asks once and says nothing more: the conversation ends after the assistant's turn."""

    async def respond(self, example: int, messages: list[dict], call_id: str = "") -> str | None:
        return None


class MultiplyTask(TaskSet):
    name = "multiply"

    def __init__(self, spec: MultiplySpec, seed: int) -> None:
        self.examples = make_examples(spec.num_examples, seed)
        self.rule_user = OneAnswerUser() if spec.user == "auto" else None

    def __len__(self) -> int:
        return len(self.examples)

    def context(self, example: int) -> list[dict]:
        return [{"role": "user", "content": question(self.examples[example])}]

    def goal(self, example: int) -> str:
        return f"You want the product {self.examples[example].value}."

    def reference(self, example: int) -> str:
        return answer(self.examples[example].value)

    async def score(self, example: int, messages: list[dict], episode=None) -> float:
        return float(last_number(final_reply(messages)) == self.examples[example].value)

    def metrics(self, example: int, messages: list[dict]) -> dict[str, float]:
        """success; `called` (some reply asked for a tool)."""
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        return {
            "success": float(last_number(replies[-1]) == self.examples[example].value),
            "called": float(any("<tool_call>" in r for r in replies)),
        }


def load(spec: MultiplySpec, seed: int, judge: Judge | None = None) -> TaskSet:
    """The task set of a job's `task` section (`rollout.tasks.TASKS`)."""
    return MultiplyTask(spec, seed)
