#!/usr/bin/env bash
# Installs dependencies, builds kvq (Release, build/) and runs the whole test suite (ctest).
# Usage: scripts/test.sh [--help]   Environment: KVQ_BUILD_DIR (default build), KVQ_JOBS.
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,3p' "$0" | sed 's/^# //'; exit 0; fi
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
BUILD="${KVQ_BUILD_DIR:-build}"
JOBS="${KVQ_JOBS:-$(nproc)}"
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/kvq/ccache}"
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"  # relative paths: clones share cache hits
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD" -j "$JOBS"
if [[ -x scripts/test-extra.sh ]]; then bash scripts/test-extra.sh "$BUILD"; fi
ctest --test-dir "$BUILD" --output-on-failure -j "$JOBS" --timeout 900
