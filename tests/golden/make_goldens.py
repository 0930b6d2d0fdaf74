#!/usr/bin/python3
"""Generate small PyTorch golden files for dp numerical-parity tests.

Usage (Debian python, CPU-only torch):
    /usr/bin/python3 tests/golden/make_goldens.py            # (re)write tests/golden/*.safetensors
    /usr/bin/python3 tests/golden/make_goldens.py --check    # regenerate in memory, compare files bit for bit
    options: --out DIR (default: this script's directory)

The files are written with a tiny hand-rolled safetensors writer (struct + json),
and --check reads them back with an equally tiny reader.  Regenerating is
deterministic: fixed seeds, one CPU thread, deterministic algorithms.
"""
import argparse
import json
import os
import struct
import sys
from collections import OrderedDict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

# --------------------------------------------------------------------------- models


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Sequential(nn.Conv2d(1, 16, 5, 1, 2), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2, 2))
        self.layer2 = nn.Sequential(nn.Conv2d(16, 32, 5, 1, 2), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2, 2))
        self.fc = nn.Linear(7 * 7 * 32, 10)

    def forward(self, x):
        x = self.layer2(self.layer1(x))
        return self.fc(x.reshape(x.size(0), -1))


class MLP(nn.Module):  # Flatten -> fc1 -> ReLU -> ... -> fcK (no ReLU after last)
    def __init__(self, hidden):
        super().__init__()
        dims = [784] + hidden + [10]
        for i in range(len(dims) - 1):
            setattr(self, f"fc{i+1}", nn.Linear(dims[i], dims[i + 1]))
        self.n = len(dims) - 1

    def forward(self, x):
        x = x.reshape(x.size(0), -1)
        for i in range(self.n):
            x = getattr(self, f"fc{i+1}")(x)
            if i + 1 < self.n:
                x = F.relu(x)
        return x


# --------------------------------------------------------------------------- cases

LR = 0.05
MOMENTUM = 0.9
WEIGHT_DECAY = 1e-3
STEPS = 3

# name -> (model, hidden, batch, nesterov, seed).  mlp_b7_nesterov deliberately
# shares mlp_b7's seed: identical init and data, so step0 grads match mlp_b7
# and the two runs diverge only through the optimizer.
CASES = OrderedDict([
    ("mlp_b1",          ("mlp", [32, 17], 1, False, 101)),
    ("mlp_b7",          ("mlp", [32, 17], 7, False, 107)),
    ("mlp_b7_nesterov", ("mlp", [32, 17], 7, True,  107)),
    ("convnet_b1",      ("convnet", None, 1, False, 201)),
    ("convnet_b7",      ("convnet", None, 7, False, 207)),
])


def randomize_batchnorm(m):
    """Every BatchNorm2d of `m`, in module order: statistics and affine values away from 0/1, drawn
    from torch's global generator, so their gradients and the running updates are exercised."""
    with torch.no_grad():
        for bn in (x for x in m.modules() if isinstance(x, nn.BatchNorm2d)):
            c = bn.num_features
            bn.running_mean.copy_(torch.randn(c) * 0.1)
            bn.running_var.copy_(torch.rand(c) + 0.5)
            bn.weight.copy_(torch.rand(c) + 0.5)
            bn.bias.copy_(torch.randn(c) * 0.1)
    return m


def build_model(kind, hidden, seed):
    torch.manual_seed(seed)
    if kind == "mlp":
        return MLP(list(hidden))
    return randomize_batchnorm(ConvNet())


def snap(t):
    """Detached, contiguous CPU copy."""
    return t.detach().clone().contiguous().cpu()


