"""The group's all-reduce paths and the vocab-parallel logits gather: against plain sums and concatenation
of every rank's fresh random inputs (gloo on CPU; symmetric memory and NCCL where two GPUs exist)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import free_port

from raysparse.all_reduce import make_all_reduce
from raysparse.tensor_parallel import all_gather_last_fn, shard_range


def test_bad_modes_are_refused():
    with pytest.raises(ValueError, match="all-reduce mode"):
        make_all_reduce("cpu", torch.float32, 8, mode="fast")
    with pytest.raises(ValueError, match="needs CUDA"):
        make_all_reduce("cpu", torch.float32, 8, mode="symm_mem")


def _inputs(world: int, seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen).to(dtype) for _ in range(world)]


def _worker(rank: int, world: int, port: int, seed: int, vocab: int, device: str, mode: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    reduce, path = make_all_reduce(dev, dtype, 64, mode=mode)
    results: dict[str, object] = {"path": path}
    sums = []
    for i, shape in enumerate(((1, 64), (3, 64), (2, 5, 64), (4, 4096))):
        xs = _inputs(world, seed + i, shape, dtype)
        if device == "cuda" and torch.cuda.is_available():  # also inside a captured graph, back to back
            x = xs[rank].to(dev)
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                reduce(x.clone())
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(g):
                y = [reduce(x) for _ in range(3)]
            g.replay()
            torch.cuda.synchronize()
            sums.append([t.float().cpu() for t in y])
        else:
            sums.append([reduce(xs[rank].clone().to(dev)).float().cpu()])
    results["sums"] = sums
    sizes = [hi - lo for lo, hi in (shard_range(vocab, r, world) for r in range(world))]
    lo, hi = shard_range(vocab, rank, world)
    full = _inputs(1, seed + 99, (3, vocab), dtype)[0]
    results["gathered"] = all_gather_last_fn(sizes, None)(full[:, lo:hi].to(dev).contiguous()).float().cpu()
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def _check(world: int, device: str, mode: str, tmp_path) -> str:
    seed, vocab = int(torch.randint(0, 10_000, ())), 97  # an odd vocabulary: an uneven split
    out = str(tmp_path / "ar.pt")
    mp.spawn(_worker, args=(world, free_port(), seed, vocab, device, mode, out), nprocs=world, join=True)
    res = torch.load(out)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for i, (shape, got) in enumerate(zip(((1, 64), (3, 64), (2, 5, 64), (4, 4096)), res["sums"], strict=True)):
        xs = _inputs(world, seed + i, shape, dtype)
        want = xs[0].float()
        for x in xs[1:]:
            want = (want + x.float()).to(dtype).float()  # two ranks: one rounding, the same on any path
        for y in got:
            assert y.shape == want.shape and torch.isfinite(y).all()
            assert torch.allclose(y, want, atol=1e-6 if device == "cpu" else 0.0, rtol=0.0)
    full = _inputs(1, seed + 99, (3, vocab), dtype)[0].float()
    assert torch.equal(res["gathered"], full)
    return res["path"]


def test_gloo_reduce_and_uneven_logits_gather(tmp_path):
    assert _check(2, "cpu", "auto", tmp_path) == "gloo"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("mode", ["nccl", "symm_mem"])
def test_two_gpus_reduce_in_graphs_and_gather(mode, tmp_path):
    assert _check(2, "cuda", mode, tmp_path) == mode


def _fused_worker(rank: int, world: int, port: int, seed: int, out: str) -> None:
    from raysparse.all_reduce import make_all_reduce, make_reduce_norm
    from raysparse.layers import RMSNorm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    hidden, dtype = 256, torch.bfloat16
    reduce, path = make_all_reduce(dev, dtype, hidden, mode="symm_mem")
    fused = make_reduce_norm(reduce, path, dev, dtype, hidden, max_rows=16)
    if fused is None:  # the same decision on every rank
        if rank == 0:
            torch.save({"fused": False, "checks": []}, out)
        dist.destroy_process_group()
        return
    gen = torch.Generator(device=dev).manual_seed(seed + rank)
    norm = RMSNorm(hidden, 1e-5).to(device=dev, dtype=dtype)
    norm.weight.data.copy_(torch.randn(hidden, device=dev))
    dist.broadcast(norm.weight.data, 0)
    checks = []
    for rows in (1, 7, 16, 40):  # 40 rows: more than the fused kernel takes, the unfused path
        xs = [torch.randn(rows, hidden, generator=gen, device=dev).to(dtype) for _ in range(4)]
        r = torch.randn(rows, hidden, generator=gen, device=dev).to(dtype)
        dist.broadcast(r, 0)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fused(xs[0].clone(), r, norm)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            got = [fused(x, r, norm) for x in xs]
        g.replay()
        want = [norm.add_forward(reduce(x.clone()), r) for x in xs]
        torch.cuda.synchronize()
        checks.append(all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want, strict=True)))
    if rank == 0:
        torch.save({"fused": fused is not None, "checks": checks}, out)
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_fused_reduce_add_norm_equals_unfused(tmp_path):
    out = str(tmp_path / "fused.pt")
    mp.spawn(_fused_worker, args=(2, free_port(), int(torch.randint(0, 10_000, ())), out), nprocs=2, join=True)
    res = torch.load(out)
    assert res["fused"] and all(res["checks"])
