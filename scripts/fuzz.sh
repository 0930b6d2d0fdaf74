#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz: IDX, safetensors, state-dict loading, the command line,
# PNG/JPEG decoding, the env:// store's requests, text files) with clang 14 under AddressSanitizer+UBSan on the sim backend, and runs each for
# SECONDS (default 60) over its seed corpus. scripts/test.sh runs the same targets for 30 s in its
# ASan+UBSan build; run them longer by hand, e.g. scripts/fuzz.sh 3600.
# A crash prints the input's path (build-fuzz/tests/fuzz/found_<target>/crash-*): add that file to
# tests/fuzz/corpus/<target>/ as a regression input once fixed.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
CC=clang-14 CXX=clang++-14 scripts/setup.sh build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDP_ENABLE_CUDA=OFF \
  -DDP_BUILD_TESTS=OFF -DDP_BUILD_BENCH=OFF -DDP_FUZZ=ON -DDP_SANITIZE=address,undefined \
  -DDP_FUZZ_SECONDS="$seconds"
ASAN_OPTIONS="detect_leaks=1" UBSAN_OPTIONS="halt_on_error=1 print_stacktrace=1" \
  ctest --test-dir build-fuzz --output-on-failure -L fuzz -j "$(nproc)"
