"""Delta tokenization equals full tokenization, for three kinds of chat template built
here (ChatML with a default system prompt, Qwen3-style think dropping, Llama-3-style),
and the sanity check catches a template that breaks it."""

from __future__ import annotations

import pytest

from rollout.tasks import clarify
from tandem.tiny_model import train_tokenizer
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
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIALS = ["<|finetune_pad|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CORPUS = clarify.corpus() + ["You are helpful.", "<think>the user was vague</think>", "latest"]

TEMPLATES = {
    "chatml": (CHATML_WITH_SYSTEM, CHATML_SPECIALS, "<|im_end|>"),
    "qwen3": (QWEN3_STYLE, CHATML_SPECIALS, "<|im_end|>"),
    "llama3": (LLAMA3_STYLE, LLAMA3_SPECIALS, "<|eot_id|>"),
    "broken": (MARKS_LAST_TURN, CHATML_SPECIALS, "<|im_end|>"),
}


def chat(name: str, mode: str = "strict") -> ChatTokenizer:
    template, specials, eos = TEMPLATES[name]
    return ChatTokenizer(train_tokenizer(CORPUS, 400, specials, eos, template), mode)


def conversation(think: bool = False) -> list[dict]:
    example = clarify.ClarifyExample("fruit", "mango", 0)
    first = ("<think>the user was vague</think>\n" if think else "") + clarify.question("fruit")
    return [{"role": "user", "content": clarify.request(example)},
            {"role": "assistant", "content": first},
            {"role": "user", "content": clarify.clarification("mango")},
            {"role": "assistant", "content": clarify.answer("fruit", "mango")}]


def episode_tokens(tok: ChatTokenizer, messages: list[dict]) -> list[int]:
    """What an episode accumulates: the first prompt, then per assistant turn the tokens
    the model emits (its content, then the end-of-turn token), then the delta of the
    following user turn."""
    tokens = tok.prompt(messages[:1])
    for i in range(1, len(messages), 2):
        tokens += tok.tokenizer.encode(messages[i]["content"], add_special_tokens=False) + [tok.eot_id]
        if i + 1 < len(messages):
            tokens += tok.delta([messages[i + 1]])
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
    at = max(i for i in range(len(canonical)) if canonical[i:i + len(word)] == word)  # in the final answer
    spelled = canonical[:at] + letters + canonical[at + len(word):]

    tok.check(spelled, messages)  # the model's own segmentation is never re-tokenized


def test_a_demonstration_masks_exactly_the_assistant_turns():
    tok = chat("llama3")
    tokens, mask = tok.encode_demonstration(conversation())
    trained = tok.tokenizer.decode([t for t, m in zip(tokens, mask) if m])
    assert trained == clarify.question("fruit") + "<|eot_id|>" + clarify.answer("fruit", "mango") + "<|eot_id|>"
