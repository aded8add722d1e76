#!/usr/bin/env bash
# The GPU machine's check, in one run: builds core/ and kernels/ (no gRPC, no frontend) with
# CUDA for sm_90, runs the CUDA parity tests against the CPU reference, the block pool on
# real pinned memory (byte_pool_test) and a short codec benchmark, and copies
# the logs to $OUT (when set).
# Usage: scripts/device-check.sh [--help]
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
cd "$(dirname "$0")/.."
OUTDIR="${OUT:-/tmp/kvq-device-check}"
mkdir -p "$OUTDIR"
nvidia-smi > "$OUTDIR/nvidia-smi.txt" 2>&1 || true
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVQ_ENABLE_CUDA=ON \
  -DKVQ_BUILD_SERVER=OFF -DKVQ_BUILD_FRONTEND=OFF > "$OUTDIR/configure.log" 2>&1
cmake --build build-gpu -j "$(nproc)" --target cuda_parity_test kernels_parity_test codec_test \
  byte_pool_test kvq-bench-codec > "$OUTDIR/build.log" 2>&1
status=0
for t in cuda_parity_test kernels_parity_test codec_test byte_pool_test; do
  build-gpu/bin/$t > "$OUTDIR/$t.log" 2>&1 || status=1
  tail -3 "$OUTDIR/$t.log"
done
build-gpu/bin/kvq-bench-codec --benchmark_filter='Attend(Codes|Dense)/T:32768' \
  --benchmark_min_time=0.2 > "$OUTDIR/bench.log" 2>&1 || status=1
exit $status
