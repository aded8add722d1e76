#!/usr/bin/env bash
# Installs the Python package (client/python) into a virtual environment outside the clone and
# runs its tests (pytest) against the kvq-server of a build folder.
# Usage: scripts/test-python.sh [--help] [BUILD_DIR] [PYTEST_ARGS...]   (BUILD_DIR default: build)
# Environment: KVQ_VENV (default ~/.cache/kvq/venv), PIP_CACHE_DIR (default ~/.cache/pip),
# KVQ_PYTHON (the interpreter that makes the venv, default python3), KVQ_MODEL, KVQ_ALLOW_NO_MODEL,
# KVQ_JOBS (compile jobs of the native module, default nproc). The venv is made or reused by
# scripts/python-venv.sh (requirements installed only when client/python/requirements-test.txt
# changed). Exit: pytest's, and 1 when pytest ran no test (its exit 5).
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,9p' "$0" | sed 's/^# //'; exit 0; fi
cd "$(dirname "$0")/.."
BUILD="${1:-build}"
[[ $# -gt 0 ]] && shift
SERVER_BIN="$(cd "$BUILD" 2>/dev/null && pwd)/bin/kvq-server"
if [[ ! -x "$SERVER_BIN" ]]; then
  echo "test-python: no kvq-server in $BUILD/bin (build first: scripts/test.sh)" >&2
  exit 1
fi

VENV="$(bash scripts/python-venv.sh)"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# Editable install of the package itself, which builds its native module kvq._codes (core's
# codec from this checkout's sources) in client/python/build/ with CMake: no build isolation
# (scikit-build-core and nanobind are pinned in the venv, so this needs no download), ccache
# shared with the C++ build. Cheap when nothing changed (CMake finds nothing to rebuild).
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/kvq/ccache}"
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-${KVQ_JOBS:-$(nproc)}}"
"$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps -e client/python

export KVQ_SERVER_BIN="$SERVER_BIN"
export KVQ_BUILD_DIR="$(cd "$BUILD" && pwd)"
start=$(date +%s)
set +e
"$VENV/bin/python" -m pytest client/python/tests -q -p no:cacheprovider "$@"
rc=$?
set -e
echo "test-python: pytest exit $rc in $(( $(date +%s) - start ))s"
if [[ $rc -eq 5 ]]; then echo "test-python: pytest ran no test" >&2; exit 1; fi
exit $rc
