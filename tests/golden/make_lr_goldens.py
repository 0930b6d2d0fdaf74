#!/usr/bin/python3
"""Golden learning rates for dp::LrSchedule: torch.optim.lr_scheduler's closed forms
(_get_closed_form_lr) at t = 0..N for a few configurations, stored as the float32 the optimizer
uses, in tests/golden/lr_schedules.safetensors (metadata: each case's parameters).

Run with Debian's python3-torch: /usr/bin/python3 tests/golden/make_lr_goldens.py
"""
import json
import os

import torch
from torch.optim import lr_scheduler as S

from make_goldens import encode_safetensors  # the one safetensors writer of the golden scripts


def closed_form(make, base, t):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    sched = make(opt)
    sched.last_epoch = t
    return sched._get_closed_form_lr()[0]


def sequential(parts, milestones, base, t):
    # SequentialLR: the schedule whose span holds t (bisect_right), its t restarting at the milestone.
    i = sum(1 for m in milestones if m <= t)
    return closed_form(parts[i], base, t if i == 0 else t - milestones[i - 1])


CASES = {
    "step": ({"step_size": 3, "gamma": 0.5, "base": 0.1}, 21,
             lambda base, t: closed_form(lambda o: S.StepLR(o, step_size=3, gamma=0.5), base, t)),
    "cosine": ({"t_max": 10, "eta_min": 0.001, "base": 0.05}, 21,
               lambda base, t: closed_form(lambda o: S.CosineAnnealingLR(o, T_max=10, eta_min=0.001), base, t)),
    "linear": ({"start_factor": 0.25, "end_factor": 1.0, "total_iters": 4, "base": 0.2}, 11,
               lambda base, t: closed_form(lambda o: S.LinearLR(o, start_factor=0.25, end_factor=1.0, total_iters=4),
                                           base, t)),
    "warmup_cosine": ({"start_factor": 0.1, "total_iters": 5, "t_max": 15, "milestone": 5, "base": 0.1}, 26,
                      lambda base, t: sequential([lambda o: S.LinearLR(o, start_factor=0.1, total_iters=5),
                                                  lambda o: S.CosineAnnealingLR(o, T_max=15)], [5], base, t)),
}


def main():
    tensors, meta = {}, {}
    for name, (params, steps, lr) in CASES.items():
        tensors[name] = torch.tensor([lr(params["base"], t) for t in range(steps)], dtype=torch.float32)
        meta[name] = json.dumps(params)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lr_schedules.safetensors")
    with open(out, "wb") as f:
        f.write(encode_safetensors(tensors, meta))
    print(f"wrote {out} (torch {torch.__version__})")


if __name__ == "__main__":
    main()
