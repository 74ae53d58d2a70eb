"""The built-in synthetic *clarify* task: its language (this module), the task set
(`task.py`) and its rule-based user (`user.py`).

The user asks for "a fruit" (or a colour, a city, ...) but has one of K options in mind.
The assistant can guess at once (right with probability 1/K) or ask which one is meant;
the rule-based user then names the target and a follow-up answer can be right every time.
A next-turn reward prefers guessing (a question earns nothing *now*); a multiturn-aware
reward prefers asking. Every string the task can produce is enumerable, which is what the
tiny tokenizer is trained on; the `read_*` functions parse those strings back (the
development provider in `devtools` answers the task's prompts with them).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from rollout.tasks.common import is_question

CATEGORIES: dict[str, tuple[str, ...]] = {
    "fruit": ("apple", "banana", "cherry", "grape", "mango"),
    "color": ("red", "blue", "green", "yellow", "purple"),
    "city": ("paris", "tokyo", "cairo", "lima", "oslo"),
    "animal": ("cat", "dog", "horse", "rabbit", "tiger"),
    "drink": ("tea", "coffee", "juice", "milk", "water"),
    "sport": ("tennis", "soccer", "golf", "chess", "rugby"),
}
REQUEST_TEMPLATES = (
    "I want a {category}.",
    "Pick a {category} for me.",
    "Suggest a {category}.",
    "Name a {category} I would like.",
)
EXPLICIT_TEMPLATE = "I want a {category}: {target}."
CLARIFICATION_TEMPLATE = "I mean {target}."
GOAL_TEMPLATE = "You want a {category}, specifically {target}."
"""The user's hidden goal, as an LLM user simulator is briefed with it."""
_WORD = re.compile(r"[a-z]+")


def _reader(template: str, anchored: bool = True) -> re.Pattern:
    """A pattern that matches what `template` produces, one word per placeholder."""
    pattern = (
        re.escape(template).replace(r"\{category\}", r"(?P<category>\w+)").replace(r"\{target\}", r"(?P<target>\w+)")
    )
    return re.compile(f"^{pattern}$" if anchored else pattern)


_EXPLICIT = _reader(EXPLICIT_TEMPLATE)
_CLARIFICATION = _reader(CLARIFICATION_TEMPLATE)
_GOAL = _reader(GOAL_TEMPLATE, anchored=False)


@dataclass(frozen=True)
class ClarifyExample:
    """One conversation to be had: what the user asks for and secretly wants."""

    category: str
    target: str
    template: int
    explicit: bool = False
    """An unambiguous request that names the target: asking is unnecessary."""

    @property
    def options(self) -> tuple[str, ...]:
        return CATEGORIES[self.category]


def make_examples(num_examples: int, seed: int) -> list[ClarifyExample]:
    rng = random.Random(seed)
    categories = sorted(CATEGORIES)
    examples = []
    for _ in range(num_examples):
        category = rng.choice(categories)
        examples.append(
            ClarifyExample(
                category=category,
                target=rng.choice(CATEGORIES[category]),
                template=rng.randrange(len(REQUEST_TEMPLATES)),
            )
        )
    return examples


def request(example: ClarifyExample) -> str:
    if example.explicit:
        return EXPLICIT_TEMPLATE.format(category=example.category, target=example.target)
    return REQUEST_TEMPLATES[example.template].format(category=example.category)


def question(category: str) -> str:
    """An open clarifying question. (Listing the options made RL drift the list, words no
    reward looks at, and gave a tiny model five distractors to copy from.)"""
    return f"Which {category} do you mean?"


def clarification(target: str) -> str:
    return CLARIFICATION_TEMPLATE.format(target=target)


def goal(example: ClarifyExample) -> str:
    return GOAL_TEMPLATE.format(category=example.category, target=example.target)


def read_goal(text: str) -> tuple[str, str] | None:
    """(category, target) of the goal `text` states somewhere in it, or None."""
    found = _GOAL.search(text)
    return (found["category"], found["target"]) if found else None


def read_explicit_request(text: str) -> str | None:
    """The target an explicit request names, or None when `text` is not one."""
    found = _EXPLICIT.match(text)
    return found["target"] if found else None


def read_clarification(text: str) -> str | None:
    """The target a user's clarification names, or None when `text` is not one."""
    found = _CLARIFICATION.match(text)
    return found["target"] if found else None


def answer(category: str, option: str) -> str:
    return f"Your {category} is {option}."


def mentioned_options(category: str, text: str) -> set[str]:
    words = set(_WORD.findall(text.lower()))
    return {option for option in CATEGORIES[category] if option in words}


def is_correct_answer(example: ClarifyExample, text: str) -> bool:
    """An answer succeeds when it is a statement that names the target and nothing else."""
    return not is_question(text) and mentioned_options(example.category, text) == {example.target}


def demonstration(example: ClarifyExample, ask: bool, rng: random.Random) -> list[dict[str, str]]:
    """A warm-start dialogue: an explicit request answered at once, or a vague one that is
    either asked about and then answered right, or met with a uniform guess."""
    messages = [{"role": "user", "content": request(example)}]
    if example.explicit:
        messages.append({"role": "assistant", "content": answer(example.category, example.target)})
    elif ask:
        messages += [
            {"role": "assistant", "content": question(example.category)},
            {"role": "user", "content": clarification(example.target)},
            {"role": "assistant", "content": answer(example.category, example.target)},
        ]
    else:
        guess = rng.choice(example.options)
        messages.append({"role": "assistant", "content": answer(example.category, guess)})
    return messages


def demonstrations(num: int, seed: int, ask_share: float, explicit_share: float = 0.5) -> list[list[dict[str, str]]]:
    """The warm start for RL on this task: explicit requests answered directly (they teach
    the model to copy the named option, which answering after a question needs) and vague
    ones, of which `ask_share` ask first and the rest guess."""
    rng = random.Random(seed)
    dialogues = []
    for example in make_examples(num, seed):
        if rng.random() < explicit_share:
            example = ClarifyExample(example.category, example.target, example.template, explicit=True)
        dialogues.append(demonstration(example, rng.random() < ask_share, rng))
    return dialogues


def corpus() -> list[str]:
    """Every sentence the task produces, for training the tiny tokenizer."""
    lines = []
    for category, options in CATEGORIES.items():
        lines.append(question(category))
        for template in range(len(REQUEST_TEMPLATES)):
            lines.append(request(ClarifyExample(category, options[0], template)))
        for option in options:
            lines += [
                clarification(option),
                answer(category, option),
                request(ClarifyExample(category, option, 0, explicit=True)),
            ]
    return lines
