"""The JSONL-backed tasks: what they load, what they show the policy and the user
simulator, and how they score a right and a wrong conversation."""

from __future__ import annotations

import json

import pytest

from rollout.tasks import load_task
from rollout.tasks.code_chat import python_code
from rollout.tasks.common import fenced_blocks
from rollout.tasks.doc_edit_chat import document_bleu, final_document
from rollout.tasks.math_chat import final_answer, normalise_answer
from services.config import TASK_SPECS, CodeChatSpec, DocEditChatSpec, MathChatSpec


def conversation(task, example: int, *replies: str) -> list[dict]:
    """The task's context, then the given assistant replies with user turns between them."""
    messages = list(task.context(example))
    for i, reply in enumerate(replies):
        if i:
            messages.append({"role": "user", "content": "Some more detail."})
        messages.append({"role": "assistant", "content": reply})
    return messages


@pytest.mark.parametrize(("name", "size"), [("math_chat", 12), ("doc_edit_chat", 10), ("code_chat", 10)])
def test_each_task_loads_its_whole_fixture_or_the_first_num_examples(name, size):
    assert len(load_task(TASK_SPECS[name]())) == size
    first_three = load_task(TASK_SPECS[name](num_examples=3))
    assert len(first_three) == 3
    assert first_three.goal(2) == load_task(TASK_SPECS[name]()).goal(2)


@pytest.mark.parametrize("name", ["math_chat", "doc_edit_chat", "code_chat"])
def test_each_task_opens_with_one_user_message_and_hides_a_longer_goal_for_an_llm_user(name):
    task = load_task(TASK_SPECS[name]())
    assert task.name == name
    assert task.rule_user is None
    for example in range(len(task)):
        [opening] = task.context(example)
        assert opening["role"] == "user"
        assert len(task.goal(example)) > len(opening["content"].split("```")[0])
        assert task.reference(example)


def test_a_data_file_replaces_the_fixture(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [
        {"opening": "Add them.", "goal": "Add 2 and 3.", "answer": "5"},
        {"opening": "Halve it.", "goal": "Halve 9.", "answer": "4.5"},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + "\n")

    task = load_task(MathChatSpec(data=str(path)))

    assert len(task) == 2
    assert task.context(1) == [{"role": "user", "content": "Halve it."}]
    assert task.reference(1) == "4.5"


def test_a_row_missing_a_field_is_rejected_at_load(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"opening": "Add them.", "goal": "Add 2 and 3."}) + "\n")
    with pytest.raises(TypeError, match="answer"):
        load_task(MathChatSpec(data=str(path)))


def test_fenced_blocks_reads_info_word_and_body():
    text = "Intro\n```Python\nx = 1\n```\nmiddle\n```\nplain\n```\n```js extra\ny\n```"
    assert fenced_blocks(text) == [("python", "x = 1\n"), ("", "plain\n"), ("js", "y\n")]
    assert fenced_blocks("```python\nnever closed") == []


# --- MATH-Chat -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("So both are red with probability \\boxed{\\frac{3}{28}}.", "\\frac{3}{28}"),
        ("\\boxed{1} then \\boxed{x = -12}", "x = -12"),  # the last box
        ("You pay 24.50 - 4 = 20.50 dollars.", "20.50"),  # the last number
        ("3/8 times 2/7 is 3/28", "3/28"),
        ("That is \\frac{1}{2} of it", "\\frac{1}{2}"),
        ("That is \\dfrac{1}{2}", "\\dfrac{1}{2}"),
        ("The total is 1,250 apples", "1,250"),
        ("I need more information.", ""),
    ],
)
def test_final_answer_takes_the_last_box_else_the_last_number(text, answer):
    assert final_answer(text) == answer


@pytest.mark.parametrize(
    ("answer", "normal"),
    [
        ("20.50", "41/2"),
        ("\\dfrac{41}{2}", "41/2"),
        ("$41/2$", "41/2"),
        ("x = -12", "-12"),
        ("-\\frac{6}{56}", "-3/28"),
        ("1,250.", "1250"),
        ("\\frac{1}{0}", "\\frac{1}{0}"),  # no number: compared as cleaned text
        ("(1, 2)", "(1,2)"),
    ],
)
def test_normalise_answer_reads_numbers_and_fractions_as_reduced_fractions(answer, normal):
    assert normalise_answer(answer) == normal


async def test_math_exact_match_scores_the_final_answer_of_the_last_reply():
    task = load_task(MathChatSpec())
    assert task.reference(3) == "\\frac{3}{28}"
    asked = "How many marbles of each colour are in the bag?"
    right = conversation(task, 3, asked, "3/8 * 2/7 = 6/56, so \\boxed{\\dfrac{3}{28}}")
    wrong = conversation(task, 3, asked, "Each draw is red with chance 3/8, so 9/64.")

    assert await task.score(3, right) == 1.0
    assert await task.score(3, wrong) == 0.0
    assert task.metrics(3, right) == {"exact_match": 1.0, "asked": 1.0}
    assert task.metrics(3, conversation(task, 3, "It is 3/28.")) == {"exact_match": 1.0, "asked": 0.0}


