#!/usr/bin/env bash
# Checks that every tracked C++ and CUDA file is formatted as .clang-format says (clang-format 14,
# Debian's); lists the files that are not and exits 1. --fix rewrites them in place instead.
# Usage: scripts/format-check.sh [--fix] [--help]
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,4p' "$0" | sed 's/^# //'; exit 0; fi
cd "$(dirname "$0")/.."
FORMAT="${CLANG_FORMAT:-clang-format-14}"
mapfile -t files < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh')
if [[ "${1:-}" == "--fix" ]]; then
  "$FORMAT" -i "${files[@]}"
  echo "format-check: formatted ${#files[@]} files"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  "$FORMAT" --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if ((${#bad[@]})); then
  printf 'format-check: not formatted: %s\n' "${bad[@]}" >&2
  echo "format-check: ${#bad[@]} of ${#files[@]} files differ from .clang-format; run scripts/format-check.sh --fix" >&2
  exit 1
fi
echo "format-check: all ${#files[@]} files formatted"
