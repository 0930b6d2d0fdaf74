#!/usr/bin/env bash
# The test command: builds dp (cuda backend too when nvcc is present) and runs every test, checks
# the formatting, then builds the sim backend under ThreadSanitizer and under AddressSanitizer+UBSan
# and runs the sim tests there, then fuzzes the readers of untrusted input for a minute each. GPU tests skip with a
# reason on machines without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)

scripts/setup.sh build -DCMAKE_BUILD_TYPE=Release
scripts/check_format.sh
ctest --test-dir build --output-on-failure -j "$jobs"

# Sanitizers run the sim backend (no nvcc: host-only objects are what they can instrument).
for san in thread "address,undefined"; do
  dir="build-san-${san%%,*}"
  scripts/setup.sh "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDP_ENABLE_CUDA=OFF -DDP_SANITIZE="$san" \
    -DDP_BUILD_BENCH=OFF
  TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$PWD/tests/tsan.supp" \
  ASAN_OPTIONS="detect_leaks=1" UBSAN_OPTIONS="halt_on_error=1 print_stacktrace=1" \
    ctest --test-dir "$dir" --output-on-failure -j "$jobs" -L sim
done
# The readers of untrusted input under libFuzzer, 60 s per target (scripts/fuzz.sh).
scripts/fuzz.sh 60
echo "test: all passed"
