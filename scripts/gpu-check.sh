#!/usr/bin/env bash
# One command that checks a GPU machine, sized for a borrowed one (15 minutes in all with its start-up,
# at most 10 a command; ../shared/tools/gpu/run.sh gives this script 400 s):
#   scripts/gpu-check.sh [--quick] [--list] [build-dir]        (build-dir: default build)
#   --quick  (<= 3 min on one H100, budget 170 s): the cuda tests that compare bits with the sim or check
#            the CUDA rules (docs/cuda-rules.md), then dp_train on cuda against sim: MLP and ConvNet,
#            single and ddp on 2 devices;
#   full     (<= 6 min, budget 360 s): that, then the rest of the cuda tests, dp on 2 devices, graphs off,
#            --amp bf16 against sim, a dp_bench --profile (busy time seen through graphs) and the
#            fp32-strict/bf16 speed rows;
#   --list   the ctest names it would run, then exit.
# Every check is a row {check, verdict PASS/FAIL/SKIP, detail, seconds}, printed and added to the JSON
# ($OUT/gpu-check.json, else <build-dir>/gpu-check.json) as soon as it ends; the JSON is written first
# with the GPU, driver and library versions, so a run killed half-way still tells what it finished and
# what was running. A step whose estimate does not fit what is left of the budget (DP_GPU_CHECK_BUDGET_S)
# is a SKIP row saying so; every command's timeout is cut to what is left.
# dp_train comparison (fp32 strict): same seed, so the same initial parameters on both; per tensor,
# with u = final - initial, |u_cuda - u_sim| <= 1e-3 |u_sim| + the rounding floor (see compare.py), and
# every logged loss within 1e-5 relative.
# Needs no compiler: a build made on another machine works where the CUDA libraries are on the
# loader's path (see ../shared/tools/gpu/). Without a GPU it says so and exits 0.
# Self-test on a machine without a GPU: DP_GPU_CHECK_BACKEND=sim (the simulator stands in for the GPU,
# the cuda tests are SKIP rows); add DP_GPU_CHECK_SELFTEST_LR0=1 and the "GPU" runs of dp_train get
# --lr 0 (their parameters never move): every comparison row must then FAIL (tests/tools/gpu_check_test.sh).
set -uo pipefail
export LC_ALL=C  # a decimal point in $EPOCHREALTIME and the tools' figures
here=$(pwd)
cd "$(dirname "$0")/.." || exit 2
usage() { sed -n '4,11p' "$0" | sed 's/^# \{0,1\}//'; }
quick=0 list=0 build_arg=
for arg in "$@"; do
  case $arg in
    --quick) quick=1 ;;
    --list) list=1 ;;
    -h | --help) usage; exit 0 ;;
    -*) echo "gpu-check: unknown option $arg" >&2; usage >&2; exit 2 ;;
    *) [ -z "$build_arg" ] || { echo "gpu-check: one build directory, not '$build_arg' and '$arg'" >&2; exit 2; }
       build_arg=$arg ;;
  esac
done
build_arg=${build_arg:-build}
# Relative to where it was called from, else to the checkout (the default, build, from anywhere).
build=$(cd "$here" && cd "$build_arg" 2>/dev/null && pwd) || build=$(cd "$build_arg" 2>/dev/null && pwd) ||
  { echo "gpu-check: no build directory '$build_arg'" >&2; exit 2; }
train=$build/bin/dp_train
bench=$build/bin/dp_bench

# The cuda tests, by ctest name (gtest's, with CMake's "  # GetParam() = ..." where it appends it).
# Every name with cuda/Cuda or DeviceRing, but the sim instances of the CudaRules suite, the fatbin
# check (needs the build's *.o, which a packed build has not) and the find_package consumer (a compiler).
tests_all='[Cc]uda|DeviceRing'
tests_out='^(cuda_fatbin_architectures|find_package_consumer)$|[/_]sim( |$)'
# --quick: those comparing cuda's bits with the sim's (reductions, fused kernels, the device ring) and
# the CUDA rules (test_cuda_rules: CudaRules, ForbiddenInCapture; test_graph: Graphs) and bf16 storage
# (test_bf16_storage: the bf16 kernels, cuDNN and cuBLAS on bf16 operands) and the transformer kernels
# (test_transformer_kernels, test_transformer) and the GPT through every engine (test_gpt_engines:
# torch's step, AdamW's decay groups, dropout's masks, graphs with dropout against eager).
tests_quick='^(ReduceCudaMatchesSim|FusionCudaMatchesSim|TransformerKernelsCudaMatchesSim|FusedAttentionCudaMatchesSim|DeviceRing)\.'
tests_quick+='|^Backends/(CudaRules|ForbiddenInCapture|Graphs|Bf16Storage|TransformerKernels|FusedAttention|Transformer|GptOnBackend)\.'
tests_quick+='[^ ]*[/_]cuda( |$)'
# ... and the collectives' agreement on cuda's ranks (a desync named before the backend sees the call).
tests_quick+='|^Backends/Collectives\.(AMismatchedCallEndsOnEveryRankBeforeItRuns|ARankThatIssuesFewerCallsIsNamedAtOnce)/cuda( |$)'
if [ "$list" = 1 ]; then
  if [ "$quick" = 1 ]; then select=$tests_quick; else select=$tests_all; fi
  names=$(cd "$build" && timeout 60 ctest -N -R "$select" -E "$tests_out") ||
    { echo "gpu-check: ctest -N failed in $build" >&2; exit 2; }
  sed -n 's/^ *Test *#[0-9]*: //p' <<<"$names"
  echo "gpu-check: $(grep -c '^ *Test *#' <<<"$names") tests ($([ "$quick" = 1 ] && echo quick || echo full))"
  exit 0
