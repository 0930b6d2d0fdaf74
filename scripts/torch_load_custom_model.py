#!/usr/bin/python3
"""Loads the checkpoint examples/custom_model.cpp saves into the PyTorch module tree its comment
shows, with load_state_dict(strict=True): every name and shape must match, nothing missing or extra.
Then evaluates a batch in both eval modes' sense (a smoke check that the weights are usable).

Run with Debian's python3-torch: /usr/bin/python3 scripts/torch_load_custom_model.py FILE
"""
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden"))
from make_goldens import as_numpy, read_safetensors  # noqa: E402  the golden scripts' reader


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(c, c, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        return self.relu(self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))) + x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.block = Block(8)
        self.pool = nn.AvgPool2d(2)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(8, 10))

    def forward(self, x):
        return self.head(self.pool(self.block(self.stem(x))))


def main():
    tensors, _ = read_safetensors(sys.argv[1])
    state = {k: torch.from_numpy(as_numpy(v).copy()).reshape(v[1]) for k, v in tensors.items()}
    net = Net()
    net.load_state_dict(state, strict=True)
    net.eval()
    with torch.no_grad():
        logits = net(torch.rand(4, 1, 28, 28))
    assert torch.isfinite(logits).all()
    print(f"loaded {len(state)} tensors into Net (strict); logits {tuple(logits.shape)}")


if __name__ == "__main__":
    main()
