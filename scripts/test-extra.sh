#!/usr/bin/env bash
# Run by scripts/test.sh after the build and before ctest (build dir as $1): fetches the
# real models (SmolLM2-135M and Qwen2.5-Coder-0.5B) into their cache outside the clone (only
# the first run downloads), so that the real-model tests (tests/frontend/, tests/e2e/) find
# them. They read them from KVQ_MODEL / KVQ_QWEN_MODEL, or from the default cache paths.
# Usage: scripts/test-extra.sh BUILD_DIR
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
cd "$(dirname "$0")/.."
for name in smollm2-135m qwen2.5-coder-0.5b; do
  if ! model="$(bash scripts/fetch-model.sh "$name")"; then
    echo "test-extra: could not fetch $name; its real-model tests will fail" \
         "(set KVQ_ALLOW_NO_MODEL=1 to let them pass without it)" >&2
    continue
  fi
  echo "test-extra: $name at $model" >&2
done
