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
    with pytest.raises(ValueError, match="RAYSPARSE_ALLREDUCE"):
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
