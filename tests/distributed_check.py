"""An independent check of `trainmem audit --nproc N --json` with PyTorch's
own DistributedDataParallel (Python, Gloo on loopback).

Each Python rank trains the same transformer (bench/compare/torch_side.py) on
its shard of the batch under DDP, measures what autograd saves with a
storage-deduplicating saved_tensors_hooks meter (parameters excluded, as
trainmem's meter does) and reads the bytes of DDP's bucket buffers from its
reducer. The figures must equal trainmem's per-rank figures exactly.

usage: distributed_check.py TRAINMEM_JSON NPROC LAYERS D_MODEL HEADS BATCH SEQ_LEN STEPS [--view]
Prints "distributed check ok" and the figures, or fails with both numbers.
"""

import json
import os
import socket
import sys
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
    ddp = DDP(model, gradient_as_bucket_view=cfg["view"])
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
    buckets = [b.buffer().numel() * b.buffer().element_size() for b in ddp.reducer._get_grad_buckets()]
    out.put((rank, saved, buckets))
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    args = [a for a in sys.argv[1:] if a != "--view"]
    path = args[0]
    world, layers, d_model, heads, batch, seq_len, steps = (int(a) for a in args[1:8])
    cfg = dict(layers=layers, d_model=d_model, heads=heads, batch=batch, seq_len=seq_len, steps=steps,
               view="--view" in sys.argv)
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
    for _ in range(world):
        rank, saved, buckets = out.get(timeout=300)
        results[rank] = (saved, buckets)
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
