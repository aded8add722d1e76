#!/usr/bin/env bash
# A real kvq-server per memory configuration, each driven by kvq-load's decode steps over a long
# context, so that the GPU store is proven end to end and its Attend latency compared with the
# host pool's on the same machine (issue 31, item 3): for each of --configs (host, gpu, auto,
# pinned+gpu: --memory pinned --attend gpu) it starts BIN/kvq-server, waits for its port, runs
# BIN/kvq-load (--context tokens a sequence and layer, attend:8,put:1, one stream, --duration),
# scrapes /metrics for kvq_block_copy_back_bytes_total (0 expected on gpu: encodes and reads run
# on the device), kvq_backend_block_ops_total and the memory pool, and stops it. A
# configuration whose server does not start is reported (its log kept), not fatal. Writes
# server-<c>.log, load-<c>.json and summary.json to --out; prints a table of Attend p50/p99.
# Exit 1 when a started configuration's load failed, 2 usage.
# Usage: scripts/device-server.sh [--help] [--bin DIR] [--out DIR] [--configs host,gpu,auto,pinned+gpu]
#                                 [--context 32768] [--duration 10s]
set -uo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
cd "$(dirname "$0")/.."
BIN=build/bin OUT=/tmp/kvq-device-server CONFIGS=host,gpu,auto,pinned+gpu CONTEXT=32768 DURATION=10s
while [[ $# -gt 0 ]]; do
  case "$1" in
    --bin) BIN="$2" ;; --out) OUT="$2" ;; --configs) CONFIGS="$2" ;; --context) CONTEXT="$2" ;;
    --duration) DURATION="$2" ;;
    *) echo "device-server: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift 2
done
for b in kvq-server kvq-load; do
  [[ -x "$BIN/$b" ]] || { echo "device-server: $BIN/$b is missing" >&2; exit 2; }
done
mkdir -p "$OUT"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
status=0
IFS=, read -r -a configs <<< "$CONFIGS"
for c in "${configs[@]}"; do
  case "$c" in
    host|gpu|auto|pinned) flags=(--memory "$c") ;;
    pinned+gpu) flags=(--memory pinned --attend gpu) ;;
    *) echo "device-server: unknown configuration '$c' (host, gpu, auto, pinned, pinned+gpu)" >&2; exit 2 ;;
  esac
  port=$(free_port) mport=$(free_port) reg=$(mktemp -d)
  "$BIN/kvq-server" --grpc-address 127.0.0.1 --grpc-port "$port" --metrics-address 127.0.0.1 \
    --metrics-port "$mport" --registry "$reg" "${flags[@]}" > "$OUT/server-$c.log" 2>&1 &
  server=$!
  up=0
  for _ in $(seq 300); do
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && { up=1; break; }
    kill -0 "$server" 2>/dev/null || break
    sleep 0.1
  done
  if [[ $up -eq 0 ]]; then
    echo "device-server: $c: the server did not start: $(tail -1 "$OUT/server-$c.log")"
    kill "$server" 2>/dev/null; wait "$server" 2>/dev/null; rm -rf "$reg"
    continue
  fi
  # A Llama-8B-like layer (32:8 heads of 128, a rank-16 basis), one stream of decode steps.
  "$BIN/kvq-load" --server "127.0.0.1:$port" --concurrency 1 --context "$CONTEXT" \
    --mix attend:8,put:1 --duration "$DURATION" --layers 1 --q-heads 32 --kv-heads 8 \
    --head-dim 128 --basis-rank 16 --progress 0 --json "$OUT/load-$c.json" \
    > "$OUT/load-$c.txt" 2>&1 || { echo "device-server: $c: kvq-load failed (load-$c.txt)"; status=1; }
  python3 -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())" \
    "http://127.0.0.1:$mport/metrics" > "$OUT/metrics-$c.txt" 2>/dev/null || true  # no curl there
  kill "$server" 2>/dev/null; wait "$server" 2>/dev/null; rm -rf "$reg"
done
python3 - "$OUT" "$CONFIGS" "$CONTEXT" <<'PY'
import json, os, re, sys
out, configs, context = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
rows = {}
for c in configs:
    row = {"started": os.path.exists(f"{out}/load-{c}.json")}
    log = open(f"{out}/server-{c}.log", errors="replace").read() if os.path.exists(f"{out}/server-{c}.log") else ""
    m = re.search(r"memory: (.*)", log)
    row["memory"] = m.group(1) if m else (log.strip().splitlines() or [""])[-1]
    if row["started"]:
        load = json.load(open(f"{out}/load-{c}.json"))
        methods = {m.get("method"): m for m in load.get("methods", [])} if isinstance(load.get("methods"), list) \
            else load.get("methods", {})
        att = methods.get("attend", {})
        row["attend"] = {k: att.get(k) for k in ("requests", "p50_ms", "p99_ms", "errors") if k in att}
        metrics = open(f"{out}/metrics-{c}.txt", errors="replace").read() if os.path.exists(f"{out}/metrics-{c}.txt") else ""
        m = re.search(r"^kvq_block_copy_back_bytes_total(?:\{[^}]*\})? (\S+)", metrics, re.M)
        row["copy_back_bytes"] = float(m.group(1)) if m else None
        m = re.search(r"^kvq_backend_block_ops_total(?:\{[^}]*\})? (\S+)", metrics, re.M)
        row["block_ops"] = float(m.group(1)) if m else None
    rows[c] = row
json.dump({"context": context, "configs": rows}, open(f"{out}/summary.json", "w"), indent=1)
print(f"{'config':<12} {'attend p50 ms':>14} {'p99 ms':>8} {'copied back B':>14} {'block ops':>10}  memory")
for c, r in rows.items():
    a = r.get("attend", {})
    print(f"{c:<12} {str(a.get('p50_ms', '-')):>14} {str(a.get('p99_ms', '-')):>8} "
          f"{str(r.get('copy_back_bytes', '-')):>14} {str(r.get('block_ops', '-')):>10}  {r['memory']}")
PY
exit $status
