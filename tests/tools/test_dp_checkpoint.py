#!/usr/bin/python3
"""scripts/dp_checkpoint.py, as a PyTorch user takes a dp checkpoint: dp_train saves a ConvNet (with
SGD momentum) after two steps; the reader's state_dict loads into torch's ConvNet with strict=True,
every value the file's bytes, the optimizer's state and metadata kept by --all, a truncated file
refused. Exit 77 (ctest: skipped) without torch. Usage: test_dp_checkpoint.py DP_TRAIN WORK_DIR"""
import json
import os
import struct
import subprocess
import sys

try:
    import torch
except ImportError:
    print("skipped: torch is not installed (Debian: python3-torch)")
    sys.exit(77)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, os.path.join(ROOT, "tests", "golden"))
from dp_checkpoint import load, read  # noqa: E402
from make_goldens import ConvNet  # noqa: E402


def main():
    train, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    path = os.path.join(work, "convnet.safetensors")
    subprocess.run([train, "--model", "convnet", "--synthetic", "64", "--batch-size", "16", "--steps", "2",
                    "--momentum", "0.9", "--save", path], check=True, capture_output=True)
    state = load(path)
    model = ConvNet()
    model.load_state_dict(state, strict=True)
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name
    assert state["layer1.1.num_batches_tracked"].dtype == torch.int64
    assert int(state["layer1.1.num_batches_tracked"]) == 2, state["layer1.1.num_batches_tracked"]
    # The bytes of one tensor, read independently of the reader.
    with open(path, "rb") as f:
        raw = f.read()
    tensors, metadata = read(path)
    assert metadata.get("dp.step") == "2", metadata
    assert any(n.startswith("optimizer.momentum.") for n in tensors), list(tensors)
    first = tensors["fc.bias"].numpy().tobytes()
    assert first in raw, "fc.bias is not the file's bytes"
    pt = os.path.join(work, "convnet.pt")
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "dp_checkpoint.py"), path, pt, "--all"], check=True,
                   capture_output=True)
    saved = torch.load(pt)
    assert set(saved) == {"state_dict", "optimizer_state", "metadata"}, set(saved)
    assert torch.equal(saved["optimizer_state"]["momentum.fc.weight"], tensors["optimizer.momentum.fc.weight"])
    truncated = os.path.join(work, "truncated.safetensors")
    with open(truncated, "wb") as f:
        f.write(raw[:8] + raw[8:40])
    try:
        read(truncated)
        raise AssertionError("a truncated file was read")
    except ValueError as e:
        assert "header claims" in str(e), e
    # What dp refuses, the script refuses: exit 2 and a line naming the problem, no traceback, no output.
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    body = raw[8 + n:]

    def variant(label, change, says):
        h = json.loads(json.dumps(header))
        data = bytearray(body)
        change(h, data)
        text = json.dumps(h).encode()
        bad = os.path.join(work, label + ".safetensors")
        with open(bad, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text + bytes(data))
        out = os.path.join(work, label + ".pt")
        r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "dp_checkpoint.py"), bad, out],
                           capture_output=True, text=True)
        assert r.returncode == 2, (label, r.returncode, r.stderr)
        assert says in r.stderr and "Traceback" not in r.stderr, (label, r.stderr)
        assert not os.path.exists(out), label

    first_offsets = header["fc.bias"]["data_offsets"]
    other = next(k for k in header if k not in ("__metadata__", "fc.bias") and header[k]["dtype"] == "F32")

    def nan(h, data):
        data[first_offsets[0]:first_offsets[0] + 4] = struct.pack("<f", float("nan"))

    def overlap(h, data):
        h[other]["data_offsets"] = list(first_offsets) if h[other]["shape"] == h["fc.bias"]["shape"] else \
            [first_offsets[0], first_offsets[0] + h[other]["data_offsets"][1] - h[other]["data_offsets"][0]]

    variant("nan", nan, "holds a non-finite value (nan) at element 0")
    variant("dtype", lambda h, d: h["fc.bias"].update(dtype="Q8"), "has dtype 'Q8'")
    variant("overlap", overlap, "overlap")
    variant("shape", lambda h, d: h["fc.bias"].update(shape=[-1]), "has shape [-1]")
    variant("json", lambda h, d: h.update({"x": 1}), "is not a dtype, shape and data_offsets")
    print("dp_checkpoint: a dp checkpoint loads into torch with strict=True; bad files are refused")


if __name__ == "__main__":
    main()
