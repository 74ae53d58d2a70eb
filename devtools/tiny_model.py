"""Build a tiny Llama-architecture model with its own byte-level BPE tokenizer.

Nothing is downloaded: the tokenizer is trained on a corpus passed in, the weights are
drawn from a fixed seed, and the result is an ordinary Hugging Face folder (config.json,
safetensors, tokenizer.json with a ChatML chat template) that both vLLM and transformers
load. head_dim is 64 because vLLM's CPU attention kernel rejects smaller heads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

CHATML_TEMPLATE = (
    # With tools: one line per tool (name, arguments, description) in a system turn, and how
    # to call one; a tool's result is a `tool` turn of its own.
    "{% if tools %}<|im_start|>system\nTools:\n{% for tool in tools %}{% set f = tool['function'] %}"
    "- {{ f['name'] }}({{ f['parameters']['properties'] | join(', ') }}): {{ f['description'] }}\n"
    '{% endfor %}Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
HEAD_DIM = 64


def train_tokenizer(
    corpus: Iterable[str],
    vocab_size: int,
    special_tokens: list[str] = SPECIAL_TOKENS,
    eos_token: str = "<|im_end|>",
    chat_template: str = CHATML_TEMPLATE,
    individual_digits: bool = False,
):
    """A byte-level BPE tokenizer wrapped as a transformers fast tokenizer (the first
    special token pads, `eos_token` ends an assistant turn). `individual_digits` makes every
    digit a token of its own, as Llama 3 and Qwen do: a number is then spelled the same way
    wherever it appears, so copying it (from a tool result into an answer) is copying tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if individual_digits
        else byte_level
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    roles = ["user", "assistant", "system", "tool"]
    lines = list(corpus) + [f"<|im_start|>{role}\n" for role in roles]
    tokenizer.train_from_iterator(lines, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=eos_token,
        pad_token=special_tokens[0],
        chat_template=chat_template,
    )


def make_tiny_model(
    out_dir: str | Path,
    corpus: Iterable[str],
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    vocab_size: int = 512,
    seed: int = 0,
    individual_digits: bool = False,
) -> Path:
    """Write a deterministic tiny LlamaForCausalLM + tokenizer to `out_dir`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(corpus, vocab_size, individual_digits=individual_digits)
    tokenizer.save_pretrained(out)
    num_heads = hidden_size // HEAD_DIM
    eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    _write_generation_config(out, eos_token_id)
    _readable_as_umask_allows(out)
    return out


def _readable_as_umask_allows(out: Path) -> None:
    """transformers writes the weights through a private temporary file (mode 0600), so a
    container running as another user (compose's uid 1000) could not read a model built
    on the host. Give every file the mode an ordinary write would have."""
    umask = os.umask(0)
    os.umask(umask)
    for path in out.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)


def _write_generation_config(out: Path, eos_token_id: int | list[int]) -> None:
    # Sampling defaults belong to the job spec, not the model folder: keep this minimal so
    # vLLM does not pick up transformers' defaults (top_k=50 would change logprobs).
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_token_id}))
