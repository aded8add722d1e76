#!/usr/bin/env bash
# Lints and type-checks the Python package (client/python): `ruff check` (src, tests, bench)
# and `mypy` (strict on the kvq package; the generated stubs are not checked, kvq.hf and
# kvq.lmcache less strictly), both as configured in client/python/pyproject.toml and pinned
# in requirements-test.txt. Exit: 0 when both are clean, else 1 (their findings on stderr).
# Usage: scripts/lint-python.sh [--help]   Environment: as scripts/python-venv.sh (the venv
# is made or reused the same way), KVQ_LINT_CACHE (ruff's and mypy's caches, default ~/.cache/kvq/lint).
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,7p' "$0" | sed 's/^# //'; exit 0; fi
cd "$(dirname "$0")/.."
VENV="$(bash scripts/python-venv.sh)"
CACHE="${KVQ_LINT_CACHE:-$HOME/.cache/kvq/lint}"
export RUFF_CACHE_DIR="$CACHE/ruff" MYPY_CACHE_DIR="$CACHE/mypy"
cd client/python
rc=0
"$VENV/bin/ruff" check --quiet . >&2 || rc=1
"$VENV/bin/mypy" --no-error-summary >&2 || rc=1
if [[ $rc -ne 0 ]]; then
  echo "lint-python: ruff or mypy found problems (above); ruff check --fix repairs some" >&2
  exit 1
fi
echo "lint-python: ruff and mypy clean"
