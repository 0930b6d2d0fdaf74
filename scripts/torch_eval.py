#!/usr/bin/python3
"""Evaluates a dp_train checkpoint with PyTorch, as `dp_train --eval-only --init` does, to check that
both count the same test samples correct (run with Debian's python3-torch, CPU):

    /usr/bin/python3 scripts/torch_eval.py --init convnet.safetensors --data /usr/share/datasets/fashion-mnist \
        --model convnet --normalize 0.2860,0.3530

It prints the test loss, the accuracy and the number of correct samples; with --predictions FILE it also
writes each sample's predicted class, one per line, for a sample-by-sample comparison.
"""
import argparse, gzip, os, struct, sys

import numpy as np
import torch
import torch.nn.functional as F


# The reference models with dp's parameter names, as the golden files' script defines them.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden"))
from make_goldens import MLP, ConvNet  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dp_checkpoint import load  # noqa: E402


def read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        magic = struct.unpack(">I", f.read(4))[0]
        dims = struct.unpack(">" + "I" * (magic & 0xFF), f.read(4 * (magic & 0xFF)))
        return np.frombuffer(f.read(), dtype=np.uint8).reshape(dims)


def find(data, name):
    for candidate in (os.path.join(data, name), os.path.join(data, name + ".gz")):
        if os.path.exists(candidate):
            return candidate
    raise SystemExit(f"{data}: no {name}[.gz]")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--init", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--model", default="convnet")
    p.add_argument("--hidden", default="256,256")
    p.add_argument("--normalize", default="0,1")
    p.add_argument("--predictions")
    args = p.parse_args()
    mean, std = (float(v) for v in args.normalize.split(","))
    images = read_idx(find(args.data, "t10k-images-idx3-ubyte"))
    labels = torch.from_numpy(read_idx(find(args.data, "t10k-labels-idx1-ubyte")).astype(np.int64))
    # torchvision's ToTensor then Normalize, in fp32.
    x = (torch.from_numpy(images.astype(np.float32)).unsqueeze(1) / 255.0 - mean) / std
    model = ConvNet() if args.model == "convnet" else MLP([int(h) for h in args.hidden.split(",")])
    state = load(args.init)
    state = {k[len("module."):] if k.startswith("module.") else k: v for k, v in state.items()}
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(x[i:i + 1000]) for i in range(0, len(x), 1000)])
    loss = F.cross_entropy(logits.double(), labels, reduction="sum").item() / len(labels)
    pred = logits.argmax(dim=1)
    correct = int((pred == labels).sum())
    print(f"torch: {len(labels)} test samples: test loss {loss:.6f}, test accuracy {100.0 * correct / len(labels):.2f}% "
          f"({correct} correct)")
    if args.predictions:
        with open(args.predictions, "w") as f:
            f.write("\n".join(str(int(c)) for c in pred) + "\n")


if __name__ == "__main__":
    main()
