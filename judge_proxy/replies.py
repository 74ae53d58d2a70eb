"""What the proxy takes of an upstream's reply: at most `max_reply_bytes` of a reply that is
not a stream (or of one event of a stream), read no further, and JSON nested at most
`MAX_REPLY_DEPTH` deep. A provider's reply is not trusted for its size or its shape: read
whole, a 64 MB reply cost the proxy 193 MB, and JSON nested past Python's recursion limit
made the decoder raise, a 500 to the client. A reply refused here is the upstream's
failure (`calls.py`): a 502 naming the reason, or a stream's error event."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from itertools import accumulate

import aiohttp
import msgspec

MAX_REPLY_DEPTH = 64
"""The deepest nesting a reply's JSON may have (the reply's own object counting 1). OpenAI's
deepest, a token's `top_logprobs` bytes, is 9; msgspec gives up near 1,000, at Python's
recursion limit."""
STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


class ReplyRefused(Exception):
    """An upstream's reply the proxy will not read or relay; the message says why."""


def over_cap(cap_bytes: int) -> ReplyRefused:
    """The refusal of a reply (or a stream's line or event) over `cap_bytes`."""
    return ReplyRefused(f"reply over {cap_bytes} bytes")


async def read_capped(response: aiohttp.ClientResponse, cap_bytes: int) -> bytes:
    """The whole body; `ReplyRefused` once it says or proves to be over `cap_bytes`, and the
    connection closed, so no more of it is read."""
    if (response.content_length or 0) <= cap_bytes:
        body = await joined_within(response.content.iter_any(), cap_bytes)
        if body is not None:
            return body
    response.close()
    raise over_cap(cap_bytes)


async def joined_within(pieces: AsyncIterator[bytes], cap_bytes: int) -> bytes | None:
    """The pieces joined, or None as soon as they come to more than `cap_bytes` (the rest
    is not read)."""
    size, kept = 0, []
    async for piece in pieces:
        size += len(piece)
        if size > cap_bytes:
            return None
        kept.append(piece)
    return b"".join(kept)


def too_deep(body: bytes) -> bool:
    """Whether `body`'s JSON nests deeper than `MAX_REPLY_DEPTH` (brackets inside its strings
    aside; its own object counts 1). Linear, in C but for one step per bracket (0.4 s for
    8 MB of brackets); a body with no more brackets than the limit is not scanned."""
    if body.count(b"[") + body.count(b"{") <= MAX_REPLY_DEPTH:
        return False
    brackets = STRING.sub(b"", body).translate(None, NOT_BRACKET)
    return max(accumulate(map(STEP.__getitem__, brackets)), default=0) > MAX_REPLY_DEPTH


def decoded(body: bytes | str) -> object:
    """`body`'s JSON; `ReplyRefused` when it nests deeper than `MAX_REPLY_DEPTH`,
    `msgspec.DecodeError` when it is not JSON."""
    raw = body.encode() if isinstance(body, str) else body
    if too_deep(raw):
        raise ReplyRefused(f"reply nested deeper than {MAX_REPLY_DEPTH}")
    return msgspec.json.decode(raw)


def decoded_object(body: bytes) -> dict:
    """`body`'s JSON object, as a chat completion is; `ReplyRefused` for JSON that is not an
    object (or nests too deep), `msgspec.DecodeError` when it is not JSON."""
    value = decoded(body)
    if not isinstance(value, dict):
        raise ReplyRefused("reply is not a JSON object")
    return value
