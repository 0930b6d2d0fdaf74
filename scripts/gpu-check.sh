#!/usr/bin/env bash
# One command that checks a GPU machine: scripts/gpu-check.sh [build-dir] (default: build).
#   1. the cuda instances of the tests (ctest -R 'cuda|DeviceRing': cuda = sim bit equality of every shared
#      functor and reduction, the CUDA rules of docs/cuda-rules.md, the device ring);
#   2. dp_train on cuda against the same run on sim, for single, dp and ddp on 1, 2 and 4 devices
#      (several on one GPU where there are fewer GPUs: --devices-per-gpu), graphs on and off: every
#      logged loss and every saved parameter within |cuda - sim| <= 1e-3 + 1e-3 |sim| (cuBLAS and
#      cuDNN sum in their own order; strict precision, so no TF32);
#   3. a short dp_bench --profile on cuda, graphs on: the devices must show busy time.
# Prints one verdict table and writes it as JSON ($OUT/gpu-check.json, or <build-dir>/gpu-check.json).
# Needs no compiler: a build made on another machine works where the CUDA libraries are on the
# loader's path (see ../shared/tools/gpu/). Without a GPU it says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
build=$(cd "${1:-build}" 2>/dev/null && pwd) || { echo "gpu-check: no build directory '${1:-build}'" >&2; exit 2; }
train=$build/examples/dp_train
bench=$build/bench/dp_bench
for tool in "$train" "$bench"; do
  [ -x "$tool" ] || { echo "gpu-check: $tool is missing: build dp first (scripts/setup.sh)" >&2; exit 2; }
done
out=${OUT:-$build}
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# DP_GPU_CHECK_BACKEND=sim runs every step with the simulator as the "GPU" (one of it): a check of
# this script itself on machines without a GPU, not of a GPU.
device=${DP_GPU_CHECK_BACKEND:-cuda}
if [ "$device" = sim ]; then gpus=1; else gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true); fi
if [ "${gpus:-0}" -eq 0 ]; then
  echo "gpu-check: no GPU found (nvidia-smi lists none): nothing to check on this machine"
  exit 0
fi
if ! "$bench" --backend "$device" --models mlp --modes single --steps 1 --warmup 0 --devices 1 > "$work/probe.txt" 2>&1; then
  echo "gpu-check: $gpus GPU(s), but dp cannot run on them:"
  tail -5 "$work/probe.txt"
  echo "(a build without the cuda backend, or CUDA libraries missing from the loader's path)"
  exit 1
fi
echo "gpu-check: $gpus GPU(s): $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"

rows=()      # "check|verdict|detail"
failed=0
verdict() {  # name, ok(0/1), detail
  local v=PASS
  [ "$2" -eq 0 ] || { v=FAIL; failed=1; }
  rows+=("$1|$v|$3")
  printf '  %-44s %s  %s\n' "$1" "$v" "$3"
}

# ---- 1. the cuda instances of the tests
echo "== cuda tests"
(cd "$build" && timeout 900 ctest -R 'cuda|DeviceRing' --timeout 300 -j 4 > "$work/ctest.txt" 2>&1)
ctest_rc=$?
summary=$(grep -E 'tests passed|tests failed' "$work/ctest.txt" | tail -1)
skipped=$(grep -c '(Skipped)' "$work/ctest.txt" || true)
verdict "cuda tests (ctest)" "$ctest_rc" "${summary:-no summary} ($skipped skipped)"
grep -E '\((Failed|Timeout|SEGFAULT|Subprocess aborted)\)' "$work/ctest.txt" | head -20
cp "$work/ctest.txt" "$out/gpu-check-ctest.txt"

