#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/fuzz_*.cc) with clang, ASan and UBSan in build-fuzz/ and
# runs each for N seconds (default 20), or for N inputs from seed 1 (--runs: repeatable, what
# CI runs), over its committed seeds (fuzz/corpus/<target>, read only) plus a scratch corpus
# (build-fuzz/corpus/<target>). A crash exits 1 and leaves its input in build-fuzz/found/.
# Usage: scripts/fuzz.sh [--help] [--seconds N | --runs N] [TARGET...]   (default: every target)
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,6p' "$0" | sed 's/^# //'; exit 0; fi
cd "$(dirname "$0")/.."
LIMIT=(-max_total_time=20)
if [[ "${1:-}" == "--seconds" ]]; then LIMIT=(-max_total_time="$2"); shift 2; fi
if [[ "${1:-}" == "--runs" ]]; then LIMIT=(-runs="$2" -seed=1); shift 2; fi
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
  echo "fuzz: $t ${LIMIT[*]} (seeds $seeds)"
  # This run's artifacts (crash-, leak-, timeout-, oom- inputs) as build-fuzz/found/<target>-*;
  # an earlier run's are moved to build-fuzz/found/old/.
  mkdir -p build-fuzz/found/old
  mv build-fuzz/found/"$t"-* build-fuzz/found/old/ 2>/dev/null || true
  (cd build-fuzz && "bin/$t" "${LIMIT[@]}" -print_final_stats=1 -artifact_prefix="found/$t-" \
      "../$work" "../$seeds" 2>&1 | grep -E "^(stat::number_of_executed_units|stat::peak_rss_mb|==|SUMMARY)" || true)
  if ls build-fuzz/found/"$t"-* >/dev/null 2>&1; then
    echo "fuzz: $t failed on $(ls build-fuzz/found/"$t"-*)"
    exit 1
  fi
done
