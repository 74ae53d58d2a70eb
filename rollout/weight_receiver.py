"""The receiving half of the weight broadcast, run inside each vLLM worker process.

vLLM mixes this class into its worker (`worker_extension_cls`), so `self.model_runner` is
the engine's model runner. The rollout server calls `tandem_receive` through
`collective_rpc` after pausing generation: each worker joins the plan's group (a new group
whenever the membership epoch changes), receives every bucket, then reloads the weights in
place. On CPU, vLLM repacks linear weights after loading, so `model.load_weights` alone
would fail; the worker's `reload_weights` (model runner's, under the vLLM config) re-runs
that processing.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from services import protocol, weight_group

if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch


class WeightReceiverExtension:
    # What vLLM's worker, which this class is mixed into, brings: declared for the type
    # checker only, since vLLM refuses an extension with an attribute its worker has.
    rank: int
    device: torch.device
    if TYPE_CHECKING:

        def reload_weights(self, *, weights_iterator: Iterator[tuple[str, object]], is_checkpoint_format: bool) -> None:
            """Load the weights in place, under the worker's vLLM config."""

    _tandem_store = None
    _tandem_store_key: tuple[str, int, str] | None = None
    _tandem_group = None
    _tandem_epoch: int | None = None
    _tandem_buffers: list = []

    def tandem_receive(self, plan_bytes: bytes, first_rank: int) -> dict:
        """Receive the update `plan_bytes` announces; returns its version, timings and size."""
        plan = protocol.decode(plan_bytes, protocol.WeightPlan)
        started = time.perf_counter()
        try:
            group = self._tandem_join(plan, first_rank + self.rank)
            pairs = weight_group.receive_buckets(group, plan.buckets, plan.timeout_s, self.device, self._tandem_buffers)
        except Exception:
            self.tandem_leave()  # a failed join or collective leaves group and store unusable
            raise
        received = time.perf_counter()
        self.reload_weights(weights_iterator=iter(pairs), is_checkpoint_format=True)
        return {
            "version": plan.version,
            "receive_s": received - started,
            "reload_s": time.perf_counter() - received,
            "nbytes": sum(bucket.nbytes for bucket in plan.buckets),
        }

    def tandem_device(self) -> str:
        """This worker's device, as the learner compares it with its own."""
        return weight_group.device_identity(self.device)

    def tandem_leave(self) -> None:
        """Abort the group and forget the store connection: the next plan connects afresh."""
        if self._tandem_group is not None:
            weight_group.close_group(self._tandem_group)
        self._tandem_group = None
        self._tandem_epoch = None
        self._tandem_store = None
        self._tandem_store_key = None

    def _tandem_join(self, plan: protocol.WeightPlan, rank: int):
        if not self._tandem_buffers:
            self._tandem_buffers = []  # per worker, not the class-level default
        # A restarted learner may reuse the address (a fixed port) but not the session: a
        # connection to the store it had is broken, and its epochs count from 1 again.
        key = (plan.store_host, plan.store_port, plan.session)
        if self._tandem_store_key != key:
            self._tandem_store = weight_group.connect_store(plan.store_host, plan.store_port, plan.timeout_s)
            self._tandem_store_key = key
            self._tandem_epoch = None
        if self._tandem_epoch != plan.epoch:
            if self._tandem_group is not None:  # an old membership's group: done with it
                weight_group.close_group(self._tandem_group)
                self._tandem_group = None
            weight_group.mark_reached(self._tandem_store, plan.epoch, rank)
            self._tandem_group = weight_group.open_group(
                self._tandem_store, plan.backend, plan.epoch, rank, plan.world_size, plan.timeout_s
            )
            self._tandem_epoch = plan.epoch
        return self._tandem_group
