#!/usr/bin/python3
"""Golden steps of bf16 autocast from PyTorch's CPU autocast (torch 1.13, Debian's python3-torch).

Usage:
    /usr/bin/python3 tests/golden/make_amp_goldens.py            # (re)write tests/golden/amp_*.safetensors
    /usr/bin/python3 tests/golden/make_amp_goldens.py --check    # regenerate in memory, compare bit for bit

What dp's Autocast::bf16 is compared with: `torch.autocast("cpu", dtype=torch.bfloat16)` around the
forward, the loss on the logits widened to fp32 (`F.cross_entropy(logits.float(), target)`), fp32
parameters and gradients. One step from the same parameters (teacher-forced, so that no difference
can compound over steps), for the MLP, the ConvNet and ResNet-8, three ways:
  single: the whole batch on one model;
  dp:     torch.nn.DataParallel written out (DataParallel itself needs CUDA): the batch scattered in
          torch.chunk's chunks over 2 replicas, each replica's forward under autocast, the bf16
          outputs gathered, one fp32 loss over the whole batch, the replicas' fp32 gradients summed
          onto the source in device order;
  ddp:    2 ranks of DistributedDataParallel written out: each rank's half of the batch, its own
          loss, the fp32 gradients averaged (g0 * 0.5 + g1 * 0.5: exact, as gloo's sum then divide).
Each file holds init.* (state dict), data.input/data.target, and per mode <mode>.output (the fp32
logits), <mode>.loss (the mean over the batch; ddp: rank 0's then rank 1's) and <mode>.grad.<name>;
also fp32.output and fp32.grad.* (the same single step without autocast), so a test can show that
dp computes bf16 and not fp32, and after.<name>: the parameters after one SGD step (lr 0.05,
momentum 0.9, weight decay 1e-3) from the single gradients. ResNet-8's file also holds each block's
input, output and output gradient of the single step (teacher_forced_blocks).
"""
import argparse
import copy
import os
import sys
from collections import OrderedDict

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_goldens as mg  # noqa: E402  (ConvNet, MLP, BatchNorm recipe, safetensors writer/reader)
from make_resnet_goldens import ResNet8  # noqa: E402

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 1e-3
DEVICES = 2

# name -> (model, hidden, batch, seed)
CASES = OrderedDict([
    ("amp_mlp",     ("mlp", [32, 17], 8, 401)),
    ("amp_convnet", ("convnet", None, 8, 402)),
    ("amp_resnet8", ("resnet8", None, 8, 403)),
])


class GlobalAvgPool(torch.nn.Module):
    """AdaptiveAvgPool2d(1) as CUDA computes it on bf16: the mean in fp32, rounded once. torch 1.13's
    CPU kernel rounds the window's sum to bf16 before dividing by its size (a second rounding,
    checked in main()); dp follows the GPU, and so does this golden."""

    def forward(self, x):
        return x.float().mean((2, 3), keepdim=True).to(x.dtype)


def build(kind, hidden, seed):
    torch.manual_seed(seed)
    if kind == "mlp":
        return mg.MLP(list(hidden))
    if kind == "convnet":
        return mg.randomize_batchnorm(mg.ConvNet())
    model = mg.randomize_batchnorm(ResNet8())
    model.avgpool = GlobalAvgPool()
    return model


def cpu_avgpool_rounds_the_sum():
    """Whether this torch's CPU adaptive_avg_pool2d on bf16 is round(round(sum) / n): the reason
    for GlobalAvgPool."""
    x = torch.randn(8, 64, 7, 7, generator=torch.Generator().manual_seed(0)).bfloat16()
    twice = (x.float().sum((2, 3), keepdim=True).bfloat16().float() / 49).bfloat16()
    once = (x.float().sum((2, 3), keepdim=True) / 49).bfloat16()
    pooled = F.adaptive_avg_pool2d(x, 1)
    return torch.equal(pooled, twice) and not torch.equal(pooled, once)


def forward(model, x, amp):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        out = model(x)
    return out


def grads(models, scale=None):
    """The fp32 gradients of `models` summed in order (each times `scale` first, when given)."""
    out = OrderedDict()
    for k, p in models[0].named_parameters():
        total = None
        for m in models:
            g = dict(m.named_parameters())[k].grad
            g = g * scale if scale is not None else g
            total = g.clone() if total is None else total + g
        out[k] = mg.snap(total)
    return out


BLOCKS = ("stem", "layer1", "layer2", "layer3", "head")


