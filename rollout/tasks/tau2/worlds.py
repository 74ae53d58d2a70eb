"""Where τ²-bench's code runs for the rollout server: worker processes (`worker`), never
its event loop. The benchmark's tools and evaluators are synchronous Python that a policy's
arguments steer; run on the loop, one slow call would stop the heartbeat and every other
episode, and the tool box's timeout could never fire. In a thread it could not be stopped
either (an integer power spins in C, holding the GIL).

Each episode's world is a process of its own, forked from the task set's worker; a forked
episode's world is a fork of that process (a few milliseconds, where copying the airline
database takes a third of a second). A call awaits the process's answer on its socket; when
the tool box's deadline cancels it, the process is killed and the world is lost. Each
verdict runs in a fresh fork too, under `VERDICT_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import weakref

from rollout.tasks.tau2.wire import WireError, blocking, receive, send
from rollout.tasks.tau2.wire import request as wire_request

WORKER = ("-m", "rollout.tasks.tau2.worker")
"""Python's arguments that run the worker, before the domain and the socket's descriptor."""
START_TIMEOUT_S = 120.0
"""For the worker to import the benchmark and load the domain."""
FORK_TIMEOUT_S = 10.0
"""For an idle process to fork (milliseconds; the server waits on its loop meanwhile)."""
VERDICT_TIMEOUT_S = 60.0
"""For a verdict: copies of the domain and a replay of the conversation's calls, seconds."""


class WorldLost(Exception):
    """A call on a world whose process is gone."""


class Process:
    """A worker process as the server holds it: its socket (non-blocking) and a pidfd."""

    def __init__(self, sock: socket.socket, pidfd: int, child: subprocess.Popen | None = None) -> None:
        sock.setblocking(False)
        self.sock, self._pidfd = sock, pidfd
        self.close = weakref.finalize(self, _release, sock, pidfd, child)
        """Close the socket (the process ends at its end of file) and reap the process if it
        is the server's child; once, also when collected."""

    def fork(self) -> Process:
        """A copy of the process, of its memory as it is now; the loop waits for it."""
        with blocking(self.sock, FORK_TIMEOUT_S):
            send(self.sock, {"op": "fork"})
            _, fds = receive(self.sock)
        if len(fds) != 2:
            raise WireError("a fork came back without its socket and pidfd")
        return Process(socket.socket(fileno=fds[0]), fds[1])

    def tell(self, message: dict) -> None:
        with blocking(self.sock, FORK_TIMEOUT_S):
            send(self.sock, message)

    async def request(self, message: dict) -> dict:
        return await wire_request(self.sock, message)

    def kill(self) -> None:
        if self.close.alive:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        self.close()


def _release(sock: socket.socket, pidfd: int, child: subprocess.Popen | None) -> None:
    sock.close()
    os.close(pidfd)
    if child is not None:
        child.wait(FORK_TIMEOUT_S)


class WorldHost:
    """A domain's worker, started at the first world or verdict and again after a failure."""

    def __init__(self, domain: str) -> None:
        self.domain = domain
        self._root: Process | None = None

    def spawn(self) -> Process:
        """A fresh fork of the worker: the domain as it ships, in a process of its own."""
        if self._root is None:
            self._root = self._start()
        try:
            return self._root.fork()
        except (OSError, WireError) as exc:
            self._root.kill()
            self._root = None
            raise RuntimeError(f"the τ² worker of {self.domain} failed ({exc}); the next world starts another") from exc

    def _start(self) -> Process:
        ours, theirs = socket.socketpair()
        with theirs:
            worker = subprocess.Popen(
                [sys.executable, *WORKER, self.domain, str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
            )
        root = Process(ours, os.pidfd_open(worker.pid), worker)
        try:
            with blocking(ours, START_TIMEOUT_S):
                receive(ours)
        except (OSError, WireError) as exc:
            root.kill()
            raise RuntimeError(f"the τ² worker of {self.domain} did not start ({exc})") from exc
        return root

    async def verdict(self, message: dict) -> dict:
        """The worker's answer to a `verdict` request, from a fresh fork killed after it;
        TimeoutError past VERDICT_TIMEOUT_S."""
        process = self.spawn()
        try:
            async with asyncio.timeout(VERDICT_TIMEOUT_S):
                return (await process.request(message))["verdict"]
        finally:
            process.kill()


class Tau2World:
    """One episode's environment, in a process of its own: the domain's database as the task
    starts, changed by the episode's calls; and the calls with the benchmark's answers, in
    order. A call stopped before it answered (its deadline) kills the process and loses the
    world: later calls and forks fail at once naming why, and the verdict scores 0."""

    def __init__(self, process: Process | None, lost: str = "") -> None:
        self.process, self.lost = process, lost
        """Its process, None once it is lost (`lost` says why)."""
        self.calls: list[tuple] = []
        """(the benchmark's ToolCall, its ToolMessage) for every call that reached it."""
        self._turn = asyncio.Lock()
        """One call at a time, in the order they were made (a reply's calls run concurrently)."""

    def fork(self) -> Tau2World:
        if self._turn.locked():
            raise RuntimeError("a τ² world forks between calls, never during one")
        forked = Tau2World(None, self.lost)
        if self.process is not None:
            try:
                forked.process = self.process.fork()
            except (OSError, WireError) as exc:
                self.lose(f"its process could not be forked ({exc})")
                forked.lost = self.lost
        forked.calls = list(self.calls)
        return forked

    async def call(self, name: str, arguments: dict):
        """The benchmark's answer (a ToolMessage) to a call of the agent's."""
        from tau2.data_model.message import ToolCall, ToolMessage

        async with self._turn:
            if self.process is None:
                raise WorldLost(f"this conversation's environment is gone: {self.lost}")
            call = ToolCall(id=f"call_{len(self.calls)}", name=name, arguments=arguments, requestor="assistant")
            try:
                reply = await self.process.request({"op": "call", "id": call.id, "name": name, "arguments": arguments})
            except BaseException:  # the deadline's cancel, or a process that died: its state is unknown
                self.lose(f"{name} was stopped before it answered")
                raise
            if "lost" in reply:
                self.lose(reply["lost"])
                raise WorldLost(f"this conversation's environment is gone: {self.lost}")
            answer = ToolMessage.model_validate(reply["answer"])
            self.calls.append((call, answer))
            return answer

    def lose(self, reason: str) -> None:
        """Kill its process: later calls and forks fail naming `reason`."""
        self.lost = reason
        if self.process is not None:
            self.process.kill()
            self.process = None
