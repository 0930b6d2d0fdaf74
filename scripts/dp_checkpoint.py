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


# Tensors nanoGPT's GPT ties: a file holding both must hold one tensor twice.
TIED = [("lm_head.weight", "transformer.wte.weight")]


def check_entry(path, name, entry, body_bytes):
    """ValueError unless `entry` is a tensor dp writes: a known dtype, a shape of non-negative whole
    numbers, offsets inside the data whose span is exactly the shape's bytes."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise ValueError(f"{path}: tensor '{name}' is not a dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPES and dtype != "BF16":
        raise ValueError(f"{path}: tensor '{name}' has dtype {dtype!r}, not one of {sorted(DTYPES) + ['BF16']}")
    whole = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0
    if not isinstance(shape, list) or not all(whole(d) for d in shape):
        raise ValueError(f"{path}: tensor '{name}' has shape {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(whole(o) for o in offsets):
        raise ValueError(f"{path}: tensor '{name}' has data_offsets {offsets!r}")
    size = 2 if dtype == "BF16" else np.dtype(DTYPES[dtype]).itemsize
    count = 1
    for d in shape:
        count *= d
    begin, end = offsets
    if not begin <= end <= body_bytes or end - begin != count * size:
        raise ValueError(f"{path}: tensor '{name}' spans bytes [{begin}, {end}) of {body_bytes}, "
                         f"its {dtype} shape {shape} needs {count * size}")


def read(path):
    """Every tensor of the file by name, in file order, and its metadata (a dict of str). Refuses
    (ValueError, naming the file and the problem) what dp refuses: a malformed header, an unknown
    dtype, offsets outside the data, overlapping or not the shape's size, a non-finite float, tied
    tensors that differ."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError(f"{path}: {len(data)} bytes, too short for a safetensors file")
    (header_bytes,) = struct.unpack("<Q", data[:8])
    if header_bytes > len(data) - 8:
        raise ValueError(f"{path}: the header claims {header_bytes} bytes, the file has {len(data) - 8} after it")
    try:
        header = json.loads(data[8:8 + header_bytes])
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: the header is not JSON ({e})")
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is not a JSON object")
    body = memoryview(data)[8 + header_bytes:]
    metadata = header.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{path}: __metadata__ is not a map of strings")
    for name, entry in header.items():
        check_entry(path, name, entry, len(body))
    ordered = sorted(header.items(), key=lambda item: tuple(item[1]["data_offsets"]))
    for (a, ea), (b, eb) in zip(ordered, ordered[1:]):
        if eb["data_offsets"][0] < ea["data_offsets"][1]:
            raise ValueError(f"{path}: tensors '{a}' and '{b}' overlap")
    tensors = {}
    for name, entry in ordered:
        begin, end = entry["data_offsets"]
        if entry["dtype"] == "BF16":  # numpy has no bfloat16: widen the 16 bits into float32's top half
            bits = np.frombuffer(body[begin:end], dtype="<u2").astype(np.uint32) << 16
            widened = bits.view(np.float32)
            array = widened
        else:
            dtype = np.dtype(DTYPES[entry["dtype"]]).newbyteorder("<")
            array = np.frombuffer(body[begin:end], dtype=dtype)
        if array.dtype.kind == "f":
            bad = np.flatnonzero(~np.isfinite(array))
            if bad.size:
                raise ValueError(f"{path}: tensor '{name}' holds a non-finite value ({array[bad[0]]}) at element "
                                 f"{bad[0]}")
        if entry["dtype"] == "BF16":
            tensors[name] = torch.from_numpy(array.copy()).to(torch.bfloat16).reshape(entry["shape"])
        else:
            tensors[name] = torch.from_numpy(array.reshape(entry["shape"]).copy())
    for a, b in TIED:
        if a in tensors and b in tensors and not torch.equal(tensors[a], tensors[b]):
            raise ValueError(f"{path}: tensors '{a}' and '{b}' differ, but the GPT ties them (one tensor)")
    return tensors, metadata


def load(path):
    """The model's state_dict: what model.load_state_dict(..., strict=True) takes."""
    tensors, _ = read(path)
    return {name: t for name, t in tensors.items() if not name.startswith(OPTIMIZER_PREFIX)}


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0 if len(argv) >= 2 else 2
    try:
        tensors, metadata = read(argv[1])
    except (ValueError, OSError) as e:
        print(f"dp_checkpoint.py: {e}", file=sys.stderr)
        return 2
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
