"""The placement plan for one machine (`tandem.placement`), the environment each process
of `tandem up` gets from it, and compose's defaults."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.config import RolloutSettings
from tandem.cli import build_parser
from tandem.cli.local import placement_of
from tandem.launcher import Stack
from tandem.placement import SHARED_GPU_ENGINE_MEMORY, VLLM_GPU_MEMORY, Placement, plan_for, this_machine

# ---- the plan, derived by hand ---------------------------------------------------------


def test_two_cores_give_two_single_threaded_learner_ranks_and_a_single_threaded_engine():
    """The engine's half is one core; one thread there is no OpenMP team, so a second
    learner rank may share its core."""
    plan = plan_for(2)
    assert (plan.learner_ranks, plan.learner_threads, plan.engine_threads) == (2, 1, 1)
    assert plan.learner_env() == {"OMP_NUM_THREADS": "1"}
    assert plan.engine_env() == {"OMP_NUM_THREADS": "1"}
    assert not plan.shared_gpu


def test_sixteen_cores_give_the_engine_eight_threads_and_the_learner_a_rank_on_each_other_core():
    """An 8-thread engine is a team: no learner rank on its cores."""
    plan = plan_for(16)
    assert (plan.learner_ranks, plan.learner_threads, plan.engine_threads) == (8, 1, 8)
    assert plan.learner_env() == {"OMP_NUM_THREADS": "1"}
    assert plan.engine_env() == {"OMP_NUM_THREADS": "8"}


def test_an_odd_core_goes_to_the_learner_and_one_core_is_shared():
    assert (plan_for(5).learner_ranks, plan_for(5).engine_threads) == (3, 2)
    assert (plan_for(3).learner_ranks, plan_for(3).engine_threads) == (3, 1)
    assert (plan_for(1).learner_ranks, plan_for(1).learner_threads, plan_for(1).engine_threads) == (1, 1, 1)


def test_one_gpu_is_shared_by_one_learner_rank_and_an_engine_held_to_a_stated_share():
    plan = plan_for(16, gpus=1)
    assert plan.shared_gpu
    assert (plan.learner_ranks, plan.learner_threads, plan.engine_threads) == (1, 8, 8)
    assert plan.learner_env() == {"OMP_NUM_THREADS": "8", "CUDA_VISIBLE_DEVICES": "0"}
    assert plan.engine_env() == {
        "OMP_NUM_THREADS": "8",
        "CUDA_VISIBLE_DEVICES": "0",
        "TANDEM_MEMORY_UTILIZATION": str(SHARED_GPU_ENGINE_MEMORY),
    }
    assert "one shared GPU" in plan.describe()


def test_the_shared_gpu_share_is_the_rollout_servers_memory_utilization(monkeypatch):
    for name, value in plan_for(16, gpus=1).engine_env().items():
        monkeypatch.setenv(name, value)
    assert RolloutSettings().memory_utilization == 0.3


def test_two_gpus_put_the_engine_on_gpu_0_and_the_learner_on_gpu_1():
    plan = plan_for(16, gpus=2)
    assert not plan.shared_gpu
    assert (plan.learner_ranks, plan.learner_threads, plan.engine_threads) == (1, 8, 8)
    assert plan.learner_env() == {"OMP_NUM_THREADS": "8", "CUDA_VISIBLE_DEVICES": "1"}
    assert plan.engine_env() == {"OMP_NUM_THREADS": "8", "CUDA_VISIBLE_DEVICES": "0"}


def test_more_gpus_give_the_learner_a_rank_on_each_gpu_but_the_engines():
    plan = plan_for(16, gpus=4)
    assert (plan.learner_ranks, plan.learner_threads, plan.engine_threads) == (3, 4, 4)
    assert plan.learner_env()["CUDA_VISIBLE_DEVICES"] == "1,2,3"
    assert plan.engine_env()["CUDA_VISIBLE_DEVICES"] == "0"


def test_eight_gpus_give_the_engine_one_and_the_learner_seven_ranks():
    plan = plan_for(16, gpus=8)
    assert (plan.learner_ranks, plan.learner_threads, plan.engine_threads) == (7, 2, 2)
    assert plan.learner_env()["CUDA_VISIBLE_DEVICES"] == "1,2,3,4,5,6,7"
    assert plan.engine_env() == {"OMP_NUM_THREADS": "2", "CUDA_VISIBLE_DEVICES": "0"}
    assert not plan.shared_gpu and "GPUs apart" in plan.describe()


def test_rollout_servers_on_one_gpu_split_the_engines_memory_share():
    """Each vLLM takes its share of the whole GPU: two at the default would not both start."""
    apart, shared = plan_for(16, gpus=2), plan_for(16, gpus=1)
    assert apart.engine_env(servers=2)["TANDEM_MEMORY_UTILIZATION"] == str(VLLM_GPU_MEMORY / 2)
    assert shared.engine_env(servers=3)["TANDEM_MEMORY_UTILIZATION"] == str(round(SHARED_GPU_ENGINE_MEMORY / 3, 4))
    assert "TANDEM_MEMORY_UTILIZATION" not in plan_for(4).engine_env(servers=2)  # CPU engines: RAM, not shared


def test_vllms_default_share_is_the_one_the_engine_uses(monkeypatch, tmp_path):
    from rollout.engine import engine_options
    from services.config import ModelSpec

    for name in ("VLLM_NO_USAGE_STATS", "DO_NOT_TRACK", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(name, raising=False)  # engine_options sets them: restored after the test
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    (tmp_path / "config.json").write_text("{}")
    assert engine_options(ModelSpec(path=str(tmp_path)), 1.0)["gpu_memory_utilization"] == VLLM_GPU_MEMORY


def test_more_learner_ranks_than_learner_gpus_are_refused(monkeypatch):
    monkeypatch.setattr("tandem.placement.this_machine", lambda: plan_for(16, gpus=2))
    with pytest.raises(SystemExit, match="each rank needs its own"):
        placement_of(build_parser().parse_args(["up", "--learner-ranks", "2"]))
    assert placement_of(build_parser().parse_args(["up", "--learner-ranks", "1"])).learner_ranks == 1


@pytest.mark.parametrize(
    ("environ", "gpus", "device"),
    [
        ({}, 0, "cpu"),
        ({"CUDA_VISIBLE_DEVICES": ""}, 0, "cpu"),
        ({"CUDA_VISIBLE_DEVICES": "-1"}, 0, "cpu"),
        ({"CUDA_VISIBLE_DEVICES": "0", "LOCAL_RANK": "0"}, 1, "cuda:0"),
        ({"CUDA_VISIBLE_DEVICES": "1,2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, 2, "cuda:1"),
    ],
)
def test_a_learner_rank_takes_its_own_gpu_or_the_cpu_when_none_was_asked_for(environ, gpus, device):
    from learner.__main__ import choose_device

    assert str(choose_device(environ, gpus)) == device


@pytest.mark.parametrize(
    ("environ", "gpus", "reason"),
    [
        ({"CUDA_VISIBLE_DEVICES": "1"}, 0, "torch sees none"),  # compose's default on a one-GPU host
        ({"CUDA_VISIBLE_DEVICES": "0", "LOCAL_WORLD_SIZE": "2"}, 1, "each rank needs its own GPU"),
    ],
)
def test_a_learner_never_falls_back_to_the_cpu_or_doubles_up_on_a_gpu_without_a_word(environ, gpus, reason):
    from learner.__main__ import choose_device

    with pytest.raises(SystemExit, match=reason):
        choose_device(environ, gpus)


@pytest.mark.parametrize(("cores", "gpus"), [(0, 0), (4, -1)])
def test_a_machine_without_cores_or_with_negative_gpus_is_refused(cores, gpus):
    with pytest.raises(ValueError, match="at least one core"):
        plan_for(cores, gpus)


# ---- wired in --------------------------------------------------------------------------

PRINT_ENV = "import json, os, torch; print(json.dumps({'env': dict(os.environ), 'torch': torch.get_num_threads()}))"


def spawned(stack: Stack, name: str) -> dict:
    """What a real process started by `stack` as `name` sees: its environment and torch's threads."""
    stack.spawn(name, [sys.executable, "-c", PRINT_ENV])
    assert stack.processes[name].wait(timeout=60) == 0
    return json.loads((stack.log_dir / f"{name}.log").read_text().splitlines()[-1])


