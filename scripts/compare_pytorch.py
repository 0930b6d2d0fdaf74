#!/usr/bin/python3
"""dp on the sim backend against PyTorch on the CPU, side by side: for each case, `rounds` pairs of
runs, dp_bench then the peer (torch_bench.py: PyTorch, one thread per rank, gloo DDP), alternated so
that both see the same machine; prints each pair's samples/s and ratio, and the median ratio.
Both do the same work: the peer's DDP is DistributedDataParallel(broadcast_buffers=False), so
dp_bench runs with --broadcast-buffers off.

A benchmark, not a test: the figures move with whatever else the machine runs, which is why the
runs alternate and the median of the pairs' ratios is the figure to quote.

Usage: scripts/compare_pytorch.py [--dp-bench build-sim/bin/dp_bench]
           [--torch-bench scripts/torch_bench.py] [--rounds 5] [--cases convnet:single,...]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# model:mode -> measured steps (enough for a few hundred ms per run, so that one slow step or a
# scheduling hiccup moves the figure little).
DEFAULT_CASES = {"convnet:single": 50, "convnet:ddp": 50, "mlp:ddp": 1000}


def dp_run(binary, model, mode, steps, batch):
    devices = 1 if mode == "single" else 2
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        subprocess.run([binary, "--backend", "sim", "--devices", str(devices), "--modes", mode, "--models", model,
                        "--batch-size", str(batch), "--steps", str(steps), "--broadcast-buffers", "off", "--json", out],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)["runs"][0]["samples_per_s"]


def torch_run(script, model, mode, steps, batch):
    ranks = 0 if mode == "single" else 2
    out = subprocess.run(["/usr/bin/python3", script, "--model", model, "--ranks", str(ranks), "--batch", str(batch),
                          "--steps", str(steps)], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["samples_per_s"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp-bench", default=os.path.join(ROOT, "build-sim", "bin", "dp_bench"))
    ap.add_argument("--torch-bench", default=os.path.join(ROOT, "scripts", "torch_bench.py"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64, help="per device / rank")
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES), help="comma list of model:mode (single or ddp)")
    a = ap.parse_args()
    for path in (a.dp_bench, a.torch_bench):
        if not os.path.exists(path):
            sys.exit(f"compare_pytorch: {path} does not exist")
    summary = []
    for case in a.cases.split(","):
        model, mode = case.split(":")
        steps = DEFAULT_CASES.get(case, 50)
        ratios = []
        for r in range(a.rounds):
            dp = dp_run(a.dp_bench, model, mode, steps, a.batch)
            peer = torch_run(a.torch_bench, model, mode, steps, a.batch)
            ratios.append(dp / peer)
            print(f"{case:16} round {r + 1}: dp {dp:9.1f}  pytorch {peer:9.1f}  samples/s  ratio {dp / peer:5.2f}",
                  flush=True)
        summary.append((case, statistics.median(ratios), min(ratios), max(ratios)))
    print()
    for case, median, low, high in summary:
        print(f"{case:16} median ratio {median:5.2f}  (range {low:.2f} - {high:.2f})")


if __name__ == "__main__":
    main()
