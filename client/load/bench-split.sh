#!/usr/bin/env bash
# Split Attend through the service (docs/BENCHMARKS.md, "Split Attend through the service"):
# two local kvq-servers with --workers 2, one splitting long Attends over idle workers
# (--split-attend-min-tokens 8192, the default) and one never (0), measured with kvq-load
# --mix attend at 1, 2 and 16 streams, in alternating rounds (odd rounds on first, even off
# first) so that other work on the machine hits both alike. Prints every round's numbers and
# on/off ratios, then the median ratio per stream count: for 1 stream the Attend p50 ratio
# (below 1: split answers faster), for every count the throughput ratio (above 1: more calls/s),
# and the share of the split server's Attends that did split (kvq_attend_split_total).
# Usage: client/load/bench-split.sh [BUILD_DIR (default build)] [ROUNDS (default 5)]
#        [DURATION (default 4s)]
# Environment: KVQ_SPLIT_SHAPE "q_heads:kv_heads:head_dim" (default 9:3:64), KVQ_SPLIT_CONTEXT
# tokens per sequence (default 32768), KVQ_SPLIT_STREAMS (default "1 2 16"), KVQ_SPLIT_POLL_US
# (both servers' --worker-poll-us, default 0), KVQ_SPLIT_ON_MIN (the splitting server's
# --split-attend-min-tokens, default 8192; 0 makes it an A/A run: the harness's own bias between
# the two servers); JSON reports in $KVQ_BENCH_OUT (default
# /tmp/kvq-bench-split). Each round also runs kvq-bench-codec's AttendSplit at the same shape,
# one thread unsplit against two parts on two threads: what a second core gave at that moment.
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,18p' "$0" | sed 's/^# //'; exit 0; fi
BUILD="${1:-build}"
ROUNDS="${2:-5}"
DURATION="${3:-4s}"
IFS=: read -r QH KV HD <<<"${KVQ_SPLIT_SHAPE:-9:3:64}"
CONTEXT="${KVQ_SPLIT_CONTEXT:-32768}"
STREAMS="${KVQ_SPLIT_STREAMS:-1 2 16}"
POLL="${KVQ_SPLIT_POLL_US:-0}"
ON_MIN="${KVQ_SPLIT_ON_MIN:-8192}"
OUT="${KVQ_BENCH_OUT:-/tmp/kvq-bench-split}"
mkdir -p "$OUT"
declare -A PID ADDR REG
cleanup() {
  for mode in on off; do
    [[ -n "${PID[$mode]:-}" ]] && { kill -TERM "${PID[$mode]}" 2>/dev/null || true; wait "${PID[$mode]}" 2>/dev/null || true; }
    [[ -n "${REG[$mode]:-}" ]] && rm -rf "${REG[$mode]}"
  done
  return 0
}
trap cleanup EXIT
for mode in on off; do
  REG[$mode]="$(mktemp -d /tmp/kvq-bench-registry-XXXXXX)"
  min="$ON_MIN"; [[ $mode == off ]] && min=0
  "$BUILD/bin/kvq-server" --grpc-address 127.0.0.1 --grpc-port 0 \
      --metrics-address 127.0.0.1 --metrics-port 0 \
      --workers 2 --worker-poll-us "$POLL" --split-attend-min-tokens "$min" --registry "${REG[$mode]}" \
      2>"$OUT/server-$mode.log" &
  PID[$mode]=$!
done
for mode in on off; do
  for _ in $(seq 1 300); do
    ADDR[$mode]="$(grep -o 'serving gRPC on 127.0.0.1:[0-9]*' "$OUT/server-$mode.log" | sed 's/serving gRPC on //' || true)"
    [[ -n "${ADDR[$mode]}" ]] && break
    kill -0 "${PID[$mode]}" 2>/dev/null || { cat "$OUT/server-$mode.log" >&2; exit 1; }
    sleep 0.1
  done
  [[ -n "${ADDR[$mode]}" ]] || { echo "bench-split: kvq-server ($mode) did not start" >&2; exit 1; }