def test_the_stack_gives_the_learner_and_each_engine_the_plans_threads_and_ranks(tmp_path):
    """A plan whose figures differ from this machine's and from each other: what the
    processes see can only have come from it. torch takes no more threads than the
    machine's cores, so the learner's single thread is what shows torch obeys."""
    plan = Placement(cores=7, gpus=0, learner_ranks=3, learner_threads=1, engine_threads=3)
    stack = Stack(tmp_path / "logs", placement=plan)
    stack.log_dir.mkdir()
    learner, engine, api = spawned(stack, "learner"), spawned(stack, "rollout-1"), spawned(stack, "api")
    assert (learner["env"]["OMP_NUM_THREADS"], learner["torch"]) == ("1", 1)
    assert engine["env"]["OMP_NUM_THREADS"] == "3"
    assert api["env"].get("OMP_NUM_THREADS") == os.environ.get("OMP_NUM_THREADS")
    assert "--nproc-per-node=3" in stack.learner_args()


def test_a_process_setting_overrides_the_plan(tmp_path):
    plan = Placement(cores=7, gpus=0, learner_ranks=3, learner_threads=1, engine_threads=3)
    stack = Stack(tmp_path / "logs", placement=plan, learner_ranks=1, env_for={"learner": {"OMP_NUM_THREADS": "2"}})
    stack.log_dir.mkdir()
    learner = spawned(stack, "learner")
    assert (learner["env"]["OMP_NUM_THREADS"], learner["torch"]) == ("2", 2)
    assert "--nproc-per-node=1" in stack.learner_args()


