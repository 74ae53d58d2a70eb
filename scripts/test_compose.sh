#!/usr/bin/env bash
# make test-compose: the README's compose quick start on this machine's Docker engine
# (tests/compose/test_compose_stack.py). Installs the compose plugin if it is missing; the
# images come from a registry when one answers, else scripts/offline_images.sh builds them
# from Debian's packages (TANDEM_COMPOSE_OFFLINE=1 forces that). Needs a running engine.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-.venv}
docker info >/dev/null 2>&1 || { echo "no Docker engine answers (docker info); start dockerd first" >&2; exit 1; }
# The images need about 6 GB on first build; a full disk fails deep inside the build with
# "No space left on device", so say it here, with the numbers.
need_gb=${TANDEM_COMPOSE_MIN_FREE_GB:-12}
[[ $need_gb =~ ^[0-9]+$ ]] || { echo "TANDEM_COMPOSE_MIN_FREE_GB must be a whole number of GB, not '$need_gb'" >&2; exit 1; }
root=$(docker info --format '{{.DockerRootDir}}')
free_gb=$(df -P --block-size=1G "$root" | awk 'NR==2 {print $4}')
if [ "$free_gb" -lt "$need_gb" ]; then
  echo "only ${free_gb} GB free under $root; the compose test needs ${need_gb} GB (TANDEM_COMPOSE_MIN_FREE_GB)" >&2
  exit 1
fi
scripts/install_compose.sh
images=
if [ -z "${TANDEM_COMPOSE_OFFLINE:-}" ] && timeout 60 docker pull -q python:3.11-slim >/dev/null 2>&1; then
  echo "a registry answers: the test builds tandem-cpu on python:3.11-slim and pulls the rest"
else
  echo "no registry: building the images from Debian's packages (scripts/offline_images.sh)"
  images=runs/compose/offline-images.env
  scripts/offline_images.sh "$images"
fi
TANDEM_COMPOSE=1 TANDEM_COMPOSE_IMAGES_ENV=$images "$venv/bin/python" -m pytest tests/compose -s -p no:cacheprovider
