#!/usr/bin/env bash
# Builds and runs the tests under sanitizers: every core, server and client test with
# AddressSanitizer + UndefinedBehaviorSanitizer (build-asan/, gcc like the gRPC it links; the
# frontend's model tests are left to the Release run), and with ThreadSanitizer one clang build
# (build-tsan/, the server on) that both TSan parts share. A sanitizer report fails its test.
# Prints each part's wall time.
# tsan: every test without gRPC in its process (ctest -LE grpc: core, kernels, the format, the
# flag parser), with no suppressions (core::Mutex announces absl::Mutex to TSan).
# tsan-server: the server tests (tests/server), with tests/tsan-server.supp for Debian's
# uninstrumented gRPC, protobuf, Abseil and OpenSSL; prints how often each suppression matched
# (docs/SANITIZERS.md).
# Usage: scripts/sanitize.sh [--help] [asan|tsan|tsan-server]...   (default: all three)
# Environment: KVQ_JOBS.
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,13p' "$0" | sed 's/^# //'; exit 0; fi
cd "$(dirname "$0")/.."
JOBS="${KVQ_JOBS:-$(nproc)}"
parts=("$@")
[[ ${#parts[@]} -eq 0 ]] && parts=(asan tsan tsan-server)
# Line tables for the reports' stacks, -O1 so that the suites stay quick.
COMMON=(-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1"
        -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DKVQ_ENABLE_CUDA=OFF -DKVQ_BUILD_FRONTEND=OFF
        -DKVQ_BUILD_BENCHMARKS=OFF -DKVQ_BUILD_TESTS=ON)
status=0
for part in "${parts[@]}"; do
  start=$(date +%s)
  case "$part" in
    asan)
      SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
      cmake -S . -B build-asan "${COMMON[@]}" -DCMAKE_C_COMPILER=gcc -DCMAKE_CXX_COMPILER=g++ \
        -DCMAKE_CXX_FLAGS="$SAN" -DCMAKE_C_FLAGS="$SAN" -DCMAKE_EXE_LINKER_FLAGS="$SAN" \
        > /dev/null
      export ASAN_OPTIONS="detect_leaks=1:strict_string_checks=1:check_initialization_order=1"
      export LSAN_OPTIONS="suppressions=$PWD/tests/lsan.supp:print_suppressions=0"
      export UBSAN_OPTIONS="print_stacktrace=1"
      dir=build-asan; canary=(overflow "ERROR: AddressSanitizer: heap-buffer-overflow"); cxx=g++ ;;
    tsan|tsan-server)
      SAN="-fsanitize=thread"
      cmake -S . -B build-tsan "${COMMON[@]}" -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
        -DCMAKE_CXX_FLAGS="$SAN" -DCMAKE_C_FLAGS="$SAN" -DCMAKE_EXE_LINKER_FLAGS="$SAN" > /dev/null
      export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1"
      if [[ $part == tsan-server ]]; then
        TSAN_OPTIONS+=" print_suppressions=1 suppressions=$PWD/tests/tsan-server.supp"
      fi
      dir=build-tsan; canary=(race "WARNING: ThreadSanitizer: data race"); cxx=clang++ ;;
    *) echo "sanitize: unknown part '$part' (asan, tsan or tsan-server)" >&2; exit 2 ;;
  esac
  cmake --build "$dir" -j "$JOBS" > "$dir/build.log" 2>&1 || { tail -30 "$dir/build.log"; exit 1; }
  # The canary: this build's flags must catch a planted bug, or its clean run means nothing.
  $cxx $SAN -O1 -g1 tests/sanitizer_canary.cc -o "$dir/sanitizer_canary" -pthread
  if "$dir/sanitizer_canary" "${canary[0]}" > "$dir/canary.log" 2>&1 || ! grep -q "${canary[1]}" "$dir/canary.log"; then
    echo "sanitize: $part did not report its planted ${canary[0]} (see $dir/canary.log)"; exit 1
  fi
  built=$(date +%s)
  rc=0
  if [[ $part == tsan-server ]]; then
    # Server tests only (core's run in the tsan part); each process's reports and suppression
    # counts go to its own file, summed below.
    rm -rf "$dir/tsan-logs" && mkdir -p "$dir/tsan-logs"
    TSAN_OPTIONS="$TSAN_OPTIONS log_path=$PWD/$dir/tsan-logs/tsan" \
      ctest --test-dir "$dir/tests/server" --output-on-failure -j "$JOBS" --timeout 900 \
      > "$dir/ctest-$part.log" 2>&1 || rc=$?
    cat "$dir"/tsan-logs/tsan.* 2>/dev/null >> "$dir/ctest-$part.log" || true
    grep -hE "^ *[0-9]+ +[a-z_]+:" "$dir"/tsan-logs/tsan.* 2>/dev/null |
      awk '{n[$2]+=$1} END {for (k in n) print "sanitize: suppressed " n[k] " x " k}' | sort || true
  else
    # tsan: the processes without gRPC only (its uninstrumented library would need suppressions).
    filter=()
    [[ $part == tsan ]] && filter=(-LE grpc)
    ctest --test-dir "$dir" --output-on-failure -j "$JOBS" --timeout 900 "${filter[@]}" \
      > "$dir/ctest-$part.log" 2>&1 || rc=$?
  fi
  grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)|Subprocess" "$dir/ctest-$part.log" || true
  if [[ $rc -ne 0 ]]; then
    # A sanitizer's report, or else the failed assertions (gtest's "Failure" lines), so that a CI
    # log that keeps only the tail still says what failed.
    grep -B2 -A30 -E "ERROR: (Address|Thread|Leak)Sanitizer|WARNING: ThreadSanitizer|runtime error" "$dir/ctest-$part.log" | head -80
    grep -A8 -E ": Failure$" "$dir/ctest-$part.log" | head -60
    status=1
  fi
  echo "sanitize: $part built in $((built - start)) s, tests in $(( $(date +%s) - built )) s, exit $rc"
done
exit $status
