"""The warm start: supervised steps on demonstrations before RL (`warm_start` in the job
spec), so the policy RL starts from already knows the task's format."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

from services import protocol
from services.config import JobSpec


def batches(spec: JobSpec) -> Iterator[list[protocol.Sample]]:
    """`warm_start.steps` batches of demonstrations, drawn with the job's seed."""
    warm = spec.warm_start
    if warm.steps == 0:
        return
    if not warm.data:
        raise ValueError("warm_start.data is required when warm_start.steps > 0")
    samples = load_demonstrations(warm.data, spec)
    rng = random.Random(spec.train.seed)
    for _ in range(warm.steps):
        yield rng.sample(samples, min(warm.batch_size, len(samples)))


def load_demonstrations(path: str, spec: JobSpec) -> list[protocol.Sample]:
    """JSONL of {"messages": [...]} -> SFT samples (mask on assistant tokens). A row may
    carry `tools` (OpenAI function schemas, the usual form of tool-calling SFT data): its
    conversation is then rendered with them, as the rollout servers render episodes. The
    job's `task.system_prompt` goes before every conversation that has no system message,
    as it goes before every RL context (CollabLLM fine-tunes under its prompt too)."""
    from transformers import AutoTokenizer

    from services.tokenization import ChatTokenizer

    chat = ChatTokenizer(AutoTokenizer.from_pretrained(spec.model.path), "off")
    by_tools: dict[str, ChatTokenizer] = {}
    samples = []
    with open(path) as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            tools = row.get("tools")
            key = json.dumps(tools, sort_keys=True)
            if key not in by_tools:  # rendering the base history once per tool list, not per row
                by_tools[key] = chat.with_tools(tools, spec.tools.parser if spec.tools else "hermes")
            messages = row["messages"]
            system = spec.task.system_message()
            if system and not (messages and messages[0].get("role") == "system"):
                messages = [{"role": "system", "content": system}, *messages]
            tokens, mask = by_tools[key].encode_demonstration(messages)
            samples.append(
                protocol.Sample(
                    sample_id=f"sft:{line_number}",
                    tokens=tokens,
                    mask=mask,
                    logprobs=[0.0] * len(tokens),
                    versions=[-1] * len(tokens),
                    reward=0.0,
                    advantage=0.0,
                    num_turns=0,
                )
            )
    if not samples:
        raise ValueError(f"no demonstrations in {path}")
    return samples
