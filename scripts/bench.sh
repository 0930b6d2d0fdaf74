#!/usr/bin/env bash
# The main job: sets up, builds and runs dp_bench (single vs DP vs DDP for the MLP and the ConvNet:
# throughput, step times, scaling efficiency, per-device busy time, traffic, memory and imbalance)
# — on every visible GPU when there is one, otherwise on 2 simulated devices.
# Extra arguments go to the benchmark, e.g. --backend sim --devices 2 --json bench.json --trace trace.json
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build -DCMAKE_BUILD_TYPE=Release >/dev/null
exec build/bench/dp_bench "$@"
