"""The process τ²-bench's code runs in: `python -m rollout.tasks.tau2.worker DOMAIN FD`.

The rollout server starts one per task set (`worlds.WorldHost`); it loads the domain and
its tasks, then answers requests on the socket FD. Every other process of the domain is a
fork of it or of one of its forks, so each starts from a copy of memory holding the shipped
environment and the tasks, and a fork of one that holds an episode's world holds a copy of
that world. A process answers one request at a time (`wire` messages):

- `fork`: a copy of this process; the reply carries its socket and a pidfd to kill it with.
- `world` {task}: become an episode's world, the task's initial state applied (no reply).
- `call` {id, name, arguments}: the environment's answer to an agent's tool call.
- `verdict` {task, trajectory, ended}: the benchmark's verdict on a conversation,
  computed on fresh copies of the shipped environment.

The server kills a process whose call passes its deadline. A process whose server is gone
ends on its socket's end of file, or, inside a request, at `BACKSTOP_S`: SIGALRM left at
its default action ends the process even while it runs C code.
"""

from __future__ import annotations

import copy
import gc
import importlib
import os
import signal
import socket
import sys

from rollout.tasks.tau2 import judged, quiet, start
from rollout.tasks.tau2.arithmetic import guard_calculate
from rollout.tasks.tau2.wire import WireError, receive, send
from rollout.tools.sandbox import PR_SET_CHILD_SUBREAPER, _prctl

BACKSTOP_S = 600
"""No request takes this long: the server has stopped every call and verdict long before."""


def main(argv: list[str]) -> None:
    domain, fd = argv[0], int(argv[1])
    sock = socket.socket(fileno=fd)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)  # a fork whose parent ended is reparented here...
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # ...and every process that ends is reaped at once
    quiet()
    guard_calculate()
    module = importlib.import_module(f"tau2.domains.{domain}.environment")
    environment, tasks = module.get_environment(), {task.id: task for task in module.get_tasks()}
    gc.freeze()  # forks share the loaded domain's pages: no collection may touch (and copy) them
    send(sock, {"ready": True})
    serve(sock, environment, tasks)


def serve(sock: socket.socket, environment, tasks: dict) -> None:
    """Answer requests until the server closes the socket, then exit."""
    lost = ""
    while True:
        try:
            message, _ = receive(sock)
        except WireError:
            os._exit(0)
        signal.alarm(BACKSTOP_S)
        op = message["op"]
        if op == "fork":
            sock = fork(sock) or sock
        elif op == "world":
            lost = start_world(environment, tasks[message["task"]])
        elif op == "call":
            send(sock, {"lost": lost} if lost else {"answer": answer(environment, message)})
        elif op == "verdict":
            send(sock, {"verdict": verdict(environment, tasks[message["task"]], message)})
        signal.alarm(0)


def fork(sock: socket.socket) -> socket.socket | None:
    """Fork this process: in the copy, the copy's socket; in this one, None once the reply
    has handed the copy's other end and a pidfd of it to the server."""
    mine, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        sock.close()
        theirs.close()
        return mine
    mine.close()
    pidfd = os.pidfd_open(pid)
    send(sock, {"pid": pid}, (theirs.fileno(), pidfd))
    theirs.close()
    os.close(pidfd)
    return None


def start_world(environment, task) -> str:
    """Apply the task's initial state; "" or why it could not be (every call then says so)."""
    try:
        start(environment, task)
    except Exception as exc:  # noqa: BLE001 - the benchmark's data; the episode's calls report it
        return f"the task's initial state could not be applied ({type(exc).__name__}: {exc})"
    return ""


def answer(environment, message: dict) -> dict:
    from tau2.data_model.message import ToolCall

    call = ToolCall(id=message["id"], name=message["name"], arguments=message["arguments"], requestor="assistant")
    return environment.get_response(call).model_dump(mode="json")


def verdict(environment, task, message: dict) -> dict:
    """The benchmark's RewardInfo for the conversation, each environment its evaluators
    build a fresh copy of this process's (a fork of the worker's: the domain as it ships)."""
    from pydantic import TypeAdapter
    from tau2.data_model.message import Message

    trajectory = TypeAdapter(list[Message]).validate_python(message["trajectory"])

    def fresh(solo_mode: bool = False):
        return copy.deepcopy(environment)

    return judged(fresh, task, trajectory, message["ended"]).model_dump(mode="json")


if __name__ == "__main__":
    main(sys.argv[1:])
