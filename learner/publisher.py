"""Weight publishing with membership: which rollout servers are on the job, and getting
each policy version to them.

A publish writes the plan (version, members, ranks) to the job's `weights` hash, announces
it on the job's events channel and then broadcasts the weights from every learner rank
(`learner.weight_sender`). Members are the servers on the job whose heartbeat is younger
than `server_timeout_s` and that are not draining; a server that joins while the learner
waits for data gets the current version in a new group at once. A server that leaves
(drained, exited, or silent) is left out of the next plan, a new group without it.

Each change of membership is logged, counted in the `rollout_servers` gauge and appended
to the job's `servers` list (the API's events stream shows it): who joined, who left and
why.

A member that heartbeats but cannot join the weight group (a wrong advertised address, a
firewall) would fail every broadcast for everyone: a member that did not even reach the
learner's weight store in `EVICT_AFTER` failed updates is evicted, left out of plans until
it restarts (its record's `started` changes). A publish that failed all its attempts is
tried again while the learner waits for groups, so no version, 0 included, stays unsent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from prometheus_client import Gauge, Histogram

from learner.control import Command, Worker
from services import protocol
from services.config import LearnerSettings
from services.queues import Keys
from services.redis_values import text

log = logging.getLogger(__name__)

SYNC_SECONDS = Histogram(
    "tandem_learner_weight_sync_seconds",
    "Gather + broadcast of one update",
    ["job"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
)
SERVERS = Gauge("tandem_learner_rollout_servers", "Rollout servers on the job (live, not draining)", ["job"])
EVICT_AFTER = 2
"""Failed updates a member may miss the weight store in before it is evicted."""
REPUBLISH_EVERY_S = 10.0
"""How often a publish that failed all its attempts is tried again while the learner waits."""
PUBLISH_ATTEMPTS = 3


class WeightPublisher:
    COUNTS = ("weight_updates", "regroups", "sync_failures", "evictions")

    def __init__(self, client: aioredis.Redis, job_id: str, settings: LearnerSettings, worker: Worker) -> None:
        self.redis = client
        self.job_id = job_id
        self.settings = settings
        self.worker = worker
        self.counts = dict.fromkeys(self.COUNTS, 0)
        self.membership_checked = 0.0
        self.members: set[str] = set()
        """The servers the last membership record saw on the job."""
        self.unreadable: set[str] = set()
        """Ids of fleet records that did not decode, as last logged."""
        self.strikes: dict[str, int] = {}
        """Failed updates in a row in which a member never reached the weight store."""
        self.evicted: dict[str, float] = {}
        """Evicted members -> the `started` of the process that was evicted."""
        self.live: list[protocol.ServerInfo] = []
        """The records of the servers `live_servers` last found live."""
        self.started_of: dict[str, float] = {}
        """Live members -> their process's `started`, as last seen."""
        self.planned: dict[str, float] = {}
        """The last plan's members -> the `started` it was made for: a live server missing
        here, or here with another `started` (restarted under the same id), needs a plan."""
        self.unsent: tuple[int, float] | None = None
        """(version, when) of a publish that failed all its attempts, to try again."""

    async def job_servers(self) -> list[protocol.ServerInfo]:
        infos, unreadable = protocol.decode_fleet(await self.redis.hgetall(Keys.rollout_servers))
        if set(unreadable) != self.unreadable:  # logged once per change, not on every poll
            self.unreadable = set(unreadable)
            log.warning("job %s: rollout server records that do not decode, left out: %s", self.job_id, unreadable)
        return [info for info in infos if info.job_id == self.job_id]

    async def live_servers(self) -> list[str]:
        """Servers on this job, not draining, whose last heartbeat is younger than
        `server_timeout_s`. Any change since the last call is recorded."""
        now = time.time()
        infos = {info.server_id: info for info in await self.job_servers()}
        self.live = [
            info
            for server, info in infos.items()
            if now - info.heartbeat < self.settings.server_timeout_s
            and not info.draining
            and self.evicted.get(server) != info.started
        ]
        live = [info.server_id for info in self.live]
        restarted = {s for s in live if s in self.started_of and self.started_of[s] != infos[s].started}
        self.started_of = {server: infos[server].started for server in live}
        if set(live) != self.members or restarted:
            await self.record_membership(live, infos, now, restarted)
        return live

    async def record_membership(
        self, live: list[str], infos: dict[str, protocol.ServerInfo], now: float, restarted: set[str]
    ) -> None:
        """Who joined (a server restarted under its old id joins anew) and who left (and
        why) into the log, the gauge and the job's `servers` list."""
        joined = sorted((set(live) - self.members) | restarted)
        left = {s: why_left(infos.get(s), self.evicted.get(s), now) for s in sorted(self.members - set(live))}
        self.members = set(live)
        SERVERS.labels(self.job_id).set(len(live))
        log.info("rollout servers: %d (joined %s, left %s)", len(live), joined or "-", left or "-")
        record = {"time": now, "servers": sorted(live), "joined": joined, "left": left}
        await self.redis.rpush(Keys.servers(self.job_id), json.dumps(record))

    async def wait_for_servers(self, check: Callable[[], Awaitable[None]]) -> None:
        """Until `min_rollout_servers` are on the job; fails when one reports it cannot serve
        the job, or none joins within `rollout_wait_s`."""
        deadline = time.monotonic() + self.settings.rollout_wait_s
        while len(await self.live_servers()) < self.settings.min_rollout_servers:
            await check()  # a cancel or a stop (SIGTERM) ends the wait
            error = await self.redis.hget(Keys.job(self.job_id), "rollout_error")
            if error:
                raise RuntimeError(f"a rollout server cannot serve this job: {text(error)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no rollout server joined within {self.settings.rollout_wait_s:.0f}s")
            await asyncio.sleep(0.5)

    async def settle_membership(self, since: float) -> None:
        """After a failed update, wait until every server on the job has either sent a
        heartbeat since `since` (alive) or aged out (dead), so the next group is right."""
        timeout = self.settings.server_timeout_s
        while time.time() < since + timeout:
            now = time.time()
            if all(info.heartbeat > since or now - info.heartbeat >= timeout for info in await self.job_servers()):
                return
            await asyncio.sleep(0.2)

    async def publish(self, version: int, servers: list[str] | None = None, regroup: bool = False) -> dict:
        """Announce the plan for `version`, then broadcast it (all ranks). `regroup` re-sends
        the current version to a new membership (a server joined). A failed
        broadcast (a member died) is retried on the settled membership."""
        started = time.perf_counter()
        for attempt in range(PUBLISH_ATTEMPTS):
            members = await self.live_servers() if servers is None else servers
            processes = {s: self.started_of.get(s, 0.0) for s in members}
            fresh = any(self.planned.get(s, t) != t for s, t in processes.items())  # one restarted
            devices = {info.server_id: info.devices for info in self.live}
            plan = self.worker.job_sender().plan(version, processes, fresh, devices)
            self.planned = processes
            await self.redis.hset(
                Keys.weights(self.job_id), mapping={"version": version, "plan": protocol.encode(plan)}
            )
            await self.redis.publish(
                Keys.events(self.job_id), protocol.encode(protocol.JobEvent(kind="version", version=version))
            )
            result = self.worker.run(Command(kind="sync", plan=plan))
            SYNC_SECONDS.labels(self.job_id).observe(result["seconds"])
            self.counts["regroups" if regroup or attempt else "weight_updates"] += 1
            await self.judge_members(plan, result["unreached"] if result["failed"] else [])
            if not result["failed"]:
                break
            self.counts["sync_failures"] += 1
            await self.settle_membership(since=time.time())
            servers = None
        self.unsent = (version, time.monotonic()) if result["failed"] else None
        return result | {"seconds": time.perf_counter() - started}  # failed attempts included

    async def judge_members(self, plan: protocol.WeightPlan, unreached: list[str]) -> None:
        """Strikes for the plan's members that never reached the weight store (none after a
        good update); a member with `EVICT_AFTER` is evicted."""
        for server in plan.ranks:
            self.strikes[server] = self.strikes.get(server, 0) + 1 if server in unreached else 0
        infos = {info.server_id: info for info in await self.job_servers()}
        for server in unreached:
            if self.strikes[server] >= EVICT_AFTER and server in infos:
                log.warning("evicting rollout server %s: it never reached the weight store", server)
                self.evicted[server] = infos[server].started
                self.counts["evictions"] += 1

    async def follow_membership(self, version: int) -> None:
        """While waiting for data: a server that joined since the last update gets the
        current weights now, in a new group, instead of idling until the next step, and a
        version whose publish failed is sent again. One that left needs nothing: the next
        update's group is formed without it."""
        if time.monotonic() - self.membership_checked < 1.0:
            return
        self.membership_checked = time.monotonic()
        servers = await self.live_servers()
        if self.unsent is not None and time.monotonic() - self.unsent[1] > REPUBLISH_EVERY_S:
            log.info("publishing version %d again: the last publish failed", version)
            await self.publish(version, servers, regroup=True)
        elif any(self.planned.get(s) != self.started_of.get(s) for s in servers):
            log.info("rollout servers changed to %s: re-sending version %d", sorted(servers), version)
            await self.publish(version, servers, regroup=True)


def why_left(info: protocol.ServerInfo | None, evicted_started: float | None, now: float) -> str:
    """Why a member is no longer on the job, from its record (`evicted_started`: the
    `started` of the process the learner evicted under its id, if any)."""
    if info is None:
        return "exited"  # it removed its own record
    if evicted_started == info.started:
        return f"evicted: it did not reach the weight store in {EVICT_AFTER} updates"
    if info.draining:
        return "draining"
    return f"no heartbeat for {now - info.heartbeat:.0f}s"
