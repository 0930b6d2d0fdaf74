#!/usr/bin/env bash
# Two dp_train binaries on the same command lines (tests/tools/compare_commands.txt, one per line, on
# the sim): the same exit code, the same metrics JSON apart from timings, checkpoints with the same
# tensor bytes (their metadata may gain keys). For a restructuring that must not change results.
#   scripts/compare_outputs.sh OLD_DP_TRAIN NEW_DP_TRAIN     prints SAME or DIFF [why] per line
set -u
[ $# -eq 2 ] || { sed -n 2,5p "$0"; exit 2; }
OLD=$(realpath "$1"); NEW=$(realpath "$2")
CMDS=$(realpath "$(dirname "$0")/../tests/tools/compare_commands.txt")
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT; cd "$W" || exit 2
n=0; same=0; diff=0
while IFS= read -r args; do
  [ -z "$args" ] && continue
  n=$((n+1)); rm -rf o n; mkdir o n
  (cd o && timeout 120 $OLD $args --backend sim --save ck.safetensors --metrics-json m.jsonl > out.txt 2>&1; echo $? > rc)
  (cd n && timeout 120 $NEW $args --backend sim --save ck.safetensors --metrics-json m.jsonl > out.txt 2>&1; echo $? > rc)
  python3 - "$args" <<'PY'
import json,sys,os
def load(d):
    rows=[]
    if os.path.exists(d+'/m.jsonl'):
        for l in open(d+'/m.jsonl'):
            r=json.loads(l)
            for k in ('samples_per_s','elapsed_s','eta_s','step_ms','wall_s','time_s','throughput'): r.pop(k,None)
            rows.append(r)
    ck=None
    if os.path.exists(d+'/ck.safetensors'):
        import struct
        b=open(d+'/ck.safetensors','rb').read(); k=struct.unpack('<Q',b[:8])[0]; h=json.loads(b[8:8+k]); h.pop('__metadata__',None)
        ck=(json.dumps(h,sort_keys=True), b[8+k:])
    return open(d+'/rc').read().strip(), rows, ck
o=load('o'); n=load('n')
ok = o[0]==n[0] and o[1]==n[1] and o[2]==n[2]
why=[]
if o[0]!=n[0]: why.append(f"rc {o[0]} vs {n[0]}")
if o[1]!=n[1]: why.append("metrics differ")
if o[2]!=n[2]: why.append("checkpoint differs" if o[2] and n[2] else f"checkpoint {'old' if o[2] else ''}{'new' if n[2] else ''} only")
print(("SAME " if ok else "DIFF ")+sys.argv[1]+("" if ok else "  ["+"; ".join(why)+"]"))
PY
done < "$CMDS"
