"""SOCKET's batched decode step on its kernels (``kernels/socket_step.py``: the group-reduced bucket distributions
and the per-row budgets; ``kernels/paged_collision.py``'s forced encoding) against the PyTorch forms, element by
element, and the step's selection against the PyTorch path and the per-sequence reference ``Socket.select_decode``,
on fresh random inputs (the seed is in every failure's message). Without a GPU the kernels run in Triton's
interpreter, so shapes stay small."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV  # before raysparse.kernels: without a GPU it picks the interpreter

from raysparse.config import ModelConfig
from raysparse.kernels.paged_collision import paged_collision, paged_collision_torch
from raysparse.kernels.socket_step import group_bucket_probs, step_budgets
from raysparse.kv_cache import KVCache
from raysparse.methods.base import DecodeView, SeqContext
from raysparse.methods.selection import SENTINEL
from raysparse.methods.socket import Socket, SocketConfig
from raysparse.methods.socket_batched import bucket_probs_torch, budget_rows, forced_lists

INF = float("inf")


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()))


def _ints(g: torch.Generator):
    return lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=g))  # inclusive


def _quarters(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Multiples of 1/4 in [-2, 2): every dot product of d <= 64 of them is exact in fp32 in any order (exact
    zeros included), so sign patterns, and so hard buckets, agree bit for bit across summation orders."""
    return torch.randint(-8, 8, shape, generator=g).float() / 4


def _rows(indices: torch.Tensor) -> list[list[int]]:
    return [[x for x in row if x != SENTINEL] for row in indices.tolist()]


# ---- the bucket distributions ---------------------------------------------------------------------------

@pytest.mark.parametrize("hard", [False, True])
@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_group_bucket_probs_match_the_torch_form(hard, reduce):
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    ri = _ints(g)
    for case in range(3):
        b, h_kv, grp, tables, d = ri(1, 3), ri(1, 2), ri(1, 5), ri(1, 3), (16, 24, 32)[ri(0, 2)]
        # case 1 holds 16 logits at a time: R > 16 buckets take the two-pass softmax over tiles of R
        planes, tile = (ri(5, 9), 16) if case == 1 else (ri(1, 9), 4096)
        tau = (0.2, 0.3, 1.0)[ri(0, 2)]
        dtype = (torch.float32, torch.bfloat16)[ri(0, 1)]
        if hard:
            w, q = _quarters(g, h_kv, tables, planes, d), _quarters(g, b, h_kv * grp, d)
        else:
            w, q = torch.randn(h_kv, tables, planes, d, generator=g), torch.randn(b, h_kv * grp, d, generator=g) * 2
        w, q = w.to(DEV), q.to(dtype).to(DEV)
        want = bucket_probs_torch(w, q, tau, hard, reduce)
        got = group_bucket_probs(w, q, tau, hard, reduce == "max", tile=tile)
        where = f"seed {seed} case {case}: B {b}, h_kv {h_kv}, g {grp}, L {tables}, P {planes}, d {d}, {dtype}"
        assert got.shape == want.shape == (b, h_kv, tables, 1 << planes) and got.dtype == torch.float32, where
        if hard:  # exact counts, the mean taken as the device's PyTorch takes it: bit for bit
            assert torch.equal(got, want), where
        else:  # sums in another order: fp32 rounding
            torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-7, msg=lambda m, w=where: f"{w}: {m}")


# ---- the collision scores in the list encoding -------------------------------------------------------------