done
METRICS="$(grep -o 'metrics on 127.0.0.1:[0-9]*' "$OUT/server-on.log" | sed 's/metrics on //')"
splits() { curl -s "http://$METRICS/metrics" | awk '/^kvq_attend_split_total /{print $2}'; }
echo "# kvq-load --mix attend --context $CONTEXT --layers 1 --q-heads $QH --kv-heads $KV" \
     "--head-dim $HD --duration $DURATION; servers --workers 2 --worker-poll-us $POLL," \
     "split on ($ON_MIN) / off (0)"
for r in $(seq 1 "$ROUNDS"); do
  order="on off"; (( r % 2 == 0 )) && order="off on"
  "$BUILD/bin/kvq-bench-codec" --benchmark_min_time=0.5 --benchmark_format=json \
      --benchmark_filter="^AttendSplit/T:$CONTEXT/d:$HD/q:$QH/kv:$KV/parts:(1/threads:1|2/threads:2)/real_time\$" \
      >"$OUT/r$r-codec.json" 2>/dev/null
  for streams in $STREAMS; do
    for mode in $order; do
      [[ $mode == on ]] && before="$(splits)"
      "$BUILD/bin/kvq-load" --server "${ADDR[$mode]}" --mix attend --context "$CONTEXT" \
          --layers 1 --q-heads "$QH" --kv-heads "$KV" --head-dim "$HD" \
          --concurrency "$streams" --duration "$DURATION" --progress 0 \
          --run-id "r$r-c$streams-$mode" --json "$OUT/r$r-c$streams-$mode.json" >/dev/null
      [[ $mode == on ]] && echo "$before $(splits)" >"$OUT/r$r-c$streams-splits.txt"
    done
  done
done
python3 - "$OUT" "$ROUNDS" "$STREAMS" <<'PY'
import json, statistics, sys
out, rounds, streams = sys.argv[1], int(sys.argv[2]), [int(s) for s in sys.argv[3].split()]
def get(r, c, mode):
    return json.load(open(f"{out}/r{r}-c{c}-{mode}.json"))["methods"]["attend"]
def split_share(r, c, requests):  # Attends the split server split, of those it answered
    a, b = (float(x) for x in open(f"{out}/r{r}-c{c}-splits.txt").read().split())
    return (b - a) / max(1, requests)
print(f"{'round':>5} {'streams':>7} {'p50 on':>8} {'p50 off':>8} {'p50 on/off':>10}"
      f" {'rps on':>8} {'rps off':>8} {'rps on/off':>10} {'split':>6}")
ratios = {c: ([], []) for c in streams}
for r in range(1, rounds + 1):
    for c in streams:
        on, off = get(r, c, "on"), get(r, c, "off")
        if on["errors"] or off["errors"]:
            print(f"round {r} streams {c}: errors on {on['errors']} off {off['errors']}")
        lat, thr = on["p50_ms"] / off["p50_ms"], on["rps"] / off["rps"]
        ratios[c][0].append(lat)
        ratios[c][1].append(thr)
        share = split_share(r, c, on["requests"])
        print(f"{r:>5} {c:>7} {on['p50_ms']:>8.2f} {off['p50_ms']:>8.2f} {lat:>10.3f}"
              f" {on['rps']:>8.1f} {off['rps']:>8.1f} {thr:>10.3f} {share:>6.0%}")
scaling = []
for r in range(1, rounds + 1):
    rows = json.load(open(f"{out}/r{r}-codec.json"))["benchmarks"]
    t = {("threads:2" in b["name"]): b["real_time"] for b in rows}
    if len(t) == 2:
        scaling.append(t[False] / t[True])
if scaling:
    print(f"kvq-bench-codec AttendSplit, 2 threads vs 1 in the same rounds: median "
          f"{statistics.median(scaling):.2f}x (range {min(scaling):.2f}-{max(scaling):.2f})")
for c in streams:
    lat, thr = ratios[c]
    print(f"{c:>2} streams: p50 on/off median {statistics.median(lat):.3f} "
          f"(range {min(lat):.3f}-{max(lat):.3f}); throughput on/off median "
          f"{statistics.median(thr):.3f} (range {min(thr):.3f}-{max(thr):.3f})")
PY
