#!/usr/bin/env bash
# Soak test on loopback: starts build/bin/kvq-server (capacity --capacity-mib, a fresh registry)
# and drives it with kvq-load for --duration, sampling the server's RSS, open file descriptors
# and threads every 5 s. --mode mixed: --streams streams of attend, put, score, readout, get and
# session (attach a shared prompt + put + attend + delete); every request must succeed.
# --mode pressure: --streams streams of 64-token puts writing past the capacity while 8 stalled
# GetBlocks readers hold their streams; only NOT_FOUND (evicted) and RESOURCE_EXHAUSTED may
# fail, evictions must happen, and the stored equivalent of what was written must reach 3x the
# capacity. Both fail (exit 1) when RSS exceeded capacity + 10% + --overhead-mib, or descriptors
# or threads grew after the warm-up (last half above the first half's peak + 8). Writes
# load.json, samples.csv, metrics.txt and summary.json to --out. Exit 2: usage; 3: no server.
# Usage: scripts/soak.sh [--help] [--mode mixed|pressure] [--duration 10m] [--streams 64]
#                        [--capacity-mib 1024] [--overhead-mib 96] [--out DIR] [--build DIR]
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,13p' "$0" | sed 's/^# //'; exit 0; fi
cd "$(dirname "$0")/.."
MODE=mixed DURATION=10m STREAMS=64 CAP_MIB=1024 OVER_MIB=96 OUT=build/soak BUILD=build
while [[ $# -gt 0 ]]; do
  case "$1" in
    --mode) MODE="$2" ;; --duration) DURATION="$2" ;; --streams) STREAMS="$2" ;; --capacity-mib) CAP_MIB="$2" ;;
    --overhead-mib) OVER_MIB="$2" ;; --out) OUT="$2" ;; --build) BUILD="$2" ;;
    *) echo "soak: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift 2
done
[[ "$MODE" == mixed || "$MODE" == pressure ]] || { echo "soak: --mode mixed or pressure" >&2; exit 2; }
for b in kvq-server kvq-load; do
  [[ -x "$BUILD/bin/$b" ]] || { echo "soak: $BUILD/bin/$b is missing (build first)" >&2; exit 2; }
done
mkdir -p "$OUT"
REG=$(mktemp -d)
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
PORT=$(free_port) MPORT=$(free_port)
"$BUILD/bin/kvq-server" --grpc-address 127.0.0.1 --grpc-port "$PORT" --metrics-address 127.0.0.1 \
  --metrics-port "$MPORT" --registry "$REG" --memory host --capacity $((CAP_MIB << 20)) \
  --retain-prefixes > "$OUT/server.log" 2>&1 &
SERVER=$!
SAMPLER=
cleanup() {
  [[ -n "$SAMPLER" ]] && kill "$SAMPLER" 2>/dev/null || true
  kill "$SERVER" 2>/dev/null || true
  wait "$SERVER" 2>/dev/null || true
  rm -rf "$REG"
}
trap cleanup EXIT
for _ in $(seq 100); do
  (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break
  kill -0 "$SERVER" 2>/dev/null || { echo "soak: the server exited (see $OUT/server.log)" >&2; exit 3; }
  sleep 0.1
done
echo "seconds,rss_kib,fds,threads" > "$OUT/samples.csv"
(
  t0=$(date +%s)
  while kill -0 "$SERVER" 2>/dev/null; do
    rss=$(awk '/^VmRSS/ {print $2}' "/proc/$SERVER/status")
    thr=$(awk '/^Threads/ {print $2}' "/proc/$SERVER/status")
    fds=$(ls "/proc/$SERVER/fd" | wc -l)
    echo "$(( $(date +%s) - t0 )),$rss,$fds,$thr" >> "$OUT/samples.csv"
    sleep 5
  done
) &
SAMPLER=$!
# A SmolLM2-shaped synthetic model (2 layers of 9:3 heads, head_dim 64).
SHAPE=(--layers 2 --q-heads 9 --kv-heads 3 --head-dim 64 --basis-rank 8)
if [[ "$MODE" == mixed ]]; then  # 512 cached tokens, decode-step puts, a 256-token prompt
  WORK=(--mix attend:4,put:2,score:1,readout:1,get:1,session:1 --context 512 --shared-prefix 256)
else
  WORK=(--mix put:1 --context 64 --put-tokens 64 --stalled-readers 8)
fi
rc=0
"$BUILD/bin/kvq-load" --server "127.0.0.1:$PORT" --concurrency "$STREAMS" --duration "$DURATION" \
  --max-duration "$DURATION" "${SHAPE[@]}" "${WORK[@]}" --progress 30s --json "$OUT/load.json" \
  > "$OUT/load.txt" || rc=$?
sleep 6  # one more sample after the load, and the gauges refreshed (housekeeping)
curl -s "http://127.0.0.1:$MPORT/metrics" > "$OUT/metrics.txt" || true
cat "$OUT/load.txt"
python3 - "$OUT" "$rc" "$CAP_MIB" "$OVER_MIB" "$MODE" <<'PY'
import csv, json, re, sys
out, rc, cap, over, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
rows = [{k: int(v) for k, v in r.items()} for r in csv.DictReader(open(f"{out}/samples.csv"))]
half = len(rows) // 2
first, last = rows[:half] or rows, rows[half:] or rows
limit_kib = (cap * 1.1 + over) * 1024
s = {
    "load_exit": rc,
    "samples": len(rows),
    "rss_max_mib": max(r["rss_kib"] for r in rows) / 1024,
    "rss_limit_mib": limit_kib / 1024,
    "fds_first_half_max": max(r["fds"] for r in first), "fds_last_half_max": max(r["fds"] for r in last),
    "threads_first_half_max": max(r["threads"] for r in first),
    "threads_last_half_max": max(r["threads"] for r in last),
}
s["rss_ok"] = s["rss_max_mib"] * 1024 <= limit_kib
s["fds_flat"] = s["fds_last_half_max"] <= s["fds_first_half_max"] + 8
s["threads_flat"] = s["threads_last_half_max"] <= s["threads_first_half_max"] + 8
def metric(name):
    total = 0.0
    for line in open(f"{out}/metrics.txt"):
        m = re.match(rf"{name}(\{{[^}}]*\}})? ([0-9.e+-]+)$", line.strip())
        if m:
            total += float(m.group(2))
    return total
codes = json.load(open(f"{out}/load.json")).get("errors_by_code", {})
s["errors_by_code"] = codes
s["evictions"] = metric("kvq_evictions_total")
if mode == "mixed":
    s["load_ok"] = rc == 0
else:
    # What the successful puts wrote (2 layers x 3 KV heads x 64 tokens x 64 channels, keys
    # and values), at the bits per element the server stores, against the capacity.
    put = json.load(open(f"{out}/load.json"))["methods"]["put"]
    bits = (metric("kvq_key_bits_per_element") + metric("kvq_value_bits_per_element")) / 2
    elements = (put["requests"] - put["errors"]) * 2 * 3 * 64 * 64 * 2
    s["stored_written_x_capacity"] = elements * bits / 8 / (cap << 20)
    s["load_ok"] = (set(codes) <= {"NOT_FOUND", "RESOURCE_EXHAUSTED"} and s["evictions"] > 0
                    and s["stored_written_x_capacity"] >= 3)
s["ok"] = s["load_ok"] and s["rss_ok"] and s["fds_flat"] and s["threads_flat"]
json.dump(s, open(f"{out}/summary.json", "w"), indent=1)
print("soak:", json.dumps(s))
sys.exit(0 if s["ok"] else 1)
PY
