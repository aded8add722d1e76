#!/usr/bin/env bash
# The GPU machine's check, in one run, on binaries built here by scripts/device-bundle.sh
# (carried as .devbin/): the CUDA parity tests against the CPU reference (score_codes, the fused
# attend, the block codec's encode/decode/score/readout, checksum verification), the block pools on
# real pinned and device memory, the memory choice and the store on the GPU (--memory gpu's pool
# and CUDA attend against an ordinary store), the kernels' CPU parity, then the CUDA benchmark
# (kvq-bench-cuda) and a short CPU codec benchmark; with a bundle made with WITH_SERVER=1, a real
# kvq-server on host, gpu, auto and pinned+gpu memory driven by kvq-load at 32k tokens
# (scripts/device-server.sh: Attend p50/p99 and the copy-back counter of each). Logs go to $OUT
# (at most 8 files come back), or /tmp/kvq-device-check.
# Usage: scripts/device-check.sh [--help] [--tests-only]
set -uo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
cd "$(dirname "$0")/.."
OUTDIR="${OUT:-/tmp/kvq-device-check}"
mkdir -p "$OUTDIR"
if [[ ! -d .devbin/bin && -f .devbin.tgz ]]; then tar xzf .devbin.tgz; fi
if [[ ! -d .devbin/bin ]]; then
  echo "device-check: no .devbin/ (run scripts/device-bundle.sh here and carry .devbin or .devbin.tgz)" >&2
  exit 2
fi
# A device the runtime cannot use must fail the CUDA tests, not skip them.
export KVQ_REQUIRE_CUDA=1
export LD_LIBRARY_PATH="$PWD/.devbin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
bin=.devbin/bin
{ echo "bundle of $(cat .devbin/commit 2>/dev/null)"; nvidia-smi; } > "$OUTDIR/nvidia-smi.txt" 2>&1
status=0
log="$OUTDIR/tests.log"
: > "$log"
for t in cuda_math_test cuda_parity_test byte_pool_test memory_pool_test store_backend_test \
  kernels_parity_test; do
  [[ -x $bin/$t ]] || { echo "device-check: $t not in the bundle" | tee -a "$log"; continue; }
  start=$SECONDS
  timeout 120 "$bin/$t" --gtest_brief=1 >> "$log" 2>&1
  rc=$?
  echo "device-check: $t exit $rc in $((SECONDS - start)) s" | tee -a "$log"
  [[ $rc -eq 0 ]] || status=1
done
[[ "${1:-}" == "--tests-only" ]] && exit $status
if [[ -x $bin/kvq-bench-cuda ]]; then
  start=$SECONDS
  timeout 300 "$bin/kvq-bench-cuda" --benchmark_out="$OUTDIR/bench-cuda.json" \
    --benchmark_out_format=json > "$OUTDIR/bench-cuda.txt" 2>&1 || status=1
  echo "device-check: kvq-bench-cuda in $((SECONDS - start)) s"; tail -40 "$OUTDIR/bench-cuda.txt"
fi
if [[ -x $bin/kvq-bench-codec ]]; then
  timeout 60 "$bin/kvq-bench-codec" --benchmark_filter='Attend(Codes|Dense)/T:32768' \
    --benchmark_min_time=0.2 > "$OUTDIR/bench-codec.txt" 2>&1 || status=1
fi
if [[ -x $bin/kvq-server && -x $bin/kvq-load ]]; then
  start=$SECONDS
  # Its many files stay on the device; the summary and the table come back.
  timeout 300 bash scripts/device-server.sh --bin "$bin" --out /tmp/kvq-device-server \
    > "$OUTDIR/server.txt" 2>&1 || status=1
  cp /tmp/kvq-device-server/summary.json "$OUTDIR/server-summary.json" 2>/dev/null
  echo "device-check: device-server in $((SECONDS - start)) s"; tail -8 "$OUTDIR/server.txt"
fi
exit $status
