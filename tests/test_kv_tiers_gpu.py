"""The K/V tiers on a GPU (skipped without one): the host tier in pinned host memory, the method state and the device
pools on the GPU, and greedy tokens through the tiers equal to those without them for streaming, Quest,
Sketch&Walk and SOCKET at TP=1, with a device pool smaller than one sequence's K/V, on ragged batches.

Both runs take the same scheduler plans (the tiered run's admission, which the pool's pins bound), so the only
difference is the tier: the same kernels read the same keys through another page table."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU form of the K/V tiers needs CUDA")

GPU_METHODS = ["streaming", "quest", "sketch_walk", "socket"]


def _run(model, method: str, seed: int, tiered: bool, dtype: torch.dtype, fetch: str = "pages",
         graphs: bool = False):
    """``graphs``: decode steps replay from captured CUDA graphs, in the graph test's admission and lengths."""
    import dataclasses

    from test_kv_tiers_engine import (
        GRAPH_LENS,
        GRAPH_OFFLOAD,
        HOST_TOKENS,
        LENS,
        OFFLOAD,
        PAGE,
        drive,
        requests,
        scheduler_config,
    )

    from raysparse.decode_graphs import DecodeGraphs
    from raysparse.kv_cache import KVCache
    from raysparse.shard_executor import ShardExecutor

    admit, lens = (GRAPH_OFFLOAD, GRAPH_LENS) if graphs else (OFFLOAD, LENS)
    offload = dataclasses.replace(admit, fetch=fetch) if tiered else None
    cache = KVCache(model.cfg, HOST_TOKENS // PAGE, PAGE, dtype, "cuda", model.num_kv_heads, offload=offload)
    ex = ShardExecutor(model, cache, graphs=DecodeGraphs(model, cache, 8) if graphs else None, offload=offload)
    assert ex.use_graphs == graphs
    tokens = drive(ex, scheduler_config(admit), requests(method, seed, lens))  # the tiered admission for both
    stats = ex.stats()
    if graphs:
        assert stats["graphs"]["replays"] > 0 and stats["graphs"]["captures"] > 0, stats["graphs"]
    return tokens, stats.get("kv_offload"), cache


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def gpu_model(request):
    from test_kv_tiers_engine import tiny

    from raysparse.loader import model_from_state

    seed = int(torch.randint(0, 2**31 - 1, ()))
    print(f"weights seed {seed}")
    cfg, state = tiny(seed)
    return model_from_state(cfg, state, dtype=request.param, device="cuda").eval(), request.param


@pytest.mark.parametrize("fetch", ["pages", "rows"])
@pytest.mark.parametrize("method", GPU_METHODS)
def test_gpu_tokens_through_the_tiers_equal_the_one_tier_tokens(gpu_model, method, fetch):
    from test_kv_tiers_engine import LENS, NEW, PAGE

    model, dtype = gpu_model
    seed = int(torch.randint(0, 2**31 - 1, ()))
    with torch.no_grad():
        plain, none, _ = _run(model, method, seed, False, dtype)
        tiered, stats, cache = _run(model, method, seed, True, dtype, fetch)
    assert none is None and all(len(t) == NEW for t in plain)
    assert tiered == plain, f"{method} {dtype}: prompt seed {seed}"
    assert stats["device_slots"] * PAGE < min(LENS), "the pool is smaller than one sequence's K/V"
    assert stats["page_copies"] + stats["row_copies"] > 0 and stats["bytes_copied"] > 0, stats
    assert stats["prefill_kept_pages"] > 0 and stats["decode_steps"] > 0, stats
    assert stats["stall_s"] >= 0.0
    t = cache.tiers
    assert t is not None and t.separate


@pytest.mark.parametrize("method", GPU_METHODS)
def test_gpu_captured_steps_through_the_tiers_equal_those_without_them(gpu_model, method):
    """fetch="rows" decode steps replayed from CUDA graphs (the tier's host side before each replay, padded rows in
    the batch, new pages made resident between replays): the tokens of the captured steps without the tier."""
    from test_kv_tiers_engine import PAGE

    model, dtype = gpu_model
    seed = int(torch.randint(0, 2**31 - 1, ()))
    with torch.no_grad():
        plain, _, _ = _run(model, method, seed, False, dtype, graphs=True)
        tiered, stats, _ = _run(model, method, seed, True, dtype, "rows", graphs=True)
    assert tiered == plain, f"{method} {dtype}: prompt seed {seed}"
    assert stats["device_slots"] * PAGE < 470 and stats["row_copies"] > 0 and stats["staged_layer_rows"] > 0, stats
    assert stats["layer_steps"] > 0 and stats["decode_steps"] > 0, stats


def test_the_gpu_host_tier_is_pinned_host_memory(gpu_model):
    from test_kv_tiers_engine import HOST_TOKENS, OFFLOAD, PAGE

    from raysparse.kv_cache import KVCache

    model, dtype = gpu_model
    cache = KVCache(model.cfg, HOST_TOKENS // PAGE, PAGE, dtype, "cuda", model.num_kv_heads, offload=OFFLOAD)
    t = cache.tiers
    assert t is not None and t.separate and t.layers == OFFLOAD.tiered_layers(model.cfg.num_layers)
    for layer in range(model.cfg.num_layers):
        if layer in t.layers:
            for h in (t.host_k[layer], t.host_v[layer]):
                assert h.device.type == "cpu" and h.is_pinned() and h.shape == cache.shape
            assert t.dev_k[layer].is_cuda and t.dev_v[layer].is_cuda
            assert cache.k[layer] is t.work[0] and cache.k[layer].is_cuda and cache.v[layer].is_cuda
            assert not cache.device_whole(layer)
        else:  # kept whole on the device
            assert cache.k[layer].is_cuda and cache.k[layer].shape == cache.shape and cache.device_whole(layer)
    pool = cache.page_pool(("test",), (2,), torch.float32)  # the methods' per-page state stays on the GPU
    assert pool.is_cuda and pool.shape[0] == cache.num_pages + 1


def test_the_separate_layout_keeps_every_copy_right_on_the_gpu():
    from test_kv_tiers import check_separate_layout

    for fetch in ("pages", "rows", "pages", "rows"):
        check_separate_layout("cuda", fetch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_gpu_reads_rows_of_the_pinned_host_tier_in_place(dtype):
    """The row copy kernel with its sources in the host tier's registered (pinned) slab and in device memory, against
    the reference gathered on the host, every element."""
    from raysparse.kernels import row_copy
    from raysparse.kv_tiers import host_tier

    seed = int(torch.randint(0, 2**31 - 1, ()))
    g = torch.Generator().manual_seed(seed)
    hk, hv, slab = host_tier((33, 4, 16, 128), 2, dtype, pinned=True)
    assert slab.is_pinned()
    for t in (*hk, *hv):
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    n = 5000
    rows = hk[1].numel() // 128
    src = torch.randint(-1, rows, (n,), generator=g)
    dst = torch.randperm(3 * n, generator=g)[:n]
    dst[torch.rand(n, generator=g) < 0.1] = -1
    for pair_src in ((hk[1], hv[1]), (hk[1].cuda(), hv[1].cuda())):  # pinned host memory, then device memory
        got = [torch.zeros(3 * n, 128, dtype=dtype, device="cuda") for _ in range(2)]
        want = [torch.zeros(3 * n, 128, dtype=dtype) for _ in range(2)]
        row_copy.copy_rows(list(zip(pair_src, got, strict=True)), src.cuda(), dst.cuda())
        row_copy.copy_rows_torch([(hk[1], want[0]), (hv[1], want[1])], src, dst)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a.cpu(), b), f"seed {seed}, source on {pair_src[0].device}"
