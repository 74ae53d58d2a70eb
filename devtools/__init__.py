"""Development doubles: what the demo, the tests and the benchmarks stand on instead of the
paid or heavy things a deployment uses. None of the product packages imports them.

- `provider`: a stand-in for an LLM provider's OpenAI-compatible API (real HTTP, rate
  limits, usage, errors, latency), run as `python -m devtools.provider` or by the launcher;
- `provider_replies`: what it answers to the built-in tasks' prompts, read from the prompt
  with the tasks' own parsers;
- `tiny_model`: the 2-layer model and tokenizer built from the clarify task's sentences
  (`tandem make-tiny-model`), so nothing is downloaded.
"""
