"""Greedy continuations by vLLM of a model folder, in a process of their own (a test session
already holds an engine): `python vllm_greedy.py FOLDER MAX_TOKENS` reads a JSON list of
prompts (token id lists) on stdin and prints the continuations' token ids as JSON."""

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402


def main() -> None:
    folder, max_tokens = sys.argv[1], int(sys.argv[2])
    prompts = json.load(sys.stdin)
    llm = LLM(
        model=folder,
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        distributed_executor_backend="uni",
        seed=0,
    )
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=max_tokens),
        use_tqdm=False,
    )
    print(json.dumps([list(o.outputs[0].token_ids) for o in outputs]))


if __name__ == "__main__":  # vLLM may spawn this file again for its engine core
    main()
