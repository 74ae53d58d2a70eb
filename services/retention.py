"""Bounded Redis memory for runs of any length: a stream keeps only what a consumer may
still need.

A stream entry is needed until every consumer group that reads the stream has
acknowledged it: pending entries come back after a crash, and entries after a group's
last-delivered id are not read yet. Everything older than both is history nobody reads
again, and `trim_acked` deletes it (XTRIM MINID). The newest entry always stays, so a
stream that was written is never empty: a resuming learner reads the last task id from
its tasks stream.

An ended job's keys expire after a retention period (`services.jobs.set_status`).
"""

from __future__ import annotations

import redis.asyncio as aioredis

from services.redis_values import Value, text

StreamId = tuple[int, int]


def parse_id(entry_id: Value) -> StreamId:
    millis, _, seq = text(entry_id).partition("-")
    return int(millis), int(seq or 0)


async def trim_acked(client: aioredis.Redis, stream: str) -> int:
    """Delete the entries of `stream` that every consumer group has acknowledged (but never
    the newest entry); the number deleted. A stream without entries or without groups is
    left alone."""
    newest = await client.xrevrange(stream, count=1)
    newest_id = newest[0][0] if newest else None
    if newest_id is None:  # no stream, or one its groups created (MKSTREAM) that holds nothing yet
        return 0
    groups = await client.xinfo_groups(stream)
    if not groups:
        return 0
    needed = min([await _first_needed(client, stream, group) for group in groups] + [parse_id(newest_id)])
    return await client.xtrim(stream, minid=f"{needed[0]}-{needed[1]}", approximate=False)


async def _first_needed(client: aioredis.Redis, stream: str, group: dict) -> StreamId:
    """The oldest entry `group` may still read: its oldest pending entry, else the one after
    its last delivered. `group` (from XINFO GROUPS) may be out of date by now: the pending
    count is asked again, as consumers ack between the two calls (a learner once failed its
    job on a pending summary with no entries); an older last-delivered id only trims less."""
    summary = await client.xpending(stream, group["name"])
    if summary["pending"]:
        return parse_id(summary["min"])
    millis, seq = parse_id(group["last-delivered-id"])
    return millis, seq + 1
