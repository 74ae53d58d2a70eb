"""The learner across nodes: two torchrun launches of one rank each, meeting through c10d
rendezvous on loopback as two machines (or pods) would, train the same step as one node,
and a checkpoint written on one node count resumes on the other."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file
from torch.distributed import TCPStore

from tandem.launcher import learner_command, rendezvous_args
from tandem.redis_embed import free_port

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("multinode_worker.py")


def torchrun_args(nodes: int, endpoint: str) -> list[str]:
    """The rendezvous arguments `tandem learner` gives torchrun, one rank per node."""
    return [*rendezvous_args(nodes, endpoint, "multinode-test"), "--nproc-per-node=1"]


def run(model: Path, out: Path, ckpt: Path, load: bool, nodes: int) -> dict[str, dict]:
    """The worker on `nodes` nodes: each node a torchrun launch of its own, as on separate
    machines; the parameters it wrote."""
    out.mkdir(parents=True)
    port = free_port()
    args = torchrun_args(nodes, f"127.0.0.1:{port}" if nodes > 1 else "")
    store = None
    if nodes > 1:
        # On separate machines the rendezvous store lives in the agent of the node whose
        # address the endpoint names. Here both nodes share that address and the agent that
        # hosts it may finish first, failing the other's last poll; a store of the test's
        # own outlives both.
        store = TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False)
        args.append("--rdzv-conf=is_host=false")
    launches = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                *args,
                str(WORKER),
                str(model),
                str(out),
                str(ckpt),
                "1" if load else "0",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(nodes)
    ]
    for launch in launches:
        output, _ = launch.communicate(timeout=300)
        assert launch.returncode == 0, output[-3000:]
    del store
    return {path.stem: load_file(path) for path in out.glob("*.safetensors")}


def max_difference(a: dict, b: dict) -> float:
    return max((a[name] - b[name]).abs().max().item() for name in a)


def test_the_learner_command_meets_other_nodes_only_at_an_endpoint():
    assert learner_command(2, resume=False)[3:] == ["--standalone", "--nproc-per-node=2", "-m", "learner"]
    assert learner_command(1, nodes=2, rdzv_endpoint="learner-0.learner:29400", rdzv_id="multinode-test")[3:] == [
        "--nnodes=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=learner-0.learner:29400",
        "--rdzv-id=multinode-test",
        "--nproc-per-node=1",
        "-m",
        "learner",
        "--resume",
    ]
    with pytest.raises(ValueError, match="rendezvous endpoint"):
        learner_command(1, nodes=2)


def test_two_nodes_train_as_one_and_resume_on_either_count(tmp_path, tiny_model):
    one = run(tiny_model, tmp_path / "one", tmp_path / "ckpt-one", load=False, nodes=1)
    two = run(tiny_model, tmp_path / "two", tmp_path / "ckpt-two", load=False, nodes=2)
    initial = load_file(tiny_model / "model.safetensors")
    assert max_difference(one["after-1"], initial) > 1e-4  # the step moved the weights
    # AdamW (lr 1e-3, eps 1e-8) moves a weight by about lr * g / (|g| + eps): near g = 0 it
    # turns the fp32 rounding of g, summed in another order over two ranks (2^-24 times
    # gradients of ~1e-3: ~6e-11), into lr * 6e-11 / eps = 6e-6; AdamW steps of this model
    # on 1 and 2 ranks differ by up to 1e-5. A wrong shard, or moments lost or misplaced on
    # resume, moves weights by a good part of lr. 1e-4 = lr / 10 sits 10 times above the
    # rounding and 10 times below such a bug.
    bound = 1e-4
    assert max_difference(one["after-1"], two["after-1"]) < bound
    assert max_difference(one["after-2"], two["after-2"]) < bound

    # The two-node checkpoint on one node, the one-node checkpoint on two: the next step
    # is the uninterrupted run's.
    two_on_one = run(tiny_model, tmp_path / "two-on-one", tmp_path / "ckpt-two", load=True, nodes=1)
    one_on_two = run(tiny_model, tmp_path / "one-on-two", tmp_path / "ckpt-one", load=True, nodes=2)
    assert max_difference(one["after-2"], two_on_one["after-2"]) < bound
    assert max_difference(one["after-2"], one_on_two["after-2"]) < bound
