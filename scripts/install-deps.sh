#!/usr/bin/env bash
# Installs kvq's build and test dependencies from Debian 12 packages.
# Idempotent: when every package is already present it returns in about a second.
# Usage: scripts/install-deps.sh [--help]
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then
  sed -n '2,4p' "$0" | sed 's/^# //'
  exit 0
fi
PKGS=(
  build-essential cmake ninja-build ccache pkg-config git
  libgtest-dev libgmock-dev libbenchmark-dev
  libabsl-dev libeigen3-dev libxxhash-dev zlib1g-dev nlohmann-json3-dev
  libopenblas-dev libpcre2-dev
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  prometheus-cpp-dev libssl-dev openssl
  python3 python3-venv python3-dev gnuplot-nox prometheus docker-compose haproxy
  docker.io iptables debootstrap
  python3-yaml
  clang libclang-rt-14-dev clang-format-14
)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}" >&2
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "install-deps: all ${#PKGS[@]} packages present" >&2
