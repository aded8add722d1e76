#!/usr/bin/env bash
# Makes, for an engine that cannot pull from an image registry, the images deploy/ needs from
# Debian packages alone:
#   base      debian:12 and debian:12-slim (what deploy/Dockerfile and the stand-ins start
#             from): a Debian 12 minbase root made by debootstrap from the mirror apt uses,
#             with a debian.sources like the official image's, imported with `docker import`.
#             The root's tarball is cached (KVQ_IMAGE_CACHE), so a wiped engine re-imports it
#             in seconds instead of running debootstrap again.
#   standins  kvq-standin/prometheus:2.42 and kvq-standin/haproxy:2.6 from Debian's prometheus
#             and haproxy packages (deploy/standin/*.Dockerfile), laid out as the official
#             prom/prometheus and haproxy images; compose uses them when KVQ_PROMETHEUS_IMAGE
#             and KVQ_HAPROXY_IMAGE name them. (Grafana has no Debian package: no stand-in.)
#   all       both (default).
# Idempotent: an image already present is left as it is (--force rebuilds).
# Usage: scripts/docker-local-images.sh [--help] [--force] [base|standins|all]
#   Environment: KVQ_DOCKER (default /usr/bin/docker), KVQ_DEBIAN_MIRROR (default: the mirror
#   apt uses for bookworm), KVQ_IMAGE_CACHE (default ~/.cache/kvq/docker).
# Needs root, a running engine (scripts/docker-engine.sh) and debootstrap.
set -euo pipefail
usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; }
FORCE=0 WHAT=all
for a in "$@"; do
  case "$a" in
    -h|--help) usage; exit 0 ;;
    --force) FORCE=1 ;;
    base|standins|all) WHAT="$a" ;;
    *) echo "docker-local-images: unknown argument '$a'" >&2; usage >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
DOCKER="${KVQ_DOCKER:-/usr/bin/docker}"
CACHE="${KVQ_IMAGE_CACHE:-$HOME/.cache/kvq/docker}"
ROOT_TAR="$CACHE/debian-12-minbase.tar.gz"

log() { echo "docker-local-images: $*" >&2; }
have() { [[ $FORCE -eq 0 ]] && "$DOCKER" image inspect "$1" >/dev/null 2>&1; }

# The bookworm mirror apt is configured with (a machine without the public mirror has its own).
mirror() {
  if [[ -n "${KVQ_DEBIAN_MIRROR:-}" ]]; then echo "$KVQ_DEBIAN_MIRROR"; return; fi
  local m
  m="$(apt-get indextargets --format '$(REPO_URI) $(CODENAME)' 2>/dev/null \
       | awk '$2 == "bookworm" {print $1; exit}')"
  echo "${m:-http://deb.debian.org/debian/}"
}

make_root_tar() {
  local dir mirror_uri security_uri
  command -v debootstrap >/dev/null || { log "debootstrap is not installed (scripts/install-deps.sh)"; exit 1; }
  mkdir -p "$CACHE"
  dir="$(mktemp -d "$CACHE/root.XXXXXX")"
  # Remove the half-made root on any exit; the tarball appears only once complete (mv below).
  trap 'rm -rf "$dir" "$ROOT_TAR.part"' EXIT
  mirror_uri="$(mirror)"
  security_uri="$(apt-get indextargets --format '$(REPO_URI) $(CODENAME)' 2>/dev/null \
                  | awk '$2 == "bookworm-security" {print $1; exit}')"
  security_uri="${security_uri:-http://deb.debian.org/debian-security/}"
  log "debootstrap --variant=minbase bookworm from $mirror_uri (about 100 s)"
  debootstrap --variant=minbase bookworm "$dir" "$mirror_uri" 2>&1 \
    | awk '/^I: (Retrieving|Validating|Extracting|Unpacking|Installing|Configuring) /{n++; if (n % 25) next}
           {print "  " $0; fflush()}' >&2
  # As the official image: deb822 sources (main, updates, security), no sources.list, no
  # package lists or downloaded packages.
  rm -f "$dir/etc/apt/sources.list"
  cat >"$dir/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: ${mirror_uri%/}
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: ${security_uri%/}
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  rm -rf "$dir"/var/lib/apt/lists/* "$dir"/var/cache/apt/archives/*.deb "$dir"/var/log/*.log
  tar -C "$dir" --numeric-owner -czf "$ROOT_TAR.part" .
  mv "$ROOT_TAR.part" "$ROOT_TAR"
  rm -rf "$dir"
  trap - EXIT
  log "cached $ROOT_TAR ($(du -h "$ROOT_TAR" | cut -f1))"
}

make_base() {
  if have debian:12 && have debian:12-slim; then log "debian:12 and debian:12-slim present"; return; fi
  if [[ $FORCE -eq 1 || ! -s "$ROOT_TAR" ]]; then make_root_tar; fi
  log "importing $ROOT_TAR as debian:12"
  "$DOCKER" import --change 'CMD ["bash"]' "$ROOT_TAR" debian:12 >/dev/null
  "$DOCKER" tag debian:12 debian:12-slim
}

make_standin() {  # NAME TAG
  local name="$1" tag="$2"
  if have "$tag"; then log "$tag present"; return; fi
  log "building $tag from Debian's $name package"
  DOCKER_BUILDKIT=0 "$DOCKER" build -q --force-rm -t "$tag" -f "deploy/standin/$name.Dockerfile" deploy/standin >/dev/null
}

if [[ "$WHAT" == base || "$WHAT" == all ]]; then make_base; fi
if [[ "$WHAT" == standins || "$WHAT" == all ]]; then
  "$DOCKER" image inspect debian:12-slim >/dev/null 2>&1 || make_base
  make_standin prometheus kvq-standin/prometheus:2.42
  make_standin haproxy kvq-standin/haproxy:2.6
fi
