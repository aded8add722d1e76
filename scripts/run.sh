#!/usr/bin/env bash
# Installs dependencies, builds kvq (Release, build/) and runs the main job.
# Usage: scripts/run.sh [--help] [args passed to the main job]
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,3p' "$0" | sed 's/^# //'; exit 0; fi
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
BUILD="${KVQ_BUILD_DIR:-build}"
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/kvq/ccache}"
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"  # relative paths: clones share cache hits
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD" -j "$(nproc)"
if [[ -x "$BUILD/bin/kvq-server" ]]; then
  exec "$BUILD/bin/kvq-server" "$@"
fi
exec "$BUILD/bin/kvq-selfreport" "$@"
