#!/usr/bin/python3
"""llm.c's files beside dp's: its GPT-2 model files (train_gpt2.c's gpt2_124M.bin: magic 20240326)
and token shards (magic 20240520, uint16 tokens), and the comparison with llm.c's CPU trainer.

    scripts/llmc.py to-safetensors gpt2_124M.bin gpt2.safetensors   # llm.c -> dp / nanoGPT names
    scripts/llmc.py to-llmc gpt2.safetensors gpt2_124M.bin          # and back (version 3, fp32)
    scripts/llmc.py tokens input.txt tokens.bin                      # a text's bytes as a token shard
    scripts/llmc.py parity ~/llm.c                                   # losses and speed against train_gpt2.c
    scripts/llmc.py golden ~/llm.c README.md tests/golden/llmc       # the test's token shard and losses

The safetensors file holds nanoGPT's tensor names (what dp_train --init and nanoGPT's GPT load) and,
in its metadata, the llm.c header's sizes as dp_train's tags (dp.context, dp.vocab, dp.layers,
dp.heads, dp.width, dp.gelu = tanh): llm.c -> safetensors -> llm.c gives the file back byte for byte.
A file that is not what it claims (a wrong magic or version, sizes that do not match its length,
overlapping tensors, a non-finite value, a wrong dtype) is refused with a message and exit 2.

`parity LLMC_DIR` builds train_gpt2 with llm.c's own Makefile in the user's checkout, writes a small
GPT-2 (L4 NH4 C128, T 64, V 256, dp's initialisation) as an llm.c model file and a text's bytes as its
token shards, runs train_gpt2.c's 40 steps (AdamW lr 1e-4, B 4, T 64) and dp_train with the same
settings from the same files, and prints both per-step losses and their largest difference; then
times both on the same cores in alternation, and prints each one's tokens/s, dp's ratio to llm.c and
the share each reaches of the cores' fp32 GEMM ceiling (dp_microbench's 512 x 512 GEMM on every
core at once; a token's FLOPs as dp's registry counts them). Without a checkout it says so and
exits 0.
"""
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time

MODEL_MAGIC, TOKENS_MAGIC, HEADER_INTS = 20240326, 20240520, 256
HERE = os.path.dirname(os.path.abspath(__file__))


class Refused(Exception):
    pass


def layout(maxT, V, L, NH, C, Vp):
    """train_gpt2.c's parameters in its file's order, under nanoGPT's names, with their shapes."""
    out = [("transformer.wte.weight", (Vp, C)), ("transformer.wpe.weight", (maxT, C))]
    per_layer = [("ln_1.weight", (C,)), ("ln_1.bias", (C,)), ("attn.c_attn.weight", (3 * C, C)),
                 ("attn.c_attn.bias", (3 * C,)), ("attn.c_proj.weight", (C, C)), ("attn.c_proj.bias", (C,)),
                 ("ln_2.weight", (C,)), ("ln_2.bias", (C,)), ("mlp.c_fc.weight", (4 * C, C)),
                 ("mlp.c_fc.bias", (4 * C,)), ("mlp.c_proj.weight", (C, 4 * C)), ("mlp.c_proj.bias", (C,))]
    for name, shape in per_layer:
        out += [("transformer.h.%d.%s" % (l, name), shape) for l in range(L)]
    return out + [("transformer.ln_f.weight", (C,)), ("transformer.ln_f.bias", (C,))]


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def check_finite(name, data):
    """`data`: little-endian fp32 bytes. An exponent of all ones is an infinity or a NaN."""
    try:
        import numpy as np
    except ImportError:
        raise Refused("checking tensor '%s' needs numpy, which %s lacks (Debian: python3-numpy)" %
                      (name, sys.executable))
    values = np.frombuffer(data, dtype="<f4")
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise Refused("tensor '%s' holds a non-finite value at element %d" % (name, bad[0]))


