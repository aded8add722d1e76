#!/usr/bin/env bash
# Installs dependencies, checks the C++ formatting (scripts/format-check.sh), builds kvq (Release,
# build/) and runs the whole test suite: C++ (ctest),
# then Python (scripts/test-python.sh: a venv outside the clone, pytest against the built server),
# then kvq.vllm in vLLM's real engine (scripts/test-vllm.sh: its own venv, the SmolLM2 folder),
# then the fuzz targets for a fixed 100,000 inputs each, fuzz_rpc 10,000 (scripts/fuzz.sh, clang + ASan/UBSan),
# then the core, server and client tests under ASan + UBSan, core's and the server's under TSan
# (scripts/sanitize.sh), then the deployment test on a real Docker engine (scripts/test-deploy.sh).
# Usage: scripts/test.sh [--help]   Environment: KVQ_BUILD_DIR (default build), KVQ_JOBS, KVQ_VENV.
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,9p' "$0" | sed 's/^# //'; exit 0; fi
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
BUILD="${KVQ_BUILD_DIR:-build}"
JOBS="${KVQ_JOBS:-$(nproc)}"
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/kvq/ccache}"
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"  # relative paths: clones share cache hits
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD" -j "$JOBS"
if [[ -x scripts/test-extra.sh ]]; then bash scripts/test-extra.sh "$BUILD"; fi
# Both suites run even when the first fails, so one run shows every failure.
cpp=0; python=0; vllm=0; fuzz=0; sanitize=0; format=0; deploy=0
bash scripts/format-check.sh || format=$?
python3 scripts/render-results.py --check || format=$?
bash scripts/lint-python.sh || format=$?
ctest --test-dir "$BUILD" --output-on-failure -j "$JOBS" --timeout 900 || cpp=$?
bash scripts/test-python.sh "$BUILD" || python=$?
bash scripts/test-vllm.sh "$BUILD" || vllm=$?
bash scripts/fuzz.sh --runs 100000 || fuzz=$?
bash scripts/sanitize.sh || sanitize=$?
bash scripts/test-deploy.sh "$BUILD" || deploy=$?
echo "test: format exit $format, ctest exit $cpp, pytest exit $python, vllm exit $vllm, fuzz exit $fuzz," \
     "sanitizers exit $sanitize, deploy exit $deploy"
[[ $format -eq 0 && $cpp -eq 0 && $python -eq 0 && $vllm -eq 0 && $fuzz -eq 0 && $sanitize -eq 0 && $deploy -eq 0 ]]