async def test_math_judge_metric_asks_the_accuracy_rubric_with_the_reference_answer():
    calls = []

    async def judge(rubric: str, messages: list[dict], reference: str | None) -> float:
        calls.append((rubric, messages, reference))
        return 0.25 if "9/64" in messages[-1]["content"] else 0.75

    task = load_task(MathChatSpec(metric="judge"), judge=judge)
    wrong = conversation(task, 3, "It is 9/64.")
    right = conversation(task, 3, "It is \\boxed{3/28}.")

    assert await task.score(3, wrong) == 0.25
    assert await task.score(3, right) == 0.75
    assert calls == [("accuracy", wrong, "\\frac{3}{28}"), ("accuracy", right, "\\frac{3}{28}")]
    assert task.metrics(3, wrong)["exact_match"] == 0.0  # exact match stays on the dashboard


def test_math_judge_metric_without_a_judge_is_rejected_at_load():
    with pytest.raises(ValueError, match="needs a judge"):
        load_task(MathChatSpec(metric="judge"))


# --- MediumDocEdit-Chat ----------------------------------------------------------------


def test_document_bleu_by_hand():
    # Unigrams 5/6, bigrams 3/5, trigrams 2/4, 4-grams 1/3, equal lengths: (1/12) ** (1/4).
    assert document_bleu("the cat sat on the mat", "the cat sat on a mat") == pytest.approx(12**-0.25)
    assert document_bleu("same words here", "same words here") == pytest.approx(1.0)
    assert document_bleu("", "same words here") == 0.0


def test_final_document_is_the_last_fenced_block_else_the_whole_reply():
    assert final_document("Sure:\n```\nfirst\n```\nor\n```text\nsecond draft\n```\nThanks!") == "second draft"
    assert final_document("  just the text \n") == "just the text"


def test_doc_edit_context_shows_the_document_in_a_fence():
    task = load_task(DocEditChatSpec())
    [opening] = task.context(5)
    assert opening["content"].startswith("Fix the mistakes in this paragraph.\n\n```\nThe river Thames flow")
    assert final_document(opening["content"]).startswith("The river Thames flow through London.")


async def test_doc_edit_scores_bleu_of_the_final_document_against_the_reference():
    task = load_task(DocEditChatSpec())
    original = final_document(task.context(5)[0]["content"])
    right = conversation(
        task, 5, "Which fixes do you want?", f"Here it is:\n```\n{task.reference(5)}\n```\nAnything else?"
    )
    unedited = conversation(task, 5, f"```\n{original}\n```")

    assert await task.score(5, right) == pytest.approx(1.0)
    # flow/Their/are wrong in 23 tokens: n-gram precisions 20/23, 16/22, 12/21, 8/20.
    expected = (20 / 23 * 16 / 22 * 12 / 21 * 8 / 20) ** 0.25
    assert await task.score(5, unedited) == pytest.approx(expected)
    assert task.metrics(5, right) == {"bleu": pytest.approx(1.0), "asked": 1.0}


# --- BigCodeBench-Chat -----------------------------------------------------------------


def test_python_code_takes_the_last_python_or_bare_fence():
    reply = "```python\nold = 1\n```\n```bash\nrm -rf x\n```\n```py\nnew = 2\n```\nDone."
    assert python_code(reply) == "new = 2\n"
    assert python_code("```\nbare = 3\n```") == "bare = 3\n"
    assert python_code("```bash\nls\n```") is None
    assert python_code("def f(): pass") is None


async def test_code_chat_scores_the_pass_rate_of_the_last_replys_code():
    task = load_task(CodeChatSpec())
    right = conversation(task, 0, "Should duplicates go?", f"```python\n{task.reference(0)}```")
    # Strips, title-cases and drops empties but keeps duplicates: tests 2 and 4 of 4 pass.
    keeps_duplicates = (
        "```python\ndef normalize_names(names):\n    return [n.strip().title() for n in names if n.strip()]\n```"
    )
    no_code = conversation(task, 0, "I would strip and title-case each name.")

    assert await task.score(0, right) == 1.0
    assert await task.score(0, conversation(task, 0, keeps_duplicates)) == 0.5
    assert await task.score(0, no_code) == 0.0
    assert task.metrics(0, right) == {"has_code": 1.0, "asked": 1.0}
    assert task.metrics(0, no_code) == {"has_code": 0.0, "asked": 0.0}
