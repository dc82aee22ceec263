"""Latency of the tensor-parallel all-reduce of one decode token's hidden state, inside a CUDA graph.

A decode step of an L-layer model does 2L all-reduces of [batch, hidden] bf16; at batch 1 they are
latency-bound. Compares NCCL (torch.distributed) with PyTorch's symmetric-memory one-shot all-reduce
(peer-to-peer loads, no NCCL kernel), each captured 64 times in one graph and replayed.

Usage (the GPU machine, two GPUs): python benchmarks/bench_allreduce.py [--hidden 4096] [--batch 1]
Prints microseconds per all-reduce for each path.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPS = 64


def _time_graph(fn, x: torch.Tensor) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS):
            fn(x)
    for _ in range(3):
        g.replay()
    dist.barrier()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        g.replay()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t) / (20 * REPS)


def worker(rank: int, world: int, port: int, hidden: int, batch: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    x = torch.randn(batch, hidden, device="cuda", dtype=torch.bfloat16)
    res = {"nccl": _time_graph(lambda t: dist.all_reduce(t), x)}
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(batch, hidden, device="cuda", dtype=torch.bfloat16)
        symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
        buf.copy_(x)
        name = dist.group.WORLD.group_name
        out = torch.empty_like(buf)
        ref = buf.clone()
        dist.all_reduce(ref)
        torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", name, out)
        torch.cuda.synchronize()
        res["symm_mem_one_shot_err"] = float((out.float() - ref.float()).abs().max())
        one_shot = torch.ops.symm_mem.one_shot_all_reduce_out
        res["symm_mem_one_shot"] = _time_graph(lambda t: one_shot(t, "sum", name, out), buf)
    except Exception as e:  # noqa: BLE001 - report what is unavailable
        res["symm_mem_error"] = f"{type(e).__name__}: {e}"[:300]
    if rank == 0:
        print(f"hidden {hidden} batch {batch}: " + ", ".join(f"{k} {v:.2f} us" if isinstance(v, float) else f"{k} {v}"
                                                            for k, v in res.items()), flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--batch", default="1,8")
    args = ap.parse_args()
    for b in (int(x) for x in args.batch.split(",")):
        mp.spawn(worker, args=(2, 29511 + b, args.hidden, b), nprocs=2, join=True)


if __name__ == "__main__":
    main()
