"""What the stand-in provider says: answers to the built-in tasks' prompts, read from the prompt.

The stand-in provider (`devtools.provider`) stands in for a provider's LLM. For the prompts
Tandem itself sends on the built-in clarify task it answers as a capable model would, using
only what the prompt contains (no hidden channel to the task):
- **the user simulator** (`rollout.interactions.llm_user`): the hidden goal ("You want a
  fruit, specifically mango.") is in its system prompt and the conversation in its user
  message. A clarifying question gets the user's answer ("I mean mango."), an answer ends
  the chat, as the rule-based user does;
- **the judge** (`judge_proxy.rubrics`): the rubric's criteria and the conversation are in
  the prompt, the turns quoted (read back with the rubrics' own `read_case`). Interactivity
  is scored from what the assistant did with the request (`interactivity_scores`); accuracy
  by whether the final answer states the reference's key word. The reply is a one-line
  rationale and the JSON object the rubric asks for; to a group prompt (several
  `<candidate>` conversations after `<shared>` turns), the JSON list with one object per
  candidate, each scored as it would be alone. A model the stand-in is told judges
  coarsely (`coarse_judge_models`) scores interactivity's clarification alone, the rest 5:
  a second, cheaper judge to compare against (`tandem rejudge`). Asked for an opening (an empty
  conversation), the user names the category only, as the task's vague requests do;
- **the extraction of a final document or code** (`rollout.tasks.extraction`): the body of
  the last fenced block the assistant wrote, or nothing when it wrote none;
- **a role-played user** (`rollout.interactions.role_play`, briefed with a τ²-bench
  `<scenario>`): the scenario's instructions as its request, then the benchmark's stop
  marker at the agent's first answer, so conversations end as the benchmark's do.
Any other prompt gets None: the upstream then answers filler text, as it always has.

What a prompt looks like and how the clarify task's sentences read are the owners'
knowledge: the prompts' opening lines and markers are imported from the modules that write
them, and the task's sentences are read with the task's own `read_*` parsers.
"""

from __future__ import annotations

import json
import re

from judge_proxy.rubrics.base import JUDGE_OPENING, read_case
from rollout.interactions.llm_user import END_MARKER, GOAL_HEADING, NOT_STARTED
from rollout.tasks import clarify
from rollout.tasks.extraction import PROMPT_OPENING
from rollout.tasks.tau2 import STOP_MARKER
from services.quoting import TAG, fenced_blocks, quoted_turns

_WORD = re.compile(r"[a-z]+")


def reply_for(messages: list[dict], coarse: bool = False) -> str | None:
    """The stand-in's answer to a chat request, or None when it does not recognise it; as a
    judge, a `coarse` one's (`coarse`)."""
    system = next((m.get("content") for m in messages if m.get("role") == "system"), None)
    if not isinstance(system, str):
        return None
    last_user = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), "")
    if GOAL_HEADING in system:
        return user_reply(system, last_user if isinstance(last_user, str) else "")
    if system.startswith(PROMPT_OPENING):
        return extraction_reply(last_user if isinstance(last_user, str) else "")
    if "<scenario>" in system and STOP_MARKER in system:
        return role_play_reply(system, messages)
    if system.startswith(JUDGE_OPENING):
        case = next((m.get("content") for m in messages if m.get("role") == "user"), "")
        return verdict_reply(system, case if isinstance(case, str) else "", coarse)
    return None


# ---- the user simulator --------------------------------------------------------------


def user_reply(system: str, transcript: str) -> str | None:
    """The simulated user's JSON reply: the target when asked, the end marker after an answer."""
    goal = clarify.read_goal(system)
    tag = TAG.search(transcript)
    turns = quoted_turns(transcript, tag.group(0)) if tag else []
    if goal is None:
        return None
    category, target = goal
    if transcript.startswith(NOT_STARTED):
        opening = clarify.REQUEST_TEMPLATES[0].format(category=category)
        return json.dumps({"current_answer": "", "thought": "I start vague.", "response": opening})
    last_assistant = next((text for role, text in reversed(turns) if role == "ASSISTANT"), "")
    if clarify.is_question(last_assistant):
        thought, response = f"It asked which {category}; I say which.", clarify.clarification(target)
    else:
        thought, response = "It gave its answer; nothing more to ask for.", END_MARKER
    return json.dumps(
        {"current_answer": "" if response != END_MARKER else last_assistant, "thought": thought, "response": response}
    )


