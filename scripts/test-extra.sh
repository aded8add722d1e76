#!/usr/bin/env bash
# Run by scripts/test.sh after the build and before ctest (build dir as $1): fetches the
# real model into its cache outside the clone (only the first run downloads), so that the
# real-model tests (tests/frontend/) find it. They read it from KVQ_MODEL, or from the
# default cache path when KVQ_MODEL is unset.
# Usage: scripts/test-extra.sh BUILD_DIR
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
cd "$(dirname "$0")/.."
if ! model="$(bash scripts/fetch-model.sh)"; then
  echo "test-extra: could not fetch the model; the real-model tests will fail" \
       "(set KVQ_ALLOW_NO_MODEL=1 to let them pass without it)" >&2
  exit 0
fi
echo "test-extra: model at $model" >&2
