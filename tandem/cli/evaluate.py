"""`tandem eval`: a policy on a job's held-out examples, or on a τ²-bench split."""

from __future__ import annotations

import argparse
import os
import sys

from tandem.cli.arguments import count, positive, tau2_domains

TAU2_TRIALS = 4
"""`tandem eval --domains`: conversations per τ²-bench task unless --trials says."""


def cmd_eval(args: argparse.Namespace) -> None:
    """A job's held-out examples (`--job`, or a policy with `--spec`), or a τ²-bench split."""
    if args.job or args.spec:
        from rollout import job_eval

        if args.job and (args.spec or args.model):
            sys.exit("tandem eval: --job names the policy and the spec; leave out MODEL and --spec")
        if args.spec and not args.model:
            sys.exit("tandem eval: --spec evaluates a policy folder: give MODEL")
        from tandem.client import load_spec_file

        job_eval.main(args, load_spec_file(args.spec) if args.spec else None)
        return
    if not args.model:
        sys.exit("tandem eval: give a policy folder (MODEL), or --job JOB")
    from rollout import tau2_eval

    args.trials = args.trials or TAU2_TRIALS
    tau2_eval.main(args)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="a policy on a job's held-out examples (any task: --job, or MODEL --spec), or on a τ²-bench split "
        "(MODEL --domains): the means, pass^1..pass^k, the JSON",
    )
    p.add_argument(
        "model", nargs="?", help="the policy: an HF folder (tandem model get, or a job's through tandem export)"
    )
    p.add_argument("--job", default="", help="a job in the runs folder: its spec and its final (or --step) policy")
    p.add_argument("--step", type=count, default=None, help="with --job: the policy it exported after this step")
    p.add_argument("--spec", default="", help="a job spec file (YAML or JSON) whose task and eval section apply")
    p.add_argument("--examples", type=positive, default=None, help="held-out examples (default: the spec's eval)")
    p.add_argument(
        "--runs-dir",
        default=os.environ.get("TANDEM_RUNS_DIR", "runs"),
        help="where the learner keeps jobs (default $TANDEM_RUNS_DIR or runs)",
    )
    p.add_argument("--domains", type=tau2_domains, default="mock", help="comma-separated: mock, airline, retail")
    p.add_argument("--split", default="test", choices=["train", "test", "base"])
    p.add_argument(
        "--trials",
        type=positive,
        default=None,
        help=f"conversations per example (k of pass^k goes up to it); default the spec's, {TAU2_TRIALS} on τ²",
    )
    p.add_argument("--num-tasks", type=count, default=0, help="the split's first N tasks (0: all of them)")
    p.add_argument(
        "--judge-url",
        default=os.environ.get("TANDEM_JUDGE_URL", "http://127.0.0.1:8001"),
        help="the judge proxy that serves the user simulator (default $TANDEM_JUDGE_URL)",
    )
    p.add_argument("--judge-token", default=os.environ.get("TANDEM_JUDGE_TOKEN", ""))
    p.add_argument("--user-model", default="user-simulator", help="the simulator's model name at the proxy")
    p.add_argument("--max-model-len", type=int, default=8192, help="the policy's context, and a conversation's")
    p.add_argument("--max-new-tokens", type=int, default=512, help="per policy reply")
    p.add_argument("--max-turns", type=int, default=10, help="assistant turns before a conversation is cut")
    p.add_argument("--temperature", type=float, default=1.0, help="the policy's sampling temperature")
    p.add_argument("--concurrency", type=positive, default=8, help="conversations at once")
    p.add_argument("--kv-cache-gib", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="write the results (per-episode rows included) to this JSON file")
    p.set_defaults(run=cmd_eval)
