#!/usr/bin/env bash
# The whole test suite, in tiers (this is what CI runs, through .ci/run). Installs dependencies,
# then:
#   1. fast checks: C++ formatting (scripts/format-check.sh), the README's rendered results
#      table (scripts/render-results.py --check), ruff and mypy (scripts/lint-python.sh);
#   2. the Release build (build/) and the unit tests (ctest without the "model" label);
#   3. the real-model tests (the models fetched by scripts/test-extra.sh; ctest -L model);
#   4. Python (scripts/test-python.sh: pytest against the built server), kvq.vllm in vLLM's
#      real engine (scripts/test-vllm.sh), the fuzz targets (scripts/fuzz.sh: 100,000 inputs
#      each, fuzz_rpc 10,000), the sanitizers (scripts/sanitize.sh: ASan + UBSan, TSan) and the
#      deployment on a real Docker engine (scripts/test-deploy.sh).
# A failure in tier 1 or 2 stops the run there (the later tiers cost most of the time);
# tiers 3 and 4 all run, so one run shows every failure among them. KVQ_KEEP_GOING=1 runs every
# tier whatever fails. Each stage's wall time is printed at the end. Exit 0 when all passed.
# Usage: scripts/test.sh [--help]
# Environment: KVQ_BUILD_DIR (default build), KVQ_JOBS, KVQ_VENV, KVQ_KEEP_GOING.
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,16p' "$0" | sed 's/^# //'; exit 0; fi
cd "$(dirname "$0")/.."
BUILD="${KVQ_BUILD_DIR:-build}"
JOBS="${KVQ_JOBS:-$(nproc)}"
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/kvq/ccache}"
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"  # relative paths: clones share cache hits

results=()  # "stage seconds exit"
failed=0
# stage NAME COMMAND...: runs one stage, records its wall time and exit status.
stage() {
  local name="$1" start=$SECONDS rc=0
  shift
  echo "test: == $name" >&2
  "$@" || rc=$?
  results+=("$name $((SECONDS - start)) $rc")
  if [[ $rc -ne 0 ]]; then failed=1; fi
}
summary() {
  local total=0 line name secs rc
  for line in "${results[@]}"; do
    read -r name secs rc <<< "$line"
    total=$((total + secs))
    printf 'test: %-14s %5d s  exit %d\n' "$name" "$secs" "$rc"
  done
  printf 'test: %-14s %5d s\n' total "$total"
}
# end_of_tier: after tiers 1 and 2, a failure stops the run (unless KVQ_KEEP_GOING=1).
end_of_tier() {
  if [[ $failed -ne 0 && "${KVQ_KEEP_GOING:-0}" != 1 ]]; then
    summary
    echo "test: tier $1 failed; later tiers not run (KVQ_KEEP_GOING=1 runs them anyway)" >&2
    exit 1
  fi
}

stage install bash scripts/install-deps.sh
# Tier 1: seconds to minutes, no build.
stage format bash scripts/format-check.sh
stage results-table python3 scripts/render-results.py --check
stage lint-python bash scripts/lint-python.sh
end_of_tier 1
# Tier 2: the build and the unit tests.
build() {
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release && cmake --build "$BUILD" -j "$JOBS"
}
stage build build
if [[ $failed -eq 0 ]]; then
  stage unit ctest --test-dir "$BUILD" --output-on-failure -j "$JOBS" --timeout 900 -LE model
fi
end_of_tier 2
# Tier 3: real models and the evaluation text.
stage models bash scripts/test-extra.sh "$BUILD"
stage model-tests ctest --test-dir "$BUILD" --output-on-failure -j "$JOBS" --timeout 900 -L model
# Tier 4: Python, the engine, fuzzing, sanitizers, deployment.
stage python bash scripts/test-python.sh "$BUILD"
stage vllm bash scripts/test-vllm.sh "$BUILD"
stage fuzz bash scripts/fuzz.sh --runs 100000
stage sanitizers bash scripts/sanitize.sh
stage deploy bash scripts/test-deploy.sh "$BUILD"
summary
[[ $failed -eq 0 ]]
