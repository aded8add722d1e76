#!/bin/sh
# Prints the Debian packages that own the shared libraries the given binaries load, one per
# line, sorted: what a runtime image from the same distribution must install to run them.
# Used by deploy/Dockerfile's build stage and by scripts/docker-kvq-image.sh (binaries built
# on a Debian 12 host). Fails when no package is found (the binaries load nothing packaged?).
# Usage: deploy/runtime-packages.sh [--help] BINARY...
set -eu
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ] || [ $# -eq 0 ]; then
  sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'
  [ $# -gt 0 ] && exit 0 || exit 2
fi
out="$(for b in "$@"; do ldd "$b"; done | awk '/=> \//{print $3}' | sort -u \
  | while read -r f; do dpkg -S "$f" 2>/dev/null || dpkg -S "$(readlink -f "$f")" 2>/dev/null \
    || true; done | cut -d: -f1 | sort -u)"
[ -n "$out" ] || { echo "runtime-packages: no package owns a library of $*" >&2; exit 1; }
echo "$out"
