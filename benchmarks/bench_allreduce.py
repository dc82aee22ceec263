"""Latency and correctness of the tensor-parallel all-reduce of one decode token's hidden state, inside a
CUDA graph, and of the vocab-parallel head's logits all-gather.

A decode step of an L-layer model does 2L all-reduces of [batch, hidden] bf16; at batch 1 they are
latency-bound. Compares NCCL (torch.distributed) with ``raysparse.all_reduce.SymmMemAllReduce`` (PyTorch's
symmetric-memory one-shot kernel), each captured 64 times in one graph on 64 different per-rank random
inputs, replayed, and checked against NCCL's results of the same inputs (exactly, at two ranks).

Usage (the GPU machine, two GPUs): python benchmarks/bench_allreduce.py [--hidden 4096] [--batch 1,8]
    [--vocab 128256] [--out results.json]
Prints microseconds per call for each path and the largest error.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPS = 64


def _graph(fn, xs: list[torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for x in xs[:3]:
            fn(x.clone())
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [fn(x) for x in xs]
    return g, outs


def _time(g: torch.cuda.CUDAGraph, calls: int) -> float:
    for _ in range(3):
        g.replay()
    dist.barrier()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        g.replay()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t) / (20 * calls)


def worker(rank: int, world: int, port: int, hidden: int, batch: int, vocab: int, out: str) -> None:
    from raysparse.all_reduce import SymmMemAllReduce, collective_all_reduce
    from raysparse.tensor_parallel import all_gather_last_fn, shard_range

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    gen = torch.Generator(device="cuda").manual_seed(100 + rank)
    src = [torch.randn(batch, hidden, device="cuda", generator=gen).bfloat16() for _ in range(REPS)]
    res: dict[str, object] = {"hidden": hidden, "batch": batch}
    nccl = collective_all_reduce(None)
    xs = [x.clone() for x in src]
    g, outs = _graph(nccl, xs)
    g.replay()
    ref = [o.clone() for o in outs]
    res["nccl_us"] = _time(g, REPS)
    try:
        symm = SymmMemAllReduce(None, torch.device("cuda", rank), (torch.bfloat16, torch.float32))
        xs = [x.clone() for x in src]
        g, outs = _graph(symm, xs)
        for _ in range(2):  # a replay after a replay: the buffer is reused across graphs too
            g.replay()
        torch.cuda.synchronize()
        errs = [float((o.float() - r.float()).abs().max()) for o, r in zip(outs, ref, strict=True)]
        res["symm_mem_max_err"] = max(errs)
        res["symm_mem_us"] = _time(g, REPS)
    except Exception as e:  # noqa: BLE001 - report what is unavailable
        res["symm_mem_error"] = f"{type(e).__name__}: {e}"[:300]
    try:  # all-reduce + residual add + RMSNorm: fused (one launch) against the two-launch path
        from raysparse.all_reduce import make_reduce_norm
        from raysparse.layers import RMSNorm

        norm = RMSNorm(hidden, 1e-5).to(device="cuda", dtype=torch.bfloat16)
        fused = make_reduce_norm(symm, "symm_mem", torch.device("cuda", rank), torch.bfloat16, hidden)
        res["fused_norm"] = fused is not None
        resid = torch.randn(batch, hidden, device="cuda").bfloat16()
        dist.broadcast(resid, 0)
        for name, fn in (("symm_mem_then_norm_us", lambda t: norm.add_forward(symm(t), resid)[0]),
                         ("fused_norm_us", (lambda t: fused(t, resid, norm)[0]) if fused else None)):
            if fn is not None:
                g, outs = _graph(fn, [x.clone() for x in src])
                g.replay()
                res[name] = _time(g, REPS)
                if name == "symm_mem_then_norm_us":
                    unfused = [o.clone() for o in outs]
                else:
                    res["fused_norm_max_err"] = max(float((o.float() - u.float()).abs().max())
                                                    for o, u in zip(outs, unfused, strict=True))
    except Exception as e:  # noqa: BLE001 - report what is unavailable
        res["fused_norm_error"] = f"{type(e).__name__}: {e}"[:300]
    sizes = [hi - lo for lo, hi in (shard_range(vocab, r, world) for r in range(world))]
    gather = all_gather_last_fn(sizes, None)
    part = torch.randn(batch, sizes[rank], device="cuda").bfloat16()
    g, outs = _graph(gather, [part] * 8)
    res["gather_logits_us"] = _time(g, 8)
    if rank == 0:
        print(json.dumps(res), flush=True)
        with open(out, "a") as f:
            f.write(json.dumps(res) + "\n")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--out", default="bench_allreduce.jsonl")
    args = ap.parse_args()
    for b in (int(x) for x in args.batch.split(",")):
        mp.spawn(worker, args=(2, 29511 + b, args.hidden, b, args.vocab, args.out), nprocs=2, join=True)


if __name__ == "__main__":
    main()
