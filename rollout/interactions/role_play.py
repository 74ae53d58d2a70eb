"""An LLM that plays the user from a brief the task writes, as τ²-bench's user simulator does.

The brief (the task's `brief(example)`: the benchmark's simulation guidelines and the task's
scenario) is the system prompt; the conversation follows as a chat with the roles swapped,
the assistant's replies as the simulator's user turns and the user's own messages as its
turns. The simulator sees only what the user saw: no system prompt, no tool traffic, no
reply that asked for tools. Its reply is the user's next message, said as written; a reply
holding one of the task's stop markers ends the conversation. It knows no task: everything
task-specific arrives in the brief and the markers.

The policy's replies reach the simulator as chat turns, as in the benchmark, `neutralised`:
a turn marker a reply spells (`<|im_start|>user`) opens no turn of its own. A reply that
talks the simulator into stopping early gains nothing: the verdict reads the database, the
actions taken and what was said, not the simulator's mood.
"""

from __future__ import annotations

from collections.abc import Callable

from rollout.interactions.llm_user import UserSimulatorError, call_seed
from services.quoting import neutralised


class RolePlayUser:
    def __init__(
        self,
        client,
        brief: Callable[[int], str],
        stop_markers: tuple[str, ...],
        model: str,
        job: str = "",
        max_tokens: int = 512,
        temperature: float = 1.0,
        seed: int = 0,
    ) -> None:
        self.client, self.brief, self.stop_markers = client, brief, stop_markers
        self.model, self.job = model, job
        self.max_tokens, self.temperature, self.seed = max_tokens, temperature, seed

    async def respond(self, example: int, messages: list[dict], call_id: str = "") -> str | None:
        prompt = [{"role": "system", "content": self.brief(example)}, *swapped(messages)]
        text = await self._ask(prompt, call_id)
        if not text:  # a blank reply is asked for once more, under a call id of its own
            text = await self._ask(prompt, call_id and f"{call_id}/again")
        if not text:
            raise UserSimulatorError("the user simulator answered nothing, twice")
        return None if any(marker in text for marker in self.stop_markers) else text

    async def _ask(self, prompt: list[dict], call_id: str) -> str:
        seed = call_seed(self.seed, call_id) if call_id else None
        result = await self.client.chat(
            prompt,
            model=self.model,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            job=self.job,
            priority="simulator",
            idempotency_key=call_id,
            seed=seed,
        )
        return (result.content or "").strip()


def swapped(messages: list[dict]) -> list[dict]:
    """The conversation as the simulator reads it: what the user saw, roles swapped, each
    message `neutralised`."""
    seen = [
        m
        for i, m in enumerate(messages)
        if m["role"] == "user"
        or (m["role"] == "assistant" and not (i + 1 < len(messages) and messages[i + 1]["role"] == "tool"))
    ]
    return [
        {"role": "assistant" if m["role"] == "user" else "user", "content": neutralised(m["content"])} for m in seen
    ]