def _table(g: torch.Generator, lens: list[int], page: int, width: int, pages: int) -> torch.Tensor:
    """Distinct random physical pages per row, the scratch page (``pages``) past each row's last page."""
    perm = torch.randperm(pages, generator=g)
    table = torch.full((len(lens), width), pages, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        m = -(-n // page)
        table[i, :m] = perm[used: used + m].to(torch.int32)
        used += m
    return table


@pytest.mark.parametrize("with_norms", [False, True])
def test_paged_collision_writes_the_list_encoding(with_norms):
    """+inf on the sinks and the local window, -inf past the length, the plain score between: against the plain
    scores encoded element by element, against the step's former encoding (two ``torch.where`` passes over the
    plain scores) bit for bit, and the kernel against the PyTorch form."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    ri = _ints(g)
    page, width, pages, h, tables, planes = 8, 7, 40, 2, 3, 4
    sink_tokens, local_tokens = ri(0, 12), ri(0, 20)
    # ragged, partial pages, one row no longer than its sinks and window together, one of a single token
    lens = [ri(1, max(1, sink_tokens + local_tokens)), 1] + [ri(2, page * (width - 1)) for _ in range(3)]
    rows = len(lens)
    table = _table(g, lens, page, width, pages)
    ids = torch.randint(0, 1 << planes, (pages + 1, h, tables, page), generator=g, dtype=torch.int64).to(torch.uint8)
    norms = torch.rand(pages + 1, h, page, generator=g) if with_norms else None
    probs = torch.softmax(torch.randn(rows, h, tables, 1 << planes, generator=g), -1)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    n = seqlens.long()
    sink = n.clamp(max=sink_tokens)
    local = (n - sink).clamp(max=local_tokens)
    sink[2], local[2] = sink[2] // 2, local[2] // 2  # shrunk below their caps, as a small budget does
    plain = paged_collision_torch(probs, ids, norms, table, seqlens)
    want = plain.clone()
    for i, m in enumerate(lens):
        for j in range(width * page):
            if j < sink[i] or m - local[i] <= j < m:
                want[i, :, j] = INF
            elif j >= m:
                want[i, :, j] = -INF
    where = f"seed {seed}: lens {lens}, sink {sink.tolist()}, local {local.tolist()}"
    got_torch = paged_collision_torch(probs, ids, norms, table, seqlens, sink=sink, local=local)
    assert torch.equal(got_torch, want), where
    j = torch.arange(width * page)
    middle = ((j >= sink[:, None]) & (j < (n - local)[:, None]))[:, None, :]
    forced = ((j < sink[:, None]) | ((j >= (n - local)[:, None]) & (j < n[:, None])))[:, None, :]
    assert torch.equal(got_torch, torch.where(forced, INF, torch.where(middle, plain, -INF))), where
    args = [t.to(DEV) if t is not None else None for t in (probs, ids, norms, table, seqlens)]
    got = paged_collision(*args, sink=sink.to(torch.int32).to(DEV), local=local.to(DEV)).cpu()
    # infinities must match exactly; the sums over the tables may differ in order
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {m}")
    unforced = paged_collision(*args).cpu()
    torch.testing.assert_close(unforced, plain, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {m}")


# ---- the budgets -----------------------------------------------------------------------------------------

def _model_cfg(kv: int = 2, group: int = 3, d: int = 16, layers: int = 2) -> ModelConfig:
    return ModelConfig(97, kv * group * d, 80, layers, kv * group, kv, d, 1e-5, 4096, False)


@pytest.mark.parametrize("explicit_k", [False, True])
def test_step_budgets_match_budget_rows(explicit_k):
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    ri = _ints(g)
    n = torch.cat([torch.arange(1, 2049), torch.randint(2049, 1 << 22, (64,), generator=g)]).to(torch.int32)
    for case in range(5):
        # half-way budgets (0.5, 0.25: round half to even); shares whose fp64 products land on integers (0.3) or
        # whose fp32 rounding would cross one (0.6 - 1e-12: 5 * it floors to 2, 5 * fp32(it) to 3); full-mantissa
        # draws
        density, share = ((0.5, 1.0), (0.25, 0.3), (0.37, 0.6 - 1e-12), (0.5, 0.5), (None, None))[case]
        density = density or 0.01 + 0.99 * float(torch.rand((), generator=g, dtype=torch.float64))
        share = share or 0.05 + 0.95 * float(torch.rand((), generator=g, dtype=torch.float64))
        low = 0 if case in (0, 4) else 2  # no sinks or no window at all, sometimes
        cfg = SocketConfig(density=density, top_k=ri(0, 60) if explicit_k else None, sink_tokens=ri(low, 40),
                           local_tokens=ri(low, 70), forced_share=share, dense_layers=())
        m = Socket(_model_cfg(), cfg)
        heads = ri(1, 3)
        sink, local, top = budget_rows(m, n.long()[:, None])
        got = step_budgets(n.to(DEV), heads, cfg.sink_tokens, cfg.local_tokens, cfg.top_k, m.layer_density, share)
        where = f"seed {seed} case {case}: {cfg}"
        assert all(t.dtype == torch.int32 for t in got), where
        assert torch.equal(got[0].cpu().long(), sink[:, 0]), where
        assert torch.equal(got[1].cpu().long(), local[:, 0]), where
        assert torch.equal(got[2].cpu().long(), top.expand(-1, heads).flatten()), where


def test_forced_lists_are_select_lists_answer():
    from raysparse.kernels.row_select import select_list_torch

    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    ri = _ints(g)
    n = torch.tensor([ri(1, 60) for _ in range(5)] + [1])
    sink = n.clamp(max=ri(0, 9))
    local = (n - sink).clamp(max=ri(0, 12))
    width = 64
    j = torch.arange(width)
    score = torch.where(j < n[:, None], 0.5, -INF)
    score = torch.where((j < sink[:, None]) | ((j >= (n - local)[:, None]) & (j < n[:, None])), INF, score)
    out_width = int((sink + local).max()) + ri(0, 3) or 1
    want = select_list_torch(score.contiguous(), torch.zeros(6, dtype=torch.long), 0, out_width)
    got = forced_lists(sink.to(torch.int32), local, n.to(torch.int32), 3, out_width)
    assert got.dtype == torch.int32 and got.is_contiguous(), f"seed {seed}"
    assert torch.equal(got, want[:, None].expand(-1, 3, -1)), f"seed {seed}"


# ---- the step ----------------------------------------------------------------------------------------------

STEP_CASES = [
    {"density": 0.3},  # soft, group mean (g = 3)
    {"density": 0.3, "group_reduce": "max", "value_norm": True},
    {"density": 0.3, "hard": True},  # a mean over 3 heads: not a power of two's
    {"top_k": 9, "hard": True, "group_reduce": "max"},
    {"top_k": 0},  # nothing scored: the forced lists, no collision scores
    {"density": 0.1, "forced_share": 1.0},  # nothing scored at any length of the bucket either
]


@pytest.mark.parametrize("params", STEP_CASES)
def test_batched_select_on_the_kernels(params, monkeypatch):
    """The step on the kernels (``RAYSPARSE_KERNELS=triton``) against the PyTorch path and the per-sequence
    reference, over a ragged batch (one row no longer than its sinks and window together, partial pages, shuffled
    pages, the page table padded with the scratch page as a graph bucket's). Hard cases hash with planes and
    queries in quarters, so every projection is exact and the lists must agree exactly; soft scores are fp32
    sums in other orders, so two tokens within rounding of each other may swap at the budget's edge."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    ri = _ints(g)
    hard = params.get("hard", False)
    cfg = _model_cfg()
    method = Socket(cfg, SocketConfig(**{"sink_tokens": 6, "local_tokens": 10, "tables": 5, "planes": 4,
                                         "dense_layers": (0,), "seed": ri(0, 2**31), **params}))
    page, width_pages, layer = 8, 8, 1
    cache = KVCache(cfg, num_pages=40, page_size=page, device=DEV)
    if hard:
        method.planes_for(layer, 2, cache.k[layer].device).copy_(_quarters(g, 2, 5, 4, 16))
    if params.get("top_k") == 0 or params.get("forced_share") == 1.0:
        assert method.budget(width_pages * page)[2] == 0  # the k_max == 0 branch
    lens = [ri(1, 15)] + [ri(16, 50) for _ in range(3)]
    sids = [2, 0, 3, 1]
    for sid, n in zip(sids, lens, strict=True):
        cache.allocate(sid, n + 4)
    monkeypatch.setenv("RAYSPARSE_KERNELS", "torch")
    batch = cache.prepare(sids, lens, True)

    def kv(t: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = _quarters(g, t, 2, 16) if hard else torch.randn(t, 2, 16, generator=g)
        return k.to(DEV), (torch.randn(t, 2, 16, generator=g) * torch.rand(t, 2, 1, generator=g) * 3).to(DEV)

    cache.write(layer, *kv(sum(lens)), batch)
    method.update_state(layer, cache, batch)
    for step in range(2):
        batch = cache.prepare(sids, [1] * 4, False)
        cache.paged(layer, batch)
        table, seqlens, blocks = batch.extras["paged"]
        wide = torch.full((4, width_pages), cache.scratch_page, dtype=table.dtype, device=table.device)
        wide[:, : table.shape[1]] = table
        batch.extras["paged"] = (wide, seqlens, blocks)
        cache.write(layer, *kv(4), batch)
        method.update_state(layer, cache, batch)
        q = (_quarters(g, 4, 6, 16) if hard else torch.randn(4, 6, 16, generator=g)).to(DEV)
        view = DecodeView(cache.paged(layer, batch)[0], batch, cache)
        got = {}
        for mode in ("torch", "triton"):
            monkeypatch.setenv("RAYSPARSE_KERNELS", mode)
            got[mode] = method.decode_select(layer, q, view)
        monkeypatch.setenv("RAYSPARSE_KERNELS", "torch")
        assert got["triton"].dtype == torch.int32 and got["triton"].shape == got["torch"].shape
        for i, sid in enumerate(sids):
            n = batch.ctx_lens[i]
            k, v = cache.gather(layer, batch, i)
            ctx = SeqContext(layer, sid, n - 1, n, cache.metadata[layer].setdefault(sid, {}))
            want = _rows(method.select_decode(ctx, q[i], k, v).indices)
            where = f"seed {seed}: {params} step {step} row {i} (n {n})"
            for mode in ("triton", "torch"):
                have = _rows(got[mode][i])
                if hard or have == want:
                    assert have == want, f"{where} {mode}: {have} != {want}"
                else:  # one swap per head at most, never a different count
                    assert all(len(a) == len(b) and len(set(a) ^ set(b)) <= 2
                               for a, b in zip(have, want, strict=True)), f"{where} {mode}: {have} != {want}"
            if hard:
                assert torch.equal(got["triton"][i], got["torch"][i]), where
