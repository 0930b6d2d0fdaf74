#!/usr/bin/python3
"""Golden values for the label-smoothing cross-entropy and the average pools (torch 1.13, CPU, fp32).

label_smoothing.safetensors, per case <name> (logits (N, C), targets (N,) int64; the metadata
entry <name> holds {"label_smoothing", "n", "classes"}):
  <name>.logits, <name>.targets, <name>.loss (F.cross_entropy, mean), <name>.per_sample
  (reduction='none'), <name>.dlogits (d loss / d logits for d loss = 1).
avgpool.safetensors, per case <name> (metadata: {"kernel", "stride", "pad"} for nn.AvgPool2d, or
{"global": 1} for nn.AdaptiveAvgPool2d(1)): <name>.x, <name>.y, <name>.dy (a random upstream
gradient) and <name>.dx (x.grad after y.backward(dy)).

Run with Debian's python3-torch: /usr/bin/python3 tests/golden/make_loss_goldens.py
"""
import json
import os

import torch
import torch.nn.functional as F

from make_goldens import encode_safetensors  # the one safetensors writer of the golden scripts

# (label_smoothing, N, C): with and without smoothing, one sample, a batch, few and many classes.
LOSS_CASES = [(eps, n, c) for eps in (0.1, 0.0) for (n, c) in ((1, 10), (7, 10), (64, 10), (5, 3), (33, 100))]
# name -> (N, C, H, W, kernel, stride, pad); kernel None: AdaptiveAvgPool2d(1).
POOL_CASES = {
    "k3s2p1": (2, 3, 9, 8, 3, 2, 1),  # overlapping windows, padding at both borders
    "k2s2p0": (2, 3, 8, 6, 2, 2, 0),  # the common non-overlapping pool
    "k5s3p2": (1, 2, 11, 10, 5, 3, 2),  # stride != kernel, some inputs in one window only
    "global7": (3, 4, 7, 7, None, None, None),
    "global14": (2, 3, 14, 14, None, None, None),
}


def loss_goldens():
    tensors, meta = {}, {}
    gen = torch.Generator().manual_seed(11)
    for eps, n, c in LOSS_CASES:
        name = f"eps{eps:g}.n{n}.c{c}"
        logits = (torch.randn(n, c, generator=gen) * 3).requires_grad_()
        targets = torch.randint(0, c, (n,), generator=gen)
        loss = F.cross_entropy(logits, targets, label_smoothing=eps)
        loss.backward()
        per_sample = F.cross_entropy(logits.detach(), targets, label_smoothing=eps, reduction="none")
        tensors[f"{name}.logits"] = logits.detach().clone()
        tensors[f"{name}.targets"] = targets
        tensors[f"{name}.loss"] = loss.detach().clone()
        tensors[f"{name}.per_sample"] = per_sample
        tensors[f"{name}.dlogits"] = logits.grad.clone()
        meta[name] = json.dumps({"label_smoothing": eps, "n": n, "classes": c})
    return tensors, meta


def pool_goldens():
    tensors, meta = {}, {}
    gen = torch.Generator().manual_seed(12)
    for name, (n, c, h, w, kernel, stride, pad) in POOL_CASES.items():
        if kernel is None:
            pool = torch.nn.AdaptiveAvgPool2d(1)
            meta[name] = json.dumps({"global": 1})
        else:
            pool = torch.nn.AvgPool2d(kernel, stride, pad)  # ceil_mode=False, count_include_pad=True
            meta[name] = json.dumps({"kernel": kernel, "stride": stride, "pad": pad})
        x = torch.randn(n, c, h, w, generator=gen).requires_grad_()
        y = pool(x)
        dy = torch.randn(y.shape, generator=gen)
        y.backward(dy)
        tensors[f"{name}.x"] = x.detach().clone()
        tensors[f"{name}.y"] = y.detach().clone()
        tensors[f"{name}.dy"] = dy
        tensors[f"{name}.dx"] = x.grad.clone()
    return tensors, meta


def main():
    torch.set_num_threads(1)
    here = os.path.dirname(os.path.abspath(__file__))
    for file, (tensors, meta) in (("label_smoothing", loss_goldens()), ("avgpool", pool_goldens())):
        meta["torch"] = torch.__version__
        out = os.path.join(here, f"{file}.safetensors")
        with open(out, "wb") as f:
            f.write(encode_safetensors(tensors, meta))
        print(f"wrote {out} (torch {torch.__version__})")


if __name__ == "__main__":
    main()
