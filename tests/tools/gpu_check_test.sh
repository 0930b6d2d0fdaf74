#!/usr/bin/env bash
# scripts/gpu-check.sh on a machine without a GPU (where a GPU is present the script runs for real,
# which is not a unit test: skipped):
#   1. it says it found none and exits 0;
#   2. --list names the cuda = sim bit-equality tests, not the fatbin check (a packed build has no *.o);
#   3. its self-test, the simulator standing in for the GPU (--quick, a few seconds each): every dp_train
#      comparison row (the GPT's included) PASSes; with DP_GPU_CHECK_SELFTEST_LR0=1 (the "GPU" runs at --lr 0, so its
#      parameters never move) every one FAILs, so the comparison can fail; with a budget too small for
#      any row, every one is a SKIP row saying so. The JSON is checked each time.
set -uo pipefail
if nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  echo "a GPU is present: run scripts/gpu-check.sh itself"
  exit 77
fi
script=$(dirname "$0")/../../scripts/gpu-check.sh
build=$1
fail() { echo "FAIL: $*"; exit 1; }

# ---- 1. no GPU: nothing to check
out=$(env -u DP_GPU_CHECK_BACKEND -u DP_GPU_CHECK_SELFTEST_LR0 timeout 60 "$script" "$build" 2>&1)
rc=$?
echo "$out"
[ "$rc" -eq 0 ] || fail "exit code $rc without a GPU, expected 0"
grep -q "no GPU found" <<<"$out" || fail "expected 'no GPU found'"

# ---- 2. --list
list=$(timeout 60 "$script" --list "$build" 2>&1)
rc=$?
echo "$list" | tail -1
[ "$rc" -eq 0 ] || fail "--list: exit code $rc"
grep -q '^ReduceCudaMatchesSim\.' <<<"$list" || fail "--list names no ReduceCudaMatchesSim test"
grep -q '^FusionCudaMatchesSim\.' <<<"$list" || fail "--list names no FusionCudaMatchesSim test"
grep -q 'cuda_fatbin_architectures' <<<"$list" && fail "--list names cuda_fatbin_architectures"
quick=$(timeout 60 "$script" --quick --list "$build" 2>&1) || fail "--quick --list failed"
grep -q '^ReduceCudaMatchesSim\.' <<<"$quick" || fail "--quick --list names no ReduceCudaMatchesSim test"
grep -qE '^Backends/GptOnBackend\..*/cuda( |$)' <<<"$quick" || fail "--quick --list names no GptOnBackend cuda test"
grep -qE '^Cuda/GraphsEqualEager\..*dropout_cuda( |$)' <<<"$list" || fail "--list names no graph-with-dropout cuda test"
[ "$(wc -l <<<"$quick")" -lt "$(wc -l <<<"$list")" ] || fail "--quick --list is not shorter than --list"

# ---- 3. the self-test: sim as the GPU. selftest NAME EXPECTED_RC ROW_VERDICT [VAR=VALUE...]
selftest() {
  local name=$1 want_rc=$2 verdict=$3 dir rc
  shift 3
  dir=$(mktemp -d)
  echo "== self-test: $name"
  env "$@" OUT="$dir" DP_GPU_CHECK_BACKEND=sim timeout 300 "$script" --quick "$build"
  rc=$?
  [ "$rc" -eq "$want_rc" ] || { rm -rf "$dir"; fail "$name: exit code $rc, expected $want_rc"; }
  python3 - "$dir/gpu-check.json" "$verdict" <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
compare = [r for r in doc["checks"] if r["kind"] == "compare"]
problems = []
if not doc["finished"] or doc["running"]:
    problems.append("the JSON says the run did not finish")
if doc["backend"] != "sim" or doc["mode"] != "quick":
    problems.append("header: backend %s, mode %s" % (doc["backend"], doc["mode"]))
if len(compare) != 7:  # mlp, convnet: single, ddp x2; gpt: single, ddp x2, ddp x2 with dropout
    problems.append("%d comparison rows, expected 7" % len(compare))
if not any(r["check"].startswith("dp_train gpt") for r in compare):
    problems.append("no GPT row")
problems += ["%s: %s, expected %s" % (r["check"], r["verdict"], sys.argv[2])
             for r in compare if r["verdict"] != sys.argv[2]]
problems += ["%s: %s, expected SKIP (no GPU)" % (r["check"], r["verdict"]) for r in doc["checks"]
             if r["kind"] == "ctest" and r["verdict"] != "SKIP"]
if sys.argv[2] == "SKIP" and not all("would not fit" in r["detail"] for r in compare):
    problems.append("a SKIP row does not say it would not fit")
print("\n".join(problems) or "JSON: %d comparison rows %s" % (len(compare), sys.argv[2]))
sys.exit(1 if problems else 0)
EOF
  rc=$?
  rm -rf "$dir"
  [ "$rc" -eq 0 ] || fail "$name: the JSON is not as expected"
}
selftest "sim against sim" 0 PASS DP_GPU_CHECK_SELFTEST_LR0=0
selftest "the GPU side at --lr 0" 1 FAIL DP_GPU_CHECK_SELFTEST_LR0=1
selftest "a budget of 5 s" 0 SKIP DP_GPU_CHECK_SELFTEST_LR0=0 DP_GPU_CHECK_BUDGET_S=5
echo "gpu-check self-test: passed"
