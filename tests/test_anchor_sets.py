"""``kernels/anchor_sets.py``: CIS's new anchor sets from the step's list. The PyTorch form and the one-launch
Triton form (the interpreter without a GPU) against the contract written out row by row in Python, entry for
entry and in order, on CIS-shaped rows: probabilities with many exact ties, forced (+inf) and excluded keys,
pairs that share (no set), leads whose neighbours overlap or fall outside [0, n), counts past their static
bounds, and widths that cut the set."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV  # before raysparse.kernels: without a GPU it picks the interpreter

from raysparse.kernels.anchor_sets import anchor_sets, anchor_sets_torch, anchor_sets_triton
from raysparse.kernels.row_select import select_list_torch

INF = float("inf")


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()))


def _python(listed, final, lo, hi, here, pair_m, pair_k, pair_n, m_w, k_w, radius, width) -> torch.Tensor:
    h_kv = here.shape[1]
    rows = []
    for p, lst in enumerate(listed.tolist()):
        b, h = divmod(p, h_kv)
        n = int(pair_n[p])
        vals = final[p].tolist()
        cand = [c for c in lst if c >= 0 and lo[b] <= c < hi[b] and bool(here[b, h])]
        best = sorted(cand, key=lambda c: (-vals[c], c))  # probability descending, the lower column first
        leads = sorted(best[: min(max(int(pair_m[p]), 0), m_w)])
        offs = [0, *range(-radius, 0), *range(1, radius + 1)]
        n_set, prev_end = [], -1
        for lead in leads:
            n_set += [lead + o for o in offs if prev_end < lead + o < n]
            prev_end = lead + radius
        others = [c for c in best if all(abs(c - lead) > radius for lead in leads)]
        k = min(max(int(pair_k[p]) - len(n_set), 0), k_w)
        row = (sorted(others[:k]) + n_set)[:width]
        rows.append(row + [-1] * (width - len(row)))
    return torch.tensor(rows, dtype=torch.int32).view(len(rows), width)


def _case(g: torch.Generator, b: int, h_kv: int, wt: int, radius: int, sink: int, local: int):
    """One step's inputs as ``cis_listed.listed_select`` builds them."""
    n = torch.randint(wt // 2, wt + 1, (b,), generator=g)
    lo = torch.full((b,), sink) if radius % 2 else torch.maximum(n // 3, torch.tensor(sink))  # PSAW's bound
    hi = n - local
    here = torch.rand(b, h_kv, generator=g) < 0.75
    here[0, 0] = True
    pos = torch.arange(wt)
    inside = (pos >= lo[:, None]) & (pos < hi[:, None])
    kept = (pos < n[:, None]) & ((pos < sink) | (pos >= torch.maximum(hi, lo)[:, None]))
    probs = torch.randint(0, 6, (b, h_kv, wt), generator=g).float() / 8  # long runs of exact ties
    final = torch.where(inside[:, None] & here[..., None], probs, -INF)
    final = torch.where(inside[:, None] & ~here[..., None], 0.0, final)
    final = torch.where(kept[:, None], INF, final)
    final = torch.where((torch.rand(b, h_kv, wt, generator=g) < 0.1) & inside[:, None] & ~here[..., None], INF, final)
    final = final.view(b * h_kv, wt).contiguous()
    budget = torch.randint(2, wt // 3, (b,), generator=g)
    pair_k = budget[:, None].expand(-1, h_kv).reshape(-1).contiguous()
    pair_m = (pair_k // (3 + 2 * radius)).clamp(min=1)
    pair_m[1] = pair_k[1]  # more leads than others: N fills the set
    pair_n = n[:, None].expand(-1, h_kv).reshape(-1).contiguous()
    k_w = int(pair_k.max())
    m_w = int(pair_m.max())
    pair_k[2] += 5  # past the static bounds: clamped to them
    pair_m[2] += 3
    out_width = sink + local + k_w + 4
    listed = select_list_torch(final, torch.where(here.flatten(), pair_k, 0), k_w, out_width)
    return listed, final, lo, hi, here, pair_m, pair_k, pair_n, m_w, k_w


@pytest.mark.parametrize("radius", [0, 1, 2, 3])
@pytest.mark.parametrize("wt", [40, 97])
def test_forms_match_the_contract(radius, wt):
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    for sink, local in ((2, 3), (0, 0)):
        case = _case(g, 3, 2, wt, radius, sink, local)
        k_w = case[-1]
        for width in (k_w + 2 * radius + 1, max(1, k_w // 2)):  # every set whole; sets cut short
            want = _python(*case, radius, width)
            got = anchor_sets_torch(*case, radius, width)
            assert torch.equal(got, want), f"seed {seed}: torch, r={radius} wt={wt} width={width}"
            dev = [x.to(DEV) for x in case[:-2]]
            got = anchor_sets_triton(*dev, *case[-2:], radius, width)
            assert torch.equal(got.cpu(), want), f"seed {seed}: triton, r={radius} wt={wt} width={width}"


def test_no_retrieving_pair_gives_empty_sets():
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    listed, final, lo, hi, here, pair_m, pair_k, pair_n, m_w, k_w = _case(g, 2, 3, 64, 1, 2, 3)
    here = torch.zeros_like(here)
    for fn in (anchor_sets_torch, anchor_sets_triton):
        got = fn(*(x.to(DEV) for x in (listed, final, lo, hi, here, pair_m, pair_k, pair_n)), m_w, k_w, 1, 9)
        assert torch.equal(got.cpu(), torch.full((6, 9), -1, dtype=torch.int32)), f"seed {seed}: {fn.__name__}"


def test_long_lists_take_the_torch_form(monkeypatch):
    """Lists past the one-program bound go to the PyTorch form, whatever the device."""
    import raysparse.kernels.anchor_sets as mod

    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    case = _case(g, 2, 2, 64, 1, 2, 3)
    monkeypatch.setattr(mod, "SINGLE_MAX", case[0].shape[1] - 1)
    monkeypatch.setattr(mod, "anchor_sets_triton", lambda *a: pytest.fail("the Triton form took a long list"))
    got = anchor_sets(*case, 1, case[-1])
    assert torch.equal(got, _python(*case, 1, case[-1])), f"seed {seed}"
