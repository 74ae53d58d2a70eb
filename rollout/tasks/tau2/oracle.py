"""The oracle's conversations of a τ² task set, as warm-start data (`bench.tau2_mock`): what
the task expects done and said, played against the shipped environment."""

from __future__ import annotations

import copy

from rollout.tasks.tau2 import Tau2Task, hermes_calls, start


def demonstration(task_set: Tau2Task, example: int) -> list[dict]:
    """The oracle's conversation, as warm-start data: the context, the user's request
    (the scenario's instructions), one reply making the task's expected calls with the
    environment's answers, then one saying what the task expects to be said."""
    task = task_set.tasks[example]
    messages = task_set.context(example)
    if messages[-1]["role"] == "assistant":
        instructions = task.user_scenario.instructions
        messages.append({"role": "user", "content": str(getattr(instructions, "reason_for_call", instructions))})
    criteria = task.evaluation_criteria
    actions = (criteria.actions or []) if criteria else []
    if actions:
        from tau2.data_model.message import ToolCall

        environment = start(copy.deepcopy(task_set.environment), task)
        messages.append({"role": "assistant", "content": hermes_calls([(a.name, a.arguments) for a in actions])})
        for action in actions:
            call = ToolCall(id=action.action_id, name=action.name, arguments=action.arguments)
            answer = environment.get_response(call)
            content = f"error: {answer.content.removeprefix('Error: ')}" if answer.error else answer.content
            messages.append({"role": "tool", "name": action.name, "content": content})
    said = (criteria.communicate_info or []) if criteria else []
    messages.append(
        {
            "role": "assistant",
            "content": " ".join(f"{info}." for info in said)
            or "That is taken care of. Is there anything else I can help you with?",
        }
    )
    return messages
