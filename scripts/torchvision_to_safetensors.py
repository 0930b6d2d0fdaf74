#!/usr/bin/python3
"""Converts a torchvision ResNet state_dict (a file torch.save wrote, e.g. resnet18-f37072fd.pth from
torchvision's model zoo) to safetensors for `dp_train --init`:

    /usr/bin/python3 scripts/torchvision_to_safetensors.py resnet18-f37072fd.pth resnet18.safetensors --drop fc

--drop PREFIX leaves out the tensors under a module (fine-tuning with another number of classes:
drop fc, then `dp_train --model resnet18 --num-classes K --init resnet18.safetensors --init-non-strict
--freeze conv1 --freeze bn1 --freeze layer1 ...`). --random writes a freshly initialised
torchvision.models.resnet18/34 instead of reading a file (no download needed), with --num-classes.
"""
import argparse
import json
import struct
import sys

import torch

DTYPES = {torch.float32: "F32", torch.int64: "I64"}


def write_safetensors(path, tensors):
    header = {"__metadata__": {"dp.source": "torchvision"}}
    blobs, offset = [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        if t.dtype not in DTYPES:
            t = t.float()
        data = t.numpy().tobytes()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((-len(h)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", nargs="?", help="a state_dict file torch.save wrote (or a dict holding 'state_dict')")
    p.add_argument("output")
    p.add_argument("--drop", action="append", default=[], help="leave out the tensors under this module (repeatable)")
    p.add_argument("--random", choices=["resnet18", "resnet34"], help="a fresh torchvision model instead of INPUT")
    p.add_argument("--num-classes", type=int, default=1000)
    a = p.parse_args()
    if a.random:
        import torchvision
        state = getattr(torchvision.models, a.random)(num_classes=a.num_classes).state_dict()
    elif a.input:
        state = torch.load(a.input, map_location="cpu")
        state = state.get("state_dict", state)
    else:
        p.error("give INPUT or --random")
    kept = {k.removeprefix("module."): v for k, v in state.items()
            if not any(k.removeprefix("module.") == d or k.removeprefix("module.").startswith(d + ".") for d in a.drop)}
    write_safetensors(a.output, kept)
    print(f"torchvision_to_safetensors: {len(kept)} tensors to {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
