"""The weight group's backend is chosen from both ends, and a group done with is aborted.

NCCL refuses two ranks on one GPU and cannot reach a CPU engine; a learner and an engine
sharing the only GPU (the one-GPU placement) must get gloo. The choice and the aborts are
checked here on CPU with the learner's identity set by hand (no GPU needed to name one).
"""

from types import SimpleNamespace

import pytest
import torch

from learner.weight_sender import WeightSender
from services import weight_group


@pytest.mark.parametrize(
    ("sender", "receivers", "backend"),
    [
        ("cuda:A", [["cuda:B"]], "nccl"),
        ("cuda:A", [["cuda:B", "cuda:C"], ["cuda:D"]], "nccl"),  # tensor-parallel workers count one each
        ("cuda:A", [["cuda:A"]], "gloo"),  # learner and engine on one GPU
        ("cuda:A", [["cuda:B"], ["cuda:B"]], "gloo"),  # two engines on one GPU
        ("cuda:A", [["cuda:B"], ["cpu"]], "gloo"),  # a CPU engine
        ("cuda:A", [["cuda:B"], []], "gloo"),  # one that has not reported its devices
        ("cpu", [["cuda:B"]], "gloo"),
        ("cpu", [["cpu"], ["cpu"]], "gloo"),
    ],
)
def test_nccl_only_when_every_rank_has_its_own_gpu(sender, receivers, backend) -> None:
    chosen, why = weight_group.choose_backend(sender, receivers)
    assert chosen == backend and why


def test_a_cpu_device_is_named_cpu() -> None:
    assert weight_group.device_identity(torch.device("cpu")) == "cpu"


class FakeGroup:
    """Counts aborts; its broadcasts fail, as a collective with a dead peer does."""

    def __init__(self, abort_fails: bool = False) -> None:
        self.aborts = 0
        self.abort_fails = abort_fails

    def abort(self) -> None:
        self.aborts += 1
        if self.abort_fails:
            raise RuntimeError("communicator already torn down")

    def broadcast(self, tensors, options):
        raise RuntimeError("peer closed the connection")


def test_closing_a_group_aborts_it_and_survives_an_abort_that_fails() -> None:
    group, broken = FakeGroup(), FakeGroup(abort_fails=True)
    weight_group.close_group(group)
    weight_group.close_group(broken)
    weight_group.close_group(object())  # a backend without abort: nothing to do
    assert group.aborts == broken.aborts == 1


@pytest.fixture
def sender():
    trainer = SimpleNamespace(
        dtype="float32",
        device=torch.device("cpu"),
        model=torch.nn.Linear(4, 4),
        rank=0,
    )
    sender = WeightSender(trainer, "job-backend", bucket_mib=1, timeout_s=5, advertise_host="127.0.0.1", store_port=0)
    yield sender
    sender.store = None


def test_a_colocated_member_moves_the_group_to_gloo_in_a_new_epoch(sender) -> None:
    sender.identity = "cuda:A"  # as a learner on GPU A would name itself
    first = sender.plan(1, {"server-1": 1.0}, devices={"server-1": ["cuda:B"]})
    old = sender.group = FakeGroup()

    again = sender.plan(2, {"server-1": 1.0}, devices={"server-1": ["cuda:B"]})
    assert (first.backend, again.epoch, old.aborts) == ("nccl", first.epoch, 0)

    joined = sender.plan(
        3, {"server-1": 1.0, "server-2": 2.0}, devices={"server-1": ["cuda:B"], "server-2": ["cuda:A"]}
    )
    assert joined.backend == "gloo" and joined.epoch == first.epoch + 1
    assert old.aborts == 1 and sender.group is None


def test_a_failed_broadcast_aborts_the_group_and_the_next_plan_opens_another(sender) -> None:
    plan = sender.plan(1, {"server-1": 1.0}, devices={"server-1": ["cpu"]})
    group = sender.group = FakeGroup()

    result = sender.send(plan)

    assert result["failed"] == 1.0 and result["unreached"] == ["server-1"]
    assert group.aborts == 1 and sender.group is None
    assert sender.plan(2, {"server-1": 1.0}, devices={"server-1": ["cpu"]}).epoch == plan.epoch + 1


def test_a_fleet_record_whose_devices_are_not_names_is_left_out_not_trusted():
    """A record from another version or a forger: devices that are not strings do not decode,
    so that server is no member and cannot steer the backend."""
    import msgspec

    from services import protocol

    good = protocol.encode(protocol.ServerInfo(server_id="a", heartbeat=1.0, devices=["cuda:A"]))
    forged = msgspec.msgpack.encode({"schema": protocol.SCHEMA, "server_id": "b", "heartbeat": 1.0, "devices": [7]})
    infos, unreadable = protocol.decode_fleet({b"a": good, b"b": forged})
    assert [i.devices for i in infos] == [["cuda:A"]] and unreadable == ["b"]


def test_an_unknown_server_device_gets_gloo_not_nccl():
    """A name that is neither `cpu` nor a GPU (a garbled or hostile record) never opens NCCL."""
    assert weight_group.choose_backend("cuda:A", [["tpu:0"]])[0] == "gloo"