def read_llmc(path):
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < HEADER_INTS * 4:
        raise Refused("%s: %d bytes, shorter than llm.c's 1024-byte header" % (path, len(blob)))
    header = struct.unpack("<256i", blob[:1024])
    if header[0] != MODEL_MAGIC:
        raise Refused("%s: not an llm.c model file (magic %d, expected %d)" % (path, header[0], MODEL_MAGIC))
    version, maxT, V, L, NH, C, Vp = header[1:8]
    if version not in (3, 5):
        raise Refused("%s: llm.c model version %d, not 3 (fp32) or 5 (bf16)" % (path, version))
    if min(maxT, V, L, NH, C, Vp) < 1 or C % NH or Vp < V:
        raise Refused("%s: llm.c header sizes maxT %d V %d L %d NH %d C %d Vp %d are not a GPT-2" %
                      (path, maxT, V, L, NH, C, Vp))
    element = 4 if version == 3 else 2
    tensors, at = [], 1024
    for name, shape in layout(maxT, V, L, NH, C, Vp):
        size = numel(shape) * element
        tensors.append((name, shape, blob[at:at + size]))
        at += size
    if at != len(blob):
        raise Refused("%s: %d bytes, but its header's sizes make %d (%s)" %
                      (path, len(blob), at, "truncated" if len(blob) < at else "trailing bytes"))
    if version == 5:  # bf16: the high halves of fp32 words
        tensors = [(n, s, b"".join(b"\0\0" + d[i:i + 2] for i in range(0, len(d), 2))) for n, s, d in tensors]
    for name, _, data in tensors:
        check_finite(name, data)
    return dict(maxT=maxT, V=V, L=L, NH=NH, C=C, Vp=Vp), tensors


def write_safetensors(path, tensors, metadata):
    header, at = {"__metadata__": metadata}, 0
    for name, shape, data in tensors:
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [at, at + len(data)]}
        at += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    write_atomically(path, [struct.pack("<Q", len(text)), text] + [d for _, _, d in tensors])


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise Refused("%s: not a safetensors file (%d bytes)" % (path, len(blob)))
    (n,) = struct.unpack("<Q", blob[:8])
    if n > len(blob) - 8:
        raise Refused("%s: a header of %d bytes in a file of %d" % (path, n, len(blob)))
    try:
        header = json.loads(blob[8:8 + n])
    except ValueError as e:
        raise Refused("%s: a malformed header (%s)" % (path, e))
    metadata = header.pop("__metadata__", {}) or {}
    data, spans = blob[8 + n:], []
    tensors = {}
    for name, t in header.items():
        if t.get("dtype") != "F32":
            raise Refused("%s: tensor '%s' is %s; llm.c's files hold F32" % (path, name, t.get("dtype")))
        begin, end = t["data_offsets"]
        if not 0 <= begin <= end <= len(data) or end - begin != 4 * numel(t["shape"]):
            raise Refused("%s: tensor '%s' has offsets %s for shape %s" % (path, name, [begin, end], t["shape"]))
        spans.append((begin, end, name))
        tensors[name] = (tuple(t["shape"]), data[begin:end])
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise Refused("%s: tensors '%s' and '%s' overlap" % (path, n0, n1))
    return metadata, tensors


def write_atomically(path, pieces):
    directory = os.path.dirname(os.path.abspath(path))
    fd, temp = tempfile.mkstemp(dir=directory, prefix=".llmc-")
    try:
        with os.fdopen(fd, "wb") as f:
            for piece in pieces:
                f.write(piece)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        os.unlink(temp)
        raise


def check_output(path):
    if os.path.exists(path) and not os.path.isfile(path):
        raise Refused("%s: not a regular file to write" % path)


def to_safetensors(src, dst):
    check_output(dst)
    c, tensors = read_llmc(src)
    metadata = {"dp.model": "gpt", "dp.context": str(c["maxT"]), "dp.vocab": str(c["V"]),
                "dp.layers": str(c["L"]), "dp.heads": str(c["NH"]), "dp.width": str(c["C"]), "dp.gelu": "tanh"}
    if c["Vp"] != (c["V"] + 127) // 128 * 128:
        metadata["llmc.padded_vocab"] = str(c["Vp"])
    write_safetensors(dst, tensors, metadata)


