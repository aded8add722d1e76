#!/usr/bin/env bash
# Moves a prefix of Qwen2.5-0.5B's shape into and out of kvq over an emulated link, fp16 rows
# against HeadQ codes (docs/BENCHMARKS.md, "Codes on the wire"): kvq-server runs in a network
# namespace of its own, reached through a veth pair whose both ends are rate-limited by tc's
# token bucket (tbf); kvq-bench-wire runs outside it and puts and gets the same sequence as rows
# and as codes (encoded and decoded in the client). The round trip is the benchmark's relay's
# delay line (--delay-us, each direction), because tc's netem, which would add it in the
# kernel, is missing here (no sch_netem). Needs root (ip netns, tc) and a build.
# Usage: scripts/bench-link.sh [--help] [BUILD_DIR]
# Environment: KVQ_LINK_RATES (default "1gbit 10gbit"), KVQ_LINK_RTT_US (default 500),
# KVQ_LINK_TOKENS (default 32768), KVQ_LINK_REPS (default 3), KVQ_LINK_ONLY (default "Qwen2.5":
# the configurations measured).
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
cd "$(dirname "$0")/.."
BUILD="${1:-build}"
RATES="${KVQ_LINK_RATES:-1gbit 10gbit}"
RTT_US="${KVQ_LINK_RTT_US:-500}"
TOKENS="${KVQ_LINK_TOKENS:-32768}"
REPS="${KVQ_LINK_REPS:-3}"
ONLY="${KVQ_LINK_ONLY:-Qwen2.5}"
for bin in kvq-server kvq-bench-wire; do
  [[ -x "$BUILD/bin/$bin" ]] || { echo "bench-link: $BUILD/bin/$bin not built" >&2; exit 1; }
done
NS="kvq-link-$$"
HOST_IF="kvql$$a" NS_IF="kvql$$b"
HOST_IP=10.231.0.1 NS_IP=10.231.0.2 PORT=50077
WORK="$(mktemp -d)"
server_pid=""
cleanup() {
  [[ -n "$server_pid" ]] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
  ip link del "$HOST_IF" 2>/dev/null || true
  ip netns del "$NS" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

ip netns add "$NS"
ip link add "$HOST_IF" type veth peer name "$NS_IF"
ip link set "$NS_IF" netns "$NS"
ip addr add "$HOST_IP/24" dev "$HOST_IF"
ip link set "$HOST_IF" up
ip netns exec "$NS" ip addr add "$NS_IP/24" dev "$NS_IF"
ip netns exec "$NS" ip link set "$NS_IF" up
ip netns exec "$NS" ip link set lo up

mkdir -p "$WORK/registry"
ip netns exec "$NS" "$BUILD/bin/kvq-server" --grpc-address "$NS_IP" --grpc-port "$PORT" \
  --metrics-port -1 --registry "$WORK/registry" --capacity 8G >"$WORK/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 100); do
  grep -q "serving gRPC" "$WORK/server.log" && break
  sleep 0.1
done
grep -q "serving gRPC" "$WORK/server.log" || { cat "$WORK/server.log" >&2; exit 1; }

for rate in $RATES; do
  # Token bucket on both ends (each direction), with a burst of a few GSO segments and room for
  # 100 ms of queue; reset per rate.
  burst=$([[ "$rate" == *gbit && "${rate%gbit}" -ge 10 ]] && echo 4mb || echo 512kb)
  tc qdisc replace dev "$HOST_IF" root tbf rate "$rate" burst "$burst" latency 100ms
  ip netns exec "$NS" tc qdisc replace dev "$NS_IF" root tbf rate "$rate" burst "$burst" latency 100ms
  echo "bench-link: link $rate each way (tc tbf), RTT $RTT_US us (relay), $TOKENS tokens, $REPS repetitions"
  "$BUILD/bin/kvq-bench-wire" --server "$NS_IP:$PORT" --tokens "$TOKENS" --reps "$REPS" --only "$ONLY" \
    --delay-us $((RTT_US / 2))
done
