"""TRL's side of bench/vs_trl.py: GRPOTrainer on a Tandem job spec's work.

Runs in TRL's own environment (bench/trl_side/.venv, made by bench/vs_trl.py), never in
Tandem's. From Tandem it imports only what defines the work: the job spec's schema, the
task (its prompts and its success rule), the user simulator's prompt and the judge
client, so that both systems optimise the same reward and reach the same judge proxy over
HTTP, under the same budget. How the work gets done is TRL's:

- TRL generates each step's responses itself (transformers' `generate`; its vLLM paths do
  not run on vLLM's CPU build, see bench/vs_trl.py) and trains them with its GRPO loss.
- The reward is one `async` reward function (bench/trl_side/reward.py, Tandem's R* for
  plain conversations), which TRL awaits once per step on its event loop. It scores every
  response of the step concurrently (`asyncio.gather`).
- `reward.mode: multiturn` with `window > 0` (CollabLLM's multiturn-aware reward) has no
  counterpart in TRL. The reward function does it the way a TRL user would: for every
  response, `num_futures` futures continued in rounds. Each round makes all live futures'
  simulator calls at once, then generates the policy's next turn for all of them in one
  batched `generate` under the current weights (`Policy`). R* of each future; the mean is
  the reward.

Writes OUT/history.jsonl (one line per step: wall seconds since training began, reward,
judge and simulator calls), OUT/policies/step-N every `train.export_every` steps and
OUT/policy at the end, all as HF folders Tandem's evaluation loads.

    python bench/trl_side/train.py --spec SPEC.json --judge-url URL --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.trl_side.reward import ClarifyReward  # noqa: E402
from services.config import JobSpec, parse_job_spec  # noqa: E402


class Policy:
    """Batched sampling from the model TRL is training, for the policy's turns in futures."""

    def __init__(self, trainer: GRPOTrainer, spec: JobSpec) -> None:
        self.trainer = trainer
        self.tokenizer = trainer.processing_class
        self.eos = set(trainer.eos_token_ids)
        self.rollout = spec.rollout
        self.temperature = spec.reward.future_temperature or spec.rollout.temperature

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )

    def sample(self, conversations: list[list[dict]]) -> list[tuple[int, str, bool]]:
        """The next assistant turn of each conversation, all in one batch: (its number of
        tokens, its text, whether it ended on an end-of-turn token rather than being cut at
        the length limit)."""
        prompts = [self.prompt_ids(m) for m in conversations]
        width = max(map(len, prompts))
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        budget = min(self.rollout.max_new_tokens, max(1, self.rollout.max_total_tokens - width))
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention,
                do_sample=True,
                temperature=self.temperature,
                top_p=1.0,
                top_k=0,
                max_new_tokens=budget,
                pad_token_id=pad,
            )
        turns = []
        for row in out[:, width:].tolist():
            end = next((i for i, token in enumerate(row) if token in self.eos), None)
            tokens = row if end is None else row[: end + 1]
            turns.append((len(tokens), self.tokenizer.decode(tokens, skip_special_tokens=True), end is not None))
        return turns


class History(TrainerCallback):
    """One line per step in OUT/history.jsonl, and the policy exported every few steps."""

    def __init__(self, out: Path, reward: ClarifyReward, export_every: int) -> None:
        self.out = out
        self.reward = reward
        self.export_every = export_every
        self.started = time.monotonic()
        self.file = open(out / "history.jsonl", "w")

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = time.monotonic()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            line = {
                "step": state.global_step,
                "seconds": time.monotonic() - self.started,
                "reward_mean": logs["reward"],
                "reward_std": logs.get("reward_std"),
                "completion_length": logs.get("completions/mean_length"),
                "kl": logs.get("kl"),
                "calls": dict(self.reward.calls),
            }
            self.file.write(json.dumps(line) + "\n")
            self.file.flush()

    def on_train_end(self, args, state, control, **kwargs):
        self.file.close()

    def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        if self.export_every and state.global_step % self.export_every == 0 and state.global_step < state.max_steps:
            export(model, processing_class, self.out / "policies" / f"step-{state.global_step}")


def export(model, tokenizer, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def config(spec: JobSpec, out: Path) -> GRPOConfig:
    """Tandem's settings in GRPOConfig's terms: the same group, batch (groups per step),
    step size, optimizer (AdamW, betas 0.9/0.99, constant rate, clip 1.0), clipping
    (0.2/0.28), KL (k3 to the start policy) and token-level normalisation ("dapo")."""
    train, rollout = spec.train, spec.rollout
    return GRPOConfig(
        output_dir=str(out / "trainer"),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        seed=train.seed,
        data_seed=train.seed,
        max_steps=train.num_steps,
        logging_steps=1,
        report_to="none",
        disable_tqdm=not sys.stderr.isatty(),  # a bar in a log file is one endless line; metrics are logged
        save_strategy="no",
        dataloader_num_workers=0,
        num_generations=rollout.group_size,
        per_device_train_batch_size=rollout.group_size * train.batch_size,
        gradient_accumulation_steps=1,
        num_iterations=1,
        learning_rate=train.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=train.weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.99,
        max_grad_norm=train.max_grad_norm,
        epsilon=train.eps_low,
        epsilon_high=train.eps_high,
        beta=train.kl_coef,
        loss_type="dapo",
        scale_rewards="group" if spec.reward.scale_advantage_by_std else "none",
        temperature=rollout.temperature,
        top_p=1.0,
        top_k=0,
        max_completion_length=rollout.max_new_tokens,
        use_vllm=False,
    )


def dataset(task, size: int) -> Dataset:
    """Every example's context as a conversational prompt, with its id for the reward."""
    return Dataset.from_list([{"prompt": task.context(i), "example": i} for i in range(size)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="the Tandem job spec (JSON) whose work TRL does")
    parser.add_argument("--judge-url", required=True, help="the judge proxy both systems share")
    parser.add_argument("--job-id", default="trl", help="the job name the proxy charges and caches under")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = parse_job_spec(json.loads(Path(args.spec).read_text()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reward = ClarifyReward(spec, args.judge_url, args.job_id)
    trainer = GRPOTrainer(
        model=spec.model.path,
        reward_funcs=reward,
        args=config(spec, out),
        train_dataset=dataset(reward.task, len(reward.task)),
    )
    reward.policy = Policy(trainer, spec)
    history = History(out, reward, spec.train.export_every)
    trainer.add_callback(history)
    trainer.train()
    export(trainer.model, trainer.processing_class, out / "policy")
    if reward.client is not None:
        asyncio.run_coroutine_threadsafe(reward.client.aclose(), trainer.async_loop).result()
    (out / "done.json").write_text(json.dumps({"seconds": time.monotonic() - history.started, "calls": reward.calls}))


if __name__ == "__main__":
    main()
