"""A chat template comes with the model folder (an imported GGUF carries its own), and Jinja's
sandbox bounds each `range` but not loops nested in one another: every rendering has a
deadline, past which the template is refused with an error that says so."""

from __future__ import annotations

import threading
import time

import pytest

from devtools.tiny_model import CHATML_TEMPLATE, train_tokenizer
from rollout.tasks import clarify
from services.chat_template import RENDER_DEADLINE_S, ChatTemplateTimeout
from services.tokenization import ChatTokenizer

SPIN = (
    "{% if messages[-1]['content'] == 'spin' %}"
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% endif %}"
)
"""10^10 iterations, each range within the sandbox's bound, and only for one message: the
template renders the base history, so the tokenizer is built, and hangs on that message."""
MARGIN_S = 10.0
"""Past the deadline: the exception lands at the loop's next iteration, microseconds."""


@pytest.fixture(scope="module")
def chat() -> ChatTokenizer:
    return ChatTokenizer(train_tokenizer(clarify.corpus(), 300, chat_template=SPIN + CHATML_TEMPLATE))


def test_a_template_that_loops_past_the_deadline_is_refused_saying_why(chat):
    outcome: list[BaseException | list[int]] = []

    def render() -> None:
        try:
            outcome.append(chat.prompt([{"role": "user", "content": "spin"}]))
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            outcome.append(exc)

    started = time.monotonic()
    worker = threading.Thread(target=render, daemon=True)  # a daemon: without the bound it spins on
    worker.start()
    worker.join(RENDER_DEADLINE_S + MARGIN_S)
    elapsed_s = time.monotonic() - started

    assert not worker.is_alive(), "the rendering ran past its deadline"
    [error] = outcome
    assert isinstance(error, ChatTemplateTimeout)
    assert f"did not render within {RENDER_DEADLINE_S:g} s" in str(error)
    assert RENDER_DEADLINE_S <= elapsed_s < RENDER_DEADLINE_S + MARGIN_S


def test_the_same_thread_renders_normally_after_a_refusal(chat):
    with pytest.raises(ChatTemplateTimeout):
        chat.prompt([{"role": "user", "content": "spin"}])

    ids = chat.prompt([{"role": "user", "content": "a fruit"}])
    time.sleep(RENDER_DEADLINE_S + 0.5)  # a stray interrupt would have landed by now

    assert chat.tokenizer.decode(ids) == "<|im_start|>user\na fruit<|im_end|>\n<|im_start|>assistant\n"
