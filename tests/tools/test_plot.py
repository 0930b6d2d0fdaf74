#!/usr/bin/python3
"""Runs scripts/plot.py on a small dp_bench report, trace and dp_train metrics file, and checks that
each PNG exists with the size plot.py promises (FIGURES x DPI). Exit 77 (ctest: skipped) without
matplotlib. Usage: test_plot.py PLOT_SCRIPT WORK_DIR"""
import json
import os
import struct
import subprocess
import sys

try:
    import matplotlib  # noqa: F401
except ImportError:
    print("skipped: matplotlib is not installed (Debian: python3-matplotlib)")
    sys.exit(77)


def png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])  # the IHDR chunk: width, height


def device(d, busy):
    return {"device": d, "busy_pct": busy, "bytes_sent": 1000 * (d + 1), "bytes_received": 900, "peak_bytes": 4 << 20}


def main():
    plot, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    runs = []
    for model in ("mlp", "convnet"):
        for mode, busy in (("single", [90]), ("dp", [80, 40]), ("ddp", [70, 70])):
            runs.append({"model": model, "mode": mode, "samples_per_s": 1000.0 * len(busy),
                         "per_device": [device(d, b) for d, b in enumerate(busy)]})
    report = {"backend": "sim", "devices": 2, "batch_size": 64, "busy_time_available": True, "runs": runs}
    events = []
    for mode in ("dp", "ddp"):
        for step in range(3):
            for d in range(2):
                for k, cat in enumerate(("kernel", "gemm", "copy", "collective")):
                    events.append({"ph": "X", "name": cat, "cat": cat, "pid": d, "tid": 10 * d + (k == 3),
                                   "ts": 1000.0 * step + 100 * k, "dur": 80.0, "args": {"run": f"mlp {mode}", "step": step}})
    metrics = [{"kind": "step", "step": s, "epoch": 1 + (s - 1) // 10, "loss": 2.0 / s, "lr": 0.1, "samples_per_s": 1e3}
               for s in range(1, 31)]
    metrics += [{"kind": "epoch", "epoch": e, "step": 10 * e, "complete": True, "train_loss": 1.0 / e,
                 "test_loss": 1.2 / e, "test_accuracy": 0.8 + 0.03 * e, "samples_per_s": 1e3} for e in (1, 2, 3)]
    paths = {name: os.path.join(work, name) for name in ("bench.json", "trace.json", "metrics.jsonl")}
    with open(paths["bench.json"], "w") as f:
        json.dump(report, f)
    with open(paths["trace.json"], "w") as f:
        json.dump({"traceEvents": events}, f)
    with open(paths["metrics.jsonl"], "w") as f:
        f.write("".join(json.dumps(m) + "\n" for m in metrics))
    subprocess.run([sys.executable, plot, "bench", "--json", paths["bench.json"], "--trace", paths["trace.json"],
                    "--out", work], check=True)
    subprocess.run([sys.executable, plot, "train", "--metrics", paths["metrics.jsonl"], "--out", work], check=True)
    want = {"bench_throughput": (800, 450), "bench_devices": (1200, 400), "bench_timeline": (1200, 500),
            "train_curves": (1100, 400)}
    for name, size in want.items():
        got = png_size(os.path.join(work, name + ".png"))
        assert got == size, f"{name}.png is {got}, expected {size}"
        print(f"ok: {name}.png {got[0]}x{got[1]}")
    # A missing input is an error, not a traceback.
    bad = subprocess.run([sys.executable, plot, "train", "--metrics", os.path.join(work, "none.jsonl"), "--out", work])
    assert bad.returncode == 2, f"a missing input exits {bad.returncode}, expected 2"


if __name__ == "__main__":
    main()
