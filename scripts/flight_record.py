#!/usr/bin/env python3
"""Merge the flight records of a job's processes (dp-flight-<process>.json, written by dp_train on an
abnormal end) into one table: for each global rank, the last collective it issued on each
communicator, its state and age, and which rank did not reach the call the others wait in.

    scripts/flight_record.py DIR_OR_FILES... [--all]

--all prints every recorded call, oldest first, instead of the last one per rank.
"""
import argparse
import glob
import json
import os
import sys


def load(paths):
    files = []
    for p in paths:
        files += sorted(glob.glob(os.path.join(p, "dp-flight-*.json"))) if os.path.isdir(p) else [p]
    if not files:
        sys.exit("flight_record.py: no dp-flight-*.json found in " + " ".join(paths))
    records = []
    for f in files:
        try:
            with open(f) as handle:
                records.append(json.load(handle))
        except (OSError, ValueError) as e:
            sys.exit(f"flight_record.py: {f}: {e}")
    return records


def describe(e):
    return f"{e['op']} #{e['seq']} ({e['purpose'] or 'no purpose'}, {e['dtype']} x {e['count']})"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--all", action="store_true")
    args = parser.parse_args()
    records = load(args.paths)
    for r in sorted(records, key=lambda r: r["process"]):
        print(f"process {r['process']}: {r['reason']}")
        for m in r.get("marks", []):
            if m["phase"] != "idle":
                where = m["phase"] + (f" ({m['detail']})" if m["detail"] else "")
                waits = f", waiting in {m['waiting']}" if m["waiting"] else ""
                print(f"  rank {m['global_rank']}: {where} of step {m['step']} for {m['idle_s']:.1f} s{waits}")
    entries = [dict(e, process=r["process"]) for r in records for e in r["entries"] if e["state"] != "captured"]
    if args.all:
        for e in sorted(entries, key=lambda e: (e["communicator"], e["seq"], e["global_rank"])):
            print(f"comm {e['communicator']} rank {e['global_rank']:>4} step {e['step']:>6} {describe(e)} {e['state']}"
                  f" at {e['site']}")
        return
    last = {}
    for e in entries:
        key = (e["communicator"], e["global_rank"])
        if key not in last or e["seq"] > last[key]["seq"]:
            last[key] = e
    print(f"{'comm':>4} {'rank':>4} {'proc':>4} {'step':>6}  last call{'':<40} state")
    for (comm, rank), e in sorted(last.items()):
        print(f"{comm:>4} {rank:>4} {e['process']:>4} {e['step']:>6}  {describe(e):<49} {e['state']}")
    # Per communicator: the furthest call, and the ranks that did not reach it.
    for comm in sorted({c for c, _ in last}):
        ranks = {r: e for (c, r), e in last.items() if c == comm}
        furthest = max(e["seq"] for e in ranks.values())
        behind = sorted(r for r, e in ranks.items() if e["seq"] < furthest)
        waiting = sorted(r for r, e in ranks.items() if e["seq"] == furthest and e["state"] != "done")
        failed = sorted(r for r, e in ranks.items() if e["state"] == "failed")
        call = describe(next(e for e in ranks.values() if e["seq"] == furthest))
        if behind:
            print(f"communicator {comm}: rank(s) {', '.join(map(str, behind))} did not reach {call}; "
                  f"rank(s) {', '.join(map(str, waiting)) or 'none'} waited in it")
        elif failed:
            print(f"communicator {comm}: {call} failed on rank(s) {', '.join(map(str, failed))}")
        else:
            print(f"communicator {comm}: every rank reached {call}")


if __name__ == "__main__":
    main()
