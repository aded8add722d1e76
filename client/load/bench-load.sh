#!/usr/bin/env bash
# The load benchmark of docs/BENCHMARKS.md ("Load (kvq-load)"): starts a local kvq-server,
# runs kvq-load --mix attend --context 4096 --baseline noop at 16 and at 2 streams, prints
# both reports and the Attend/Echo p99 ratio at 2 streams, stops the server (SIGTERM).
# Usage: client/load/bench-load.sh [BUILD_DIR (default build)] [DURATION (default 20s)]
# Output: the reports on stdout; JSON in $KVQ_BENCH_OUT (default /tmp/kvq-bench-load).
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,6p' "$0" | sed 's/^# //'; exit 0; fi
BUILD="${1:-build}"
DURATION="${2:-20s}"
OUT="${KVQ_BENCH_OUT:-/tmp/kvq-bench-load}"
mkdir -p "$OUT"
REG="$(mktemp -d /tmp/kvq-bench-registry-XXXXXX)"
"$BUILD/bin/kvq-server" --grpc-address 127.0.0.1 --grpc-port 0 --metrics-port -1 \
    --registry "$REG" 2>"$OUT/server.log" &
SERVER=$!
cleanup() { kill -TERM "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; rm -rf "$REG"; }
trap cleanup EXIT
ADDR=""
for _ in $(seq 1 300); do
  ADDR="$(grep -o 'serving gRPC on 127.0.0.1:[0-9]*' "$OUT/server.log" | sed 's/serving gRPC on //' || true)"
  [[ -n "$ADDR" ]] && break
  kill -0 "$SERVER" 2>/dev/null || { cat "$OUT/server.log" >&2; exit 1; }
  sleep 0.1
done
[[ -n "$ADDR" ]] || { echo "bench-load: kvq-server did not start" >&2; exit 1; }
for streams in 16 2; do
  echo "== $streams streams"
  "$BUILD/bin/kvq-load" --server "$ADDR" --mix attend --context 4096 --baseline noop \
      --concurrency "$streams" --duration "$DURATION" --progress 5s --json "$OUT/c$streams.json"
done
python3 - "$OUT/c2.json" "$OUT/c16.json" <<'PY'
import json, sys
c2, c16 = (json.load(open(p)) for p in sys.argv[1:])
a, e = c2["methods"]["attend"], c2["methods"]["noop"]
print(f"2 streams: attend p99 {a['p99_ms']:.2f} ms, Echo p99 {e['p99_ms']:.2f} ms, "
      f"ratio {a['p99_ms'] / e['p99_ms']:.2f} (target <= 3)")
errs = sum(m["errors"] for m in c16["methods"].values())
print(f"16 streams: {errs} errors (target 0)")
PY
