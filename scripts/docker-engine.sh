#!/usr/bin/env bash
# Makes sure a Docker engine answers, for machines without an init system (containers, CI
# runners): `start STATE` starts Debian's dockerd in the background only when no engine answers
# on the default socket, and records in the file STATE whether it did; `stop STATE` stops the
# engine only when that record says this script started it (an engine someone else runs is
# left alone), then removes STATE.
# Usage: scripts/docker-engine.sh [--help] start|stop STATE
#   Environment: KVQ_DOCKER (default /usr/bin/docker: Debian's client; a newer client elsewhere
#   in PATH may lack the buildx plugin that DOCKER_BUILDKIT=1 needs), KVQ_DOCKERD_LOG (default
#   STATE.log), KVQ_DOCKERD_WAIT (seconds to wait for readiness, default 60).
# Needs root and the packages docker.io and iptables (scripts/install-deps.sh).
set -euo pipefail
usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; }
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then usage; exit 0; fi
if [[ $# -ne 2 ]]; then usage >&2; exit 2; fi
ACTION="$1" STATE="$2"
DOCKER="${KVQ_DOCKER:-/usr/bin/docker}"
LOG="${KVQ_DOCKERD_LOG:-$STATE.log}"
WAIT="${KVQ_DOCKERD_WAIT:-60}"

log() { echo "docker-engine: $*" >&2; }
answers() { "$DOCKER" info >/dev/null 2>&1; }

case "$ACTION" in
  start)
    if answers; then
      echo "started=0" >"$STATE"
      log "an engine already answers; leaving it as it is"
      exit 0
    fi
    command -v dockerd >/dev/null || { log "dockerd is not installed (apt-get install docker.io)"; exit 1; }
    # setsid: the engine outlives this shell but not a `stop`; its own process group lets the
    # stop below signal exactly what it started (dockerd and the containerd it spawns).
    setsid dockerd >"$LOG" 2>&1 </dev/null &
    pid=$!
    echo "started=1 pid=$pid" >"$STATE"
    for ((i = 0; i < WAIT * 10; i++)); do
      if answers; then log "dockerd (pid $pid) ready after $((i / 10)).$((i % 10)) s; log $LOG"; exit 0; fi
      if ! kill -0 "$pid" 2>/dev/null; then log "dockerd exited; last lines of $LOG:"; tail -n 20 "$LOG" >&2; exit 1; fi
      sleep 0.1
    done
    log "dockerd (pid $pid) not ready after ${WAIT} s; see $LOG"
    exit 1
    ;;
  stop)
    [[ -f "$STATE" ]] || { log "no state file $STATE: nothing to stop"; exit 0; }
    read -r started pidf <"$STATE" || true
    rm -f "$STATE"
    if [[ "$started" != "started=1" ]]; then log "the engine was not started here; left running"; exit 0; fi
    pid="${pidf#pid=}"
    kill -TERM "$pid" 2>/dev/null || { log "dockerd (pid $pid) already gone"; exit 0; }
    # dockerd stops its containers (10 s grace each) and its containerd before exiting.
    for ((i = 0; i < 600; i++)); do
      kill -0 "$pid" 2>/dev/null || { log "dockerd (pid $pid) stopped"; exit 0; }
      sleep 0.1
    done
    log "dockerd (pid $pid) still running after 60 s; sending SIGKILL to its process group"
    kill -KILL -- "-$pid" 2>/dev/null || true
    ;;
  *) log "unknown action '$ACTION' (start or stop)"; exit 2 ;;
esac
