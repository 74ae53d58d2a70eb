"""What tests/gpu's tests share: the model shape, a free port, the learner's Trainer on
CUDA and random samples (a module of its own: `conftest` is a name every folder's conftest has)."""

from __future__ import annotations

import random
import socket

import torch

SHAPE = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=2,
    num_attention_heads=4,  # head_dim 64, as SmolLM2's
    num_key_value_heads=2,
    vocab_size=2048,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
)
"""A small Llama of SmolLM2's kind (grouped-query attention, tied embeddings)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_trainer(folder, dtype: str, packing: str = "varlen"):
    """The learner's own Trainer on CUDA (its packing probe runs here)."""
    from learner.trainer import Trainer
    from services.config import parse_job_spec

    spec = parse_job_spec(
        {"model": {"path": str(folder), "dtype": dtype}, "train": {"lr": 1e-4, "packing": packing, "kl_coef": 0.0}}
    )
    return Trainer(spec, torch.device("cuda", 0))


def make_samples(count: int, lengths: tuple[int, int], seed: int = 0) -> list:
    """Random token sequences of varied length with ±1 advantages (random weights: a
    uniform policy gives each token about -log(vocab))."""
    import math

    from services.protocol import Sample

    rng = random.Random(seed)
    vocab = SHAPE["vocab_size"]

    def sample(i: int, n: int) -> Sample:
        return Sample(
            sample_id=str(i),
            tokens=[rng.randrange(vocab) for _ in range(n)],
            mask=[0] * 4 + [1] * (n - 4),
            logprobs=[-math.log(vocab)] * n,
            versions=[0] * n,
            reward=0.0,
            advantage=rng.choice([-1.0, 1.0]),
            num_turns=1,
        )

    return [sample(i, rng.randint(*lengths)) for i in range(count)]
