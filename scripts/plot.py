#!/usr/bin/python3
"""Pictures of dp's runs (PNG, matplotlib):

  scripts/plot.py bench --json bench.json [--trace trace.json] [--model mlp] --out DIR
      bench_throughput.png  samples/s per model and mode
      bench_devices.png     per device: busy %, device-to-device traffic and peak memory, dp beside ddp
      bench_timeline.png    (with --trace) every device's streams during one measured step of dp and of ddp
  scripts/plot.py train --metrics metrics.jsonl --out DIR
      train_curves.png      loss per step and epoch, test loss and test accuracy per epoch

Run it with Debian's python (/usr/bin/python3, python3-matplotlib). Inputs are what `dp_bench --json/--trace` and `dp_train --metrics-json` write. Every figure has a fixed
size (FIGURES below, at 100 dpi), so a test can check what it produced.
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

DPI = 100
FIGURES = {  # name: (width, height) in inches
    "bench_throughput": (8, 4.5),
    "bench_devices": (12, 4),
    "bench_timeline": (12, 5),
    "train_curves": (11, 4),
}
MODE_COLORS = {"single": "#7f7f7f", "dp": "#d62728", "ddp": "#1f77b4"}
KIND_COLORS = {"kernel": "#1f77b4", "gemm": "#ff7f0e", "copy": "#2ca02c", "collective": "#d62728", "host": "#9467bd"}


def save(fig, out, name):
    path = os.path.join(out, name + ".png")
    fig.savefig(path, dpi=DPI)  # no bbox_inches="tight": the size stays FIGURES[name] x DPI
    plt.close(fig)
    print(f"plot: {path}")
    return path


def figure(name, **kwargs):
    return plt.subplots(figsize=FIGURES[name], **kwargs)


def bench_throughput(report, out):
    runs = report["runs"]
    models = list(dict.fromkeys(r["model"] for r in runs))
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    fig, ax = figure("bench_throughput")
    width = 0.8 / max(len(modes), 1)
    for j, mode in enumerate(modes):
        xs, ys = [], []
        for i, model in enumerate(models):
            for r in runs:
                if r["model"] == model and r["mode"] == mode:
                    xs.append(i + (j - (len(modes) - 1) / 2) * width)
                    ys.append(r["samples_per_s"])
        bars = ax.bar(xs, ys, width, label=mode, color=MODE_COLORS.get(mode))
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(models)), models)
    ax.set_yscale("log")
    ax.set_ylabel("training samples/s (log)")
    ax.set_title(f"dp_bench: {report['backend']}, {report['devices']} device(s), --batch-size {report['batch_size']} "
                 "(dp: global)")
    ax.legend()
    fig.tight_layout()
    return save(fig, out, "bench_throughput")


def bench_devices(report, out):
    runs = [r for r in report["runs"] if r["mode"] in ("dp", "ddp")]
    metrics = [("busy_pct", "busy % of the measured window", 1.0),
               ("traffic", "device-to-device MiB per step (sent + received)", 1.0 / 2**20),
               ("peak_bytes", "peak memory, MiB", 1.0 / 2**20)]
    fig, axes = figure("bench_devices", ncols=len(metrics))
    labels = [f"{r['model']} {r['mode']}" for r in runs]
    devices = sorted({d["device"] for r in runs for d in r["per_device"]})
    width = 0.8 / max(len(devices), 1)
    for ax, (key, title, scale) in zip(axes, metrics):
        for k, device in enumerate(devices):
            xs, ys = [], []
            for i, r in enumerate(runs):
                for d in r["per_device"]:
                    if d["device"] != device:
                        continue
                    value = d["bytes_sent"] + d["bytes_received"] if key == "traffic" else d[key]
                    xs.append(i + (k - (len(devices) - 1) / 2) * width)
                    ys.append((value or 0) * scale)
            ax.bar(xs, ys, width, label=f"device {device}")
        ax.set_xticks(range(len(runs)), labels, rotation=20, fontsize=8)
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=7)
    if not report.get("busy_time_available", True):
        axes[0].text(0.5, 0.5, "no spans on this backend", ha="center", transform=axes[0].transAxes)
    fig.suptitle("per device: DP's source device (0) does the gathering, reducing and updating", fontsize=10)
    fig.tight_layout()
    return save(fig, out, "bench_devices")


def bench_timeline(report, trace, out, model):
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    fig, axes = figure("bench_timeline", nrows=2, sharex=False)
    for ax, mode in zip(axes, ("dp", "ddp")):
        run = f"{model} {mode}"
        mine = [e for e in events if e.get("args", {}).get("run") == run]
        steps = sorted({e["args"]["step"] for e in mine})
        if not steps:
            ax.set_title(f"{run}: not in the trace")
            continue
        step = steps[len(steps) // 2]  # one measured step from the middle of the run
        shown = [e for e in mine if e["args"]["step"] == step]
        t0 = min(e["ts"] for e in shown)
        lanes = sorted({(e["pid"], e["tid"]) for e in shown})
        for e in shown:
            y = lanes.index((e["pid"], e["tid"]))
            ax.barh(y, e["dur"] / 1e3, left=(e["ts"] - t0) / 1e3, height=0.8,
                    color=KIND_COLORS.get(e.get("cat"), "#bbbbbb"))
        ax.set_yticks(range(len(lanes)), [f"device {p} stream {t}" for p, t in lanes], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{run}: step {step}", fontsize=9)
        ax.set_xlabel("ms since the step began", fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in KIND_COLORS.values()]
    axes[0].legend(handles, KIND_COLORS.keys(), fontsize=7, loc="lower right", bbox_to_anchor=(1.0, 1.0),
                   ncols=len(KIND_COLORS), frameon=False)
    fig.tight_layout()
    return save(fig, out, "bench_timeline")


def train_curves(records, out):
    steps = [r for r in records if r.get("kind") == "step"]
    epochs = [r for r in records if r.get("kind") == "epoch"]
    fig, (loss_ax, acc_ax) = figure("train_curves", ncols=2)
    per_epoch = max((r["step"] / r["epoch"] for r in epochs if r.get("complete") and r["epoch"]), default=None)
    if per_epoch:
        loss_ax.plot([r["step"] / per_epoch for r in steps], [r["loss"] for r in steps], lw=0.6, alpha=0.5,
                     label="step loss")
        x_label = "epoch"
    else:
        loss_ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], lw=0.6, alpha=0.5, label="step loss")
        x_label = "step"
    if epochs and per_epoch:
        loss_ax.plot([r["epoch"] for r in epochs], [r["train_loss"] for r in epochs], "o-", label="train loss (epoch)")
        tested = [r for r in epochs if r.get("test_loss") is not None]
        loss_ax.plot([r["epoch"] for r in tested], [r["test_loss"] for r in tested], "s-", label="test loss")
        acc_ax.plot([r["epoch"] for r in tested], [100 * r["test_accuracy"] for r in tested], "s-", color="#2ca02c")
        for r in tested:
            acc_ax.annotate(f"{100 * r['test_accuracy']:.2f}", (r["epoch"], 100 * r["test_accuracy"]), fontsize=7,
                            textcoords="offset points", xytext=(0, 5), ha="center")
    loss_ax.set_xlabel(x_label)
    loss_ax.set_ylabel("cross-entropy")
    loss_ax.set_yscale("log")
    loss_ax.legend(fontsize=8)
    acc_ax.set_xlabel("epoch")
    acc_ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    acc_ax.set_ylabel("test accuracy, %")
    acc_ax.grid(alpha=0.3)
    fig.tight_layout()
    return save(fig, out, "train_curves")


def read_json(path):
    with open(path) as f:
        return json.load(f)


def read_json_lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    b = sub.add_parser("bench", help="figures from dp_bench --json (and --trace)")
    b.add_argument("--json", required=True)
    b.add_argument("--trace")
    b.add_argument("--model", help="the model of the timeline (default: the first one in the report)")
    b.add_argument("--out", default=".")
    t = sub.add_parser("train", help="figures from dp_train --metrics-json")
    t.add_argument("--metrics", required=True)
    t.add_argument("--out", default=".")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    try:
        if args.what == "bench":
            report = read_json(args.json)
            bench_throughput(report, args.out)
            bench_devices(report, args.out)
            if args.trace:
                bench_timeline(report, read_json(args.trace), args.out, args.model or report["runs"][0]["model"])
        else:
            train_curves(read_json_lines(args.metrics), args.out)
    except (OSError, ValueError, KeyError) as e:
        print(f"plot: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
