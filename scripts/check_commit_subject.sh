#!/usr/bin/env bash
# commit-msg hook (see .pre-commit-config.yaml): the subject, the first line, under 72
# characters and followed by a blank line when a body follows (CONTRIBUTING.md says why).
set -euo pipefail
subject=$(head -n 1 "$1")
if [ ${#subject} -gt 72 ]; then
  echo "commit subject is ${#subject} characters; keep it to 72 and put the why in the body" >&2
  exit 1
fi
if [ "$(sed -n 2p "$1")" != "" ]; then
  echo "leave the second line of the commit message blank" >&2
  exit 1
fi
