"""SmolLM2-135M-Instruct, a real pretrained model (tied embeddings, its own chat template with
a default system turn), as the policy of a job through the whole system, and exported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from helpers import wait_for
from safetensors.torch import load_file

from services.tokenization import ChatTokenizer, TokenizationMismatch
from tandem.launcher import Ports, Stack

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
    assert tokens == chat.render(messages)[: len(tokens)]  # here even the ids are the canonical ones
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
        "train": {"num_steps": 2, "batch_size": 2, "lr": 1e-5, "max_staleness": 0, "checkpoint_every": 1},
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory, real_model) -> tuple[Path, str, list[dict]]:
    """A two-step job on the real model: (runs folder, job id, history)."""
    tmp = tmp_path_factory.mktemp("real-job")
    with Stack(tmp / "logs", ports=Ports.free(), extra_env={"TANDEM_RUNS_DIR": str(tmp / "runs")}) as stack:
        api = httpx.Client(base_url=stack.api_url, timeout=10)
        job_id = api.post("/v1/jobs", json=job_spec(str(real_model))).json()["id"]
        record = wait_for(
            lambda: (r := api.get(f"/v1/jobs/{job_id}").json())["status"] in ("SUCCEEDED", "FAILED") and r,
            600,
            "the job to end",
            interval_s=1,
        )
        assert record["status"] == "SUCCEEDED", record.get("error")
        return tmp / "runs", job_id, api.get(f"/v1/jobs/{job_id}/history").json()


def test_real_model_trains_through_the_whole_system_with_engine_parity(trained):
    _, _, history = trained
    steps = [h for h in history if h.get("phase") == "rl"]
    assert [h["step"] for h in steps] == [1, 2]
    for h in steps:
        assert h["unversioned_tokens"] == 0 and h["trained_tokens"] > 0
        assert abs(h["mismatch_kl"]) < MISMATCH_KL_BOUND and h["is_weight_max"] < IS_WEIGHT_BOUND, h
    assert all(h["staleness_max"] == 0 for h in steps)
    # A real update, which the export tests below check landed in the weights. The
    # untrained model mostly breaks clarify's format (reward -1 for every sample: no spread,
    # no update), so one step may pass without one; both without would be a finding.
    assert any(h["skipped_updates"] == 0 and h["grad_norm"] > 0 for h in steps), steps


def export(runs: Path, job_id: str, out: Path, *step: str) -> Path:
    subprocess.run(
        [sys.executable, "-m", "tandem.cli", "export", job_id, str(out), "--runs-dir", str(runs), *step], check=True
    )
    return out


def transformers_greedy(folder: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = []
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
        out.append(ids[0, len(prompt) :].tolist())
    return out


def test_export_from_a_checkpoint_equals_the_learners_export_and_loads_in_transformers_and_vllm(
    trained, real_model, chat, tmp_path
):
    runs, job_id, _ = trained
    final = export(runs, job_id, tmp_path / "final")  # the folder the learner wrote at the end
    from_checkpoint = export(runs, job_id, tmp_path / "step-2", "--step", "2")  # rebuilt from the DCP shards
    learner, rebuilt, base = (load_file(f / "model.safetensors") for f in (final, from_checkpoint, real_model))
    assert learner.keys() == rebuilt.keys() == base.keys()  # lm_head tied, saved once, as in the base
    assert all(torch.equal(learner[k], rebuilt[k]) for k in learner)
    assert not all(torch.equal(learner[k], base[k]) for k in learner)  # the job did move the weights
    record = json.loads((from_checkpoint / "provenance.json").read_text())
    assert record["step"] == 2 and record["base_provenance"]["model"] == "smollm2-135m-instruct"

    prompts = [
        chat.prompt([{"role": "user", "content": text}])
        for text in ("What is the capital of France?", "Write a haiku about rain.", "Help me plan a trip.")
    ]
    by_transformers = transformers_greedy(from_checkpoint, prompts, 24)  # both stop at <|im_end|>
    by_vllm = json.loads(
        subprocess.run(
            [sys.executable, str(Path(__file__).parent / "vllm_greedy.py"), str(from_checkpoint), "24"],
            input=json.dumps(prompts),
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()[-1]
    )
    assert by_vllm == by_transformers
    assert sum(len(ids) for ids in by_vllm) > 30


def test_export_names_the_steps_it_has_when_asked_for_another(trained, tmp_path):
    runs, job_id, _ = trained
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.cli",
            "export",
            job_id,
            str(tmp_path / "x"),
            "--runs-dir",
            str(runs),
            "--step",
            "7",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "no complete checkpoint at step 7" in done.stderr
    assert "complete checkpoints: " in done.stderr and not (tmp_path / "x").exists()


def test_export_of_a_job_the_runs_folder_does_not_hold_says_so(tmp_path):
    (tmp_path / "runs" / "other-job").mkdir(parents=True)  # a folder without job.json is no job either
    for job in ("no-such-job", "other-job"):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "tandem.cli",
                "export",
                job,
                str(tmp_path / "x"),
                "--runs-dir",
                str(tmp_path / "runs"),
            ],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 1 and f"no job {job} under" in done.stderr and not (tmp_path / "x").exists()


def test_export_of_a_job_with_no_policy_or_checkpoint_yet_says_it_has_none(tmp_path):
    (tmp_path / "runs" / "fresh-job").mkdir(parents=True)
    (tmp_path / "runs" / "fresh-job" / "job.json").write_text("{}")  # written at start, nothing trained yet
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.cli",
            "export",
            "fresh-job",
            str(tmp_path / "x"),
            "--runs-dir",
            str(tmp_path / "runs"),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "(complete checkpoints: none)" in done.stderr and not (tmp_path / "x").exists()
