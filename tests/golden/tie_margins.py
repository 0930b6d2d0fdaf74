#!/usr/bin/python3
"""How close a ConvNet DDP golden's run comes to a tie that fp32 may break either way.

A max-pool window whose two largest inputs lie within fp32 rounding of each other, or a ReLU input
within rounding of 0, routes its gradient by the last bit of a sum, which another summation order
(another CPU's BLAS or oneDNN kernel, another engine) can flip: the runs then part by far more than
rounding. For each seed given this prints, over the run's steps in fp64, the smallest max-pool gap
(largest minus second largest of a window whose largest is positive) and the smallest |ReLU input|,
both relative to the activations' largest magnitude, and how far the fp32 run's norms and losses lie
from the fp64 run's. Pick a seed whose margins are far above fp32's relative rounding (~1e-6 here).

Usage: /usr/bin/python3 tests/golden/tie_margins.py [--case ddp_convnet_w3_clip] SEED [SEED ...]
"""
import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_ddp_goldens as d  # noqa: E402

torch.set_num_threads(1)


def run(case, seed, dtype, margins=None):
    """The case's DDP run as one process (the ranks' mean gradient), in `dtype`: its norms, losses."""
    kind, hidden, world, n, batch, steps, _ = d.CASES[case]
    init = d.build(kind, hidden, seed).state_dict()
    _, X, Y = d.make_data(n, seed)
    X = X.to(dtype)
    sched = [d.expected_schedule(n, world, r, batch, steps) for r in range(world)]
    models = []
    for _ in range(world):
        m = d.new_model(kind, hidden).to(dtype)
        m.load_state_dict(init)
        m.train()
        models.append(m)
    if margins is not None:
        def after_batchnorm(module, inputs, out):  # the ReLU's input, and the max-pool's before it
            x = out.detach()
            scale = x.abs().max().item()
            margins["relu"] = min(margins["relu"], x.abs().min().item() / scale)
            top = F.unfold(x.reshape(-1, 1, x.shape[2], x.shape[3]), 2, stride=2).topk(2, dim=1).values
            live = top[:, 0] > 0
            if live.any():
                margins["pool"] = min(margins["pool"], (top[:, 0] - top[:, 1])[live].min().item() / scale)
        for m in models:
            for module in m.modules():
                if isinstance(module, nn.BatchNorm2d):
                    module.register_forward_hook(after_batchnorm)
    master = models[0]
    opt = torch.optim.SGD(master.parameters(), lr=d.LR, momentum=d.MOMENTUM, weight_decay=d.WEIGHT_DECAY)
    norms, losses = [], []
    for k in range(steps):
        params = dict(master.named_parameters())
        grads = []
        for r, m in enumerate(models):
            with torch.no_grad():
                for name, p in m.named_parameters():
                    p.copy_(params[name])
            m.zero_grad(set_to_none=True)
            loss = F.cross_entropy(m(X[sched[r][k]]), Y[sched[r][k]])
            loss.backward()
            losses.append(loss.item())
            grads.append({name: p.grad.detach().clone() for name, p in m.named_parameters()})
        for name, p in params.items():
            p.grad = sum(g[name] for g in grads) / world
        norms.append(float(nn.utils.clip_grad_norm_(master.parameters(), d.CLIP.get(case, float("inf")))))
        opt.step()
    return norms, losses


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="ddp_convnet_w3_clip", choices=[c for c in d.CASES if "convnet" in c])
    ap.add_argument("seeds", type=int, nargs="+")
    args = ap.parse_args()
    for seed in args.seeds:
        margins = {"relu": 1.0, "pool": 1.0}
        n64, l64 = run(args.case, seed, torch.float64, margins)
        n32, l32 = run(args.case, seed, torch.float32)
        norm = max(abs(a - b) / abs(b) for a, b in zip(n32, n64))
        loss = max(abs(a - b) / abs(b) for a, b in zip(l32, l64))
        print(f"seed {seed}: max-pool gap {margins['pool']:.2e}, |ReLU input| {margins['relu']:.2e}; "
              f"fp32 vs fp64: norms {norm:.2e}, losses {loss:.2e}", flush=True)


if __name__ == "__main__":
    main()
