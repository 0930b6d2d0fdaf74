#!/usr/bin/python3
"""nanoGPT's GPT (Karpathy's model.py, bias=True, dropout 0, the manual attention path) in PyTorch, and
what dp's byte-level recipe does with it, for the comparison in docs/transformer.md:

    scripts/nanogpt.py train --text FILE [--context 64 --layers 4 --heads 4 --width 128 --steps 2000
                             --batch-size 32 --lr 1e-3 --warmup-steps 100 --weight-decay 0.1 --seed 0]
        trains the model on this CPU as `dp_train --model gpt --text FILE --optimizer adamw
        --schedule cosine --decay matrices` trains it (the same corpus, split, windows, model,
        initialisation's distribution, optimizer groups and schedule; torch's own random numbers),
        and prints the held-out bits per byte. `--processes N` trains under DistributedDataParallel
        over N gloo processes on this host (each --threads threads, its slice of the global batch).
    scripts/nanogpt.py check CKPT --text FILE [--context 64 ...]
        loads a dp checkpoint into the torch GPT with strict=True and prints its held-out loss and
        bits per byte, to set beside `dp_train --eval-only --init CKPT`.

The data, as dp's (dp/io/text.h): the file's bytes are the tokens, the last 10 % held out
(split = n - n // 10); training windows of context + 1 bytes at random offsets of the first part;
the held-out part cut into disjoint windows, every byte after the first predicted once.
"""
import argparse
import datetime
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