fi

for tool in "$train" "$bench"; do
  [ -x "$tool" ] || { echo "gpu-check: $tool is missing: build dp first (scripts/setup.sh)" >&2; exit 2; }
done
out=${OUT:-$build}
mkdir -p "$out"
json=$out/gpu-check.json
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# tmo SECONDS COMMAND...: COMMAND under timeout (TERM, then KILL 5 s on), waited for in the background
# so that a TERM to this script (run.sh's own timeout) reaches it at once: timeout passes it on to its
# whole process group (ctest's tests too), which the group of the caller's timeout does not hold.
child=
tmo() {
  timeout -k 5 "$1" "${@:2}" &
  child=$!
  wait "$child"
  local rc=$?
  child=
  return $rc
}
# shellcheck disable=SC2317  # called by the trap
on_signal() {
  [ -n "$child" ] && kill -TERM "$child" 2>/dev/null
  echo "gpu-check: stopped by a signal; $json holds the rows that finished" >&2
  exit 143
}
trap on_signal TERM INT HUP

# DP_GPU_CHECK_BACKEND=sim runs every step with the simulator as the "GPU" (one of it): a check of
# this script itself on machines without a GPU, not of a GPU.
device=${DP_GPU_CHECK_BACKEND:-cuda}
if [ "$device" = sim ]; then gpus=1; else gpus=$(timeout 30 nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true); fi
if [ "${gpus:-0}" -eq 0 ]; then
  echo "gpu-check: no GPU found (nvidia-smi lists none): nothing to check on this machine"
  exit 0
fi
lr0=()
[ "${DP_GPU_CHECK_SELFTEST_LR0:-0}" = 1 ] && lr0=(--lr 0)  # the last --lr wins (argparse's rule)
if [ "$quick" = 1 ]; then mode=quick default_budget=170; else mode=full default_budget=360; fi
budget=${DP_GPU_CHECK_BUDGET_S:-$default_budget}
[[ $budget =~ ^[0-9]+$ ]] || { echo "gpu-check: DP_GPU_CHECK_BUDGET_S='$budget': not whole seconds" >&2; exit 2; }
t0=0  # $SECONDS counts from the script's start, and so does the budget
left() { echo $((budget - (SECONDS - t0))); }
# cap N: a timeout of N s, or what is left of the budget when that is less (at least 1 s)
cap() { local l; l=$(left); if [ "$l" -lt "$1" ]; then echo $((l > 1 ? l : 1)); else echo "$1"; fi; }
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }

# ---- the JSON: a header now, then a row as each check ends (temp file + mv: never half written)
cat > "$work/rows.py" <<'EOF'
import json, os, sys
cmd, path, work = sys.argv[1:4]
rows_path, state_path = os.path.join(work, "rows.jsonl"), os.path.join(work, "running")
if cmd == "header":  # gpus backend mode budget lr0 nvidia-smi-line versions-json commit build
    gpus, backend, mode, budget, lr0, smi, versions, commit, build = sys.argv[4:13]
    smi = [s.strip() for s in smi.split(",")] if smi else []
    try:
        versions = json.loads(versions)
    except ValueError:
        versions = {}
    header = {"gpus": int(gpus), "backend": backend, "mode": mode, "budget_s": int(budget),
              "selftest_lr0": lr0 == "1", "gpu": smi[0] if smi else None,
              "driver": smi[1] if len(smi) > 1 else None, "memory": smi[2] if len(smi) > 2 else None}
    for key in ("cuda_driver", "cuda_runtime", "cublas", "cudnn", "nccl"):
        header[key] = versions.get(key)
    header.update(commit=commit or None, build=build)
    json.dump(header, open(os.path.join(work, "header.json"), "w"))
    open(rows_path, "w").close()
elif cmd == "running":
    open(state_path, "w").write(sys.argv[4])
elif cmd == "add":  # kind check verdict detail seconds
    kind, check, verdict, detail, seconds = sys.argv[4:9]
    with open(rows_path, "a") as f:
        f.write(json.dumps({"check": check, "verdict": verdict, "detail": detail, "seconds": float(seconds),
                            "kind": kind}) + "\n")
    open(state_path, "w").close()
doc = json.load(open(os.path.join(work, "header.json")))
rows = [json.loads(line) for line in open(rows_path)]
running = open(state_path).read() if os.path.exists(state_path) else ""
counts = {v: sum(r["verdict"] == v for r in rows) for v in ("PASS", "FAIL", "SKIP")}
doc.update(finished=cmd == "finish", running=running or None, passed=counts["FAIL"] == 0, counts=counts,
           checks=rows)
if cmd == "finish":
    doc["seconds"] = float(sys.argv[4])
with open(path + ".tmp", "w") as f:
    json.dump(doc, f, indent=1)
os.replace(path + ".tmp", path)
EOF
jsonw() {  # header|running|add|finish ARGS: rows.py rewrites the JSON
  timeout 30 python3 "$work/rows.py" "$1" "$json" "$work" "${@:2}" || echo "gpu-check: could not write $json" >&2
}
failed=0
row() {  # kind check verdict detail seconds
  [ "$3" = FAIL ] && failed=1
  printf '  %-42s %-4s %6ss  %s\n' "$2" "$3" "$5" "$4"
  jsonw add "$@"
}
# fits KIND CHECK EST: the step's estimate fits what is left of the budget; else a SKIP row says so.
fits() {
  local l; l=$(left)
  [ "$3" -le "$l" ] && return 0
  row "$1" "$2" SKIP "would not fit: needs ~$3 s (estimate), $l s left of the $budget s budget" 0
  return 1
}

