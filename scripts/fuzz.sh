#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/fuzz_*.cc) with clang, ASan and UBSan in build-fuzz/ and
# runs each for SECONDS (default 20) over its committed seeds (fuzz/corpus/<target>, read
# only) plus a scratch corpus (build-fuzz/corpus/<target>). A crash leaves its input in
# build-fuzz/crash-*; keep it as a regression seed in fuzz/corpus/<target> once fixed.
# Usage: scripts/fuzz.sh [--help] [--seconds N] [TARGET...]   (default: every target)
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,6p' "$0" | sed 's/^# //'; exit 0; fi
cd "$(dirname "$0")/.."
SECONDS_EACH=20
if [[ "${1:-}" == "--seconds" ]]; then SECONDS_EACH="$2"; shift 2; fi
SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined"
mkdir -p build-fuzz
cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_CXX_FLAGS="-fsanitize=fuzzer-no-link $SAN" -DCMAKE_EXE_LINKER_FLAGS="$SAN" \
  -DKVQ_ENABLE_CUDA=OFF -DKVQ_BUILD_SERVER=OFF -DKVQ_BUILD_FRONTEND=OFF -DKVQ_BUILD_TESTS=OFF \
  -DKVQ_BUILD_BENCHMARKS=OFF -DKVQ_BUILD_FUZZERS=ON > build-fuzz/configure.log
targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then
  for f in fuzz/fuzz_*.cc; do targets+=("$(basename "$f" .cc)"); done
fi
ninja -C build-fuzz "${targets[@]}" > build-fuzz/build.log
for t in "${targets[@]}"; do
  seeds="fuzz/corpus/${t#fuzz_}"
  work="build-fuzz/corpus/${t#fuzz_}"
  mkdir -p "$work"
  echo "fuzz: $t for ${SECONDS_EACH}s (seeds $seeds)"
  (cd build-fuzz && "bin/$t" -max_total_time="$SECONDS_EACH" -print_final_stats=1 \
      "../$work" "../$seeds" 2>&1 | grep -E "^(stat::number_of_executed_units|stat::peak_rss_mb|==|SUMMARY)" || true)
  if ls build-fuzz/crash-* >/dev/null 2>&1; then echo "fuzz: $t crashed (build-fuzz/crash-*)"; exit 1; fi
done
