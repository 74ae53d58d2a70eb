"""Tandem's benchmarks: each measures one claim against a baseline run beside it and writes
a report (`python -m bench.<name>`; `bench/README.md` lists them, `bench.harness` is what they
share)."""
