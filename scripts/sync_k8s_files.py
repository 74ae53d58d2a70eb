"""Copy into deploy/k8s/base/files what the base's ConfigMaps hold, from the files compose
mounts (deploy/grafana, deploy/configs, deploy/alerts.yml), so that `kubectl apply -k deploy/k8s/overlays/<name>`
reads nothing outside the kustomization, as kustomize and GitOps tools require.

    python scripts/sync_k8s_files.py          # copy
    python scripts/sync_k8s_files.py --check  # exit 1 if a copy differs or is missing (make lint)
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
FILES = DEPLOY / "k8s" / "base" / "files"


def sources() -> dict[Path, Path]:
    """Each file the base needs -> where its copy lives."""
    found = {DEPLOY / "configs" / "judge_upstreams.example.yaml": FILES / "judge_upstreams.example.yaml"}
    found[DEPLOY / "alerts.yml"] = FILES / "alerts.yml"
    found[DEPLOY / "grafana" / "provisioning" / "dashboards" / "tandem.yaml"] = FILES / "dashboard-provider.yaml"
    for dashboard in sorted((DEPLOY / "grafana" / "dashboards").glob("*.json")):
        found[dashboard] = FILES / "dashboards" / dashboard.name
    return found


def stale() -> list[str]:
    """The copies that differ from their source or are missing, and copies with no source."""
    wanted = sources()
    found = [
        str(copy.relative_to(ROOT))
        for source, copy in wanted.items()
        if not copy.is_file() or copy.read_bytes() != source.read_bytes()
    ]
    extra = set(FILES.rglob("*.*")) - set(wanted.values())
    return found + [f"{path.relative_to(ROOT)} (no source)" for path in sorted(extra)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if args.check:
        if problems := stale():
            raise SystemExit(
                f"deploy/k8s/base/files is out of date ({', '.join(problems)}): run python scripts/sync_k8s_files.py"
            )
        return
    shutil.rmtree(FILES, ignore_errors=True)
    for source, copy in sources().items():
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, copy)
    print(f"copied {len(sources())} files into {FILES.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
