#!/usr/bin/python3
"""Reads a dp checkpoint (a safetensors file) into PyTorch with numpy and torch alone: no
`safetensors` module needed (Debian has none).

    from dp_checkpoint import load
    model.load_state_dict(load("run.safetensors"), strict=True)

or from the shell, to a file torch.load reads:

    scripts/dp_checkpoint.py run.safetensors run.pt            # the model's state_dict
    scripts/dp_checkpoint.py run.safetensors run.pt --all      # and the optimizer's state
    scripts/dp_checkpoint.py run.safetensors                   # lists what the file holds

The model's entries are its state dict under PyTorch's names (BatchNorm's num_batches_tracked as
int64). A training checkpoint (--save during dp_train) also holds the optimizer's per-parameter
state, "optimizer.<state>.<parameter>" (SGD's momentum, AdamW's exp_avg and exp_avg_sq), and its
progress in the header's metadata ("dp.step", "dp.epoch", "dp.seed", ...): --all keeps those
tensors, and the .pt file holds {"state_dict", "optimizer_state", "metadata"}.
"""
import json
import struct
import sys

import numpy as np
import torch

# safetensors' dtype names, as dp writes them.
DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
OPTIMIZER_PREFIX = "optimizer."


def read(path):
    """Every tensor of the file by name, in file order, and its metadata (a dict of str)."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError(f"{path}: {len(data)} bytes, too short for a safetensors file")
    (header_bytes,) = struct.unpack("<Q", data[:8])
    if header_bytes > len(data) - 8:
        raise ValueError(f"{path}: the header claims {header_bytes} bytes, the file has {len(data) - 8} after it")
    header = json.loads(data[8:8 + header_bytes])
    body = memoryview(data)[8 + header_bytes:]
    metadata = header.pop("__metadata__", {})
    tensors = {}
    for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
        begin, end = entry["data_offsets"]
        if entry["dtype"] == "BF16":  # numpy has no bfloat16: widen the 16 bits into float32's top half
            bits = np.frombuffer(body[begin:end], dtype="<u2").astype(np.uint32) << 16
            tensors[name] = torch.from_numpy(bits.view(np.float32).copy()).to(torch.bfloat16).reshape(entry["shape"])
            continue
        dtype = np.dtype(DTYPES[entry["dtype"]]).newbyteorder("<")
        array = np.frombuffer(body[begin:end], dtype=dtype).reshape(entry["shape"])
        tensors[name] = torch.from_numpy(array.copy())
    return tensors, metadata


def load(path):
    """The model's state_dict: what model.load_state_dict(..., strict=True) takes."""
    tensors, _ = read(path)
    return {name: t for name, t in tensors.items() if not name.startswith(OPTIMIZER_PREFIX)}


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0 if len(argv) >= 2 else 2
    tensors, metadata = read(argv[1])
    if len(argv) == 2:
        for name, t in tensors.items():
            print(f"{name:48} {str(t.dtype):16} {list(t.shape)}")
        for key, value in metadata.items():
            print(f"metadata {key} = {value}")
        return 0
    state = {n: t for n, t in tensors.items() if not n.startswith(OPTIMIZER_PREFIX)}
    if "--all" in argv[3:]:
        optimizer = {n[len(OPTIMIZER_PREFIX):]: t for n, t in tensors.items() if n.startswith(OPTIMIZER_PREFIX)}
        torch.save({"state_dict": state, "optimizer_state": optimizer, "metadata": metadata}, argv[2])
    else:
        torch.save(state, argv[2])
    print(f"{argv[2]}: {len(state)} tensors of the model" + (" and the optimizer's state" if "--all" in argv else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
