#!/usr/bin/env bash
# scripts/gpu-check.sh on a machine without a GPU: it says it found none and exits 0 (where a GPU
# is present the script runs for real, which is not a unit test: skipped).
set -uo pipefail
if nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  echo "a GPU is present: run scripts/gpu-check.sh itself"
  exit 77
fi
out=$("$(dirname "$0")/../scripts/gpu-check.sh" "$1" 2>&1)
rc=$?
echo "$out"
[ "$rc" -eq 0 ] || { echo "exit code $rc, expected 0"; exit 1; }
grep -q "no GPU found" <<<"$out" || { echo "expected 'no GPU found'"; exit 1; }
