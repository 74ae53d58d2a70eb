"""`tandem serve-model`: the command line it hands to vLLM's server, and the CPU threads it
gives that server's engine (two engines on shared cores must not spin against each other)."""

from __future__ import annotations

import os

import pytest

from tandem.cli import build_parser


def served(tiny_model, monkeypatch, *flags: str) -> tuple[dict, list[str]]:
    """Runs `tandem serve-model` up to the exec; the environment and argv vLLM would get."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    calls = []
    monkeypatch.setattr(os, "execv", lambda path, argv: calls.append((dict(os.environ), argv)))
    args = build_parser().parse_args(["serve-model", str(tiny_model), "--name", "tiny", *flags])
    args.run(args)
    (call,) = calls
    return call


def test_threads_become_the_engines_openmp_threads(tiny_model, monkeypatch):
    env, argv = served(tiny_model, monkeypatch, "--threads", "1")
    assert env["OMP_NUM_THREADS"] == "1"
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--served-model-name") + 1] == "tiny"


def test_without_threads_the_engine_keeps_every_core(tiny_model, monkeypatch):
    env, _ = served(tiny_model, monkeypatch)
    assert "OMP_NUM_THREADS" not in env


def test_a_negative_thread_count_is_refused(tiny_model, monkeypatch):
    with pytest.raises(SystemExit):
        served(tiny_model, monkeypatch, "--threads", "-1")


def test_on_cpu_seeded_requests_are_never_prefilled_in_chunks(tiny_model, monkeypatch):
    """The judge proxy seeds every call; vLLM's CPU engine dies on a seeded request in a
    partial prefill, so the served model prefills whole prompts within one step's budget."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("chunked prefill stays on on GPU")
    _, argv = served(tiny_model, monkeypatch, "--max-model-len", "4096")
    assert "--no-enable-chunked-prefill" in argv
    assert int(argv[argv.index("--max-num-batched-tokens") + 1]) >= 4096