# The versions of the libraries dp loads (the loader's path, as dp sees it); unknown: null.
versions=$(timeout 20 python3 - 2>/dev/null <<'EOF'
import ctypes, json
def lib(name):
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None
def call_int(library, fn, *args):
    v = ctypes.c_int(0)
    return v.value if getattr(library, fn)(*args, ctypes.byref(v)) == 0 else None
out = {}
def probe(key, f):
    try:
        out[key] = f()
    except Exception:
        out[key] = None
names = ("libcudart.so.13", "libcublas.so.13", "libcudnn.so.9", "libnccl.so.2")
cudart, cublas, cudnn, nccl = (lib(n) for n in names)
def cuda_version(fn):  # 13000 -> 13.0; 0: no driver
    v = call_int(cudart, fn)
    return None if not v else "%d.%d" % (v // 1000, v % 1000 // 10)
def cublas_version():
    parts = [call_int(cublas, "cublasGetProperty", t) for t in (0, 1, 2)]  # MAJOR, MINOR, PATCH
    if None not in parts:
        return "%d.%d.%d" % tuple(parts)
    v = call_int(cublas, "cublasGetVersion_v2", None)  # 130100 -> 13.1.0
    return None if v is None else "%d.%d.%d" % (v // 10000, v % 10000 // 100, v % 100)
def cudnn_version():  # 91002 -> 9.10.2 (cuDNN 9: major * 10000 + minor * 100 + patch)
    cudnn.cudnnGetVersion.restype = ctypes.c_size_t
    v = cudnn.cudnnGetVersion()
    return "%d.%d.%d" % (v // 10000, v % 10000 // 100, v % 100) if v >= 90000 else str(v)
def nccl_version():  # 22703 -> 2.27.3
    v = call_int(nccl, "ncclGetVersion")
    return None if v is None else "%d.%d.%d" % (v // 10000, v % 10000 // 100, v % 100)
probe("cuda_driver", lambda: cuda_version("cudaDriverGetVersion"))
probe("cuda_runtime", lambda: cuda_version("cudaRuntimeGetVersion"))
probe("cublas", cublas_version)
probe("cudnn", cudnn_version)
probe("nccl", nccl_version)
print(json.dumps(out))
EOF
) || versions='{}'
smi=$(timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
commit=$(timeout 10 git rev-parse --short HEAD 2>/dev/null)
jsonw header "$gpus" "$device" "$mode" "$budget" "${DP_GPU_CHECK_SELFTEST_LR0:-0}" "$smi" "$versions" "$commit" "$build"
echo "gpu-check: $gpus GPU(s): ${smi:-(none: backend $device)}; libraries $versions"
echo "gpu-check: $mode run, budget $budget s, $json"

# ---- 0. dp runs on the GPU at all. ~5 s on the GPU (context, cuBLAS; estimate); 0.1 s on sim here.
start=$EPOCHREALTIME
jsonw running "probe"
tmo "$(cap 60)" "$bench" --backend "$device" --models mlp --modes single --steps 1 --warmup 0 --devices 1 \
  > "$work/probe.txt" 2>&1
probe_rc=$?
if [ $probe_rc -ne 0 ]; then
  row probe "probe: dp_bench runs on $device" FAIL "exit $probe_rc: $(tail -1 "$work/probe.txt")" "$(since "$start")"
  tail -5 "$work/probe.txt"
  echo "(a build without the cuda backend, or CUDA libraries missing from the loader's path)"
  jsonw finish "$((SECONDS - t0))"
  exit 1
fi
row probe "probe: dp_bench runs on $device" PASS "one mlp step" "$(since "$start")"

# ---- the cuda tests (ctest). A row: how many passed, failed, were skipped, of how many.
ctest_row() {  # check est jobs select exclude file
  local check=$1 est=$2 jobs=$3 select=$4 exclude=$5 file=$6 start rc total ran passed skipped failures detail
  if [ "$device" = sim ]; then
    row ctest "$check" SKIP "no GPU: DP_GPU_CHECK_BACKEND=sim checks this script, not the cuda tests" 0
    return
  fi
  fits ctest "$check" "$est" || return
  jsonw running "$check"
  start=$EPOCHREALTIME
  total=$(cd "$build" && timeout 60 ctest -N -R "$select" -E "$exclude" | grep -c '^ *Test *#')
  # Twice the estimate at most (a slower GPU still ends, the later steps still run), and within the budget.
  cd "$build" || return
  tmo "$(cap $((2 * est)))" ctest -R "$select" -E "$exclude" --timeout 60 --output-on-failure -j "$jobs" > "$work/$file" 2>&1
  rc=$?
  cd - > /dev/null || exit 2
  cp "$work/$file" "$out/gpu-check-$file"
  ran=$(grep -cE '^ *[0-9]+/[0-9]+ Test +#' "$work/$file")
  passed=$(grep -E '^ *[0-9]+/[0-9]+ Test +#' "$work/$file" | grep -c ' Passed ')
  skipped=$(grep -E '^ *[0-9]+/[0-9]+ Test +#' "$work/$file" | grep -c 'Skipped')
  failures=$(grep -E '^ *[0-9]+/[0-9]+ Test +#' "$work/$file" | grep -vE ' Passed |Skipped' |
    sed -E 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: ([^ ]+).*/\1/' | head -3 | tr '\n' ' ')
  detail="$passed passed, $((ran - passed - skipped)) failed, $skipped skipped of $total"
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && detail="$detail; timed out after $(since "$start") s, $ran ran"
  [ -n "$failures" ] && detail="$detail; failed: $failures"
  if [ "$rc" -eq 0 ] && [ "$ran" -eq "$total" ] && [ "$skipped" -lt "$total" ]; then
    row ctest "$check" PASS "$detail" "$(since "$start")"
  else
    [ "$total" -gt 0 ] && [ "$skipped" -eq "$total" ] && detail="$detail; every one skipped: no GPU seen"
    row ctest "$check" FAIL "$detail" "$(since "$start")"
  fi
}

# ---- dp_train on the GPU against the same run on sim
cat > "$work/compare.py" <<'EOF'
# compare.py init.st sim.st gpu.st sim.jsonl gpu.jsonl tolerance loss_tolerance steps -> "ok|bad detail"
# Per float32 tensor of the model (parameters, BatchNorm statistics), u = final - initial:
#   |u_gpu - u_sim|_2 <= tol |u_sim|_2 + floor,  floor = steps x |ulp(final_sim)|_2
# (each step rounds p - lr g to float once, and two runs whose updates differ in the last bits may
# round the other way: one ulp per element and step; a sim update of exactly zero is held to it too).
# A bias feeding a BatchNorm (layerN.K.bias before layerN.K+1) has an exact gradient of zero (the
# BatchNorm takes the channel's mean away): its update is rounding noise of sums taken in another
# order (1e-9 in fp32, 1e-4 in bf16), so |u_sim| there is its layer's weight update, not its own: a
# GPU whose BatchNorm backward leaves the mean in fails, noise does not. The optimizer's state is not
# compared (such a bias' momentum is that noise alone; the updates carry the state anyway). Integer
# tensors (num_batches_tracked) must be equal. Reported: the worst |u_gpu - u_sim| / (|u_sim| +
# floor / tol), <= tol exactly when the tensor passes, and the worst relative loss error.
import array, json, math, re, struct, sys
def tensors(path):
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    floats, others = {}, {}
    for name, meta in header.items():
        if name == "__metadata__" or name.startswith("optimizer."):
            continue
        lo, hi = meta["data_offsets"]
        if meta["dtype"] == "F32":
            floats[name] = array.array("f")
            floats[name].frombytes(data[8 + n + lo:8 + n + hi])
        else:
            others[name] = (meta["dtype"], data[8 + n + lo:8 + n + hi])
    return floats, others
def losses(path):
    return [json.loads(line)["loss"] for line in open(path) if '"kind":"step"' in line.replace(" ", "")]
def ulp(x):
    return math.ldexp(1.0, math.frexp(x)[1] - 24) if x else 2.0 ** -149
init_path, sim_path, gpu_path, sim_log, gpu_log = sys.argv[1:6]
tol, loss_tol, steps = float(sys.argv[6]), float(sys.argv[7]), int(sys.argv[8])
(init, _), (sim, sim_o), (gpu, gpu_o) = tensors(init_path), tensors(sim_path), tensors(gpu_path)
if sim.keys() != gpu.keys() or sim_o.keys() != gpu_o.keys() or not set(sim) <= set(init):
    print("bad the checkpoints hold different tensors:", sorted(set(sim) ^ set(gpu)) or sorted(set(sim) - set(init)))
    sys.exit()
def sim_update(name):
    return math.sqrt(sum((s - i) ** 2 for i, s in zip(init[name], sim[name])))
ok, worst, worst_name, bad = True, 0.0, "", []
for name in sim:
    du = math.sqrt(sum((g - s) ** 2 for s, g in zip(sim[name], gpu[name])))
    fl = steps * math.sqrt(sum(ulp(s) ** 2 for s in sim[name]))
    layer = re.fullmatch(r"(.*)\.(\d+)\.bias", name)
    weight = layer and "%s.%s.weight" % (layer[1], layer[2])
    before_bn = layer and "%s.%d.running_mean" % (layer[1], int(layer[2]) + 1) in sim and weight in sim
    su = sim_update(weight if before_bn else name)
    r = du / (su + fl / tol)
    if not r <= tol:  # NaN fails
        ok = False
        bad.append(name)
    if not r <= worst:
        worst, worst_name = r, name
for name in sim_o:
    if sim_o[name] != gpu_o[name]:
        ok = False
        bad.append(name + " (" + sim_o[name][0] + ", not equal)")
sl, gl = losses(sim_log), losses(gpu_log)
loss_worst, loss_step = 0.0, 0
if not sl or len(sl) != len(gl):
    ok = False
    bad.append("logged %d losses on sim, %d on the GPU" % (len(sl), len(gl)))
for step, (s, g) in enumerate(zip(sl, gl), 1):
    e = abs(g - s) / abs(s) if s else abs(g)
    if not e <= loss_worst:
        loss_worst, loss_step = e, step
if not loss_worst <= loss_tol:
    ok = False
    bad.append("loss")
update = "update %.1e (%s)" % (worst, worst_name) if worst else "updates equal"
loss = "loss %.1e (step %d)" % (loss_worst, loss_step) if loss_worst else "losses equal"
print("%s %s, %s; bounds %g, %g; %d tensors, %d losses%s" % ("ok" if ok else "bad", update, loss, tol, loss_tol,
      len(sim), len(sl), "; over: " + ", ".join(bad[:4]) if bad else ""))
EOF
steps=4
# The initial state of MODEL (dp_train seeds its initialisation on the host: the same on sim and cuda):
# one sim step at --lr 0 (parameters as initialised; BatchNorm statistics after one batch, a common
# reference for both runs). 0.1 s here.
# A model's dp_train flags and data: the GPT small (2 layers of width 64, context 32) on the bytes of
# this checkout's README (the last 10 % held out), the others on 256 synthetic images.
model_flags() {  # model -> flags
  case $1 in
    gpt) echo "--model gpt --context 32 --layers 2 --heads 2 --width 64 --text $PWD/README.md" ;;
    *) echo "--model $1 --synthetic 256" ;;
  esac
}
initial() {  # model -> $work/init_MODEL.st
  [ -s "$work/init_$1.st" ] && return 0
  # shellcheck disable=SC2046  # model_flags' words
  tmo "$(cap 60)" "$train" --backend sim $(model_flags "$1") --mode single --batch-size 16 \
    --steps 1 --lr 0 --no-shuffle --save "$work/init_$1.st" > "$work/init_$1.txt" 2>&1
}
# A row: dp_train on sim and on the GPU with the same arguments (the GPU's with DP_GPU_CHECK_SELFTEST_LR0's
# --lr 0), compared by compare.py. Several dp devices share a GPU where there are fewer GPUs.
train_row() {  # model mode devices graphs amp est [extra dp_train flags]
  local model=$1 mode=$2 devices=$3 graphs=$4 amp=$5 est=$6 extra=${7:-} per_gpu=1 tol=1e-3 loss_tol=1e-5
  local check="dp_train $model $mode x$devices${extra:+ $extra}" start init_rc sim_rc gpu_rc result
  local tag="$1_$2_$3_$4_$5${extra:+_$(tr -c 'a-z0-9' _ <<<"$extra")}"
  [ "$graphs" = off ] && check="$check graphs off"
  # --amp bf16: bf16 keeps 8 significant bits, so a rounding that falls the other way (cuBLAS/cuDNN and
  # the sim sum the fp32 products in another order) moves an operand by 2^-8 = 3.9e-3 relative, and such
  # flips add up over 4 steps. Measured here on sim with the order changed alone (ddp x2, x4 --sync-bn
  # against single): updates 1.2e-2, 2.6e-2 (fp32: 2e-6), losses 3e-4, 1.3e-3. Bounds 5e-2 and 1e-2:
  # twice the worst of those and more, still far below the 1.0 (update) of a GPU that does not learn.
  [ "$amp" != off ] && { check="$check --amp $amp"; tol=5e-2; loss_tol=1e-2; }
  [ "$devices" -gt "$gpus" ] && per_gpu=$devices
  fits compare "$check" "$est" || return
  jsonw running "$check"
  start=$EPOCHREALTIME
  # shellcheck disable=SC2207  # model_flags' words
  local args=($(model_flags "$model") --mode "$mode" --devices "$devices" --batch-size 16 --steps "$steps"
              --lr 0.01 --log-every 1 --no-shuffle --graphs "$graphs" --amp "$amp")
  # shellcheck disable=SC2206  # the extra flags are words
  [ -n "$extra" ] && args+=($extra)
  initial "$model"
  init_rc=$?
  tmo "$(cap 60)" "$train" --backend sim "${args[@]}" --metrics-json "$work/$tag.sim.jsonl" \
    --save "$work/$tag.sim.st" > "$work/$tag.sim.txt" 2>&1
  sim_rc=$?
  tmo "$(cap 90)" "$train" --backend "$device" --devices-per-gpu "$per_gpu" "${args[@]}" "${lr0[@]}" \
    --metrics-json "$work/$tag.gpu.jsonl" --save "$work/$tag.gpu.st" > "$work/$tag.gpu.txt" 2>&1
  gpu_rc=$?
  if [ $init_rc -ne 0 ] || [ $sim_rc -ne 0 ] || [ $gpu_rc -ne 0 ]; then
    cp "$work/$tag.gpu.txt" "$out/gpu-check-$tag.txt"
    row compare "$check" FAIL \
      "exit codes: initial $init_rc, sim $sim_rc, $device $gpu_rc: $(tail -1 "$work/$tag.gpu.txt")" "$(since "$start")"
    return
  fi
  result=$(timeout "$(cap 60)" python3 "$work/compare.py" "$work/init_$model.st" "$work/$tag.sim.st" \
    "$work/$tag.gpu.st" "$work/$tag.sim.jsonl" "$work/$tag.gpu.jsonl" "$tol" "$loss_tol" "$steps" 2>&1 | tail -1)
  if [[ $result == ok\ * ]]; then
    row compare "$check" PASS "${result#ok }" "$(since "$start")"
  else
    cp "$work/$tag.sim.txt" "$out/gpu-check-$tag.sim.txt"
    cp "$work/$tag.gpu.txt" "$out/gpu-check-$tag.gpu.txt"
    row compare "$check" FAIL "${result#bad }" "$(since "$start")"
  fi
}

# ---- 1. quick: the cuda tests comparing bits with the sim, the CUDA rules and the GPT through the
# engines: 58 tests (--list counts them), one process each (a CUDA context, cuBLAS/cuDNN handles), 4 at
# a time: ~70 s on one H100 (estimate: 36 of them took ~40 s on the H200; the GPT's ~1 s each).
echo "== cuda tests: bit equality with the sim, CUDA rules, the GPT"
ctest_row "cuda tests: sim bits, CUDA rules, GPT" 70 4 "$tests_quick" "$tests_out" ctest-quick.txt

# ---- 2. quick: dp_train on the GPU against sim, graphs on (the default), strict fp32. A row: ~10 s on
# the GPU (start-up, cuDNN's plan search, capture; estimate); its sim side 0.5 s here (2 cores).
echo "== dp_train: $device against sim"
train_row mlp single 1 on off 10
train_row mlp ddp 2 on off 10
train_row convnet single 1 on off 10
train_row convnet ddp 2 on off 10
# The GPT (tokens in, T targets per sample, the tied head, attention and LayerNorm kernels), SGD, with
# and without dropout (its masks the same Philox bits on both; with graphs on, its step read from
# device memory at each replay).
train_row gpt single 1 on off 12
train_row gpt ddp 2 on off 12
train_row gpt ddp 2 on off 12 "--dropout 0.1"

# ---- 2b. quick: failures injected on the GPU (docs/training.md, "When a job stops", "Silent
# corruption", "When a device fails"): dp_train ddp on 4 dp devices of the GPU(s), --shards 4, 4 steps, with DP_FAULT set, must
# end with the exit code and say the text; where the run goes on (a stall, a lost device) its
# checkpoint must be the undisturbed run's on the same GPU, byte for byte. ~10 s a row (estimate).
echo "== injected failures on $device"
fault_args=(--model convnet --synthetic 256 --mode ddp --devices 4 --devices-per-gpu "$((gpus >= 4 ? 1 : 4))"
            --shards 4 --batch-size 4 --steps 4 --lr 0.01 --momentum 0.9 --no-eval --check-replicas 1)
fault_row() {  # check fault code text same(0/1) est [extra dp_train args]
  local check="DP_FAULT $1" start rc same="" extra=("${@:7}")
  fits fault "$check" "$6" || return
  jsonw running "$check"
  start=$EPOCHREALTIME
  if [ "$5" = 1 ] && [ ! -s "$work/fault_ref.st" ]; then
    tmo "$(cap 60)" "$train" --backend "$device" "${fault_args[@]}" --save "$work/fault_ref.st" \
      > "$work/fault_ref.txt" 2>&1
  fi
  rm -f "$work/fault.st"
  DP_FAULT=$2 DP_STALL_WARN_S=1 tmo "$(cap 60)" "$train" --backend "$device" "${fault_args[@]}" "${extra[@]}" \
    --save "$work/fault.st" > "$work/fault.txt" 2>&1
  rc=$?
  [ "$5" = 1 ] && same=$(timeout 30 python3 - "$work/fault_ref.st" "$work/fault.st" 2>&1 <<'EOF2'
import json, struct, sys
def tensors(path):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    return {k: b[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]] for k, v in h.items() if k != "__metadata__"}
a, b = tensors(sys.argv[1]), tensors(sys.argv[2])
bad = [k for k in a if a[k] != b.get(k)]
print("equal %d tensors" % len(a) if not bad and a.keys() == b.keys() else "differ: " + ", ".join(bad[:4]))
EOF2
)
  if [ "$rc" = "$3" ] && grep -qF "$4" "$work/fault.txt" && { [ "$5" = 0 ] || [[ $same == equal* ]]; }; then
    row fault "$check" PASS "exit $rc${same:+, $same}" "$(since "$start")"
  else
    cp "$work/fault.txt" "$out/gpu-check-fault-$(tr -c 'a-z0-9' _ <<<"$1").txt"
    row fault "$check" FAIL "exit $rc (expected $3)${same:+, $same}: $(tail -1 "$work/fault.txt")" "$(since "$start")"
  fi
}
fault_row "desync-extra@d1:3" desync-extra@d1:3 4 "collectives desynchronized" 0 10
fault_row "stall@d1:2:3" stall@d1:2:3 0 "no progress" 1 15
fault_row "lose@d2:2 (one of 4 devices)" lose@d2:2 0 "4 shards go on from step" 1 15
# ZeRO-1: the lost device's part of the state comes back from its host copy (not compared with the
# plain reference: NCCL may sum a reduce-scatter in another order than its all-reduce).
fault_row "lose@d2:2 --zero 1 (host copies)" lose@d2:2 0 "4 shards go on from step" 0 15 --zero 1
fault_row "flip-param@d1:2" flip-param@d1:2 8 "global rank 1 (device 1) holds other bits" 0 10
# Shadow shards: step 2 checks device 2's shard on device 3, device 0 settles it; the run goes on.
fault_row "flip-gemm@d2:2 (shadow shards)" flip-gemm@d2:2 0 "device 2 computes wrong" 1 15 --shadow-shards 1

# ---- 2c. quick: GPT-2 124M's shape (context 1024), one device, batch 8, the fused attention: its step
# beside its roofline and its bytes (dp_bench). ~20 s on one H100 (estimate: start-up, 3 steps).
check="dp_bench gpt2 (fused attention)"
if fits bench "$check" 25; then
  jsonw running "$check"
  start=$EPOCHREALTIME
  roofline_gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 |
    grep -oiE 'h200|h100|a100' | head -1 | tr 'A-Z' 'a-z')
  # On the sim (this script's self-check) GPT-2's shape takes minutes a step: the small GPT stands in.
  gpt_run=(--models gpt2 --batch-size 8)
  [ "$device" = sim ] && gpt_run=(--models gpt --batch-size 4)
  tmo "$(cap 60)" "$bench" --backend "$device" --devices 1 "${gpt_run[@]}" --modes single \
    --steps 2 --warmup 1 --roofline "${roofline_gpu:-h100}" --json "$work/gpt2.json" > "$work/gpt2.txt" 2>&1
  gpt2_rc=$?
  cp "$work/gpt2.txt" "$out/gpu-check-gpt2.txt"
  detail=$(timeout 30 python3 - "$work/gpt2.json" 2>&1 <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))["runs"][0]
roof = r.get("roofline") or {}
print("%s: %.1f ms/step, %.0f tokens/s, roofline %s ms (%s), %.2f GiB/step, peak %.2f GiB" % (
    r["model"], r["step_ms_median"], r["tokens_per_s"], "%.1f" % roof["estimate_ms"] if roof else "n/a",
    roof.get("bound", "?"), (r.get("bytes_per_step") or 0) / 2**30, r["per_device"][0]["peak_bytes"] / 2**30))
EOF
) || gpt2_rc=1
  if [ $gpt2_rc -eq 0 ]; then v=PASS; else v=FAIL; fi
  row bench "$check" $v "$(tail -1 <<<"$detail")" "$(since "$start")"