# ---- 2. dp_train on cuda against sim
echo "== dp_train: cuda against sim"
compare() {  # sim_log cuda_log sim.st cuda.st [tolerance] -> prints "ok detail" or "bad detail"
  python3 - "$@" <<'EOF'
import json, re, struct, sys
def losses(path):
    return [float(m) for m in re.findall(r"^step .* loss ([0-9.eE+-]+)", open(path).read(), re.M)]
def tensors(path):
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, meta in header.items():
        if name == "__metadata__" or meta["dtype"] != "F32":
            continue
        lo, hi = meta["data_offsets"]
        out[name] = struct.unpack("<%df" % ((hi - lo) // 4), data[8 + n + lo:8 + n + hi])
    return out
def within(a, b):
    return all(abs(x - y) <= tol + tol * abs(y) for x, y in zip(a, b))
def max_diff(a, b):
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)
tol = float(sys.argv[5]) if len(sys.argv) > 5 else 1e-3
sim_l, cuda_l = losses(sys.argv[1]), losses(sys.argv[2])
if not sim_l or len(sim_l) != len(cuda_l):
    print("bad logged %d losses on sim, %d on cuda" % (len(sim_l), len(cuda_l))); sys.exit()
sim_t, cuda_t = tensors(sys.argv[3]), tensors(sys.argv[4])
if sim_t.keys() != cuda_t.keys():
    print("bad the checkpoints hold different tensors"); sys.exit()
ok = within(cuda_l, sim_l) and all(within(cuda_t[k], sim_t[k]) for k in sim_t)
print("%s %d losses, max |cuda - sim|: loss %.1e, parameters %.1e" % ("ok" if ok else "bad", len(sim_l),
      max_diff(cuda_l, sim_l), max(max_diff(cuda_t[k], sim_t[k]) for k in sim_t)))
EOF
}
# One dp_train run on sim and one on the GPU with the same arguments, compared (compare's
# tolerance): a verdict named $1, logs and checkpoints tagged $2 in $work.
train_both() {  # name tag devices_per_gpu tolerance args
  local name=$1 tag=$2 per_gpu=$3 tolerance=$4 args=$5 sim_rc cuda_rc result
  # shellcheck disable=SC2086
  timeout 120 "$train" --backend sim $args --save "$work/$tag.sim.st" > "$work/$tag.sim.txt" 2>&1
  sim_rc=$?
  # shellcheck disable=SC2086
  timeout 120 "$train" --backend "$device" --devices-per-gpu "$per_gpu" $args --save "$work/$tag.cuda.st" \
    > "$work/$tag.cuda.txt" 2>&1
  cuda_rc=$?
  if [ $sim_rc -ne 0 ] || [ $cuda_rc -ne 0 ]; then
    verdict "$name" 1 "exit codes: sim $sim_rc, cuda $cuda_rc: $(tail -1 "$work/$tag.cuda.txt")"
    return
  fi
  result=$(compare "$work/$tag.sim.txt" "$work/$tag.cuda.txt" "$work/$tag.sim.st" "$work/$tag.cuda.st" "$tolerance")
  [[ $result == ok* ]]
  verdict "$name" $? "${result#* }"
}
for model in mlp convnet; do
  for mode in single dp ddp; do
    for devices in 1 2 4; do
      [ "$mode" = single ] && [ "$devices" -gt 1 ] && continue
      per_gpu=1
      [ "$devices" -gt "$gpus" ] && per_gpu=$devices
      for graphs in on off; do
        name="$model $mode x$devices graphs $graphs"
        args="--model $model --mode $mode --devices $devices --synthetic 256 --batch-size 16 --steps 4 --lr 0.01
              --log-every 1 --no-shuffle --graphs $graphs"
        train_both "$name" "${model}_${mode}_${devices}_${graphs}" "$per_gpu" 1e-3 "$args"
      done
    done
  done
done

# ---- 3. dp_bench --profile on cuda, graphs on: busy time is seen through replayed graphs
echo "== dp_bench --profile (graphs on)"
bench_devices=2
bench_per_gpu=1
[ "$bench_devices" -gt "$gpus" ] && bench_per_gpu=$bench_devices
timeout 300 "$bench" --backend "$device" --devices "$bench_devices" --devices-per-gpu "$bench_per_gpu" --steps 10 \
  --warmup 3 --profile --json "$work/bench.json" > "$work/bench.txt" 2>&1
bench_rc=$?
cp "$work/bench.txt" "$out/gpu-check-bench.txt"
if [ $bench_rc -ne 0 ]; then
  verdict "dp_bench --profile" 1 "exit $bench_rc: $(tail -1 "$work/bench.txt")"
else
  detail=$(python3 - "$work/bench.json" <<'EOF'
import json, sys
runs = json.load(open(sys.argv[1]))["runs"]
busy = ["%s %s %.0f%%%s" % (r["model"], r["mode"], r["busy_pct_mean"] or 0, " graphs" if r["graphs"] else "") for r in runs]
print(("ok " if all((r["busy_pct_mean"] or 0) > 0 for r in runs) else "bad ") + ", ".join(busy))
EOF
)
  [[ $detail == ok* ]]
  verdict "dp_bench --profile busy %" $? "${detail#* }"
fi

# ---- 4. autocast (--amp bf16): cuda against sim (bf16 tensor-core GEMMs sum in another order, and a
# flipped bf16 rounding moves a loss by ~1e-2 after a few steps), then its speed against fp32 strict
echo "== --amp bf16: cuda against sim, and its speed"
for mode in single ddp; do
  devices=1
  [ "$mode" = ddp ] && devices=2
  per_gpu=1
  [ "$devices" -gt "$gpus" ] && per_gpu=$devices
  args="--model convnet --mode $mode --devices $devices --synthetic 256 --batch-size 16 --steps 4 --lr 0.01
        --log-every 1 --no-shuffle --amp bf16"
  train_both "convnet $mode --amp bf16" "amp_$mode" "$per_gpu" 3e-2 "$args"
done
for spec in "convnet 1024" "resnet8 256"; do
  # shellcheck disable=SC2086
  set -- $spec
  rates=""
  for amp in off bf16; do
    timeout 300 "$bench" --backend "$device" --devices 1 --models "$1" --modes single --batch-size "$2" --steps 20 \
      --warmup 5 --amp "$amp" --json "$work/amp_$1_$amp.json" > "$work/amp_$1_$amp.txt" 2>&1 || rates="$rates failed"
    cp "$work/amp_$1_$amp.txt" "$out/gpu-check-amp-$1-$amp.txt"
    rates="$rates $(python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))["runs"][0]; print("%s %.0f/s act %d B" % (sys.argv[2], r["samples_per_s"], r["activation_bytes_per_sample"]))' "$work/amp_$1_$amp.json" "$amp" 2>/dev/null)"
  done
  [[ $rates != *failed* ]]
  verdict "$1 b$2 samples/s, fp32 strict vs --amp bf16" $? "$rates"
done

# ---- the verdict, as a table above and as JSON
python3 - "$out/gpu-check.json" "$gpus" "${rows[@]}" <<'EOF'
import json, sys
rows = [dict(zip(("check", "verdict", "detail"), r.split("|", 2))) for r in sys.argv[3:]]
json.dump({"gpus": int(sys.argv[2]), "passed": all(r["verdict"] == "PASS" for r in rows), "checks": rows},
          open(sys.argv[1], "w"), indent=1)
EOF
echo "gpu-check: $( [ $failed -eq 0 ] && echo 'all passed' || echo 'FAILED' ) ($out/gpu-check.json)"
exit $failed