def to_llmc(src, dst, heads=None, vocab=None):
    check_output(dst)
    metadata, tensors = read_safetensors(src)
    # A dp training checkpoint's optimizer state is not the model's.
    tensors = {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}
    if "lm_head.weight" in tensors:  # nanoGPT ties it to wte: one tensor, two names
        if tensors["lm_head.weight"] != tensors.get("transformer.wte.weight"):
            raise Refused("%s: lm_head.weight and transformer.wte.weight differ, but GPT-2 ties them" % src)
        del tensors["lm_head.weight"]
    if "transformer.wte.weight" not in tensors or "transformer.wpe.weight" not in tensors:
        raise Refused("%s: no transformer.wte.weight and transformer.wpe.weight: not a GPT" % src)
    Vp, C = tensors["transformer.wte.weight"][0]
    maxT = tensors["transformer.wpe.weight"][0][0]
    L = len({m.group(1) for m in (re.match(r"transformer\.h\.(\d+)\.", k) for k in tensors) if m})
    NH = heads or int(metadata.get("dp.heads", 0))
    V = vocab or int(metadata.get("dp.vocab", Vp))
    if not NH:
        raise Refused("%s: the head count is not in the file's metadata (dp.heads): give --heads" % src)
    if metadata.get("dp.gelu", "tanh") != "tanh":
        raise Refused("%s: trained with GELU %s; llm.c computes the tanh form" % (src, metadata["dp.gelu"]))
    Vp = int(metadata.get("llmc.padded_vocab", Vp))
    expected = layout(maxT, V, L, NH, C, Vp)
    out = []
    for name, shape in expected:
        if name not in tensors:
            raise Refused("%s: no tensor '%s'" % (src, name))
        if tensors[name][0] != shape:
            raise Refused("%s: '%s' has shape %s, llm.c's layout needs %s" % (src, name, tensors[name][0], shape))
        check_finite(name, tensors[name][1])
        out.append(tensors[name][1])
    extra = sorted(set(tensors) - {n for n, _ in expected})
    if extra:
        raise Refused("%s: tensor '%s' has no place in llm.c's GPT-2" % (src, extra[0]))
    header = [0] * HEADER_INTS
    header[:8] = [MODEL_MAGIC, 3, maxT, V, L, NH, C, Vp]
    write_atomically(dst, [struct.pack("<256i", *header)] + out)


def write_tokens(path, tokens):
    header = [0] * HEADER_INTS
    header[:3] = [TOKENS_MAGIC, 1, len(tokens)]
    write_atomically(path, [struct.pack("<256i", *header), struct.pack("<%dH" % len(tokens), *tokens)])


def tokens_of_text(src, dst):
    check_output(dst)
    with open(src, "rb") as f:
        data = f.read()
    if len(data) < 2:
        raise Refused("%s: %d bytes hold no token and its successor" % (src, len(data)))
    write_tokens(dst, list(data))


# ---- parity and speed against train_gpt2.c

SMALL = dict(context=64, layers=4, heads=4, width=128, vocab=256)
LARGE = dict(context=64, layers=6, heads=6, width=384, vocab=256)


def dp_bin(name, variable):
    for candidate in (os.environ.get(variable), os.path.join(HERE, "..", "build", "bin", name),
                      os.path.join(HERE, "..", "build-sim", "bin", name)):
        if candidate and os.access(candidate, os.X_OK):
            return os.path.abspath(candidate)
    raise Refused("no %s: build dp first (scripts/setup.sh) or set %s" % (name, variable))


def dp_train_bin():
    return dp_bin("dp_train", "DP_TRAIN")


def flops_per_token(size):
    """A token's FLOPs in a training step, forward and backward, as dp's registry counts them (its
    GEMMs and the attention's products): dp_bench's gemm_flops_per_sample over the sample's tokens."""
    with tempfile.TemporaryDirectory() as work:
        report = os.path.join(work, "bench.json")
        subprocess.run([dp_bin("dp_bench", "DP_BENCH"), "--backend", "sim", "--models", "gpt", "--modes", "single",
                        "--devices", "1", "--batch-size", "1", "--steps", "1", "--warmup", "0", "--gelu", "tanh",
                        "--json", report] + shape_flags(size), check=True, stdout=subprocess.DEVNULL)
        with open(report) as f:
            run = json.load(f)["runs"][0]
    return run["gemm_flops_per_sample"] / run["tokens_per_sample"]