fi

if [ "$quick" = 0 ]; then
  # ---- 3. the rest of the cuda tests (~110: kernels, layers, engines, graphs against eager, collectives),
  # 6 at a time: ~120 s on one H100 (estimate; the biggest step: a slow GPU is cut at twice that).
  echo "== cuda tests: the rest"
  ctest_row "cuda tests: the rest" 120 6 "$tests_all" "$tests_out|$tests_quick" ctest-rest.txt

  # ---- 4. dp on 2 devices, and graphs off (every kernel launched each step): ~10 s a row (estimate).
  echo "== dp_train: dp, graphs off"
  train_row mlp dp 2 on off 10
  train_row convnet dp 2 on off 10
  train_row mlp single 1 off off 10
  train_row convnet ddp 2 off off 10
  train_row convnet dp 2 off off 10

  # ---- 5. autocast (--amp bf16) against sim: ~12 s a row (estimate; bf16 plans too); 0.5 s here.
  echo "== dp_train --amp bf16: $device against sim"
  train_row convnet single 1 on bf16 12
  train_row convnet ddp 2 on bf16 12

  # ---- 5b. the training-loop options against sim: ZeRO-2 (its gradients in bucket slots, the
  # compute stream waiting for a slot's reduce-scatter on the communication stream inside the graph;
  # stage 1's reduce-scatter and parameter all-gather with it), accumulation and clipping on the device. ~12 s a row (estimate). SGD with momentum, not AdamW: a convolution bias
  # before a BatchNorm has an exact gradient of 0, so its fp32 gradient is rounding noise of another
  # summation order on each library, which AdamW (g / (sqrt(v) + eps), eps 1e-8 far below that noise)
  # turns into updates of +-lr whose signs differ between cuDNN and oneDNN (docs/gpu.md).
  echo "== dp_train --zero 2, --accumulate, --clip-grad-norm: $device against sim"
  train_row convnet ddp 2 on off 12 "--zero 2 --momentum 0.9 --bucket-cap-mb 0.05 --first-bucket-mb 0.05"
  train_row gpt single 1 off off 12 "--dropout 0.1"
  train_row convnet dp 2 on off 12 "--accumulate 2 --clip-grad-norm 0.5"
  train_row mlp ddp 2 on off 12 "--accumulate 3 --clip-grad-norm 0.1"


  # ---- 6. dp_bench --profile, graphs on: busy time is seen through replayed graphs. 9 runs (mlp,
  # convnet, gpt x single, dp, ddp) on 2 devices: ~35 s on the GPU (estimate); 2 s on sim here.
  echo "== dp_bench --profile (graphs on)"
  check="dp_bench --profile busy %"
  if fits bench "$check" 35; then
    jsonw running "$check"
    start=$EPOCHREALTIME
    per_gpu=1
    [ 2 -gt "$gpus" ] && per_gpu=2
    tmo "$(cap 90)" "$bench" --backend "$device" --devices 2 --devices-per-gpu "$per_gpu" --steps 10 --warmup 3 \
      --models mlp,convnet,gpt --profile --json "$work/bench.json" > "$work/bench.txt" 2>&1
    bench_rc=$?
    cp "$work/bench.txt" "$out/gpu-check-bench.txt"
    if [ $bench_rc -ne 0 ]; then
      row bench "$check" FAIL "exit $bench_rc: $(tail -1 "$work/bench.txt")" "$(since "$start")"
    else
      detail=$(timeout 30 python3 - "$work/bench.json" <<'EOF'
import json, sys
runs = json.load(open(sys.argv[1]))["runs"]
busy = ["%s %s %.0f%%%s" % (r["model"], r["mode"], r["busy_pct_mean"] or 0, " graphs" if r["graphs"] else "")
        for r in runs]
print(("ok " if runs and all((r["busy_pct_mean"] or 0) > 0 for r in runs) else "bad ") + ", ".join(busy))
EOF
)
      if [[ $detail == ok\ * ]]; then v=PASS; else v=FAIL; fi
      row bench "$check" $v "${detail#* }" "$(since "$start")"
    fi
  fi

  # ---- 7. the speed of --amp bf16 against fp32 strict, ConvNet and ResNet-8 at batch 256, one device:
  # two dp_bench runs, ~15 s each on the GPU (estimate); 30 s on sim here. Figures, not a verdict on
  # speed: it fails only when a run does.
  echo "== --amp bf16 speed against fp32 strict"
  check="dp_bench samples/s, fp32 vs bf16"
  if fits bench "$check" 30; then
    jsonw running "$check"
    start=$EPOCHREALTIME
    rates="" speed_rc=0
    # The roofline on this GPU's data-sheet peaks where dp_bench knows them (H100 otherwise).
    roofline_gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 |
      grep -oiE 'h200|h100|a100' | head -1 | tr 'A-Z' 'a-z')
    roofline_gpu=${roofline_gpu:-h100}
    for amp in off bf16; do
      tmo "$(cap 60)" "$bench" --backend "$device" --devices 1 --models convnet,resnet8 --modes single \
        --batch-size 256 --steps 20 --warmup 5 --amp "$amp" --roofline "$roofline_gpu" --json "$work/amp_$amp.json" \
        > "$work/amp_$amp.txt" 2>&1 ||
        speed_rc=1
      cp "$work/amp_$amp.txt" "$out/gpu-check-amp-$amp.txt"
    done
    rates=$(timeout 30 python3 - "$work/amp_off.json" "$work/amp_bf16.json" 2>&1 <<'EOF'
import json, sys
off, bf16 = ({r["model"]: r for r in json.load(open(p))["runs"]} for p in sys.argv[1:3])
# Each measured step beside its roofline estimate (bytes / HBM bandwidth or FLOPs / peak, dp_bench).
def step(r):
    est = (r.get("roofline") or {}).get("estimate_ms")
    return "%.2f ms (roofline %s)" % (r["step_ms_median"], "%.3f ms" % est if est is not None else "n/a")
print("; ".join("%s %.0f/s %s, bf16 %.0f/s %s (x%.2f), act %d -> %d B/sample" % (
    m, off[m]["samples_per_s"], step(off[m]), bf16[m]["samples_per_s"], step(bf16[m]),
    bf16[m]["samples_per_s"] / off[m]["samples_per_s"],
    off[m]["activation_bytes_per_sample"], bf16[m]["activation_bytes_per_sample"]) for m in off))
EOF
) || speed_rc=1
    if [ $speed_rc -eq 0 ]; then v=PASS; else v=FAIL; fi
    row bench "$check" $v "$(tail -1 <<<"$rates")" "$(since "$start")"
  fi

  # ---- 8. fixed shards (--shards 4): ConvNet on 1, 2 and 4 dp devices of the GPU(s), ddp and dp, writes
  # the same tensor bytes (every device runs each shard with the same shapes, so with the same cuBLAS and
  # cuDNN plans). 4 dp_train runs of ~8 s on the GPU (estimate); 1 s on sim here.
  echo "== dp_train --shards 4: 1, 2 and 4 devices, the same bits"
  check="dp_train --shards 4: same bits on 1/2/4"
  if fits compare "$check" 35; then
    jsonw running "$check"
    start=$EPOCHREALTIME
    shards_rc=0
    for run in "single 1" "ddp 2" "dp 2" "ddp 4"; do
      set -- $run
      per_gpu=1
      [ "$2" -gt "$gpus" ] && per_gpu=$2
      tmo "$(cap 60)" "$train" --backend "$device" --devices-per-gpu "$per_gpu" --model convnet --mode "$1" \
        --devices "$2" --shards 4 --synthetic 256 --batch-size 8 --steps 4 --lr 0.01 --no-shuffle \
        --save "$work/shards_$1_$2.st" > "$work/shards_$1_$2.txt" 2>&1 || shards_rc=1
      cp "$work/shards_$1_$2.txt" "$out/gpu-check-shards-$1-$2.txt"
    done
    detail=$(timeout 30 python3 - "$work"/shards_single_1.st "$work"/shards_ddp_2.st "$work"/shards_dp_2.st \
      "$work"/shards_ddp_4.st 2>&1 <<'EOF'
import json, struct, sys
def tensors(path):
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n]); header.pop("__metadata__", None)
    return {k: data[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]] for k, v in header.items()}
first = tensors(sys.argv[1])
bad = ["%s: %s" % (p.rsplit("/", 1)[-1], ", ".join(k for k in first if tensors(p).get(k) != first[k])[:200])
       for p in sys.argv[2:] if tensors(p) != first]
print(("bad " + "; ".join(bad)) if bad else "ok %d tensors equal on 1, 2 and 4 devices" % len(first))
EOF
) || shards_rc=1
    if [ $shards_rc -eq 0 ] && [[ $detail == ok\ * ]]; then v=PASS; else v=FAIL; fi
    row compare "$check" $v "${detail#* }" "$(since "$start")"
  fi
fi

# ---- the verdict (the rows above, and the JSON)
jsonw finish "$((SECONDS - t0))"
summary=$(timeout 30 python3 - "$json" 2>/dev/null <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))["counts"]
print("%s: %d PASS, %d FAIL, %d SKIP" % ("FAILED" if c["FAIL"] else "passed, some skipped" if c["SKIP"] else
                                      "all passed", c["PASS"], c["FAIL"], c["SKIP"]))
EOF
)
echo "gpu-check: ${summary:-see $json} in $((SECONDS - t0)) s (budget $budget s; $json)"
exit $failed
