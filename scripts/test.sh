#!/usr/bin/env bash
# The test command: builds dp (cuda backend too when nvcc is present) and runs every test, checks
# the formatting, then runs the sim tests under ThreadSanitizer (those of the layers that own
# threads: runtime, engines, io) and under AddressSanitizer+UBSan (all of them), and fuzzes the
# readers of untrusted input for 30 s each. GPU tests skip with a reason on machines without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)

scripts/setup.sh build -DCMAKE_BUILD_TYPE=Release
scripts/check_format.sh
ctest --test-dir build --output-on-failure -j "$jobs"

# Sanitizers run the sim backend (no nvcc: host-only objects are what they can instrument).
scripts/setup.sh build-san-thread -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDP_ENABLE_CUDA=OFF -DDP_SANITIZE=thread \
  -DDP_BUILD_BENCH=OFF -DDP_TEST_AREAS="runtime;engines;io"
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$PWD/tests/tsan.supp" \
  ctest --test-dir build-san-thread --output-on-failure -j "$jobs" -L sim
# AddressSanitizer+UBSan and the libFuzzer targets share one clang build (scripts/fuzz.sh has the
# same targets in a build of their own, to fuzz longer by hand).
CC=clang-14 CXX=clang++-14 scripts/setup.sh build-san-address -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DDP_ENABLE_CUDA=OFF -DDP_SANITIZE=address,undefined -DDP_BUILD_BENCH=OFF -DDP_FUZZ=ON -DDP_FUZZ_SECONDS=30
export ASAN_OPTIONS="detect_leaks=1" UBSAN_OPTIONS="halt_on_error=1 print_stacktrace=1"
ctest --test-dir build-san-address --output-on-failure -j "$jobs" -L sim
ctest --test-dir build-san-address --output-on-failure -j "$jobs" -L fuzz
echo "test: all passed"
