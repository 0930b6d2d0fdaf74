#!/usr/bin/python3
"""Golden forward/backward of torchvision.models.resnet18(num_classes=10) (torch 1.13, torchvision 0.14, CPU, fp32).

The 11.2M parameters are too many to commit, so every parameter and buffer comes from a formula that
tests/nn/test_resnet18.cpp reproduces bit for bit. For state-dict entry number t (0-based, in
state_dict() order, num_batches_tracked included) and flat element i:
    z = splitmix64((t << 32) + i)                  (the finaliser of the golden-gamma step below)
    u = (z >> 11) * 2**-53 * 2.0 - 1.0             (float64 in [-1, 1))
    conv weight (fan_in f = in*k*k):  u * sqrt(6.0 / f)     (kaiming-uniform bound, ReLU gain)
    fc.weight, fc.bias (f = 512):     u / sqrt(512.0)
    bn weight 1.0 + 0.25*u, bias 0.1*u, running_mean 0.1*u, running_var 1.0 + 0.5*u, num_batches_tracked 0
then rounded once to float32. Every step is an IEEE operation with one correctly rounded result, so
C++ doubles give the same floats.

Input: batch 2 x 3 x 64 x 64 (torch.randn from the seed below), targets randint(0, 10). Not 32 x 32:
at 32 layer4 works on 1x1 planes, so its train-mode BatchNorms normalise 2 values per channel, where
x_hat = +-d/sqrt(d^2 + eps) and the input gradient is (1 - x_hat^2) ~ eps/d^2 times a difference of
two nearly equal terms — torch's own fp32 gradients differ from fp64 by 3% there, so no fp32 engine
can be compared at that size. At 64, layer4 has 2x2 planes (8 values per channel) and torch fp32 vs
fp64 agree to ~1e-5 of each gradient's largest element, ~2e-6 on the logits.

Near-ties: a ReLU input within fp32 rounding of 0, or a max-pool window whose two largest values are
within rounding, lets a correct fp32 engine route a gradient differently. The script measures the
rounding of each ReLU and max-pool input as max |fp32 - fp64| of the same forward (forward pre-hooks,
since torchvision's ReLUs are in place) and takes the first input seed from 0 on where every ReLU
input is at least MARGIN times that away from 0 and every max-pool window whose maximum is positive
has its two largest values at least MARGIN times apart (a window of zeros routes its gradient into a
ReLU that blocks it either way). The measured rounding is each tensor's worst element; one element's
own error is a few times smaller, so MARGIN = 3 leaves an order of magnitude. (A fixed 1e-5 of each
tensor's max |x| held for none of 400 seeds: ~500k ReLU inputs put about 15 within it.)

The file holds: input, target; train.output (logits), train.loss (cross-entropy, mean);
grad_summary.<param> = [sum, sum of squares] (float64 sums of the fp32 gradient, stored as F32) and
grad_head.<param> (its first 8 elements, flat order); grad.fc.weight and grad.fc.bias in full;
eval.output (eval-mode logits of the same input with the formula's running statistics, before the
train-mode forward updates them). Metadata: the state dict's keys, shapes and dtypes in order as JSON
("state_dict"), the input seed, the margin found, versions.

Run: /usr/bin/python3 tests/golden/make_resnet18_goldens.py
"""
import json
import math
import os
from collections import OrderedDict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision

from make_goldens import encode_safetensors  # the one safetensors writer of the golden scripts

BATCH, IMAGE, CLASSES = 2, 64, 10
MARGIN = 3.0
HEAD = 8


def splitmix64(x):
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def formula(index, name, shape):
    """State-dict entry `index` (named `name`, of `shape`) as the module docstring defines it."""
    n = int(np.prod(shape, dtype=np.int64))
    if name.endswith("num_batches_tracked"):
        return torch.zeros(shape, dtype=torch.int64)
    z = splitmix64((np.uint64(index) << np.uint64(32)) + np.arange(n, dtype=np.uint64))
    u = (z >> np.uint64(11)).astype(np.float64) * 2.0**-53 * 2.0 - 1.0
    if len(shape) == 4:
        v = u * math.sqrt(6.0 / (shape[1] * shape[2] * shape[3]))
    elif name.startswith("fc."):
        v = u / math.sqrt(512.0)
    elif name.endswith("running_mean"):
        v = 0.1 * u
    elif name.endswith("running_var"):
        v = 1.0 + 0.5 * u
    elif name.endswith("weight"):
        v = 1.0 + 0.25 * u
    else:
        v = 0.1 * u
    return torch.from_numpy(v.astype(np.float32)).reshape(shape)


