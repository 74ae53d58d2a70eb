"""`tandem submit`, `list`, `status`, `follow`, `datasets`, `cancel`, `resume`, `rejudge`, `servers`,
`drain`: the job API's client (`--api`, `--token`)."""

from __future__ import annotations

import argparse
import os
import sys

from tandem.cli.arguments import positive


def cmd_submit(args: argparse.Namespace) -> None:
    from tandem.client import ApiClient, load_spec_file

    job = ApiClient(args.api, args.token).submit(load_spec_file(args.file))
    print(job["id"])  # alone on stdout, for scripts: JOB=$(tandem submit spec.yaml)
    print(
        f"its page: {args.api.rstrip('/')}/jobs/{job['id']} (add #token=... when the API has tokens)", file=sys.stderr
    )


def cmd_list(args: argparse.Namespace) -> None:
    from tandem.client import ApiClient

    for job in ApiClient(args.api, args.token).list():
        print(f"{job['id']:32} {job['status']:10} step {job['step']:>5}  version {job['version']:>5}")


def cmd_status(args: argparse.Namespace) -> None:
    import json

    from tandem.client import ApiClient

    print(json.dumps(ApiClient(args.api, args.token).get(args.job_id), indent=2))


def cmd_follow(args: argparse.Namespace) -> None:
    from tandem.client import ApiClient, follow

    record = follow(ApiClient(args.api, args.token), args.job_id)
    print(f"{args.job_id}: {record['status']} {record.get('error') or ''}")
    if record["status"] != "SUCCEEDED":
        sys.exit(1)


def cmd_datasets(args: argparse.Namespace) -> None:
    from tandem.client import ApiClient

    for dataset in ApiClient(args.api, args.token).datasets(args.job_id):
        print(f"{dataset['name']:8} {dataset['rows']:>7} rows  {dataset['path']}")


def cmd_cancel(args: argparse.Namespace) -> None:
    from tandem.client import ApiClient

    print(ApiClient(args.api, args.token).cancel(args.job_id)["status"])


def cmd_resume(args: argparse.Namespace) -> None:
    from tandem.client import ApiClient, ApiError

    try:
        budget = {k: v for k, v in (("usd", args.budget_usd), ("tokens", args.budget_tokens)) if v is not None}
        print(ApiClient(args.api, args.token).resume(args.job_id, budget or None)["status"])
    except ApiError as err:  # the API says why the job does not resume
        sys.exit(str(err))


def cmd_rejudge(args: argparse.Namespace) -> None:
    """A job's judged conversations scored again by another judge or rubric, compared."""
    from tandem import rejudge

    rejudge.main(args)


def cmd_servers(args: argparse.Namespace) -> None:
    from tandem.client import ApiClient

    for server in ApiClient(args.api, args.token).servers():
        state = "draining" if server["draining"] else "drain requested" if server["drain_requested"] else "serving"
        print(
            f"{server['server_id']:32} {state:16} job {server['job_id'] or '-':32} v{server['version']:<5} "
            f"{server['inflight']}/{server['capacity']} tasks  heartbeat {server['heartbeat_age_s']}s ago"
        )


def cmd_drain(args: argparse.Namespace) -> None:
    from tandem.client import ApiClient

    server = ApiClient(args.api, args.token).drain(args.server_id, lift=args.lift)
    print(f"{server['server_id']}: drain {'lifted' if args.lift else 'requested'}")


def api_client_parser(sub: argparse._SubParsersAction, name: str, run, help_text: str, *positional: str):
    """A subcommand that talks to the job API: its positionals, `--api` and `--token`
    (defaults `$TANDEM_API_URL`, `$TANDEM_API_TOKEN`)."""
    p = sub.add_parser(name, help=help_text)
    for arg in positional:
        p.add_argument(arg)
    p.add_argument("--api", default=os.environ.get("TANDEM_API_URL", "http://127.0.0.1:8000"))
    p.add_argument(
        "--token", default=os.environ.get("TANDEM_API_TOKEN", ""), help="bearer token (default $TANDEM_API_TOKEN)"
    )
    p.set_defaults(run=run)
    return p


def register(sub: argparse._SubParsersAction) -> None:
    api_client_parser(sub, "list", cmd_list, "list jobs")
    api_client_parser(sub, "submit", cmd_submit, "submit a job spec (YAML or JSON)", "file")
    for name, run, help_text in (
        ("status", cmd_status, "show a job"),
        ("follow", cmd_follow, "follow a job with a progress bar"),
        ("datasets", cmd_datasets, "list the files a generate job wrote"),
        ("cancel", cmd_cancel, "cancel a job"),
    ):
        api_client_parser(sub, name, run, help_text, "job_id")
    p = api_client_parser(
        sub,
        "resume",
        cmd_resume,
        "continue a FAILED or CANCELLED job, or one a spend cap ended, from its newest checkpoint",
        "job_id",
    )
    p.add_argument("--budget-usd", type=float, default=None, help="its new cap in US dollars (above what it spent)")
    p.add_argument("--budget-tokens", type=int, default=None, help="its new cap in provider tokens")
    register_rejudge(sub)
    api_client_parser(sub, "servers", cmd_servers, "list the rollout servers (operators)")
    p = api_client_parser(
        sub,
        "drain",
        cmd_drain,
        "take a rollout server out of service: it finishes or hands back its tasks and leaves its job (operators)",
        "server_id",
    )
    p.add_argument("--lift", action="store_true", help="let it take jobs again")


def register_rejudge(sub: argparse._SubParsersAction) -> None:
    p = api_client_parser(
        sub,
        "rejudge",
        cmd_rejudge,
        "score a job's stored conversations again with another judge (or rubric) through the judge proxy, "
        "and compare: agreement, rank correlation per group, flipped pairs, cost",
        "job_id",
    )
    p.add_argument("--judge-model", required=True, help="the model group at the proxy to judge with")
    p.add_argument("--rubric", default="", help="a rubric the proxy knows (default: the job's reward.judge_rubric)")
    p.add_argument(
        "--steps", default="", help="A:B: only groups dispatched at weight versions A..B (either may be left out)"
    )
    p.add_argument(
        "--judge-url",
        default=os.environ.get("TANDEM_JUDGE_URL", "http://127.0.0.1:8001"),
        help="the judge proxy (default $TANDEM_JUDGE_URL)",
    )
    p.add_argument(
        "--judge-token",
        default=os.environ.get("TANDEM_JUDGE_TOKEN", ""),
        help="a client token of the proxy (default $TANDEM_JUDGE_TOKEN); the calls are charged to a key of their own",
    )
    p.add_argument("--concurrency", type=positive, default=8, help="verdicts asked for at once")
    p.add_argument("--out", default="", help="the comparison's JSON (default rejudge-JOB-MODEL.json)")
