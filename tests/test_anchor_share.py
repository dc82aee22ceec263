"""``kernels/anchor_share.py``: CIS's per-step bookkeeping, the one-launch Triton forms (the interpreter without
a GPU) against the PyTorch forms on fresh random state: which pairs share and the valid flags a block's first
step clears, the shared sets' marks in the selection row, and the committed anchors, counters and counts. Every
buffer is compared whole after the call (the unit queries to fp32 rounding, everything else exactly)."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV  # before raysparse.kernels: without a GPU it picks the interpreter

from raysparse.kernels.anchor_share import (
    commit_torch,
    commit_triton,
    mark_shared_torch,
    mark_shared_triton,
    share_torch,
    share_triton,
)

INF = float("inf")


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()))


def _state(g: torch.Generator, b: int, s: int, h_kv: int, qdim: int, width: int, wt: int):
    cq = torch.nn.functional.normalize(torch.randn(b, s, h_kv, qdim, generator=g), dim=-1)
    sets = torch.randint(-1, wt + 4, (b, s, h_kv, width), generator=g).to(torch.int32)  # some past every row
    valid = torch.rand(b, s, h_kv, generator=g) < 0.7
    step = torch.randint(0, 3 * s, (b,), generator=g)
    step[0] = s  # a block's first step
    return cq, sets, valid, step


@pytest.mark.parametrize("grp, d", [(2, 16), (3, 8)])  # 3 x 8: a group width off the powers of two (g = 3)
def test_share_matches_torch(grp, d):
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    b, s, h_kv = 5, 4, 3
    cq, _, valid, step = _state(g, b, s, h_kv, grp * d, 8, 64)
    q = torch.randn(b, h_kv * grp, d, generator=g)
    near = cq[:, 1].reshape(b, h_kv * grp, d) * 3 + 0.05 * torch.randn(b, h_kv * grp, d, generator=g)
    q = torch.where(torch.arange(b)[:, None, None] % 2 == 1, near, q)  # rows 1 and 3 close to their anchor 1
    valid[1::2, 1] = True
    step[1::2] = torch.where(step[1::2] % s == 0, step[1::2] + 1, step[1::2])  # no block's first step there
    for threshold in (0.8, -2.0, 2.0):
        v_want = valid.clone()
        qn_want, ch_want = share_torch(q, cq, v_want, step, threshold)
        v_got = valid.clone().to(DEV)
        qn_got, ch_got = share_triton(q.to(DEV), cq.to(DEV), v_got, step.to(DEV), threshold)
        assert torch.equal(ch_got.cpu(), ch_want), f"seed {seed}: threshold {threshold}"
        assert torch.equal(v_got.cpu(), v_want), f"seed {seed}: threshold {threshold}"
        torch.testing.assert_close(qn_got.cpu(), qn_want, rtol=1e-6, atol=1e-6, msg=f"seed {seed}")
        if threshold == 0.8:
            assert (ch_want >= 0).any() and (ch_want < 0).any(), f"seed {seed}: no mix of sharing and retrieving"


def test_mark_shared_matches_torch():
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    b, s, h_kv, width, wt, sink = 4, 3, 2, 24, 80, 3
    _, sets, _, _ = _state(g, b, s, h_kv, 8, width, wt)
    chosen = torch.randint(-1, s, (b, h_kv), generator=g)
    n = torch.randint(wt // 2, wt + 1, (b,), generator=g)
    lo = torch.randint(sink, wt // 2, (b,), generator=g)
    pos = torch.arange(wt)
    final = torch.where(torch.rand(b * h_kv, wt, generator=g) < 0.2, INF, 0.0)
    final = torch.where(pos >= n.repeat_interleave(h_kv)[:, None], -INF, final)
    want = final.clone()
    mark_shared_torch(want, sets, chosen, n, lo, sink)
    got = final.clone().to(DEV)
    mark_shared_triton(got, sets.to(DEV), chosen.to(DEV), n.to(DEV), lo.to(DEV), sink)
    assert torch.equal(got.cpu(), want), f"seed {seed}"
    assert not torch.equal(want, final), f"seed {seed}: nothing was marked"


@pytest.mark.parametrize("qdim", [32, 24])
def test_commit_matches_torch(qdim):
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    b, s, h_kv, width, ow = 4, 3, 3, 20, 30
    cq, sets, valid, step = _state(g, b, s, h_kv, qdim, width, 64)
    counts = torch.zeros(b, h_kv, 2, dtype=torch.long)
    qn = torch.randn(b, h_kv, qdim, generator=g)
    new_set = torch.randint(-1, 64, (b, h_kv, width), generator=g).to(torch.int32)
    chosen = torch.randint(-1, s, (b, h_kv), generator=g)
    out = torch.randint(-1, 64, (b, h_kv, ow), generator=g).to(torch.int32)
    want = [x.clone() for x in (cq, sets, valid, step, counts)]
    commit_torch(*want, qn, new_set, chosen, out)
    got = [x.clone().to(DEV) for x in (cq, sets, valid, step, counts)]
    commit_triton(*got, *(x.to(DEV) for x in (qn, new_set, chosen, out)))
    for name, x, y in zip(("cq", "sets", "valid", "step", "counts"), got, want, strict=True):
        assert torch.equal(x.cpu(), y), f"seed {seed}: {name}"


@pytest.mark.parametrize("grp", [2, 3])
def test_cis_steps_on_the_kernels_match_the_torch_forms(monkeypatch, grp):
    """CIS's listed step over several decode steps of a ragged batch with the anchor kernels (the rest of the
    step in PyTorch, so both runs score alike) against the same step on the PyTorch forms: every selected entry,
    every state buffer, on steps that mix sharing and retrieving pairs."""
    import raysparse.kernels.anchor_sets as sets_mod
    import raysparse.kernels.anchor_share as share_mod
    from raysparse.kernels.formats import PagedKV
    from raysparse.methods.cis import CISConfig
    from raysparse.methods.cis_batched import CISRows, cis_batched_step, set_width

    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    cfg = CISConfig(density=0.3, sink=2, local=3, share_block=3, radius=1, threshold=0.5)
    b, h_kv, d, page, width = 3, 2, 16, 8, 12
    k = torch.randn(b * width + 1, h_kv, page, d, generator=g)
    table = torch.randperm(b * width + 1, generator=g)[: b * width].view(b, width).to(torch.int32)
    steps, wt = 8, width * page
    n = torch.randint(page, wt - steps, (b,), generator=g)
    bufs = [CISRows(1, b, cfg, h_kv, grp * d, set_width(cfg, wt), torch.device("cpu")) for _ in range(2)]
    q = torch.randn(b, h_kv * grp, d, generator=g)
    for step in range(steps):
        kv = PagedKV(k, k, table, (n + step).to(torch.int32))
        outs = []
        for buf, kernels in zip(bufs, (True, False), strict=True):
            for mod in (sets_mod, share_mod):
                monkeypatch.setattr(mod, "triton_wanted", lambda *a, on=kernels: on)
            outs.append(cis_batched_step(cfg, buf, 0, q, kv, wt, None, listed=True))
        assert torch.equal(outs[0], outs[1]), f"seed {seed} step {step}"
        for name in ("sets", "valid", "step", "counts"):
            assert torch.equal(getattr(bufs[0], name), getattr(bufs[1], name)), f"seed {seed} step {step}: {name}"
        torch.testing.assert_close(bufs[0].q, bufs[1].q, rtol=1e-6, atol=1e-6, msg=f"seed {seed} step {step}")
        slow = (torch.arange(b * h_kv).view(b, h_kv, 1, 1) + step) % 2 == 0  # half the pairs barely move
        drift = q.view(b, h_kv, grp, d) + 0.01 * torch.randn(b, h_kv, grp, d, generator=g)
        q = torch.where(slow, drift, torch.randn(b, h_kv, grp, d, generator=g)).view(q.shape)
    assert 0 < int(bufs[0].counts[0, ..., 1].sum()) < b * h_kv, f"seed {seed}: the last step did not mix"
