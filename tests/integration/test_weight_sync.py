"""The weight broadcast into the real vLLM engine, checked against the learner's logprobs."""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch

from learner.trainer import Trainer
from learner.weight_sender import WeightSender
from rollout.tasks import clarify
from services import protocol
from services.config import ModelSpec, RLJob
from services.tokenization import ChatTokenizer
from tandem.redis_embed import free_port

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.slow]


@pytest.fixture(scope="module")
def trainer(tiny_model, process_group, tokenizer):
    """A learner whose weights have moved away from the checkpoint the engine loaded."""
    spec = RLJob(model=ModelSpec(path=str(tiny_model), max_model_len=512))
    spec.warm_start.lr = 1e-2
    trainer = Trainer(spec, torch.device("cpu"))
    chat = ChatTokenizer(tokenizer)
    samples = []
    for i, messages in enumerate(clarify.demonstrations(16, seed=0, ask_share=0.5)):
        tokens, mask = chat.encode_demonstration(messages)
        samples.append(
            protocol.Sample(
                sample_id=str(i),
                tokens=tokens,
                mask=mask,
                logprobs=[0.0] * len(tokens),
                versions=[-1] * len(tokens),
                reward=0.0,
                advantage=0.0,
                num_turns=0,
            )
        )
    for _ in range(3):
        trainer.sft_step(samples)
    return trainer


def fixed_sequence(tokenizer) -> list[int]:
    example = clarify.make_examples(1, seed=7)[0]
    return ChatTokenizer(tokenizer).encode_demonstration(clarify.demonstration(example, True, None))[0]


def learner_logprobs(trainer: Trainer, tokens: list[int]) -> list[float]:
    sample = protocol.Sample(
        sample_id="x",
        tokens=tokens,
        mask=[1] * len(tokens),
        logprobs=[0.0] * len(tokens),
        versions=[0] * len(tokens),
        reward=0.0,
        advantage=0.0,
        num_turns=0,
    )
    with torch.no_grad():
        logprobs, _ = trainer.token_logprobs(trainer.batches.collate([sample], [0]))
    trainer.model.reshard()
    return logprobs.tolist()


async def broadcast(engine, sender: WeightSender, version: int, server: str = "server-a") -> dict:
    plan = sender.plan(version, {server: 0.0})
    sent, received = await asyncio.gather(
        asyncio.to_thread(sender.send, plan),
        engine.update_weights(plan, protocol.encode(plan), plan.ranks[server], "abort"),
    )
    assert sent["failed"] == 0.0
    return received


async def test_the_engine_names_its_workers_devices(engine):
    """What its server reports for the learner's choice of backend (`weight_group.choose_backend`)."""
    await engine.identify_devices()
    assert engine.devices == ["cpu"]


async def test_engine_logprobs_equal_learner_logprobs_after_broadcast(engine, trainer, tokenizer):
    tokens = fixed_sequence(tokenizer)
    before = await engine.score(tokens)
    learner = learner_logprobs(trainer, tokens)
    assert max(abs(a - b) for a, b in zip(before, learner)) > 1e-2, "the learner's weights should differ"

    # 1 MiB buckets: the tiny model's 2.5 MB of weights travel in several buckets.
    sender = WeightSender(trainer, "job-sync", bucket_mib=1, timeout_s=30, advertise_host="127.0.0.1", store_port=0)
    assert len(sender.buckets) > 1
    received = await broadcast(engine, sender, version=1)
    after = await engine.score(tokens)

    assert engine.version == received["version"] == 1
    assert received["nbytes"] == sum(b.nbytes for b in sender.buckets)
    assert max(abs(a - b) for a, b in zip(after[1:], learner[1:])) < 1e-4


async def test_sampled_logprobs_match_learner_and_versions_tag_tokens(engine, trainer, tokenizer):
    sender = WeightSender(trainer, "job-sync-2", bucket_mib=512, timeout_s=30, advertise_host="127.0.0.1", store_port=0)
    await broadcast(engine, sender, version=5)
    prompt = ChatTokenizer(tokenizer).prompt([{"role": "user", "content": "I want a fruit."}])
    generation = await engine.generate(prompt, 24, 1.0, [tokenizer.eos_token_id])
    learner = learner_logprobs(trainer, prompt + generation.tokens)[len(prompt) :]

    assert set(generation.versions) == {5}
    assert max(abs(a - b) for a, b in zip(generation.logprobs, learner)) < 1e-4


async def test_a_new_epoch_forms_a_new_group_when_membership_changes(engine, trainer, tokenizer):
    sender = WeightSender(trainer, "job-sync-3", bucket_mib=512, timeout_s=30, advertise_host="127.0.0.1", store_port=0)
    await broadcast(engine, sender, version=1, server="server-a")
    first_epoch = sender.epoch
    await broadcast(engine, sender, version=2, server="server-b")  # same engine, new identity

    assert sender.epoch == first_epoch + 1
    assert engine.version == 2


async def test_a_learner_restarted_on_the_same_port_reaches_the_engine_again(engine, trainer, tokenizer):
    """A fixed store port (as in docker compose): the restarted learner's store is new and
    its epochs count from 1 again; only the session tells the receiver to reconnect."""
    port = free_port()
    first = WeightSender(
        trainer, "job-sync-4", bucket_mib=512, timeout_s=30, advertise_host="127.0.0.1", store_port=port
    )
    await broadcast(engine, first, version=1)
    first.group = first.store = None  # the learner process ends: its group and store go
    del first
    gc.collect()

    again = WeightSender(
        trainer, "job-sync-4", bucket_mib=512, timeout_s=30, advertise_host="127.0.0.1", store_port=port
    )
    received = await broadcast(engine, again, version=2)

    assert again.epoch == 1 and received["version"] == engine.version == 2


async def test_keep_mode_continues_a_generation_on_the_new_weights(engine, trainer, tokenizer, tiny_model):
    """A request kept across an update goes on with the new weights (its KV recomputed):
    its tokens after the update score as the learner scores them."""
    await engine.reload_from_disk(str(tiny_model))
    prompt = ChatTokenizer(tokenizer).prompt([{"role": "user", "content": "I want a fruit."}])
    sender = WeightSender(trainer, "job-sync-5", bucket_mib=512, timeout_s=30, advertise_host="127.0.0.1", store_port=0)
    generating = asyncio.create_task(engine.generate(prompt, 400, 1.0, [], ignore_eos=True))  # runs its length
    await asyncio.sleep(0.3)
    plan = sender.plan(7, {"server-a": 0.0})
    await asyncio.gather(
        asyncio.to_thread(sender.send, plan),
        engine.update_weights(plan, protocol.encode(plan), plan.ranks["server-a"], "keep"),
    )
    generation = await generating

    assert generation.versions[0] == 0 and generation.versions[-1] == 7, "the update must land mid-generation"
    first_new = generation.versions.index(7)
    learner = learner_logprobs(trainer, prompt + generation.tokens)[len(prompt) :]
    assert max(abs(a - b) for a, b in zip(generation.logprobs[first_new:], learner[first_new:])) < 1e-4
