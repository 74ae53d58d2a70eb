"""Reward presets: a job spec's `reward.preset` fills in the settings a published recipe
uses, wherever the spec does not set them itself. Whatever a spec does set is kept, so a
departure from the recipe is written in the spec, never hidden (the API stores the spec
with the preset filled in).

`collabllm`: CollabLLM (Wu et al., ICML 2025), its paper's Table 6 and its authors' code.
- MR over S = 3 futures of w = 2 more assistant turns, all sampled (no adaptive count);
- R* = R_ext - min(lambda * tokens, 1) + R_llm, all weights 1, R_llm the interactivity
  judge, which is not shown the task's reference;
- lambda 5e-4 per token (1e-4 for document editing, whose lengths vary most), counting every
  token from the scored response on, user turns included (`token_count: all`);
- futures played by the current policy at 0.6 (math, code) or 0.8 (documents and the rest);
- a collaborative system prompt before every trained context, hidden from the simulator and
  the judge; the simulator plays a person (`task.simulator: person`) and, on the paper's
  three tasks, writes the opening request (`task.opening: simulator`).
What Tandem does differently under the preset, and why, is in docs/DESIGN.md ("CollabLLM").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.config.tasks import TaskBase

COLLABORATIVE_SYSTEM_PROMPT = """You are an assistant who works with the user towards what they actually need.
- Keep track of what the user is after and of everything said so far.
- When a request is unclear or leaves out something that matters, ask about it instead of guessing; \
ask specific questions, and offer choices the user can pick from.
- Suggest concrete next steps when they help.
- Keep what the user has to read and write short; do not repeat yourself.
- Match the user's tone.
- If you do not know, say so, and say where the answer could be found.
- Be accurate and well organised, and check whether what you gave is what the user wanted."""


def collabllm(task: type[TaskBase], given_task: dict) -> dict[str, dict]:
    """The `collabllm` preset's settings, by job-spec section, for a task of model `task`
    (its per-task settings are `task.collabllm`) and the section a spec gives (whether it
    brings its own `contexts`)."""
    defaults = task.collabllm
    writes_openings = defaults.simulator_opens and given_task.get("contexts") is None
    return {
        "reward": {
            "mode": "multiturn",
            "window": 2,
            "num_futures": 3,
            "futures": "fixed",
            "token_penalty": defaults.token_penalty,
            "token_count": "all",
            "extrinsic_weight": 1.0,
            "judge_rubric": "interactivity",
            "judge_weight": 1.0,
            "judge_reference": False,
            "future_temperature": defaults.future_temperature,
        },
        "task": {"system_prompt": COLLABORATIVE_SYSTEM_PROMPT, "simulator": "person"}
        | ({"opening": "simulator"} if writes_openings else {}),
    }


PRESETS = {"collabllm": collabllm}
