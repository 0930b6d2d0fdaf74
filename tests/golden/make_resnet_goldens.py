#!/usr/bin/python3
"""Golden training steps of ResNet-8 (dp::models::make_resnet8) from PyTorch (torch 1.13, CPU, fp32).

The module tree is torchvision's: resnet.BasicBlock with conv1/bn1/relu/conv2/bn2/downsample, the
stem conv1/bn1/relu, layer1..layer3 as nn.Sequential(BasicBlock), avgpool, fc — written out here
because torchvision is not packaged for Debian's torch; names and registration order are the same,
so a dp checkpoint's state dict loads into torchvision's blocks as it loads into this tree.

Two cases, 3 training steps each on random 28x28 batches (values like the ConvNet goldens):
  resnet8_sgd:          SGD(lr 0.05, momentum 0.9, weight_decay 1e-4), plain cross-entropy
  resnet8_adamw_cosine: AdamW(lr 2e-3, weight_decay 0.05) with CosineAnnealingLR(T_max 3) and
                        CrossEntropyLoss(label_smoothing=0.1)
Each file holds init.*, per step input/target/output/loss/lr, step0.grad.*, final.* (state dict after the
steps) and eval.output (eval-mode logits of step 0's input).

Run: /usr/bin/python3 tests/golden/make_resnet_goldens.py
"""
import os
from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F

from make_goldens import encode_safetensors  # the one safetensors writer of the golden scripts

STEPS, BATCH = 3, 6


class BasicBlock(nn.Module):
    """torchvision.models.resnet.BasicBlock (expansion 1), same attribute names and order."""

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet8(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(BasicBlock(16, 16))
        self.layer2 = nn.Sequential(BasicBlock(16, 32, 2, nn.Sequential(nn.Conv2d(16, 32, 1, 2, bias=False),
                                                                          nn.BatchNorm2d(32))))
        self.layer3 = nn.Sequential(BasicBlock(32, 64, 2, nn.Sequential(nn.Conv2d(32, 64, 1, 2, bias=False),
                                                                          nn.BatchNorm2d(64))))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def snap(t):
    return t.detach().clone().contiguous()


def run_case(name, seed):
    torch.manual_seed(seed)
    model = ResNet8()
    with torch.no_grad():  # BatchNorm affine values away from 1/0, so their gradients matter
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.copy_(1.0 + 0.1 * torch.randn(m.num_features))
                m.bias.copy_(0.1 * torch.randn(m.num_features))
    model.train()
    if name == "resnet8_sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        sched, smoothing = None, 0.0
        meta = {"optimizer": "sgd", "lr": "0.05", "momentum": "0.9", "weight_decay": "0.0001"}
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
        smoothing = 0.1
        meta = {"optimizer": "adamw", "lr": "0.002", "weight_decay": "0.05", "beta1": "0.9", "beta2": "0.999",
                "eps": "1e-08", "schedule": "cosine", "t_max": str(STEPS)}
    meta.update({"model": "resnet8", "batch": str(BATCH), "steps": str(STEPS), "label_smoothing": str(smoothing),
                 "torch": torch.__version__})
    gen = torch.Generator().manual_seed(seed + 10000)
    out = OrderedDict()
    for k, v in model.state_dict().items():
        out[f"init.{k}"] = snap(v)
    params = OrderedDict(model.named_parameters())
    first = None
    for k in range(STEPS):
        x = torch.randint(0, 256, (BATCH, 1, 28, 28), generator=gen, dtype=torch.uint8).to(torch.float32) / 255.0
        y = torch.randint(0, 10, (BATCH,), generator=gen, dtype=torch.int64)
        first = x if first is None else first
        out[f"step{k}.lr"] = torch.tensor([opt.param_groups[0]["lr"]], dtype=torch.float64).to(torch.float32)
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        loss = F.cross_entropy(logits, y, label_smoothing=smoothing)
        loss.backward()
        out[f"step{k}.input"] = snap(x)
        out[f"step{k}.target"] = snap(y)
        out[f"step{k}.output"] = snap(logits)
        out[f"step{k}.loss"] = snap(loss).reshape(1)
        if k == 0:  # later steps' gradients show through the final parameters; the files stay small
            for pn, p in params.items():
                out[f"step{k}.grad.{pn}"] = snap(p.grad)
        opt.step()
        if sched:
            sched.step()
    for k, v in model.state_dict().items():
        out[f"final.{k}"] = snap(v)
    model.eval()
    with torch.no_grad():
        out["eval.output"] = snap(model(first))
    return out, meta


def main():
    torch.set_num_threads(1)
    here = os.path.dirname(os.path.abspath(__file__))
    for name, seed in (("resnet8_sgd", 301), ("resnet8_adamw_cosine", 302)):
        tensors, meta = run_case(name, seed)
        with open(os.path.join(here, f"{name}.safetensors"), "wb") as f:
            f.write(encode_safetensors(tensors, meta))
        print(name, len(tensors), "tensors")


if __name__ == "__main__":
    main()
