"""The sending half of the weight broadcast (mirror of `rollout.weight_receiver`).

All learner ranks call `send` in lockstep, because gathering a parameter's full tensor
from its FSDP shards is a collective. Rank 0 alone talks to the weight group: it packs each
bucket into one flat buffer and broadcasts it. The plan (bucket layout, group epoch and
ranks) is made once per update by rank 0 and announced by the driver before the first
bucket goes out; a new epoch (new process group) starts whenever membership changes or
the last update failed.
"""

from __future__ import annotations

import logging
import time
import uuid

from learner import policy
from learner.trainer import Trainer
from services import weight_group
from services.protocol import WeightPlan

log = logging.getLogger(__name__)


class WeightSender:
    def __init__(
        self, trainer: Trainer, job_id: str, bucket_mib: int, timeout_s: float, advertise_host: str, store_port: int
    ) -> None:
        self.trainer = trainer
        self.job_id = job_id
        self.timeout_s = timeout_s
        self.dtype = trainer.dtype
        self.identity = weight_group.device_identity(trainer.device)
        self.backend = ""
        """The current epoch's backend, chosen from both ends at each new membership."""
        specs = policy.parameter_specs(trainer.model, self.dtype)
        self.buckets = weight_group.plan_buckets(specs, bucket_mib << 20)
        self.advertise_host = advertise_host
        self.store = weight_group.host_store(store_port, timeout_s, advertise_host) if trainer.rank == 0 else None
        self.store_port = self.store.port if self.store else store_port
        self.session = uuid.uuid4().hex
        self.epoch = 0
        self.ranks: dict[str, int] = {}
        self.group = None
        self.buffers: list = [None, None]
        """Pack buffers, kept across updates (reallocating costs page faults every time)."""

    def plan(
        self, version: int, members: dict[str, float], fresh: bool = False, devices: dict[str, list[str]] | None = None
    ) -> WeightPlan:
        """Rank 0: the plan for this update to `members` (server id -> its process's
        `started`); a new epoch if the members changed, `fresh` (one restarted), or the
        backend must change. `devices`: each member's engine devices, as it reported them
        (`weight_group.device_identity`); a member missing there counts as unknown."""
        devices = devices or {}
        backend, why = weight_group.choose_backend(
            self.identity, [devices.get(server, []) for server in sorted(members)]
        )
        if fresh or set(members) != set(self.ranks) or self.group is None or backend != self.backend:
            if backend != self.backend:
                log.info("weight group over %s: %s", backend, why)
            self.epoch += 1
            self.ranks = {server: rank for rank, server in enumerate(sorted(members), start=1)}
            self.backend = backend
            self.close()
        return WeightPlan(
            job_id=self.job_id,
            session=self.session,
            version=version,
            epoch=self.epoch,
            backend=backend,
            store_host=self.advertise_host,
            store_port=self.store_port,
            world_size=len(self.ranks) + 1,
            ranks=dict(self.ranks),
            buckets=self.buckets,
            timeout_s=self.timeout_s,
            started=dict(members),
        )

    def send(self, plan: WeightPlan) -> dict[str, float | list[str]]:
        """All ranks: gather each bucket's tensors; rank 0 broadcasts them. A failed
        collective is logged and ends this epoch; the gathers still run to keep ranks aligned."""
        started = time.perf_counter()
        fetched = 0

        def fetch(bucket) -> dict:
            nonlocal fetched
            fetched += 1
            return policy.full_tensors(self.trainer.model, [t.name for t in bucket.tensors], self.dtype)

        nbytes, failed, unreached = 0, False, []
        if self.trainer.rank == 0 and plan.ranks:
            try:
                if self.group is None:
                    self.group = weight_group.open_group(
                        self.store, plan.backend, plan.epoch, 0, plan.world_size, plan.timeout_s
                    )
                nbytes = weight_group.send_buckets(
                    self.group, plan.buckets, fetch, plan.timeout_s, self.trainer.device, self.buffers
                )
            except Exception:
                log.exception("weight broadcast v%d (epoch %d) failed", plan.version, plan.epoch)
                self.close()
                failed = True
                unreached = weight_group.unreached(self.store, plan.epoch, plan.ranks)
        for bucket in plan.buckets[fetched:]:
            fetch(bucket)
        seconds = time.perf_counter() - started
        return {"seconds": seconds, "bytes": float(nbytes), "failed": float(failed), "unreached": unreached}

    def close(self) -> None:
        """Abort the current group, if any (a failed update, a new epoch): the next update opens another."""
        if self.group is not None:
            weight_group.close_group(self.group)
            self.group = None
