"""The rubrics `/v1/judge` knows, by name."""

from __future__ import annotations

from judge_proxy.rubrics.base import Criterion, Rubric

INTERACTIVITY = Rubric(
    name="interactivity",
    task=(
        "Judge how well the assistant collaborates over the whole conversation: does it work out "
        "what the user is really after, ask when it cannot know, and move the user forward? "
        "Do not grade the correctness of facts here."
    ),
    criteria=(
        Criterion(
            "understanding",
            "How well does the assistant grasp the user's actual goal, including "
            "needs the user implied but did not state?",
            (
                (0, "Misreads the request or answers a different question."),
                (3, "Gets the topic but misses what the user needs it for."),
                (5, "Understands the literal request; implicit needs are ignored."),
                (7, "Understands the goal and most implicit needs."),
                (10, "Understands the goal and its constraints precisely, stated or not."),
            ),
        ),
        Criterion(
            "clarification",
            "When the request is ambiguous or missing information, does the "
            "assistant ask focused questions instead of guessing, and stay quiet when it is clear?",
            (
                (0, "Guesses through a real ambiguity, or buries the user in needless questions."),
                (3, "Asks, but vaguely or about things that do not matter."),
                (5, "Asks some of what matters; misses a key gap or asks one needless question."),
                (7, "Asks about the key gaps, concisely."),
                (10, "Asks exactly what is needed, at the right moment; no question when none is needed."),
            ),
        ),
        Criterion(
            "suggestions",
            "Does the assistant offer useful next steps, options or "
            "improvements that bring the user closer to the goal?",
            (
                (0, "Nothing beyond the literal answer, or suggestions that mislead."),
                (3, "Generic suggestions that would fit any conversation."),
                (5, "One relevant suggestion."),
                (7, "Relevant, concrete suggestions that fit the user's situation."),
                (10, "Anticipates the user's next need with specific, well-chosen options."),
            ),
        ),
    ),
)

_ACCURACY_TASK = (
    "Compare the assistant's final answer with the reference answer. Only the last answer the "
    "assistant commits to counts, not earlier attempts. Answers that are mathematically or "
    "semantically equivalent to the reference are correct whatever their form."
)

ACCURACY = Rubric(
    name="accuracy",
    task=_ACCURACY_TASK,
    criteria=(
        Criterion(
            "correctness",
            "Does the final answer match the reference?",
            (
                (0, "No final answer, a wrong one, or several candidate answers of which the user must pick."),
                (10, "States one answer, equivalent to the reference."),
            ),
        ),
    ),
    needs_reference=True,
    anchored=True,
)
"""Binary, as the references are (CollabLLM's accuracy): hedging between answers earns nothing."""

ACCURACY_GRADED = Rubric(
    name="accuracy_graded",
    task=_ACCURACY_TASK,
    criteria=(
        Criterion(
            "correctness",
            "Does the final answer match the reference?",
            (
                (0, "No final answer, or an answer that contradicts the reference."),
                (3, "Part of a multi-part answer is right, the rest is wrong or missing."),
                (
                    6,
                    "Right in substance, but with an error the reference does not allow "
                    "(unit, rounding, sign of a part).",
                ),
                (8, "Matches the reference, but hedged among alternatives or stated ambiguously."),
                (10, "States one answer, equivalent to the reference."),
            ),
        ),
    ),
    needs_reference=True,
)

HELPFULNESS = Rubric(
    name="helpfulness",
    task="Judge how useful the assistant's replies are to this user for what they asked.",
    criteria=(
        Criterion(
            "relevance",
            "Do the replies address what the user asked, without drifting?",
            (
                (0, "Off topic."),
                (5, "On topic, with large parts the user did not need."),
                (10, "Every part serves the user's request."),
            ),
        ),
        Criterion(
            "completeness",
            "Do the replies cover everything the user needs to act on them?",
            (
                (0, "Leaves the request unanswered."),
                (3, "Answers a fragment; the user must ask again for the essentials."),
                (5, "Covers the main point; important details or caveats are missing."),
                (7, "Covers the request with minor gaps."),
                (10, "Complete: the user can act without asking again."),
            ),
        ),
        Criterion(
            "clarity",
            "Are the replies easy to follow and as short as the content allows?",
            (
                (0, "Confusing or contradictory."),
                (5, "Understandable, but padded or badly ordered."),
                (10, "Clear, well ordered and concise."),
            ),
        ),
    ),
)

RUBRICS: dict[str, Rubric] = {r.name: r for r in (INTERACTIVITY, ACCURACY, ACCURACY_GRADED, HELPFULNESS)}
