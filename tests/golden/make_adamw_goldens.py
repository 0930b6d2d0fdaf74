#!/usr/bin/python3
"""Golden AdamW steps for dp::kernels::adamw_step: torch.optim.AdamW (torch 1.13, CPU, fp32,
amsgrad off) on one parameter tensor of 1027 values (a vector body and a scalar tail) for 4 steps,
per case: init, the gradient of every step, and params / exp_avg / exp_avg_sq after every step.
Written to tests/golden/adamw.safetensors; each case's hyper-parameters are in the metadata.

Run with Debian's python3-torch: /usr/bin/python3 tests/golden/make_adamw_goldens.py
"""
import json
import os

import torch

from make_goldens import encode_safetensors  # the one safetensors writer of the golden scripts

N, STEPS = 1027, 4
CASES = {
    "defaults": {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 1e-2},
    "aggressive": {"lr": 0.05, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.1},
}


def main():
    torch.set_num_threads(1)
    tensors, meta = {}, {}
    for name, h in CASES.items():
        gen = torch.Generator().manual_seed(7)
        init = torch.randn(N, generator=gen)
        param = torch.nn.Parameter(init.clone())
        opt = torch.optim.AdamW([param], lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                                weight_decay=h["weight_decay"], foreach=False)
        tensors[f"{name}.init"] = init.clone()
        for step in range(STEPS):
            grad = torch.randn(N, generator=gen) * (0.5 + step)
            param.grad = grad.clone()
            opt.step()
            state = opt.state[param]
            tensors[f"{name}.grad.{step}"] = grad
            tensors[f"{name}.param.{step}"] = param.detach().clone()
            tensors[f"{name}.exp_avg.{step}"] = state["exp_avg"].clone()
            tensors[f"{name}.exp_avg_sq.{step}"] = state["exp_avg_sq"].clone()
        meta[name] = json.dumps(h)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "adamw.safetensors")
    with open(out, "wb") as f:
        f.write(encode_safetensors(tensors, meta))
    print(f"wrote {out} (torch {torch.__version__})")


if __name__ == "__main__":
    main()
