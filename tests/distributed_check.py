"""An independent check of `trainmem audit --nproc N --json` with PyTorch's
own DistributedDataParallel (Python, Gloo on loopback).

Each Python rank trains the same transformer (bench/compare/torch_side.py) on
its shard of the batch under DDP, measures what autograd saves with a
storage-deduplicating saved_tensors_hooks meter (parameters excluded, as
trainmem's meter does) and reads the bytes of DDP's bucket buffers from its
reducer. The figures must equal trainmem's per-rank figures exactly.

usage: distributed_check.py TRAINMEM_JSON NPROC LAYERS D_MODEL HEADS BATCH SEQ_LEN STEPS [--view] [--bucket-cap-mb X]
Prints "distributed check ok" and the figures, or fails with both numbers.
"""

import json
import os
import queue
import socket
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "compare"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch_side import Meter, Transformer  # noqa: E402


def rank_main(rank, world, port, cfg, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Transformer(cfg["layers"], cfg["d_model"], cfg["heads"])
    ddp = DDP(model, gradient_as_bucket_view=cfg["view"], bucket_cap_mb=cfg["bucket_cap_mb"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1)
    x = torch.randn(cfg["batch"], cfg["seq_len"], cfg["d_model"]).chunk(world)[rank].clone()
    saved = []
    for _ in range(cfg["steps"]):
        opt.zero_grad()
        meter = Meter(model)
        with meter.hooks():
            loss = ddp(x).pow(2).mean()
        loss.backward()
        opt.step()
        saved.append(meter.saved_bytes)
    # Buffers shaped like the reducer's buckets (PyTorch exposes these, not the buckets themselves).
    buckets = [b.buffer().numel() * b.buffer().element_size() for b in ddp.reducer._get_zeros_like_grad_buckets()]
    out.put((rank, saved, buckets))
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    argv = sys.argv[1:]
    bucket_cap_mb = None  # DDP's default (25 MiB, a 1 MiB first bucket)
    if "--bucket-cap-mb" in argv:
        i = argv.index("--bucket-cap-mb")
        bucket_cap_mb = float(argv[i + 1])
        del argv[i:i + 2]
    args = [a for a in argv if a != "--view"]
    path = args[0]
    world, layers, d_model, heads, batch, seq_len, steps = (int(a) for a in args[1:8])
    cfg = dict(layers=layers, d_model=d_model, heads=heads, batch=batch, seq_len=seq_len, steps=steps,
               view="--view" in sys.argv, bucket_cap_mb=bucket_cap_mb)
    with open(path) as f:
        doc = json.load(f)
    assert doc["schema"] == "trainmem-distributed/1", doc["schema"]
    assert doc["world_size"] == world and len(doc["ranks"]) == world, (doc["world_size"], len(doc["ranks"]))

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, cfg, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + 300
    while len(results) < world:
        # A rank that dies must end the check now, not after the queue's timeout.
        try:
            rank, saved, buckets = out.get(timeout=1)
            results[rank] = (saved, buckets)
            continue
        except queue.Empty:
            pass
        dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if dead or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            sys.exit(f"distributed check failed: Python rank(s) {dead} exited with "
                     f"{[procs[r].exitcode for r in dead]}" if dead else "distributed check failed: timed out")
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, f"a Python rank exited with {p.exitcode}"

    for r in range(world):
        saved, buckets = results[r]
        mine = doc["ranks"][r]
        steps_saved = [s["saved_activation_bytes"] for s in mine["report"]["steps"]]
        assert steps_saved == saved, f"rank {r}: trainmem saved {steps_saved} B, PyTorch DDP {saved} B"
        assert mine["communication_bytes"] == sum(buckets), \
            f"rank {r}: trainmem buckets {mine['communication_bytes']} B, PyTorch DDP {sum(buckets)} B ({buckets})"
        assert mine["bucket_bytes"] == buckets, \
            f"rank {r}: trainmem bucket sizes {mine['bucket_bytes']}, PyTorch DDP {buckets}"
        print(f"rank {r}: saved per step {saved} B, DDP buckets {buckets} B: equal")
    print("distributed check ok")


if __name__ == "__main__":
    main()