def make_model(dtype):
    model = torchvision.models.resnet18(num_classes=CLASSES)
    state = model.state_dict()
    model.load_state_dict(OrderedDict((k, formula(t, k, list(v.shape))) for t, (k, v) in enumerate(state.items())))
    return model.to(dtype)


def make_batch(seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=gen, dtype=torch.float32)
    y = torch.randint(0, CLASSES, (BATCH,), generator=gen, dtype=torch.int64)
    return x, y


def pooling_inputs(model, x):
    """Train-mode forward; the input of every ReLU and MaxPool2d call, as float64, in call order (copied:
    the ReLUs overwrite their input)."""
    seen = []
    hooks = [m.register_forward_pre_hook(lambda m, inp: seen.append((type(m).__name__, inp[0].detach().double().clone())))
             for m in model.modules() if isinstance(m, (nn.ReLU, nn.MaxPool2d))]
    model.train()
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return seen


def top2_gaps(x):
    """MaxPool2d(3, 2, 1) windows of x: top1 - top2 for each window whose maximum is positive."""
    padded = F.pad(x, (1, 1, 1, 1), value=-math.inf)
    windows = padded.unfold(2, 3, 2).unfold(3, 3, 2)
    top = windows.reshape(*windows.shape[:4], 9).topk(2, dim=-1).values
    return (top[..., 0] - top[..., 1])[top[..., 0] > 0]


def tie_margin(x):
    """The smallest distance of a routing decision from a tie, in units of that tensor's fp32 rounding."""
    fp32 = pooling_inputs(make_model(torch.float32), x)
    fp64 = pooling_inputs(make_model(torch.float64), x.double())
    worst = math.inf
    for (kind, a), (_, b) in zip(fp32, fp64):
        rounding = (a - b).abs().max().item()
        distance = b.abs().min().item() if kind == "ReLU" else top2_gaps(b).min().item()
        worst = min(worst, distance / rounding)
    return worst


def main():
    torch.set_num_threads(1)
    seed = 0
    while True:
        x, y = make_batch(seed)
        margin = tie_margin(x)
        print(f"input seed {seed}: nearest tie {margin:.2f} x rounding")
        if margin >= MARGIN:
            break
        seed += 1

    out = OrderedDict()
    out["input"] = x.clone()
    out["target"] = y.clone()
    model = make_model(torch.float32)
    model.eval()
    with torch.no_grad():
        eval_logits = model(x)
    model.train()
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    loss.backward()
    out["train.output"] = logits.detach().clone()
    out["train.loss"] = loss.detach().reshape(1).clone()
    for name, p in model.named_parameters():
        g = p.grad.double()
        out[f"grad_summary.{name}"] = torch.tensor([g.sum().item(), (g * g).sum().item()], dtype=torch.float32)
        out[f"grad_head.{name}"] = p.grad.reshape(-1)[:HEAD].clone()
    out["grad.fc.weight"] = model.fc.weight.grad.clone()
    out["grad.fc.bias"] = model.fc.bias.grad.clone()
    out["eval.output"] = eval_logits.clone()

    keys = [[k, list(v.shape), "I64" if v.dtype == torch.int64 else "F32"]
            for k, v in torchvision.models.resnet18(num_classes=CLASSES).state_dict().items()]
    meta = {"model": "resnet18", "num_classes": CLASSES, "batch": BATCH, "image_size": IMAGE, "input_seed": seed,
            "tie_margin": f"{margin:.3f}", "loss": "cross_entropy", "torch": torch.__version__,
            "torchvision": torchvision.__version__, "state_dict": json.dumps(keys, separators=(",", ":"))}
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "resnet18.safetensors")
    with open(path, "wb") as f:
        f.write(encode_safetensors(out, meta))
    print(f"{path}: {len(out)} tensors, loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
