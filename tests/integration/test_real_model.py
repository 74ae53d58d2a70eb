"""SmolLM2-135M-Instruct, a real pretrained model (tied embeddings, its own chat template with
a default system turn), as the policy of a job through the whole system."""

from __future__ import annotations

import httpx
import pytest

from services.tokenization import ChatTokenizer, TokenizationMismatch
from tandem.launcher import Ports, Stack

from helpers import wait_for

pytestmark = pytest.mark.slow
MISMATCH_KL_BOUND = 1e-5
"""Per-token KL(vLLM's behaviour logprobs || the learner's) on data sampled from the weights
the learner holds: both in fp32 on CPU, measured at about 1e-9 here. A wrong template, a
weight that did not reach the engine or an untied lm_head shows as 0.1 or more."""
IS_WEIGHT_BOUND = 1.01
"""The largest per-token ratio of learner to engine probability on the same data."""


@pytest.fixture(scope="module")
def chat(real_model) -> ChatTokenizer:
    from transformers import AutoTokenizer

    return ChatTokenizer(AutoTokenizer.from_pretrained(real_model), "strict")


def test_episode_tokens_built_from_deltas_pass_the_strict_check_with_the_default_system_turn(chat):
    tokenizer = chat.tokenizer
    messages = [{"role": "user", "content": "Write me a poem."}]
    tokens = chat.prompt(messages)
    assert tokenizer.decode(tokens).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    for reply, answer in (("About what?", "The sea, please."), ("Rhymed or free?", "Rhymed.")):
        tokens += tokenizer.encode(reply, add_special_tokens=False) + [chat.eot_id]
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": answer}]
        tokens += chat.delta(messages[-1:])
    tokens += tokenizer.encode("Waves at dawn.", add_special_tokens=False) + [chat.eot_id]
    messages.append({"role": "assistant", "content": "Waves at dawn."})
    chat.check(tokens, messages)
    assert tokens == chat.render(messages)[:len(tokens)]  # here even the ids are the canonical ones
    assert chat.eot_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(TokenizationMismatch, match="strict: character"):
        chat.check(tokens, [{"role": "system", "content": "Another system turn."}, *messages])


def job_spec(model: str) -> dict:
    return {
        "name": "real-model-one-step",
        "model": {"path": model, "max_model_len": 1024},
        "task": {"name": "clarify", "num_examples": 32},
        "rollout": {"group_size": 4, "max_new_tokens": 24, "max_turns": 2, "max_total_tokens": 512},
        # The pretrained model does not play clarify's format yet, so success is 0 for
        # every sample; the token penalty gives the groups a spread, hence a real update.
        "reward": {"token_penalty": 0.01},
        # Synchronous, so step 2 trains on samples of the weights step 1 sent: parity after
        # an in-place reload, tied embedding included.
        "train": {"num_steps": 2, "batch_size": 2, "lr": 1e-5, "max_staleness": 0},
    }


def test_real_model_trains_through_the_whole_system_with_engine_parity(tmp_path, real_model):
    with Stack(tmp_path / "logs", ports=Ports.free(), extra_env={"TANDEM_RUNS_DIR": str(tmp_path / "runs")}) as stack:
        api = httpx.Client(base_url=stack.api_url, timeout=10)
        job_id = api.post("/v1/jobs", json=job_spec(str(real_model))).json()["id"]
        record = wait_for(lambda: (r := api.get(f"/v1/jobs/{job_id}").json())["status"] in ("SUCCEEDED", "FAILED")
                          and r, 600, "the job to end", interval_s=1)
        history = api.get(f"/v1/jobs/{job_id}/history").json()
    assert record["status"] == "SUCCEEDED", record.get("error")
    steps = [h for h in history if h.get("phase") == "rl"]
    assert [h["step"] for h in steps] == [1, 2]
    for h in steps:
        assert h["unversioned_tokens"] == 0 and h["trained_tokens"] > 0
        assert abs(h["mismatch_kl"]) < MISMATCH_KL_BOUND and h["is_weight_max"] < IS_WEIGHT_BOUND, h
    assert all(h["staleness_max"] == 0 for h in steps)
    assert steps[0]["skipped_updates"] == 0 and steps[0]["grad_norm"] > 0  # a real update, then parity on it
