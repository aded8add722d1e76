#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/fuzz_*.cc) with clang, ASan and UBSan in build-fuzz/ and
# runs each for N seconds (default 20), or for N inputs from seed 1 (--runs: repeatable, what
# CI runs; N/10 for fuzz_rpc and fuzz_registry, whose inputs are gRPC calls and folders), over
# its seeds (fuzz/corpus/<target>, read only) plus a scratch corpus (build-fuzz/corpus/<target>).
# A crash exits 1 and leaves its input in build-fuzz/found/. fuzz_rpc needs gRPC (else skipped).
# --long: the long run by hand, 10^7 inputs or one hour per target, whichever comes first.
# Usage: scripts/fuzz.sh [--help] [--seconds N | --runs N | --long] [TARGET...]   (default: all)
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,8p' "$0" | sed 's/^# //'; exit 0; fi
cd "$(dirname "$0")/.."
LIMIT=(-max_total_time=20)
if [[ "${1:-}" == "--seconds" ]]; then LIMIT=(-max_total_time="$2"); shift 2; fi
if [[ "${1:-}" == "--runs" ]]; then LIMIT=(-runs="$2" -seed=1); shift 2; fi
# (the time limit first: the tenth below applies to --runs only)
if [[ "${1:-}" == "--long" ]]; then LIMIT=(-max_total_time=3600 -runs=10000000); shift; fi
SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined"
mkdir -p build-fuzz
cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_CXX_FLAGS="-fsanitize=fuzzer-no-link $SAN" -DCMAKE_EXE_LINKER_FLAGS="$SAN" \
  -DKVQ_ENABLE_CUDA=OFF -DKVQ_BUILD_FRONTEND=OFF -DKVQ_BUILD_TESTS=OFF \
  -DKVQ_BUILD_BENCHMARKS=OFF -DKVQ_BUILD_FUZZERS=ON -UKVQ_BUILD_SERVER > build-fuzz/configure.log
# (-U: the server, which fuzz_rpc needs, is built when gRPC is found, as in any build.)
targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then
  for f in fuzz/fuzz_*.cc; do
    t="$(basename "$f" .cc)"
    if ninja -C build-fuzz -t query "$t" >/dev/null 2>&1; then
      targets+=("$t")
    else
      echo "fuzz: $t skipped (not configured: fuzz_rpc needs gRPC)"
    fi
  done
fi
if ! ninja -C build-fuzz "${targets[@]}" > build-fuzz/build.log; then
  tail -30 build-fuzz/build.log
  echo "fuzz: the build failed (build-fuzz/build.log)"
  exit 1
fi
for t in "${targets[@]}"; do
  limit=("${LIMIT[@]}")
  # fuzz_rpc's inputs are gRPC calls, fuzz_registry's folders of files loaded into a registry
  # (each about a thousand a second): a tenth of the runs.
  if [[ ( "$t" == fuzz_rpc || "$t" == fuzz_registry ) && "${LIMIT[0]}" == -runs=* ]]; then
    limit=(-runs=$(( ${LIMIT[0]#-runs=} / 10 )) -seed=1)
  fi
  seeds="fuzz/corpus/${t#fuzz_}"
  work="build-fuzz/corpus/${t#fuzz_}"
  mkdir -p "$work"
  echo "fuzz: $t ${limit[*]} (seeds $seeds)"
  # This run's artifacts (crash-, leak-, timeout-, oom- inputs) as build-fuzz/found/<target>-*;
  # an earlier run's are moved to build-fuzz/found/old/.
  mkdir -p build-fuzz/found/old
  mv build-fuzz/found/"$t"-* build-fuzz/found/old/ 2>/dev/null || true
  (cd build-fuzz && "bin/$t" "${limit[@]}" -print_final_stats=1 -artifact_prefix="found/$t-" \
      "../$work" "../$seeds" 2>&1 | grep -E "^(stat::number_of_executed_units|stat::average_exec_per_sec|stat::peak_rss_mb|==|SUMMARY|fuzz_|Done )" || true)
  if ls build-fuzz/found/"$t"-* >/dev/null 2>&1; then
    echo "fuzz: $t failed on $(ls build-fuzz/found/"$t"-*)"
    exit 1
  fi
done
