"""`tandem up`, `demo`, `placement`, `prepare-demo`: the whole system on this machine."""

from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path

from tandem.cli.arguments import count, positive


def exit_on_termination() -> None:
    """SIGTERM and SIGHUP end the process as Ctrl-C would end `up` and `demo`: by unwinding,
    so the stack's context manager stops the processes it started. They run in sessions of
    their own, out of reach of the terminal's signals, and would otherwise be orphaned."""

    def leave(signum, frame) -> None:
        for sig in (signal.SIGTERM, signal.SIGHUP):  # a second signal must not cut the stop short
            signal.signal(sig, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, leave)


def placement_of(args: argparse.Namespace):
    """This machine's placement (`tandem.placement`), with the figures given on the command
    line in place of the plan's."""
    import dataclasses

    from tandem.placement import this_machine

    given = {
        "learner_ranks": args.learner_ranks,
        "learner_threads": args.learner_threads,
        "engine_threads": args.engine_threads,
    }
    placement = dataclasses.replace(this_machine(), **{k: v for k, v in given.items() if v is not None})
    if placement.learner_gpus and placement.learner_ranks > len(placement.learner_gpus):
        raise SystemExit(
            f"--learner-ranks {placement.learner_ranks}: the learner has {len(placement.learner_gpus)} GPU(s) "
            f"here ({','.join(map(str, placement.learner_gpus))}), and each rank needs its own"
        )
    return placement


def add_placement_arguments(p: argparse.ArgumentParser) -> None:
    """Figures that replace the plan's for this machine (`tandem placement` prints the plan)."""
    p.add_argument("--learner-ranks", type=positive, default=None, help="default: the plan's")
    p.add_argument("--learner-threads", type=positive, default=None, help="per learner rank; default: the plan's")
    p.add_argument("--engine-threads", type=positive, default=None, help="per rollout server; default: the plan's")


def cmd_up(args: argparse.Namespace) -> None:
    from tandem.launcher import Ports, Stack

    exit_on_termination()
    ports = Ports(rollout=[8002 + 10 * i for i in range(args.rollout_servers)])
    placement = placement_of(args)
    print(f"placement: {placement.describe()}")
    with Stack(Path(args.log_dir), ports=ports, placement=placement) as stack:
        print(f"tandem is up: API {stack.api_url}, judge proxy {stack.judge_url}, Redis {stack.redis_url}")
        print(f"logs in {args.log_dir}; Ctrl-C stops everything")
        try:
            while True:
                stack.check_alive()
                time.sleep(1)
        except KeyboardInterrupt:
            print("stopping")


def cmd_demo(args: argparse.Namespace) -> None:
    from tandem.demo import run_demo

    exit_on_termination()
    placement = placement_of(args)
    print(f"placement: {placement.describe()}")
    run_demo(Path(args.out), steps=args.steps, placement=placement)


def cmd_placement(args: argparse.Namespace) -> None:
    """The plan for this machine (or the one described), as compose's .env lines."""
    from tandem.placement import plan_for, this_machine

    here = this_machine()
    plan = plan_for(args.cores or here.cores, here.gpus if args.gpus is None else args.gpus)
    print(f"# {plan.describe()}")
    print(f"{'LEARNER_NPROC' if plan.gpus else 'LEARNER_CPU_NPROC'}={plan.learner_ranks}")
    print(f"LEARNER_THREADS={plan.learner_threads}")
    print(f"ROLLOUT_THREADS={plan.engine_threads}")
    if plan.gpus:
        print(f"ROLLOUT_GPU={','.join(map(str, plan.engine_gpus))}")
        print(f"LEARNER_GPUS={','.join(map(str, plan.learner_gpus))}")
    if plan.engine_memory_utilization is not None:
        print(f"TANDEM_MEMORY_UTILIZATION={plan.engine_memory_utilization}")


def cmd_prepare_demo(args: argparse.Namespace) -> None:
    from tandem.demo import write_demo_files

    path = write_demo_files(Path(args.dir), seen_as=args.seen_as, steps=args.steps)
    print(f"wrote the demo's model, data and job spec; submit it with: tandem submit {path}")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start every process locally")
    p.add_argument("--log-dir", default="runs/logs")
    add_placement_arguments(p)
    p.add_argument("--rollout-servers", type=int, default=1)
    p.set_defaults(run=cmd_up)

    p = sub.add_parser("demo", help="up + the demo job + report")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--steps", type=int, default=None)
    add_placement_arguments(p)
    p.set_defaults(run=cmd_demo)

    p = sub.add_parser("placement", help="learner ranks, threads and GPUs for this machine, as .env lines")
    p.add_argument("--cores", type=positive, default=None, help="plan for this many cores (default: this machine's)")
    p.add_argument("--gpus", type=count, default=None, help="plan for this many GPUs (default: this machine's)")
    p.set_defaults(run=cmd_placement)

    p = sub.add_parser("prepare-demo", help="write the demo job (model, data, spec) for a stack started elsewhere")
    p.add_argument("dir")
    p.add_argument(
        "--seen-as",
        default=None,
        help="where the stack's processes see DIR, e.g. /models/demo under compose (default: DIR)",
    )
    p.add_argument("--steps", type=int, default=None)
    p.set_defaults(run=cmd_prepare_demo)
