"""Tandem's benchmarks: each measures one claim against a baseline run beside it and writes
a report (`python -m bench.<name>`; `bench/README.md` lists them, `bench.harness` is what they
share)."""

SHARED = ("harness", "judge_bound", "clarify_runs", "async_groups")
"""The modules benchmarks share (a benchmark imports no other module of bench/)."""
PARTS = ("chaos_learner",)
"""Modules run by a benchmark as a process of its own: neither shared nor benchmarks."""