def run_case(name):
    kind, hidden, batch, nesterov, seed = CASES[name]
    model = build_model(kind, hidden, seed)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, dampening=0,
                          weight_decay=WEIGHT_DECAY, nesterov=nesterov)
    gen = torch.Generator().manual_seed(seed + 10000)  # data RNG independent of init RNG

    out = OrderedDict()
    for k, v in model.state_dict().items():
        out[f"init.{k}"] = snap(v)

    # forward hooks for step-0 intermediates
    acts = OrderedDict()
    if kind == "convnet":
        hook_mods = OrderedDict((f"layer{l}.{i}", getattr(model, f"layer{l}")[i])
                                for l in (1, 2) for i in (0, 1, 3))
    else:
        hook_mods = OrderedDict((f"fc{i+1}", getattr(model, f"fc{i+1}")) for i in range(model.n))
    handles = []
    for hn, mod in hook_mods.items():
        handles.append(mod.register_forward_hook(
            lambda m, inp, o, hn=hn: acts.__setitem__(hn, snap(o))))

    params = OrderedDict(model.named_parameters())
    step0_input = None
    for k in range(STEPS):
        pixels = torch.randint(0, 256, (batch, 1, 28, 28), generator=gen, dtype=torch.uint8)
        target = torch.randint(0, 10, (batch,), generator=gen, dtype=torch.int64)
        x = pixels.to(torch.float32) / 255.0
        if k == 0:
            step0_input = x
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        loss = F.cross_entropy(logits, target)
        loss.backward()
        if k == 0:
            for h in handles:
                h.remove()
        out[f"step{k}.input"] = snap(x)
        out[f"step{k}.pixels"] = snap(pixels)
        out[f"step{k}.target"] = snap(target)
        out[f"step{k}.output"] = snap(logits)
        out[f"step{k}.loss"] = snap(loss)
        for pn, p in params.items():
            out[f"step{k}.grad.{pn}"] = snap(p.grad)
        opt.step()
        for pn, p in params.items():
            out[f"step{k}.momentum.{pn}"] = snap(opt.state[p]["momentum_buffer"])
        if k == 0:
            for hn, a in acts.items():
                out[f"step0.act.{hn}"] = a

    for k, v in model.state_dict().items():
        out[f"final.{k}"] = snap(v)
    model.eval()
    with torch.no_grad():
        out["eval.output"] = snap(model(step0_input))

    meta = OrderedDict([
        ("model", kind),
        ("hidden", ",".join(str(h) for h in hidden) if hidden else ""),
        ("batch", str(batch)),
        ("lr", repr(LR)),
        ("momentum", repr(MOMENTUM)),
        ("weight_decay", repr(WEIGHT_DECAY)),
        ("nesterov", "1" if nesterov else "0"),
        ("dampening", "0"),
        ("steps", str(STEPS)),
        ("seed", str(seed)),
        ("loss", "cross_entropy_mean"),
        ("torch", torch.__version__),
    ])
    return out, meta


# --------------------------------------------------------------------------- safetensors

DTYPES = {torch.float32: "F32", torch.int64: "I64", torch.uint8: "U8"}
NP_DTYPES = {"F32": np.dtype("<f4"), "I64": np.dtype("<i8"), "U8": np.dtype("u1")}


def tensor_bytes(t):
    code = DTYPES[t.dtype]
    return t.numpy().astype(NP_DTYPES[code], copy=False).tobytes(order="C")


