#!/usr/bin/env bash
# The main job: sets up, builds and runs the benchmark — on the GPUs when there are any,
# otherwise on simulated devices. Extra arguments go to the benchmark.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build -DCMAKE_BUILD_TYPE=Release >/dev/null
exec build/bench/dp_microbench "$@"
