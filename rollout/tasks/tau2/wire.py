"""The messages between the rollout server and τ² worker processes (`worlds`, `worker`):
each a JSON object after its length (4 bytes, big-endian) on a Unix stream socket. A reply
that hands over a new process carries its socket and a pidfd as SCM_RIGHTS on its first
bytes. JSON, not pickle, so a worker that misbehaves can send the server only data.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct

HEADER = struct.Struct("!I")
MAX_FDS = 2


class WireError(ConnectionError):
    """The other end closed the socket, or sent something that is not a message."""


def encode(message: dict) -> bytes:
    body = json.dumps(message).encode()
    return HEADER.pack(len(body)) + body


def send(sock: socket.socket, message: dict, fds: tuple[int, ...] = ()) -> None:
    data = encode(message)
    sent = socket.send_fds(sock, [data], list(fds)) if fds else 0
    sock.sendall(data[sent:])


def receive(sock: socket.socket) -> tuple[dict, list[int]]:
    """The next message and the descriptors that came with it; blocks (up to the socket's timeout)."""
    header, fds = bytearray(), []
    while len(header) < HEADER.size:
        data, got, _, _ = socket.recv_fds(sock, HEADER.size - len(header), MAX_FDS)
        if not data:
            raise WireError("the other end closed the connection")
        header += data
        fds += got
    (size,) = HEADER.unpack(header)
    body = bytearray()
    while len(body) < size:
        data = sock.recv(size - len(body))
        if not data:
            raise WireError("the other end closed the connection")
        body += data
    return decode(body), fds


async def request(sock: socket.socket, message: dict) -> dict:
    """Send `message` and await the reply, without blocking the event loop (`sock` non-blocking)."""
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(sock, encode(message))
    (size,) = HEADER.unpack(await _read(loop, sock, HEADER.size))
    return decode(await _read(loop, sock, size))


async def _read(loop: asyncio.AbstractEventLoop, sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = await loop.sock_recv(sock, size - len(data))
        if not chunk:
            raise WireError("the other end closed the connection")
        data += chunk
    return bytes(data)


def decode(body: bytes | bytearray) -> dict:
    try:
        message = json.loads(body)
    except ValueError as exc:
        raise WireError(f"not a message: {exc}") from None
    if not isinstance(message, dict):
        raise WireError("not a message: not an object")
    return message


@contextlib.contextmanager
def blocking(sock: socket.socket, timeout_s: float):
    """`sock` blocking for at most `timeout_s` per operation inside, non-blocking again after."""
    sock.settimeout(timeout_s)
    try:
        yield sock
    finally:
        sock.setblocking(False)
