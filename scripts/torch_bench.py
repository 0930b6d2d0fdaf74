#!/usr/bin/python3
"""dp_bench's PyTorch peer: training samples/s of the reference models (Debian's python3-torch, CPU),
as one process (--ranks 0) or DistributedDataParallel over gloo, one process of one thread per rank.
Prints one JSON line. scripts/compare_pytorch.py runs it beside dp_bench."""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

# The reference models with dp's state-dict names, as the golden files are made from them.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden"))
from make_goldens import MLP, ConvNet  # noqa: E402


def build(model, hidden):
    if model == "convnet":
        return ConvNet()
    if model == "mlp":
        return MLP([int(h) for h in hidden.split(",")])
    sys.exit(f"torch_bench: unknown model {model!r} (convnet, mlp)")


def seconds_for(model, optimizer, batch, steps, warmup):
    """Time of `steps` training steps after `warmup` untimed ones, on one fixed random batch."""
    x = torch.rand(batch, 1, 28, 28)
    y = torch.randint(0, 10, (batch,))
    start = None
    for i in range(warmup + steps):
        if i == warmup:
            start = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return time.perf_counter() - start


def rank_main(rank, args, results):
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    torch.manual_seed(0)
    # broadcast_buffers=False: dp_bench's peer runs are compared with --broadcast-buffers off.
    model = torch.nn.parallel.DistributedDataParallel(build(args.model, args.hidden), broadcast_buffers=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    elapsed = seconds_for(model, optimizer, args.batch, args.steps, args.warmup)
    if rank == 0:
        results.put(elapsed)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="convnet")
    ap.add_argument("--hidden", default="256,256", help="the MLP's hidden sizes")
    ap.add_argument("--ranks", type=int, default=2, help="0: one process, no DDP")
    ap.add_argument("--batch", type=int, default=64, help="per rank")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--port", type=int, default=29611)
    args = ap.parse_args()
    if args.ranks == 0:
        torch.set_num_threads(1)
        model = build(args.model, args.hidden)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        elapsed = seconds_for(model, optimizer, args.batch, args.steps, args.warmup)
        processes = 1
    else:
        import torch.multiprocessing as mp
        results = mp.get_context("spawn").SimpleQueue()
        mp.spawn(rank_main, args=(args, results), nprocs=args.ranks, join=True)
        elapsed = results.get()
        processes = args.ranks
    print(json.dumps({"peer": "pytorch-" + torch.__version__, "model": args.model, "ranks": args.ranks,
                      "batch_per_rank": args.batch,
                      "samples_per_s": processes * args.batch * args.steps / elapsed}))


if __name__ == "__main__":
    main()
