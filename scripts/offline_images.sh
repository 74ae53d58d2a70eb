#!/usr/bin/env bash
# The images docker-compose.yml runs, built where no container registry is reachable, from
# Debian bookworm's packages (apt reaches deb.debian.org) and the repo's locks (pip reaches
# PyPI). With a registry, none of this is needed: compose pulls the upstream images and
# builds tandem-cpu on python:3.11-slim.
#
#   tandem-offline/debian:bookworm   debootstrap --variant=minbase, the base of the rest
#   tandem-offline/python:3.11       Debian's python3 (3.11) and venv   (for python:3.11-slim)
#   tandem-offline/redis:7.0         Debian's redis-server              (for redis:7.4)
#   tandem-offline/prometheus:2.42   Debian's prometheus                (for prom/prometheus:v3.5.0)
#   tandem-cpu:$TANDEM_IMAGE_TAG     deploy/Dockerfile.cpu on the python image above; torch's CPU
#                                    wheel from TORCH_WHEELS (a folder, served to the build over
#                                    loopback), everything else from PyPI, all checked by the locks
#
# Grafana has no Debian package and no offline build here; the CUDA image needs NVIDIA's
# base image. Writes the variables that select these images to ENV_FILE, for compose's
# --env-file (or COMPOSE_ENV_FILES). Images already built are kept (docker's layer cache
# makes the rest quick); REBUILD=1 starts the Debian base afresh.
# Needs root (debootstrap) and a running Docker engine.
# Usage: scripts/offline_images.sh [ENV_FILE, default runs/compose/offline-images.env]
set -euo pipefail
cd "$(dirname "$0")/.."
env_file=${1:-runs/compose/offline-images.env}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
wheels=${TORCH_WHEELS:-/opt/wheels}
tag=${TANDEM_IMAGE_TAG:-latest}
debian=tandem-offline/debian:bookworm
python_image=tandem-offline/python:3.11
redis_image=tandem-offline/redis:7.0
prometheus_image=tandem-offline/prometheus:2.42
phase() { printf '\n== %s (%s)\n' "$1" "$(date +%T)"; }

build_debian_base() {
  local root
  root=$(mktemp -d /var/tmp/tandem-debian.XXXXXX)
  debootstrap --variant=minbase --include=ca-certificates bookworm "$root" "$mirror"
  # Behind a TLS-intercepting proxy, containers need the CA this host trusts for it.
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
    chroot "$root" update-ca-certificates >/dev/null
  fi
  cat > "$root/etc/apt/sources.list" <<SOURCES
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
SOURCES
  # As in Debian's own images: package scripts start no services during a build.
  printf '#!/bin/sh\nexit 101\n' > "$root/usr/sbin/policy-rc.d"
  chmod +x "$root/usr/sbin/policy-rc.d"
  chroot "$root" apt-get clean
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin
  tar -C "$root" -c . | docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["bash"]' - "$debian"
  rm -rf "$root"
}

build_from_debian() {  # image, Dockerfile under deploy/offline
  docker build --network host --force-rm --build-arg "DEBIAN_IMAGE=$debian" -t "$1" -f "deploy/offline/$2" deploy/offline
}

serve_wheels() {  # a loopback HTTP server over $wheels: sets wheels_url and wheel_server
  # A fixed port: the URL is a build argument, and a new one would rebuild the install layer.
  local port=${WHEELS_PORT:-38765}
  if curl -s "http://127.0.0.1:$port/" >/dev/null; then
    echo "port $port is taken; set WHEELS_PORT to a free one" >&2
    return 1
  fi
  python3 -m http.server --bind 127.0.0.1 --directory "$wheels" "$port" >/dev/null 2>&1 &
  wheel_server=$!
  wheels_url="http://127.0.0.1:$port/"
  for _ in $(seq 50); do curl -fs "$wheels_url" >/dev/null && return; sleep 0.1; done
  echo "the wheel server on $wheels_url did not start" >&2
  return 1
}

phase "Debian bookworm base: $debian"
if [ -n "${REBUILD:-}" ] || ! docker image inspect "$debian" >/dev/null 2>&1; then
  build_debian_base
else
  echo "kept (REBUILD=1 rebuilds it)"
fi
phase "Python 3.11: $python_image"
build_from_debian "$python_image" python.Dockerfile
phase "Redis: $redis_image"
build_from_debian "$redis_image" redis.Dockerfile
phase "Prometheus: $prometheus_image"
build_from_debian "$prometheus_image" prometheus.Dockerfile

phase "Tandem CPU image: tandem-cpu:$tag"
torch=$(sed -n 's/^torch==\([^ ]*\).*/\1/p' requirements/torch-cpu.lock)
compgen -G "$wheels/torch-$torch-cp311-*.whl" >/dev/null \
  || { echo "no torch $torch wheel for Python 3.11 in $wheels (set TORCH_WHEELS to its folder)" >&2; exit 1; }
wheel_server=
trap '[ -z "$wheel_server" ] || kill "$wheel_server"' EXIT
serve_wheels
docker build --network host --force-rm -f deploy/Dockerfile.cpu -t "tandem-cpu:$tag" \
  --build-arg "PYTHON_IMAGE=$python_image" --build-arg TORCH_INDEX_URL= --build-arg "PIP_FIND_LINKS=$wheels_url" .

mkdir -p "$(dirname "$env_file")"
cat > "$env_file" <<VARS
# Written by scripts/offline_images.sh: images built from Debian's packages, no registry.
TANDEM_PYTHON_IMAGE=$python_image
REDIS_IMAGE=$redis_image
PROMETHEUS_IMAGE=$prometheus_image
TANDEM_IMAGE_TAG=$tag
VARS
phase "done: $env_file"
cat "$env_file"
