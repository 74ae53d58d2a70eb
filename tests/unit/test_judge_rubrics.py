"""Judge rubrics: the prompts they render and the verdicts read back (no made-up scores)."""

from __future__ import annotations

import pytest

from judge_proxy.rubrics import RUBRICS, parse_verdict, render

INTERACTIVITY = RUBRICS["interactivity"]


def test_interactivity_is_the_mean_of_understanding_clarification_and_suggestions():
    text = ('The assistant asks one sharp question.\n'
            '{"understanding": 8, "clarification": 6, "suggestions": 1, "verdict": "Asks well, suggests little."}')

    verdict = parse_verdict(INTERACTIVITY, text)

    assert verdict.criteria == {"understanding": 0.8, "clarification": 0.6, "suggestions": 0.1}
    assert verdict.score == pytest.approx(0.5)
    assert verdict.verdict == "Asks well, suggests little."


def test_json_in_a_code_fence_after_prose_is_found_and_numeric_strings_count():
    text = 'Reasoning {braces in prose}.\n```json\n{"Understanding": "7", "clarification": "10/10", "suggestions": 4.5}\n```'

    verdict = parse_verdict(INTERACTIVITY, text)

    assert verdict.criteria == {"understanding": 0.7, "clarification": 1.0, "suggestions": 0.45}
    assert verdict.score == pytest.approx(0.7166667)
    assert verdict.verdict == ""


def test_a_tagged_verdict_is_read():
    text = ("<understanding>9</understanding> <clarification> 3 </clarification>\n"
            "<suggestions>6</suggestions><verdict> Fine overall. </verdict>")

    verdict = parse_verdict(INTERACTIVITY, text)

    assert verdict.criteria == {"understanding": 0.9, "clarification": 0.3, "suggestions": 0.6}
    assert verdict.score == pytest.approx(0.6)
    assert verdict.verdict == "Fine overall."


def test_a_json_object_without_the_criteria_is_skipped_for_a_later_one():
    verdict = parse_verdict(RUBRICS["accuracy"], 'Given {"answer": 42} I judge: {"correctness": 10, "verdict": "same"}')

    assert verdict.score == 1.0 and verdict.criteria == {"correctness": 1.0}


@pytest.mark.parametrize("text", [
    "",
    "I would give it 8/10 overall.",
    '{"understanding": 8, "clarification": 6}',
    '{"understanding": 11, "clarification": 6, "suggestions": 1}',
    '{"understanding": -1, "clarification": 6, "suggestions": 1}',
    '{"understanding": true, "clarification": 6, "suggestions": 1}',
    '{"understanding": "high", "clarification": 6, "suggestions": 1}',
    "<understanding>8</understanding><clarification>6</clarification>",
])
def test_a_verdict_missing_or_out_of_range_is_unparseable_not_guessed(text):
    assert parse_verdict(INTERACTIVITY, text) is None


def test_the_prompt_holds_every_criterion_the_conversation_and_the_reference():
    conversation = [{"role": "user", "content": "What is 6*7?"}, {"role": "assistant", "content": "42"}]

    system, user = render(RUBRICS["accuracy"], conversation, "42")

    assert system["role"] == "system" and "correctness" in system["content"]
    assert '{"correctness": <0-10>, "verdict": "<one sentence>"}' in system["content"]
    assert user["content"] == ("<conversation>\n[user]\nWhat is 6*7?\n\n[assistant]\n42\n</conversation>\n\n"
                               "<reference>\n42\n</reference>")


def test_the_strict_prompt_replays_the_unreadable_reply_and_demands_bare_json():
    conversation = [{"role": "user", "content": "help me plan a trip"}]

    prompt = render(INTERACTIVITY, conversation, None, strict=True, previous_reply="It is good.")

    assert [m["role"] for m in prompt] == ["system", "user", "assistant", "user"]
    assert prompt[2]["content"] == "It is good."
    assert "exactly one JSON object and nothing before or after it" in prompt[3]["content"]
    assert "<reference>" not in prompt[1]["content"]


def test_rubrics_are_fine_grained_with_anchors_spanning_the_scale():
    assert [c.name for c in INTERACTIVITY.criteria] == ["understanding", "clarification", "suggestions"]
    assert [c.name for c in RUBRICS["helpfulness"].criteria] == ["relevance", "completeness", "clarity"]
    assert RUBRICS["accuracy"].needs_reference and not INTERACTIVITY.needs_reference
    for rubric in RUBRICS.values():
        for criterion in rubric.criteria:
            scores = [score for score, _ in criterion.anchors]
            assert scores[0] == 0 and scores[-1] == 10 and len(scores) >= 3 and scores == sorted(scores)
