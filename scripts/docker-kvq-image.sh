#!/usr/bin/env bash
# Builds the kvq image (deploy/Dockerfile, tag kvq:latest unless --tag) in one of two ways:
#   prebuilt BUILD_DIR  from binaries already built on this Debian 12 host (BUILD_DIR/bin):
#                       stages kvq-server, kvq, kvq-load, kvq-calibrate and kvq-eval (stripped)
#                       with the packages that own the libraries they load
#                       (deploy/runtime-packages.sh) and builds deploy/Dockerfile with
#                       KVQ_BINARIES=prebuilt; seconds, no compiler in Docker. The deployment
#                       test (scripts/test-deploy.sh) uses this.
#   source              the full multi-stage build from the repository (compiles inside
#                       Docker; the command a user without a host build runs).
# Both share deploy/Dockerfile's runtime stage. Prints the build's wall time.
# Usage: scripts/docker-kvq-image.sh [--help] [--tag TAG] prebuilt BUILD_DIR | source
#   Environment: KVQ_DOCKER (default /usr/bin/docker; BuildKit is used, which Debian's client
#   has built in), KVQ_DEBIAN_IMAGE (base, default debian:12-slim).
set -euo pipefail
usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; }
TAG=kvq:latest
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --tag) TAG="$2"; shift 2 ;;
    *) break ;;
  esac
done
MODE="${1:-}"
cd "$(dirname "$0")/.."
DOCKER="${KVQ_DOCKER:-/usr/bin/docker}"
BASE="${KVQ_DEBIAN_IMAGE:-debian:12-slim}"
log() { echo "docker-kvq-image: $*" >&2; }
export DOCKER_BUILDKIT=1
start=$(date +%s)

case "$MODE" in
  prebuilt)
    [[ $# -eq 2 ]] || { usage >&2; exit 2; }
    bin="$2/bin"
    ctx="$(mktemp -d)"
    trap 'rm -rf "$ctx"' EXIT
    mkdir "$ctx/bin"
    for b in kvq-server kvq kvq-load kvq-calibrate kvq-eval; do
      [[ -x "$bin/$b" ]] || { log "$bin/$b missing: build it first (scripts/test.sh builds all)"; exit 1; }
      strip -o "$ctx/bin/$b" "$bin/$b"
    done
    sh deploy/runtime-packages.sh "$ctx"/bin/* >"$ctx/runtime-packages.txt"
    log "building $TAG from $bin ($(du -sh "$ctx/bin" | cut -f1) of binaries," \
        "$(wc -l <"$ctx/runtime-packages.txt") runtime packages)"
    "$DOCKER" build --progress=plain -f deploy/Dockerfile --build-arg KVQ_BINARIES=prebuilt \
      --build-arg DEBIAN_IMAGE="$BASE" -t "$TAG" "$ctx" 2>&1 | sed -u 's/^/  /' >&2
    ;;
  source)
    [[ $# -eq 1 ]] || { usage >&2; exit 2; }
    log "building $TAG from source inside Docker (compiles kvq: 4 min 17 s measured on 2 shared cores)"
    "$DOCKER" build --progress=plain -f deploy/Dockerfile --build-arg DEBIAN_IMAGE="$BASE" \
      -t "$TAG" . 2>&1 | sed -u 's/^/  /' >&2
    ;;
  *) usage >&2; exit 2 ;;
esac
log "built $TAG in $(($(date +%s) - start)) s ($("$DOCKER" image inspect -f '{{.Size}}' "$TAG" \
    | awk '{printf "%d MB", $1 / 1e6}'))"
