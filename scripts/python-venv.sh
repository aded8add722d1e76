#!/usr/bin/env bash
# Makes (or reuses) the Python virtual environment of the tests and lint, outside the clone,
# and prints its folder. Shared by scripts/test-python.sh and scripts/lint-python.sh.
# Usage: scripts/python-venv.sh [--help] [--venv DIR --requirements FILE]
# Environment: KVQ_VENV (default ~/.cache/kvq/venv), PIP_CACHE_DIR (default ~/.cache/pip),
# KVQ_PYTHON (the interpreter that makes the venv, default python3). The requirements
# (client/python/requirements-test.txt) are installed only when that file changed (a stamp in
# the venv holds its hash). Progress goes to stderr, the folder to stdout. --venv and
# --requirements make another venv the same way (scripts/test-deploy.sh: its own tools).
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,9p' "$0" | sed 's/^# //'; exit 0; fi
cd "$(dirname "$0")/.."
VENV="${KVQ_VENV:-$HOME/.cache/kvq/venv}"
REQ=client/python/requirements-test.txt
if [[ "${1:-}" == "--venv" && "${3:-}" == "--requirements" && $# -eq 4 ]]; then
  VENV="$2" REQ="$4"
elif [[ $# -ne 0 ]]; then
  echo "python-venv: usage: scripts/python-venv.sh [--venv DIR --requirements FILE]" >&2
  exit 2
fi
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$HOME/.cache/pip}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
hash_now="$(sha256sum "$REQ" | cut -d' ' -f1)"
stamp="$VENV/.kvq-requirements.sha256"
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "python-venv: creating $VENV" >&2
  "${KVQ_PYTHON:-python3}" -m venv "$VENV" >&2
fi
if [[ "$(cat "$stamp" 2>/dev/null)" != "$hash_now" ]]; then
  echo "python-venv: installing $REQ into $VENV" >&2
  "$VENV/bin/python" -m pip install -q -r "$REQ" >&2
  echo "$hash_now" > "$stamp"
fi
echo "$VENV"
