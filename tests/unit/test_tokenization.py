"""Delta tokenization equals full tokenization, for three kinds of chat template built
here (ChatML with a default system prompt, Qwen3-style think dropping, Llama-3-style),
and with tool messages for the tiny model's template and Qwen2.5/Qwen3-style tool
templates; the sanity check catches a template that breaks it."""

from __future__ import annotations

import json

import pytest

from devtools.tiny_model import CHATML_TEMPLATE, train_tokenizer
from rollout.tasks import clarify
from rollout.tools.calculator import Calculator
from services.tokenization import ChatTokenizer, TokenizationMismatch

CHATML_WITH_SYSTEM = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Like Qwen3: reasoning of assistant turns before the last user message is not rendered.
QWEN3_STYLE = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% set content = m['content'] %}"
    "{% if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_STYLE = (
    "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# Breaks the delta property: the last user message is marked, so earlier turns re-render.
MARKS_LAST_TURN = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if loop.last and m['role'] == 'user' %} (latest){% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Like Qwen2.5: the tools' JSON schemas in the system turn; a `tool` message is a user turn
# wrapping `<tool_response>`, and consecutive ones share that turn. A newline right after a
# block tag is a `{{ '\n' }}` expression: transformers renders with trim_blocks.
_TOOLS_SYSTEM = (
    "{% if tools %}<|im_start|>system\nYou are helpful.\n\n# Tools\n\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    'Call one as <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    "<|im_end|>\n{% endif %}"
)
_TOOL_AS_USER = (
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
)
QWEN25_TOOLS = (
    _TOOLS_SYSTEM + "{% for m in messages %}{% if m['role'] == 'tool' %}" + _TOOL_AS_USER + "{% else %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Like Qwen3 with tools: as Qwen2.5, and reasoning of assistant turns before the last *user*
# message (tool results do not count) is not rendered.
QWEN3_TOOLS = (
    _TOOLS_SYSTEM + "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% set content = m['content'] %}"
    "{% if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "{% if m['role'] == 'tool' %}" + _TOOL_AS_USER + "{% else %}"
    "<|im_start|>{{ m['role'] }}\n{{ content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIALS = ["<|finetune_pad|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
TOOLS = [Calculator().schema()]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "4821 * 397"}}</tool_call>'
CORPUS = (
    clarify.corpus()
    + ["You are helpful.", "<think>the user was vague</think>", "latest"]
    + [
        CALL,
        "<tool_response>\n1913937\n</tool_response>",
        "The answer is 1913937.",
        "<think>too big to do by heart</think>",
        "# Tools",
        "<tools>",
        json.dumps(TOOLS[0]),
        "Tools:",
        "- calculator(expression): " + Calculator().description,
        '{"name": <function-name>, "arguments": <args-json-object>}',
    ]
)

TEMPLATES = {
    "chatml": (CHATML_WITH_SYSTEM, CHATML_SPECIALS, "<|im_end|>"),
    "qwen3": (QWEN3_STYLE, CHATML_SPECIALS, "<|im_end|>"),
    "llama3": (LLAMA3_STYLE, LLAMA3_SPECIALS, "<|eot_id|>"),
    "broken": (MARKS_LAST_TURN, CHATML_SPECIALS, "<|im_end|>"),
    "tiny": (CHATML_TEMPLATE, CHATML_SPECIALS, "<|im_end|>"),
    "qwen2.5_tools": (QWEN25_TOOLS, CHATML_SPECIALS, "<|im_end|>"),
    "qwen3_tools": (QWEN3_TOOLS, CHATML_SPECIALS, "<|im_end|>"),
}


def chat(name: str, mode: str = "strict", tools: list[dict] | None = None) -> ChatTokenizer:
    template, specials, eos = TEMPLATES[name]
    return ChatTokenizer(train_tokenizer(CORPUS, 400, specials, eos, template), mode, tools)


def conversation(think: bool = False) -> list[dict]:
    example = clarify.ClarifyExample("fruit", "mango", 0)
    first = ("<think>the user was vague</think>\n" if think else "") + clarify.question("fruit")
    return [
        {"role": "user", "content": clarify.request(example)},
        {"role": "assistant", "content": first},
        {"role": "user", "content": clarify.clarification("mango")},
        {"role": "assistant", "content": clarify.answer("fruit", "mango")},
    ]


def tool_conversation(think: bool = False) -> list[dict]:
    """A question answered after one call, then after two calls in one reply, then a
    follow-up answered at once; `think` opens every reply with reasoning."""
    thought = "<think>too big to do by heart</think>\n" if think else ""
    two_calls = CALL + "\n" + CALL.replace("4821 * 397", "1913937 + 1")
    return [
        {"role": "user", "content": "What is 4821 * 397?"},
        {"role": "assistant", "content": thought + CALL},
        {"role": "tool", "name": "calculator", "content": "1913937"},
        {"role": "assistant", "content": thought + two_calls},
        {"role": "tool", "name": "calculator", "content": "1913937"},
        {"role": "tool", "name": "calculator", "content": "1913938"},
        {"role": "assistant", "content": thought + "The answer is 1913937."},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": thought + "You are welcome."},
    ]


def episode_tokens(tok: ChatTokenizer, messages: list[dict]) -> list[int]:
    """What an episode accumulates: the first prompt, then per assistant reply the tokens
    the model emits (its content, then the end-of-turn token), then the delta of the user
    or tool messages that follow it."""
    tokens = tok.prompt(messages[:1])
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for i, following in zip(replies, replies[1:] + [len(messages)]):
        tokens += tok.tokenizer.encode(messages[i]["content"], add_special_tokens=False) + [tok.eot_id]
        if i + 1 < following:
            tokens += tok.delta(messages[i + 1 : following])
    return tokens


@pytest.mark.parametrize("name", ["chatml", "qwen3", "llama3"])
def test_delta_tokenization_equals_full_tokenization(name):
    tok = chat(name)
    messages = conversation()
    tokens = episode_tokens(tok, messages)

    assert tokens == tok.render(messages)[: len(tokens)]
    tok.check(tokens, messages)  # strict: no exception


def test_the_delta_keeps_the_separator_after_the_end_of_turn_token():
    tok = chat("chatml")
    delta = tok.delta([{"role": "user", "content": "I mean mango."}])
    assert tok.tokenizer.decode(delta).startswith("\n<|im_start|>user\nI mean mango.")
    assert tok.tokenizer.decode(delta).endswith("<|im_start|>assistant\n")


def test_qwen3_style_think_dropping_needs_ignore_strippable():
    messages = conversation(think=True)
    strict, lenient = chat("qwen3", "strict"), chat("qwen3", "ignore_strippable")
    tokens = episode_tokens(strict, messages)  # the model's own <think> tokens stay in

    with pytest.raises(TokenizationMismatch):
        strict.check(tokens, messages)  # the re-rendering dropped the first turn's <think>
    lenient.check(tokens, messages)
    chat("qwen3", "off").check(tokens, messages)


def test_the_sanity_check_flags_a_template_that_rewrites_earlier_turns():
    tok = chat("broken")
    messages = conversation()
    with pytest.raises(TokenizationMismatch):
        tok.check(episode_tokens(tok, messages), messages)


def test_a_non_canonical_segmentation_of_the_policys_text_passes_strict():
    tok = chat("chatml")
    messages = conversation()
    canonical = episode_tokens(tok, messages)
    word = tok.tokenizer.encode(" mango", add_special_tokens=False)
    letters = [t for ch in " mango" for t in tok.tokenizer.encode(ch, add_special_tokens=False)]
    assert word != letters
    at = max(i for i in range(len(canonical)) if canonical[i : i + len(word)] == word)  # in the final answer
    spelled = canonical[:at] + letters + canonical[at + len(word) :]

    tok.check(spelled, messages)  # the model's own segmentation is never re-tokenized


def test_a_demonstration_masks_exactly_the_assistant_turns():
    tok = chat("llama3")
    tokens, mask = tok.encode_demonstration(conversation())
    trained = tok.tokenizer.decode([t for t, m in zip(tokens, mask) if m])
    assert trained == clarify.question("fruit") + "<|eot_id|>" + clarify.answer("fruit", "mango") + "<|eot_id|>"


@pytest.mark.parametrize("name", ["tiny", "qwen2.5_tools", "qwen3_tools"])
def test_delta_tokenization_with_tool_messages_equals_full_tokenization(name):
    tok = chat(name, tools=TOOLS)
    messages = tool_conversation()
    tokens = episode_tokens(tok, messages)

    assert tokens == tok.render(messages)[: len(tokens)]
    tok.check(tokens, messages)  # strict: no exception


def test_the_tiny_template_shows_the_tools_and_gives_a_tool_result_its_own_turn():
    tok = chat("tiny", tools=TOOLS)
    decode = tok.tokenizer.decode

    assert decode(tok.prompt(tool_conversation()[:1])) == (
        "<|im_start|>system\nTools:\n- calculator(expression): " + Calculator().description + "\n"
        'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>\n'
        "<|im_start|>user\nWhat is 4821 * 397?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert decode(tok.delta([{"role": "tool", "name": "calculator", "content": "1913937"}])) == (
        "\n<|im_start|>tool\n1913937<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not decode(chat("tiny").prompt(tool_conversation()[:1])).startswith("<|im_start|>system")


def test_qwen25_style_consecutive_tool_messages_share_one_user_turn():
    tok = chat("qwen2.5_tools", tools=TOOLS)
    delta = tok.delta([{"role": "tool", "content": "1913937"}, {"role": "tool", "content": "1913938"}])

    assert tok.tokenizer.decode(delta) == (
        "\n<|im_start|>user\n<tool_response>\n1913937\n</tool_response>"
        "\n<tool_response>\n1913938\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_qwen3_style_think_dropping_with_tool_messages_needs_ignore_strippable():
    messages = tool_conversation(think=True)
    strict, lenient = chat("qwen3_tools", "strict", TOOLS), chat("qwen3_tools", "ignore_strippable", TOOLS)
    tokens = episode_tokens(strict, messages)  # the model's own <think> tokens stay in

    with pytest.raises(TokenizationMismatch):
        strict.check(tokens, messages)  # the re-rendering dropped the reasoning before "Thanks."
    lenient.check(tokens, messages)


def test_with_tools_renders_the_schemas_and_keeps_the_tokenizer_and_mode():
    plain = chat("qwen2.5_tools", "ignore_strippable")
    tooled = plain.with_tools(TOOLS)

    assert plain.with_tools(None) is plain and tooled.with_tools(TOOLS) is tooled
    assert (tooled.tokenizer, tooled.check_mode, tooled.tools) == (plain.tokenizer, "ignore_strippable", TOOLS)
    shown = tooled.tokenizer.decode(tooled.prompt([{"role": "user", "content": "hi"}]))
    assert '<tools>\n{"type": "function", "function": {"name": "calculator"' in shown


def test_a_template_that_ignores_tools_gets_them_in_its_system_turn_in_every_rendering(real_model):
    """SmolLM2's template drops the `tools` argument: the schemas and how to call them go
    into the system turn instead, the same in the prompt, the deltas and the check."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model)
    schema = {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Find an order.",
            "parameters": {"type": "object", "properties": {}},
        },
    }
    plain = ChatTokenizer(tokenizer)
    chat = plain.with_tools([schema])
    context = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is my order?"}]
    shown = tokenizer.decode(chat.prompt(context))
    assert shown.startswith("<|im_start|>system\nBe brief.\n\nYou can call these tools")
    assert '"name": "lookup"' in shown and "<tool_call>" in shown
    assert '"name": "lookup"' not in tokenizer.decode(plain.prompt(context))
    reply = tokenizer.encode('<tool_call>{"name": "lookup", "arguments": {}}</tool_call>', add_special_tokens=False)
    result = [{"role": "tool", "name": "lookup", "content": "shipped"}]
    answer = tokenizer.encode("It shipped.", add_special_tokens=False)
    tokens = chat.prompt(context) + reply + [chat.eot_id] + chat.delta(result) + answer + [chat.eot_id]
    messages = context + [
        {"role": "assistant", "content": tokenizer.decode(reply)},
        *result,
        {"role": "assistant", "content": "It shipped."},
    ]
    chat.check(tokens, messages)  # raises on a mismatch