def test_by_default_the_stack_follows_the_plan_for_this_machine(tmp_path):
    assert Stack(tmp_path).placement == this_machine()


def test_up_and_demo_take_the_plan_with_the_figures_given_on_the_command_line():
    here = this_machine()
    for command in ("up", "demo"):
        args = build_parser().parse_args([command, "--learner-ranks", "2", "--engine-threads", "5"])
        assert placement_of(args) == Placement(here.cores, here.gpus, 2, here.learner_threads, 5)
        assert placement_of(build_parser().parse_args([command])) == here


def test_tandem_placement_prints_env_lines_compose_reads():
    result = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "placement", "--cores", "16", "--gpus", "0"],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = dict(line.split("=", 1) for line in result.stdout.splitlines() if not line.startswith("#"))
    assert lines == {"LEARNER_CPU_NPROC": "8", "LEARNER_THREADS": "1", "ROLLOUT_THREADS": "8"}


def compose_default(value: str) -> str:
    """The default of compose's `${NAME:-default}`."""
    return re.fullmatch(r"\$\{\w+:-(.*)\}", value).group(1)


def test_compose_defaults_are_the_plan_for_two_cores():
    """The cpu profile, with compose's defaults (tests/unit/test_compose.py checks
    .env.example agrees), runs the plan for the smallest machine it is meant for."""
    plan = plan_for(2)
    services = yaml.safe_load((Path(__file__).resolve().parents[2] / "docker-compose.yml").read_text())["services"]
    learner, rollout = services["learner-cpu"], services["rollout-cpu"]
    assert compose_default(learner["environment"]["OMP_NUM_THREADS"]) == str(plan.learner_threads)
    assert compose_default(rollout["environment"]["OMP_NUM_THREADS"]) == str(plan.engine_threads)
    assert learner["command"][2] == "--nproc"
    assert compose_default(learner["command"][3]) == str(plan.learner_ranks)
