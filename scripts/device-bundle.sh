#!/usr/bin/env bash
# Builds the GPU check's binaries on this machine (nvcc here, no GPU needed) and gathers them
# with the shared libraries they load, glibc's aside, into .devbin/ for the device machine,
# whose image lacks Debian's -dev libraries (Abseil, xxHash, GoogleTest, Google Benchmark).
# scripts/device-check.sh then runs them there from .devbin/ (carried, or carried packed as
# .devbin.tgz; both git-ignored).
# WITH_SERVER=1 also builds kvq-server and kvq-load (the server configured in; device-check then
# runs scripts/device-server.sh): check `du -sh .devbin` against the device tool's 64 MiB carry.
# Usage: scripts/device-bundle.sh [--help] [target...]   (default: every device-check target)
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
cd "$(dirname "$0")/.."
targets=("$@")
[[ ${#targets[@]} -eq 0 ]] && targets=(cuda_parity_test cuda_math_test kernels_parity_test
  codec_test byte_pool_test memory_pool_test store_backend_test kvq-bench-cuda kvq-bench-codec)
server=OFF
if [[ "${WITH_SERVER:-0}" == 1 ]]; then
  server=ON
  [[ $# -eq 0 ]] && targets+=(kvq-server kvq-load)
fi
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/kvq/ccache}" CCACHE_BASEDIR="$PWD"
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVQ_ENABLE_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DKVQ_BUILD_SERVER=$server -DKVQ_BUILD_FRONTEND=OFF > /dev/null
# Only the targets this tree defines (a check added later need not break an older bundle).
available=$(cmake --build build-gpu --target help | sed -n 's/^\([^:]*\): .*/\1/p')
wanted=()
for t in "${targets[@]}"; do
  if grep -qx "$t" <<< "$available"; then wanted+=("$t"); else echo "device-bundle: no target $t, skipped" >&2; fi
done
cmake --build build-gpu -j "${JOBS:-2}" --target "${wanted[@]}"
rm -rf .devbin && mkdir -p .devbin/bin .devbin/lib
for t in "${wanted[@]}"; do
  cp build-gpu/bin/"$t" .devbin/bin/
  # glibc and the CUDA driver come from the device's image; everything else travels.
  ldd build-gpu/bin/"$t" | awk '/=> \//{print $3}' \
    | grep -vE '/(libc|libm|libdl|librt|libpthread|ld-linux[^/]*|libcuda)\.so' \
    | xargs -r cp -Lu -t .devbin/lib/
done
git rev-parse --short HEAD > .devbin/commit
# Symbols stripped (the tests and benchmarks need none), and a gzipped copy: the device tool
# carries at most 64 MiB with the working tree, which the server's gRPC and OpenSSL libraries
# alone would nearly fill unpacked (carry .devbin.tgz; device-check unpacks it).
strip --strip-unneeded .devbin/bin/* .devbin/lib/*
tar czf .devbin.tgz .devbin
du -sh .devbin .devbin.tgz