class CausalSelfAttention(torch.nn.Module):
    """nanoGPT's (model.py), without dropout and without flash attention: the manual path."""

    def __init__(self, c, h):
        super().__init__()
        self.c_attn = torch.nn.Linear(c, 3 * c)
        self.c_proj = torch.nn.Linear(c, c)
        self.n_head, self.n_embd = h, c

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(torch.tril(torch.ones(t, t)).view(1, 1, t, t) == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


class MLP(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc = torch.nn.Linear(c, 4 * c)
        self.gelu = torch.nn.GELU()
        self.c_proj = torch.nn.Linear(4 * c, c)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(torch.nn.Module):
    def __init__(self, c, h):
        super().__init__()
        self.ln_1 = torch.nn.LayerNorm(c)
        self.attn = CausalSelfAttention(c, h)
        self.ln_2 = torch.nn.LayerNorm(c)
        self.mlp = MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(torch.nn.Module):
    def __init__(self, vocab, context, width, layers, heads):
        super().__init__()
        self.transformer = torch.nn.ModuleDict(dict(
            wte=torch.nn.Embedding(vocab, width),
            wpe=torch.nn.Embedding(context, width),
            h=torch.nn.ModuleList([Block(width, heads) for _ in range(layers)]),
            ln_f=torch.nn.LayerNorm(width)))
        self.lm_head = torch.nn.Linear(width, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as nanoGPT

    def forward(self, idx):
        t = idx.size(1)
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(t))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def gpt2_init(model, layers):
    """nanoGPT's _init_weights, then the residual projections' scaled normals."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, torch.nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight"):
            torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))


def param_groups(model, weight_decay):
    """nanoGPT's configure_optimizers: weight decay on the matrices, none on biases and norm weights."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def read_text(path, context):
    with open(path, "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
    split = len(data) - len(data) // 10
    return data[:split], data[split:]


def held_out_loss(model, held_out, context, batch=64):
    """The mean cross-entropy over every predicted byte of the held-out windows (nats per byte)."""
    windows = (len(held_out) - 1) // context
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for first in range(0, windows, batch):
            starts = torch.arange(first, min(windows, first + batch)) * context
            x = torch.stack([held_out[s:s + context] for s in starts])
            y = torch.stack([held_out[s + 1:s + 1 + context] for s in starts])
            logits = model(x)
            total += float(F.cross_entropy(logits.view(-1, logits.size(-1)).double(), y.view(-1),
                                           reduction="sum"))
            count += y.numel()
    model.train()
    return total / count


def lr_at(step, args):
    """dp_train's --warmup-steps W then --schedule cosine over the remaining steps (eta_min 0)."""
    if args.warmup_steps > 0 and step < args.warmup_steps:
        start = args.lr / args.warmup_steps
        return start + (args.lr - start) * step / args.warmup_steps
    t_max = max(1, args.steps - max(0, args.warmup_steps))
    return args.lr * (1 + math.cos(math.pi * (step - max(0, args.warmup_steps)) / t_max)) / 2


def train(args):
    """nanoGPT's training loop on one process, or under DistributedDataParallel over --processes
    gloo processes on this host (PyTorch's best CPU setup: one process per core, --threads each):
    every rank draws the same global batch and trains on its slice of it, so the global batch and
    the averaged gradient are the single process's."""
    if args.processes < 1 or args.threads < 1:
        raise ValueError("--processes and --threads take a count of at least 1")
    if args.batch_size % args.processes:
        raise ValueError(f"--batch-size {args.batch_size} does not split over --processes {args.processes}")
    if args.processes == 1:
        train_rank(0, args, None)
        return
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(train_rank, args=(args, port), nprocs=args.processes, join=True)


def train_rank(rank, args, port):
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    train_part, held_out = read_text(args.text, args.context)
    model = GPT(256, args.context, args.width, args.layers, args.heads)
    gpt2_init(model, args.layers)
    trained = model
    if port is not None:
        # A rank that stops answering ends the others' collectives within a minute, not gloo's 30.
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.processes,
                                timeout=datetime.timedelta(seconds=60))
        trained = torch.nn.parallel.DistributedDataParallel(model)
    per_rank = args.batch_size // args.processes
    optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(args.beta1, args.beta2),
                                  eps=1e-8)
    began = time.time()
    interval_began, interval_first = began, 0
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        starts = torch.randint(len(train_part) - args.context, (args.batch_size,))
        starts = starts[rank * per_rank:(rank + 1) * per_rank]
        x = torch.stack([train_part[s:s + args.context] for s in starts])
        y = torch.stack([train_part[s + 1:s + 1 + args.context] for s in starts])
        logits = trained(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            # The global batch's loss (the ranks' slices averaged), and the rate since the last line.
            shown = loss.detach().clone()
            if port is not None:
                dist.all_reduce(shown)
                shown /= args.processes
            now = time.time()
            if rank == 0:
                print(f"step {step + 1:6d} loss {float(shown):.6f} lr {lr_at(step, args):.3g} "
                      f"{(step + 1 - interval_first) * args.batch_size / (now - interval_began):.1f} samples/s",
                      flush=True)
            interval_began, interval_first = now, step + 1
    if rank == 0:
        print(f"torch: {args.steps} steps in {time.time() - began:.1f} s", flush=True)
    if port is not None:
        dist.destroy_process_group()
    if args.no_eval or rank != 0:
        return
    loss = held_out_loss(model, held_out, args.context)
    print(f"torch: held-out loss {loss:.6f}, {loss / math.log(2):.4f} bits/byte")


def check(args):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from dp_checkpoint import load
    torch.set_num_threads(args.threads)
    _, held_out = read_text(args.text, args.context)
    model = GPT(256, args.context, args.width, args.layers, args.heads)
    model.load_state_dict(load(args.checkpoint), strict=True)
    loss = held_out_loss(model, held_out, args.context)
    print(f"torch: {args.checkpoint} loaded with strict=True: held-out loss {loss:.6f}, "
          f"{loss / math.log(2):.4f} bits/byte")


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["train", "check"])
    parser.add_argument("checkpoint", nargs="?")
    parser.add_argument("--text", required=True)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--beta1", type=float, default=0.9)
    parser.add_argument("--beta2", type=float, default=0.999)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--processes", type=int, default=1,
                        help="train: DistributedDataParallel over this many gloo processes on this host")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--no-eval", action="store_true", help="train: skip the held-out evaluation")
    args = parser.parse_args(argv)
    try:
        if args.command == "check":
            if not args.checkpoint:
                parser.error("check takes the dp checkpoint to load")
            check(args)
        else:
            train(args)
    except (ValueError, OSError, RuntimeError) as e:
        # What dp refuses (a malformed or hostile checkpoint, one of another shape, an unreadable
        # text) is a message and exit 2, as dp_train's, not a traceback.
        print(f"nanogpt.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