def encode_safetensors(tensors, meta):
    header = OrderedDict()
    header["__metadata__"] = OrderedDict((k, str(v)) for k, v in meta.items())
    blobs = []
    off = 0
    for name, t in tensors.items():
        b = tensor_bytes(t)
        header[name] = OrderedDict([("dtype", DTYPES[t.dtype]), ("shape", list(t.shape)),
                                    ("data_offsets", [off, off + len(b)])])
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * ((-len(h)) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


def read_safetensors(path):
    """Minimal reader -> (OrderedDict name -> (dtype, shape, bytes), metadata)."""
    with open(path, "rb") as f:
        buf = f.read()
    (n,) = struct.unpack("<Q", buf[:8])
    assert n % 8 == 0, "header length not a multiple of 8"
    header = json.loads(buf[8:8 + n].decode("utf-8"), object_pairs_hook=OrderedDict)
    data = buf[8 + n:]
    meta = header.pop("__metadata__", {})
    res = OrderedDict()
    expect = 0
    for name, info in header.items():
        b, e = info["data_offsets"]
        assert b == expect, f"{name}: non-contiguous offsets"
        nbytes = int(np.prod(info["shape"], dtype=np.int64)) * NP_DTYPES[info["dtype"]].itemsize
        assert e - b == nbytes, f"{name}: size mismatch"
        res[name] = (info["dtype"], list(info["shape"]), data[b:e])
        expect = e
    assert expect == len(data), "trailing bytes after data section"
    return res, meta


def as_numpy(entry):
    dt, shape, b = entry
    return np.frombuffer(b, dtype=NP_DTYPES[dt]).reshape(shape)


# --------------------------------------------------------------------------- checks


def sgd_replay_check(name, f, meta):
    """Independently replay SGD from stored init + grads (numpy, float64) and compare
    against stored momenta / final params.  Catches naming or semantic mistakes."""
    nesterov = meta["nesterov"] == "1"
    pnames = [k[len("step0.grad."):] for k in f if k.startswith("step0.grad.")]
    worst = 0.0
    for pn in pnames:
        p = as_numpy(f[f"init.{pn}"]).astype(np.float64)
        buf = None
        for k in range(STEPS):
            g = as_numpy(f[f"step{k}.grad.{pn}"]).astype(np.float64)
            d = g + WEIGHT_DECAY * p
            buf = d if buf is None else MOMENTUM * buf + d
            worst = max(worst, float(np.max(np.abs(buf - as_numpy(f[f"step{k}.momentum.{pn}"])))))
            p = p - LR * (d + MOMENTUM * buf if nesterov else buf)
        worst = max(worst, float(np.max(np.abs(p - as_numpy(f[f"final.{pn}"])))))
    assert worst < 1e-5, f"{name}: SGD replay mismatch {worst}"
    return worst


def forward_check(name, f, meta):
    """Recompute step0 logits/loss from stored init state + stored input with a fresh model."""
    kind = meta["model"]
    hidden = [int(h) for h in meta["hidden"].split(",")] if meta["hidden"] else None
    m = MLP(hidden) if kind == "mlp" else ConvNet()
    sd = OrderedDict()
    for k in m.state_dict():
        sd[k] = torch.from_numpy(as_numpy(f[f"init.{k}"]).copy())
    m.load_state_dict(sd)
    m.train()
    x = torch.from_numpy(as_numpy(f["step0.input"]).copy())
    px = torch.from_numpy(as_numpy(f["step0.pixels"]).copy())
    assert torch.equal(px.to(torch.float32) / 255.0, x), f"{name}: input != pixels/255"
    with torch.no_grad():
        y = m(x)
    ref = torch.from_numpy(as_numpy(f["step0.output"]).copy())
    assert torch.equal(y, ref), f"{name}: step0 forward not reproducible"
    loss = F.cross_entropy(y, torch.from_numpy(as_numpy(f["step0.target"]).copy()))
    assert torch.equal(loss, torch.from_numpy(as_numpy(f["step0.loss"]).copy())), f"{name}: loss"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="verify files instead of writing")
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    args = ap.parse_args()

    ok = True
    for name in CASES:
        tensors, meta = run_case(name)
        path = os.path.join(args.out, f"{name}.safetensors")
        blob = encode_safetensors(tensors, meta)
        if not args.check:
            with open(path, "wb") as fh:
                fh.write(blob)
            print(f"wrote {path}: {len(tensors)} tensors, {len(blob)} bytes")
            continue
        # --check: read back and compare bit for bit with freshly generated tensors
        f, fmeta = read_safetensors(path)
        try:
            assert dict(fmeta) == {k: str(v) for k, v in meta.items()}, "metadata differs"
            assert list(f.keys()) == list(tensors.keys()), "tensor names/order differ"
            for tn, t in tensors.items():
                dt, shape, b = f[tn]
                assert dt == DTYPES[t.dtype], f"{tn}: dtype {dt}"
                assert shape == list(t.shape), f"{tn}: shape {shape} vs {list(t.shape)}"
                back = torch.from_numpy(as_numpy(f[tn]).copy()).reshape(t.shape)
                assert torch.equal(back, t), f"{tn}: values differ"
                assert b == tensor_bytes(t), f"{tn}: raw bytes differ"
            with open(path, "rb") as fh:
                assert fh.read() == blob, "file bytes differ from regenerated encoding"
            w = sgd_replay_check(name, f, fmeta)
            forward_check(name, f, fmeta)
            print(f"OK {name}: {len(f)} tensors bit-identical; SGD replay max|diff| {w:.3g}")
        except AssertionError as e:
            ok = False
            print(f"FAIL {name}: {e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
