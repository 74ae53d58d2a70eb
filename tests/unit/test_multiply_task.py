"""The multiply task: its warm-start rows (the share that calls the calculator, what a call
returns), how a conversation is scored, and what SFT trains on in a row with a tool turn."""

from __future__ import annotations

import json
from itertools import groupby

import pytest

from devtools.tiny_model import CHATML_TEMPLATE, train_tokenizer
from rollout.tasks import multiply
from rollout.tools.calculator import Calculator
from rollout.tools.parsers import parse_hermes
from services.config import MultiplySpec
from services.tokenization import ChatTokenizer


def calls_the_tool(row: dict) -> bool:
    return any(m["role"] == "tool" for m in row["messages"])


@pytest.mark.parametrize(
    ("tool_share", "low", "high"), [(0.0, 0.0, 0.0), (0.3, 0.2, 0.4), (0.7, 0.6, 0.8), (1.0, 1.0, 1.0)]
)
def test_demonstrations_call_the_tool_in_about_the_given_share(tool_share, low, high):
    rows = multiply.demonstrations(200, tool_share, seed=3)

    assert len(rows) == 200
    assert low <= sum(map(calls_the_tool, rows)) / len(rows) <= high


async def test_a_tool_demonstration_calls_the_calculator_and_copies_its_result():
    row = multiply.demonstration(multiply.Product(4821, 397, 0), with_tool=True)

    assert [m["role"] for m in row["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert row["messages"][0]["content"] == "What is 4821 * 397?"
    [call] = parse_hermes(row["messages"][1]["content"]).calls
    assert await Calculator().call(call.arguments) == row["messages"][2]["content"] == "1913937"
    assert row["messages"][3]["content"] == "The answer is 1913937."
    assert row["tools"] == [Calculator().schema()]


async def test_demonstrations_score_1_and_a_wrong_number_scores_0():
    task = multiply.MultiplyTask(MultiplySpec(num_examples=20), seed=5)
    rows = multiply.demonstrations(20, 0.5, seed=5)  # the same examples as the task's
    assert any(map(calls_the_tool, rows)) and not all(map(calls_the_tool, rows))

    for example, row in enumerate(rows):
        messages = row["messages"]
        assert messages[:1] == task.context(example)
        assert await task.score(example, messages) == 1.0
        assert task.metrics(example, messages) == {"success": 1.0, "called": float(calls_the_tool(row))}
        wrong = messages[:-1] + [{"role": "assistant", "content": multiply.answer(task.examples[example].value + 1)}]
        assert await task.score(example, wrong) == 0.0
        assert task.metrics(example, wrong)["success"] == 0.0


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("The answer is 1,913,937.", 1913937),
        ("4821 * 397 = 1913937", 1913937),
        ("It is -12 or 40, I think", 40),
        ("Roughly 2,000,000 - no, 1913937", 1913937),
        ("I cannot tell.", None),
    ],
)
def test_last_number_reads_the_last_integer_commas_included(text, number):
    assert multiply.last_number(text) == number


def test_a_tool_demonstration_trains_on_the_replies_and_not_on_the_tool_result():
    row = multiply.demonstration(multiply.Product(4821, 397, 0), with_tool=True)
    chat = ChatTokenizer(
        train_tokenizer(multiply.corpus(CHATML_TEMPLATE), 512, individual_digits=True), tools=row["tools"]
    )

    tokens, mask = chat.encode_demonstration(row["messages"])

    runs = [
        (trained, chat.tokenizer.decode([t for t, _ in run]))
        for trained, run in groupby(zip(tokens, mask), key=lambda pair: pair[1])
    ]
    assert [trained for trained, _ in runs] == [0, 1, 0, 1]
    assert runs[0][1].startswith("<|im_start|>system\nTools:\n- calculator(expression): ")
    assert runs[0][1].endswith("<|im_start|>user\nWhat is 4821 * 397?<|im_end|>\n<|im_start|>assistant\n")
    assert runs[1][1] == multiply.call(multiply.Product(4821, 397, 0)) + "<|im_end|>"
    assert runs[2][1] == "\n<|im_start|>tool\n1913937<|im_end|>\n<|im_start|>assistant\n"
    assert runs[3][1] == "The answer is 1913937.<|im_end|>"
    assert tokens == chat.render(row["messages"])[: len(tokens)]


def test_warm_start_rows_with_tools_are_rendered_with_them_and_rows_without_are_not(tmp_path):
    from devtools.tiny_model import make_tiny_model
    from learner.warm_start import load_demonstrations
    from services.config import ModelSpec, RLJob

    model = make_tiny_model(tmp_path / "model", multiply.corpus(CHATML_TEMPLATE), individual_digits=True)
    example = multiply.make_examples(1, seed=3)[0]
    plain = {"messages": multiply.demonstration(example, False)["messages"]}
    rows = [multiply.demonstration(example, True), plain, multiply.demonstration(example, False)]
    data = tmp_path / "warm.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))

    samples = load_demonstrations(str(data), RLJob(model=ModelSpec(path=str(model))))

    tokenizer = ChatTokenizer(train_tokenizer(multiply.corpus(CHATML_TEMPLATE), 512, individual_digits=True))
    texts = [tokenizer.tokenizer.decode(s.tokens) for s in samples]
    assert [t.startswith("<|im_start|>system\nTools:") for t in texts] == [True, False, True]
    assert texts[1] == texts[2][texts[2].index("<|im_start|>user") :]  # the same conversation, no tool list