def teacher_forced_blocks(m, x, y):
    """ResNet-8's single step again, block by block (the same ops: model(x) is these calls), with
    each block's input, output and output gradient: tf.<block>.input/.output/.grad_output, bf16
    values held in fp32 (the stem's input and the head's gradient are fp32). A test runs each block
    alone from torch's input and gradient, so that no difference from an earlier block reaches it:
    only the block's own summation orders can move its results."""
    acts = {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = x
        acts["stem"] = (a, m.relu(m.bn1(m.conv1(a))))
        for name in ("layer1", "layer2", "layer3"):
            a = acts[BLOCKS[BLOCKS.index(name) - 1]][1]
            acts[name] = (a, getattr(m, name)(a))
        a = acts["layer3"][1]
        acts["head"] = (a, m.fc(torch.flatten(m.avgpool(a), 1)))
    for name in BLOCKS:
        acts[name][1].retain_grad()
    F.cross_entropy(acts["head"][1].float(), y).backward()
    out = OrderedDict()
    for name in BLOCKS:
        inp, outp = acts[name]
        out[f"tf.{name}.input"] = mg.snap(inp.float())
        out[f"tf.{name}.output"] = mg.snap(outp.float())
        out[f"tf.{name}.grad_output"] = mg.snap(outp.grad.float())
    return out


def run_case(name):
    kind, hidden, batch, seed = CASES[name]
    model = build(kind, hidden, seed)
    model.train()
    init = OrderedDict((k, mg.snap(v)) for k, v in model.state_dict().items())
    gen = torch.Generator().manual_seed(seed + 10000)
    x = torch.randint(0, 256, (batch, 1, 28, 28), generator=gen, dtype=torch.uint8).to(torch.float32) / 255.0
    y = torch.randint(0, 10, (batch,), generator=gen, dtype=torch.int64)

    out = OrderedDict()
    for k, v in init.items():
        out[f"init.{k}"] = v
    out["data.input"] = x
    out["data.target"] = y

    def fresh():
        m = copy.deepcopy(model)
        m.load_state_dict(init)
        m.train()
        return m

    # single, and the same step in fp32
    for mode, amp in (("single", True), ("fp32", False)):
        m = fresh()
        logits = forward(m, x, amp)
        loss = F.cross_entropy(logits.float(), y)
        loss.backward()
        out[f"{mode}.output"] = mg.snap(logits.float())
        if mode == "single":
            out[f"{mode}.loss"] = mg.snap(loss)
        for k, g in grads([m]).items():
            out[f"{mode}.grad.{k}"] = g
        if mode == "single":
            opt = torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM, dampening=0, weight_decay=WEIGHT_DECAY)
            opt.step()
            for k, p in m.named_parameters():
                out[f"after.{k}"] = mg.snap(p)

    if kind == "resnet8":
        for k, v in teacher_forced_blocks(fresh(), x, y).items():
            out[k] = v

    # dp: scatter, replica forwards under autocast, gather, one loss, gradients reduced to the source
    replicas = [fresh() for _ in range(DEVICES)]
    chunks = torch.chunk(x, DEVICES)
    logits = torch.cat([forward(r, c, True) for r, c in zip(replicas, chunks)])
    loss = F.cross_entropy(logits.float(), y)
    loss.backward()
    out["dp.output"] = mg.snap(logits.float())
    out["dp.loss"] = mg.snap(loss)
    for k, g in grads(replicas).items():
        out[f"dp.grad.{k}"] = g

    # ddp: each rank its half, its own loss, gradients averaged
    ranks = [fresh() for _ in range(DEVICES)]
    per_rank = batch // DEVICES
    losses, outputs = [], []
    for r, m in enumerate(ranks):
        xs, ys = x[r * per_rank:(r + 1) * per_rank], y[r * per_rank:(r + 1) * per_rank]
        logits = forward(m, xs, True)
        loss = F.cross_entropy(logits.float(), ys)
        loss.backward()
        losses.append(mg.snap(loss))
        outputs.append(mg.snap(logits.float()))
    out["ddp.output"] = torch.cat(outputs)
    out["ddp.loss"] = torch.stack(losses)
    for k, g in grads(ranks, scale=torch.tensor(1.0 / DEVICES)).items():
        out[f"ddp.grad.{k}"] = g

    meta = OrderedDict([("model", kind), ("hidden", ",".join(map(str, hidden)) if hidden else ""),
                        ("batch", batch), ("devices", DEVICES), ("lr", LR), ("momentum", MOMENTUM),
                        ("weight_decay", WEIGHT_DECAY), ("torch", torch.__version__)])
    return out, meta


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    print(f"torch's CPU bf16 adaptive_avg_pool2d rounds its sum first: {cpu_avgpool_rounds_the_sum()}")
    failed = False
    for name in CASES:
        tensors, meta = run_case(name)
        blob = mg.encode_safetensors(tensors, meta)
        path = os.path.join(args.out, f"{name}.safetensors")
        if args.check:
            with open(path, "rb") as f:
                same = f.read() == blob
            print(f"{name}: {'identical' if same else 'DIFFERS'}")
            failed = failed or not same
        else:
            with open(path, "wb") as f:
                f.write(blob)
            print(f"wrote {path} ({len(blob)} bytes)")
        a, b = tensors["single.output"], tensors["fp32.output"]
        print(f"  |amp - fp32| / |fp32| of the logits: {float((a - b).norm() / b.norm()):.3e}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
