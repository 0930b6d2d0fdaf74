#!/usr/bin/python3
"""Golden convolutions from PyTorch's CPU convolutions (torch 1.13, Debian's python3-torch, which
runs them on Debian's oneDNN, as dp's sim backend does).

Usage:
    /usr/bin/python3 tests/golden/make_conv_goldens.py            # (re)write tests/golden/conv_layers.safetensors
    /usr/bin/python3 tests/golden/make_conv_goldens.py --check    # regenerate in memory, compare bit for bit

For each case: x, weight, bias, y = F.conv2d(x, weight, bias, stride, padding), a random dy, and
the backward's dx and dweight (one thread, fp32). The shapes are the reference models' kinds of
layer at batch 2: the ConvNet's two 5x5 layers, a ResNet 3x3 layer, a 3x3 stride-2 one and a 1x1
stride-2 shortcut, and torchvision ResNet-18's 7x7 stride-2 stem on 3 channels. torch runs every
one on oneDNN (DNNL_VERBOSE=1 lists their 18 primitives).

__metadata__ "onednn_isa" is dnnl_get_effective_cpu_isa() of the libdnnl torch ran on (the same
library dp links) and "caches" the CPU's cache sizes (sysfs, as cpu_caches() in
tests/kernels/test_conv2d.cpp reads them): oneDNN picks its kernels by instruction set and sizes their
blocking by the caches, so the bits are PyTorch's only on a machine where dp's oneDNN picks the same
(tests/kernels/test_conv2d.cpp: SimConvolutionsArePyTorchs).
"""
import argparse
import ctypes
import os
import sys
from collections import OrderedDict

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_goldens as mg  # noqa: E402  (safetensors writer/reader)

torch.set_num_threads(1)
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conv_layers.safetensors")

# name: (n, c_in, h, w, c_out, kernel, stride, pad)
CASES = OrderedDict([
    ("convnet_conv1", (2, 1, 28, 28, 16, 5, 1, 2)),
    ("convnet_conv2", (2, 16, 14, 14, 32, 5, 1, 2)),
    ("resnet_3x3", (2, 16, 14, 14, 16, 3, 1, 1)),
    ("resnet_3x3_s2", (2, 16, 14, 14, 32, 3, 2, 1)),
    ("resnet_1x1_s2", (2, 16, 14, 14, 32, 1, 2, 0)),
    ("resnet18_stem", (2, 3, 32, 32, 64, 7, 2, 3)),
])


def onednn_isa():
    lib = ctypes.CDLL("libdnnl.so.2")
    lib.dnnl_get_effective_cpu_isa.restype = ctypes.c_int
    return lib.dnnl_get_effective_cpu_isa()


def cpu_caches():
    """"L1 Data 32K,L1 Instruction 32K,L2 Unified 1024K,..." for cpu0, or "" without sysfs."""
    root = "/sys/devices/system/cpu/cpu0/cache"
    out = []
    for index in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if not index.startswith("index"):
            continue
        read = lambda name: open(os.path.join(root, index, name)).read().strip()  # noqa: E731
        out.append(f"L{read('level')} {read('type')} {read('size')}")
    return ",".join(out)


def build():
    torch.manual_seed(20261125)
    tensors = OrderedDict()
    for name, (n, c_in, h, w, c_out, k, stride, pad) in CASES.items():
        x = torch.randn(n, c_in, h, w, requires_grad=True)
        weight = (torch.randn(c_out, c_in, k, k) / (c_in * k * k) ** 0.5).requires_grad_()
        bias = torch.randn(c_out) * 0.1
        y = F.conv2d(x, weight, bias, stride, pad)
        dy = torch.randn_like(y)
        y.backward(dy)
        for key, t in (("x", x), ("weight", weight), ("bias", bias), ("y", y), ("dy", dy), ("dx", x.grad),
                       ("dweight", weight.grad)):
            tensors[f"{name}.{key}"] = t.detach().contiguous()
    meta = {"torch": torch.__version__, "onednn_isa": str(onednn_isa()), "caches": cpu_caches(),
            "cases": ",".join(f"{k}:{'x'.join(map(str, v))}" for k, v in CASES.items()),
            "layout": "n,c_in,h,w,c_out,kernel,stride,pad"}
    return mg.encode_safetensors(tensors, meta)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    data = build()
    if a.check:
        with open(OUT, "rb") as f:
            same = f.read() == data
        print("conv_layers.safetensors:", "identical" if same else "DIFFERS")
        sys.exit(0 if same else 1)
    with open(OUT, "wb") as f:
        f.write(data)
    print(f"wrote {OUT} ({len(data)} bytes)")


if __name__ == "__main__":
    main()