def attainable_gflops(threads):
    """The cores' fp32 ceiling, measured rather than assumed (a VM reports no clock it can be held
    to): dp_microbench's 512 x 512 GEMM (OpenBLAS, one thread each) on `threads` devices at once,
    summed over them."""
    out = subprocess.run([dp_bin("dp_microbench", "DP_MICROBENCH"), "--backend", "sim", "--devices", str(threads),
                          "--reps", "20", "--copy-mib", "1", "--allreduce-max-mib", "1", "--allreduce-iters", "1"],
                         check=True, capture_output=True, text=True).stdout
    line = re.search(r"^square 512\s+(.*)$", out, re.M)
    if not line:
        raise Refused("dp_microbench printed no 'square 512' row")
    return float(line.group(1).split()[-1]) * threads  # with several devices the last column: all at once


def shape_flags(size):
    return [x for k, v in size.items() for x in ("--" + k, str(v))]


def gpt_flags(size):
    return ["--model", "gpt", "--gelu", "tanh"] + shape_flags(size)


def make_files(work, size, text, steps):
    """The text's bytes as both token shards where train_gpt2.c looks for them (enough for `steps`
    batches of 4 x T without wrapping around: llm.c reshuffles then), and dp's initial GPT as its
    gpt2_124M.bin."""
    shards = os.path.join(work, "dev/data/tinyshakespeare")
    os.makedirs(shards, exist_ok=True)
    with open(text, "rb") as f:
        data = list(f.read())
    need = steps * 4 * size["context"] + 1
    while len(data) < need:
        data += data
    for split in ("train", "val"):
        write_tokens(os.path.join(shards, "tiny_shakespeare_%s.bin" % split), data[:need])
    init = os.path.join(work, "init.safetensors")
    # One step at learning rate 0 leaves dp's initialisation (of --seed's default) as it is.
    subprocess.run([dp_train_bin(), "--backend", "sim", "--tokens", os.path.join(shards, "tiny_shakespeare_train.bin"),
                    "--steps", "1", "--lr", "0", "--no-eval", "--save", init] + gpt_flags(size),
                   check=True, stdout=subprocess.DEVNULL)
    to_llmc(init, os.path.join(work, "gpt2_124M.bin"))