def role_play_reply(system: str, messages: list[dict]) -> str:
    """The request the scenario describes, or the stop marker once the user has made it
    (its own messages come as `assistant` turns: the roles are swapped). Messages of a
    task's history the user said earlier are not that request: a task that starts from one
    is asked for all the same."""
    scenario = system.split("<scenario>", 1)[1].split("</scenario>", 1)[0]
    instructions = scenario.split("Instructions:", 1)[-1]
    request = " ".join(instructions.split()) or "I need help."
    if any(m.get("role") == "assistant" and m.get("content") == request for m in messages):
        return STOP_MARKER
    return request


# ---- extraction ----------------------------------------------------------------------


def extraction_reply(request: str) -> str:
    """{"final": the last fenced block of the assistant's turns, or ""}."""
    tag = TAG.search(request)
    turns = quoted_turns(request, tag.group(0)) if tag else []
    blocks = [body for role, text in turns if role == "ASSISTANT" for _, body in fenced_blocks(text)]
    return json.dumps({"final": blocks[-1] if blocks else ""})


# ---- the judge -----------------------------------------------------------------------


def stripped(turns: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(role, text.strip()) for role, text in turns]


def interactivity_scores(turns: list[tuple[str, str]]) -> dict[str, int]:
    """0-10 per criterion of the interactivity rubric, by its anchors, for a clarify chat.

    clarification: a vague request met with a question 10; guessed through 0; an explicit
    request answered at once 10, asked about 3; each extra question costs 3.
    understanding: the final answer names what the user said they want 10, something else 3;
    a guess the user never confirmed 5 (the literal request, not the need); no answer 3.
    suggestions: a committed answer 5 (one relevant option), none 0."""
    users = [text for role, text in turns if role == "user"]
    replies = [text for role, text in turns if role == "assistant"]
    if not users or not replies:
        return {"understanding": 0, "clarification": 0, "suggestions": 0}
    stated = clarify.read_explicit_request(users[0])
    explicit = stated is not None
    for text in users[1:]:
        stated = clarify.read_clarification(text) or stated
    questions = sum(clarify.is_question(text) for text in replies)
    first_asks = clarify.is_question(replies[0])
    if explicit:
        clarification = 3 if first_asks else 10
    else:
        clarification = 10 if first_asks else 0
    clarification = max(0, clarification - 3 * max(0, questions - 1))
    final = replies[-1]
    answered = not clarify.is_question(final)
    if not answered:
        understanding = 3
    elif stated is None:
        understanding = 5
    else:
        understanding = 10 if stated in _WORD.findall(final.lower()) else 3
    return {"understanding": understanding, "clarification": clarification, "suggestions": 5 if answered else 0}


def accuracy_scores(turns: list[tuple[str, str]], reference: str) -> dict[str, int]:
    """correctness 10 when the final answer holds the reference's last word, else 0."""
    replies = [text for role, text in turns if role == "assistant"]
    key = _WORD.findall(reference.lower())
    if not replies or not key:
        return {"correctness": 0}
    return {"correctness": 10 if key[-1] in _WORD.findall(replies[-1].lower()) else 0}


def coarse(scores: dict[str, int]) -> dict[str, int]:
    """A judge that reads less than the anchors ask: it sees whether the assistant asked
    (clarification, by its anchor) and gives every other criterion a middling 5."""
    return {name: value if name == "clarification" else 5 for name, value in scores.items()}


def verdict_reply(system: str, case: str, coarse_judge: bool = False) -> str | None:
    read = read_case(case)
    reference = read.reference or ""
    if read.candidates:
        objects = [
            {"candidate": number} | scored
            for number, turns in read.candidates.items()
            if (scored := verdict_of(system, stripped(turns), reference, coarse_judge)) is not None
        ]
        if len(objects) < len(read.candidates):
            return None
        return f"Scoring each candidate against the anchors.\n{json.dumps(objects)}"
    scored = verdict_of(system, stripped(read.turns), reference, coarse_judge)
    return None if scored is None else f"Scoring each criterion against its anchors.\n{json.dumps(scored)}"


def verdict_of(system: str, turns: list[tuple[str, str]], reference: str, coarse_judge: bool = False) -> dict | None:
    """The rubric's criteria scores and a verdict sentence for one conversation (a
    `coarse_judge`'s: `coarse`)."""
    if not turns:
        return None
    if "understanding:" in system and "clarification:" in system:
        scores = interactivity_scores(turns)
        scores = coarse(scores) if coarse_judge else scores
    elif "correctness:" in system and reference:
        scores = accuracy_scores(turns, reference)
    else:
        return None
    mean = sum(scores.values()) / len(scores)
    verdict = "It works with the user well." if mean >= 7 else "It leaves the user's need partly unmet."
    return scores | {"verdict": verdict}
