#!/usr/bin/python3
"""Loads a dp_train checkpoint of --model resnet18/34 into torchvision's model with strict=True and
evaluates it on an image folder with the eval transform dp uses, then compares with what dp reported.

The transform is torchvision's on tensors: ToTensor, Resize(R) and CenterCrop(S) without
antialiasing (dp's bilinear resampling; PIL's antialiased resize differs), Normalize(mean, std).

Usage: torchvision_check.py CHECKPOINT VAL_DIR --model resnet18 --num-classes K --size S --resize R
         --mean M,M,M --std S,S,S --predictions FILE --accuracy A
Prints the accuracy and exits 0 when torchvision's predictions equal dp's (a sample whose top two
logits lie within 1e-4 of each other may go either way and is not counted as a difference) and the
accuracies are equal; 1 otherwise; 77 (skip) without torchvision.
"""
import argparse
import json
import struct
import sys

try:
    import torch
    import torchvision
    from torchvision import datasets, transforms
except ImportError as e:  # the ctest skip code
    print(f"skipped: {e}")
    sys.exit(77)

DTYPES = {"F32": torch.float32, "I64": torch.int64}


def read_safetensors(path):
    with open(path, "rb") as f:
        buf = f.read()
    (n,) = struct.unpack("<Q", buf[:8])
    header = json.loads(buf[8:8 + n].decode("utf-8"))
    header.pop("__metadata__", None)
    data = buf[8 + n:]
    tensors = {}
    for name, info in header.items():
        b, e = info["data_offsets"]
        t = torch.frombuffer(bytearray(data[b:e]), dtype=DTYPES[info["dtype"]])
        tensors[name] = t.reshape(info["shape"]).clone()
    return tensors


def main():
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("val_dir")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--num-classes", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--resize", type=int, required=True)
    p.add_argument("--mean", required=True)
    p.add_argument("--std", required=True)
    p.add_argument("--predictions", required=True)
    p.add_argument("--accuracy", type=float, required=True)
    a = p.parse_args()

    model = getattr(torchvision.models, a.model)(num_classes=a.num_classes)
    # The checkpoint also holds the optimizer's state ("optimizer.*"): the model's tensors are the rest.
    state = {k: v for k, v in read_safetensors(a.checkpoint).items() if not k.startswith("optimizer.")}
    model.load_state_dict(state, strict=True)
    model.eval()

    mean = [float(x) for x in a.mean.split(",")]
    std = [float(x) for x in a.std.split(",")]
    transform = transforms.Compose([
        transforms.ToTensor(),
        transforms.Resize(a.resize, antialias=False),
        transforms.CenterCrop(a.size),
        transforms.Normalize(mean, std),
    ])
    folder = datasets.ImageFolder(a.val_dir, transform=transform)
    with open(a.predictions) as f:
        dp_predictions = [int(line) for line in f if line.strip()]
    if len(dp_predictions) != len(folder):
        print(f"dp predicted {len(dp_predictions)} samples, the folder holds {len(folder)}")
        return 1
    correct = 0
    differ = 0
    with torch.no_grad():
        for i in range(len(folder)):
            x, y = folder[i]
            logits = model(x.unsqueeze(0))[0]
            top2 = torch.topk(logits, 2).values if logits.numel() > 1 else logits
            prediction = int(logits.argmax())
            correct += int(prediction == y)
            near_tie = logits.numel() > 1 and float(top2[0] - top2[1]) < 1e-4
            if prediction != dp_predictions[i] and not near_tie:
                differ += 1
                print(f"sample {i} ({folder.samples[i][0]}): torchvision {prediction}, dp {dp_predictions[i]}")
    accuracy = correct / len(folder)
    print(f"torchvision: {a.model} strict load, accuracy {accuracy:.6f} on {len(folder)} samples; dp: {a.accuracy:.6f}")
    if differ or abs(accuracy - a.accuracy) > 1e-9:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