def median(values):
    values = sorted(values)
    return values[len(values) // 2]


def llmc_losses(binary, work, threads):
    """train_gpt2.c's losses, and its median step's seconds (its own "took" timings)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run([binary], cwd=work, env=env, capture_output=True, text=True, check=True).stdout
    steps = re.findall(r"step \d+: train loss ([-0-9.e]+) \(took ([0-9.]+) ms\)", out)
    return [float(loss) for loss, _ in steps], median([float(ms) for _, ms in steps[1:]]) / 1000


def dp_losses(work, size, steps, extra):
    metrics = os.path.join(work, "dp.json")
    if os.path.exists(metrics):
        os.unlink(metrics)
    cmd = [dp_train_bin(), "--init", os.path.join(work, "gpt2_124M.bin"), "--tokens",
           os.path.join(work, "dev/data/tinyshakespeare/tiny_shakespeare_train.bin"), "--batch-size", "4",
           "--steps", str(steps), "--optimizer", "adamw", "--lr", "1e-4", "--beta1", "0.9", "--beta2", "0.999", "--eps", "1e-8",
           "--weight-decay", "0", "--no-eval", "--log-every", "1", "--metrics-json", metrics] + extra
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(metrics) as f:
        records = [json.loads(line) for line in f if '"kind":"step"' in line.replace(" ", "")]
    # The median step's seconds, from each logged step's samples/s (4 samples a step).
    return [r["loss"] for r in records], median([4.0 / r["samples_per_s"] for r in records[1:]])


def build_llmc(llmc_dir):
    """train_gpt2 built by llm.c's own Makefile in the user's checkout; None without one."""
    if not llmc_dir or not os.path.isfile(os.path.join(llmc_dir, "train_gpt2.c")):
        return None
    subprocess.run(["make", "train_gpt2"], cwd=llmc_dir, check=True, stdout=subprocess.DEVNULL)
    return os.path.join(os.path.abspath(llmc_dir), "train_gpt2")


def golden(llmc_dir, text, out_dir):
    """tests/golden/llmc: the small GPT's token shard and train_gpt2.c's 41 losses on it (steps 0..40)
    from dp's initialisation: what dp_train must reproduce without llm.c at hand."""
    binary = build_llmc(llmc_dir)
    if not binary:
        raise Refused("no llm.c checkout at %r (train_gpt2.c)" % llmc_dir)
    with tempfile.TemporaryDirectory() as work:
        make_files(work, SMALL, text, 41)
        losses, _ = llmc_losses(binary, work, os.cpu_count() or 1)
        os.makedirs(out_dir, exist_ok=True)
        shutil.copyfile(os.path.join(work, "dev/data/tinyshakespeare/tiny_shakespeare_train.bin"),
                        os.path.join(out_dir, "tokens.bin"))
    commit = subprocess.run(["git", "-C", llmc_dir, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    with open(os.path.join(out_dir, "train_gpt2_losses.json"), "w") as f:
        json.dump({"model": SMALL, "batch": 4, "optimizer": "AdamW lr 1e-4 betas 0.9,0.999 eps 1e-8 wd 0",
                   "llm.c": commit or "unknown", "losses": losses}, f, indent=1)
        f.write("\n")
    print("llmc.py golden: %d losses into %s" % (len(losses), out_dir))
    return 0


def parity(llmc_dir, text):
    binary = build_llmc(llmc_dir)
    if not binary:
        print("llmc.py parity: no llm.c checkout at %r (train_gpt2.c): skipped" % llmc_dir)
        return 0
    threads = os.cpu_count() or 1
    steps = 41
    for label, size in (("small", SMALL), ("10.8M", LARGE)):
        with tempfile.TemporaryDirectory() as work:
            make_files(work, size, text, steps)
            reference, llmc_s = llmc_losses(binary, work, threads)
            ours, dp_s = dp_losses(work, size, len(reference), ["--backend", "sim"])
            gap = max(abs(a - b) for a, b in zip(reference, ours))
            print("%s GPT (L%d NH%d C%d): %d steps, largest |dp - llm.c| train loss %.3g" %
                  (label, size["layers"], size["heads"], size["width"], len(reference), gap))
            for i, (a, b) in enumerate(zip(reference, ours)):
                print("  step %2d  llm.c %.6f  dp %.6f" % (i, a, b))
            # Alternating runs, each side's median step: llm.c's own timing, dp's from its step log.
            llmc_times, single, ddp = [llmc_s], [dp_s], []
            for _ in range(2):
                ddp.append(dp_losses(work, size, len(reference), ["--backend", "sim", "--mode", "ddp", "--devices",
                                                                  str(threads), "--batch-size", str(4 // threads)])[1]
                           if 4 % threads == 0 else float("nan"))
                llmc_times.append(llmc_losses(binary, work, threads)[1])
                single.append(dp_losses(work, size, len(reference), ["--backend", "sim"])[1])
            tokens = 4 * size["context"]
            a, b, c = tokens / median(llmc_times), tokens / median(single), tokens / median(ddp)
            print("  tokens/s (median step of 3 alternating runs): llm.c %.0f (OMP_NUM_THREADS=%d), dp single %.0f "
                  "(%.2fx), dp ddp over %d sim devices %.0f (%.2fx)" % (a, threads, b, b / a, threads, c, c / a))
            per_token, peak = flops_per_token(size), attainable_gflops(threads)
            share = lambda rate: 100.0 * rate * per_token / 1e9 / peak
            print("  of the %d cores' fp32 GEMM ceiling (%.0f GFLOP/s, dp_microbench; %.1f MFLOP a token): llm.c "
                  "%.0f %%, dp single %.0f %%, dp ddp %.0f %%" % (threads, peak, per_token / 1e6, share(a), share(b),
                                                                  share(c)))
    return 0


def main(argv):
    usage = __doc__.split("\n\n")[1]
    try:
        if len(argv) == 4 and argv[1] == "to-safetensors":
            to_safetensors(argv[2], argv[3])
        elif len(argv) >= 4 and argv[1] == "to-llmc":
            to_llmc(argv[2], argv[3])
        elif len(argv) == 4 and argv[1] == "tokens":
            tokens_of_text(argv[2], argv[3])
        elif len(argv) == 5 and argv[1] == "golden":
            return golden(argv[2], argv[3], argv[4])
        elif len(argv) in (3, 4) and argv[1] == "parity":
            return parity(argv[2], argv[3] if len(argv) == 4 else os.path.join(HERE, "..", "README.md"))
        else:
            print(usage, file=sys.stderr)
            return 2
    except (Refused, OSError) as e:
        print("llmc.py: %s" % e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
