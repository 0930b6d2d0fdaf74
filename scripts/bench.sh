#!/usr/bin/env bash
# The main job: sets up, builds and runs dp_bench (single vs DP vs DDP for the MLP and the ConvNet:
# throughput, step times, scaling efficiency, per-device busy time, traffic, memory and imbalance)
# — on every visible GPU when there is one, otherwise on 2 simulated devices.
# Extra arguments go to the benchmark, e.g. --backend sim --devices 2 --json bench.json --trace trace.json
set -euo pipefail
cd "$(dirname "$0")/.."
echo "bench: setting up first (missing packages, configure, build), then dp_bench" >&2
if [ -t 2 ]; then
  # On a terminal: the build's progress ("[n/N] Building ...") on one line updated in place.
  scripts/setup.sh build -DCMAKE_BUILD_TYPE=Release | while IFS= read -r line; do
    case $line in \[*/*\]*) printf '\r%s\033[K' "${line:0:110}" >&2 ;; esac
  done
  printf '\r\033[K' >&2
else
  scripts/setup.sh build -DCMAKE_BUILD_TYPE=Release >/dev/null
fi
exec build/bin/dp_bench "$@"
