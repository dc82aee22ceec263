"""Sketch&Walk's paired part selection in kernels (``part_scores.part_combine`` + ``kernels/part_select.py``)
against the graph path's PyTorch form (``SketchWalk._combine_heads`` + ``PartsDecode._choose_parts``),
and the paired graph decode with the kernels against it.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is
imported). Fresh random inputs each run; outputs start as NaN or a sentinel so every element must be
written. The combine is checked with two shards' partials summed by a fake ``head_reduce``; the selection
bit for bit against ``_choose_parts`` on the kernel's own fp32 scores, with heavy ties, infinite scores,
empty and forced parts, short rows and a padded row; the state page-indexed (``test_part_scores._draw``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import DEVICES, tiny_model, whole_model_density
from test_part_scores import B, _draw, check_state, query_heads
from triton_env import DEV  # before raysparse.kernels: without a GPU it picks the interpreter

import raysparse.kernels.part_scores as ps
import raysparse.kernels.part_select as psel
from raysparse.kernels.common import interpreting
from raysparse.methods.sketch_walk import SketchWalk
from raysparse.methods.sketch_walk_config import SketchWalkConfig
from raysparse.methods.sketch_walk_parts import PartsDecode


def _seed() -> torch.Generator:
    return torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))


def _combine(heads: str, s: torch.Tensor, reduce=None, kv_heads: int = 0, per_kv: int = 1) -> torch.Tensor:
    """``SketchWalk._combine_heads`` itself, on a stand-in method (its config, reduce and head count)."""
    m = SimpleNamespace(config=SimpleNamespace(heads=heads), head_reduce=reduce,
                        model_cfg=SimpleNamespace(num_kv_heads=kv_heads))
    m.head_partial = lambda x: SketchWalk.head_partial(m, x)
    m._head_part = lambda x, g=1: SketchWalk._head_part(m, x, g)
    m._finish_heads = lambda x: SketchWalk._finish_heads(m, x)
    return SketchWalk._combine_heads(m, s, per_kv)[0]


def _path(parts: int, density: float, local: int, heads: str) -> PartsDecode:
    """A paired path holding only what ``paired_constants`` and ``_choose_parts`` read."""
    path = PartsDecode.__new__(PartsDecode)
    path.cfg = SketchWalkConfig(block_size=B, density=density, local_blocks=local, sub_blocks=parts, heads=heads)
    path.parts = parts
    return path


@pytest.mark.parametrize("heads", ["pair", "pair-lse"])
@pytest.mark.parametrize("h_kv,r,parts,width,tile,group", [(2, 16, 4, 40, 16, 1), (4, 32, 8, 24, None, 1),
                                                          (6, 16, 2, 18, 8, 1), (4, 16, 4, 24, 8, 3)])
def test_combine_matches_combine_heads(heads, h_kv, r, parts, width, tile, group):
    """Two shards' partials (half the KV heads each) summed by the reduce, finalised by the select kernel,
    against ``_combine_heads`` over the reference scores with the same reduce; the state as the reference's.
    With ``group`` > 1 every query head of a KV head's group is scored on its own and combined."""
    g = _seed()
    state, table, n, q, k = _draw(g, h_kv, r, parts, width)
    q = query_heads(g, q, group)
    size, wid, half = B // parts, width, h_kv // 2  # width in parts
    start, want_state = state.clone(), state.clone()
    s = ps.part_scores_reference(want_state[1], table, n, q, k, size, parts)  # [h_kv * group, bsz, wid]
    # the other shard's partial as _combine_heads makes it ("pair": divided before the reduce, the kernel after)
    mine, theirs, heads_n = s[: half * group], s[half * group:], h_kv * group
    other = theirs.double().exp().sum(0) if heads == "pair-lse" else theirs.double().sum(0) / heads_n
    want = _combine(heads, mine, lambda x: x + other, h_kv, group)
    got = []
    for sl, ql in ((slice(0, half), slice(0, half * group)), (slice(half, h_kv), slice(half * group, None))):
        out = torch.full((len(n), wid), float("nan"), dtype=torch.float64, device=DEV)
        x = ps.part_combine(state[1, :, sl], table, n, q[:, ql], k[:, sl], size, parts, heads, out=out, tile=tile)
        assert x.data_ptr() == out.data_ptr() and not x.isnan().any()
        got.append(x)
    sc = torch.full((len(n), wid), float("nan"), device=DEV)
    st = _path(parts, 0.3, 1, heads).paired_constants(n, width // parts)
    psel.part_select(got[0] + got[1], n, heads, heads_n, B, parts, 1, 0.3, st["p_k"], st["p_width"], scores=sc)
    # padded rows too: each stores its key over the scratch page's first part before reading it
    torch.testing.assert_close(sc, want, rtol=1e-5, atol=1e-5)
    assert not sc.isnan().any() and torch.equal(sc.isinf(), want.isinf())
    check_state(state, want_state, start, table, n, parts)


def test_combine_one_shard_and_bad_heads():
    """One shard: no reduce, the local heads divide "pair"."""
    state, table, n, q, k = _draw(_seed(), 3, 16, 4, 12)
    want_state = state.clone()
    s = ps.part_scores_reference(want_state[1], table, n, q, k, B // 4, 4)
    for heads in ("pair", "pair-lse"):
        cur = state.clone()
        x = ps.part_combine(cur[1], table, n, q, k, B // 4, 4, heads)
        sc = torch.full(x.shape, float("nan"), device=DEV)
        psel.part_select(x, n, heads, 3, B, 4, 1, 0.5, 12, 12, scores=sc)
        torch.testing.assert_close(sc, _combine(heads, s), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="heads"):
        ps.part_combine(state[1], table, n, q, k, B // 4, 4, "mean")


def _partials(g: torch.Generator, heads: str, bsz: int, wid: int, ties: bool) -> torch.Tensor:
    """Partials whose finalised scores tie heavily (a few levels), with extremes: for "pair" -inf, +inf and
    -0.0 sums; for "pair-lse" 0 (every head empty), a subnormal (both clamp to one floor) and +inf."""
    if heads == "pair":
        levels = torch.tensor([-float("inf"), float("inf"), -0.0, 0.0, -1.5, 2.25, 7.0], dtype=torch.float64)
        x = torch.randn(bsz, wid, generator=g, dtype=torch.float64) * 3
    else:
        levels = torch.tensor([0.0, 1e-310, float("inf"), 0.5, 1.0, 3.0, 1e-200], dtype=torch.float64)
        x = (torch.randn(bsz, wid, generator=g, dtype=torch.float64) * 2).exp()
    pick = levels[torch.randint(0, len(levels), (bsz, wid), generator=g)]
    some = torch.rand(bsz, wid, generator=g) < (0.9 if ties else 0.05)
    x = torch.where(some, pick, x)
    # a row of signed zeros ("pair") or of floors ("pair-lse"): one tie that the threshold must fall in
    zero = 2 if heads == "pair" else 0  # levels[zero], levels[zero + 1]: -0.0 and 0.0, or 0 and a subnormal
    x[3] = levels[zero + torch.randint(0, 2, (wid,), generator=g)]
    return x.to(DEV)


@pytest.mark.parametrize("heads", ["pair", "pair-lse"])
@pytest.mark.parametrize("ties", [True, False], ids=["ties", "spread"])
@pytest.mark.parametrize("parts,width,local,wide", [
    (4, 40, 1, False), (8, 24, 2, False), (1, 70, 1, False), (2, 300, 3, False),
    (4, 40, 1, True), (8, 24, 2, True), (8, 300, 2, True),  # the multi-program path; the last in 3 chunks
])
def test_select_matches_choose_parts(heads, ties, parts, width, local, wide):
    """Both paths (one program a row, and wide rows' marks + ``select_list``) bit for bit as ``_choose_parts``."""
    g = _seed()
    density = float(torch.empty(()).uniform_(0.05, 0.6, generator=g))
    wid, bsz = width * parts, 6
    n = torch.randint(1, width * B + 1, (bsz,), generator=g)
    n[0] = width * B - int(torch.randint(0, B // parts, (), generator=g))  # the full width
    n[1] = int(torch.randint(1, B + 1, (), generator=g))  # one block: all forced
    n[2] = int(torch.randint(B + 1, (local + 2) * B, (), generator=g))  # forced >= the budget
    n[5] = 1  # a padded row's length
    n = n.to(DEV)
    x = _partials(g, heads, bsz, wid, ties)
    path = _path(parts, density, local, heads)
    st = path.paired_constants(n, width)
    kv = int(torch.randint(1, 9, (), generator=g))
    # the reduce hands _combine_heads the partial (its own division, for "pair", done here as the kernel does)
    reduced = x[None] / kv if heads == "pair" else x[None]
    want_scores = _combine(heads, torch.zeros(1, bsz, wid, device=DEV), lambda _: reduced, kv)
    out = torch.full((bsz, st["p_width"]), -7, dtype=torch.int32, device=DEV)
    sc = torch.full((bsz, wid), float("nan"), device=DEV)
    got = psel.part_select(x, n, heads, kv, B, parts, local, density, st["p_k"], st["p_width"], out=out, scores=sc,
                           wide_min=1 if wide else psel.SINGLE_MAX + 1)
    assert got.data_ptr() == out.data_ptr()
    # the scores ranked: _combine_heads' finalisation (exact but for fp64 log rounding in another library)
    torch.testing.assert_close(sc, want_scores, rtol=1e-6, atol=0.0)
    assert torch.equal(got, path._choose_parts(sc, st))  # bit for bit on the same scores, every element


def test_select_refuses_bad_arguments():
    n = torch.ones(2, dtype=torch.long, device=DEV)
    x = torch.zeros(2, 16, dtype=torch.float64, device=DEV)
    with pytest.raises(ValueError, match="heads"):
        psel.part_select(x, n, "mean", 1, 16, 4, 1, 0.5, 4, 8)
    with pytest.raises(ValueError, match="fp64"):
        psel.part_select(x.float(), n, "pair", 1, 16, 4, 1, 0.5, 4, 8)
    with pytest.raises(ValueError, match="out_width"):
        psel.part_select(x, n, "pair", 1, 16, 4, 1, 0.5, 4, 17)


@pytest.fixture(scope="module", params=DEVICES)
def model(request):
    return tiny_model(request.param, 2, 2, 5)


@pytest.mark.parametrize("scoring,scores_kernel,reduce", [
    ({"heads": "pair-lse", "sub_blocks": 8}, True, False),
    ({"heads": "pair", "sub_blocks": 4}, True, True),
    ({"heads": "pair-lse", "sub_blocks": 2}, False, True),
    ({"heads": "pair", "sub_blocks": 4, "decode_query": "heads"}, True, True),
], ids=["pair-lse-P8", "pair-P4-reduce", "pair-lse-P2-torch-scores-reduce", "pair-P4-query-heads-reduce"])
def test_paired_graph_decode_with_the_select_kernel(model, scoring, scores_kernel, reduce, monkeypatch):
    """The same decode (lists, units, logits) through the kernels as through the PyTorch form; with a
    reduce (a group of one) the "pair" divisor is the model's KV heads."""
    from test_sketch_walk_parts import _run

    if model.lm_head.weight.device.type == "cpu" and not interpreting():
        pytest.skip("CPU tensors run the kernels only in Triton's interpreter")
    seed = int(torch.randint(0, 2**31 - 1, ()))
    params = {**scoring, "decode_unit": "part",
              "density": whole_model_density(float(torch.empty(()).uniform_(0.15, 0.5)), 5),
              "local_blocks": 1 + seed % 2}
    lens, steps = [100, 14, 158], 3
    monkeypatch.setattr(PartsDecode, "part_kernel", False)
    monkeypatch.setattr(PartsDecode, "select_kernel", False)
    want_picks, want_logits, _ = _run(model, params, lens, steps, True, seed, [] if reduce else None)
    calls = []
    real = psel.part_select
    monkeypatch.setattr(psel, "part_select", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(PartsDecode, "part_kernel", scores_kernel)
    monkeypatch.setattr(PartsDecode, "select_kernel", True)
    reduced: list = []
    got_picks, got_logits, backend = _run(model, params, lens, steps, True, seed, reduced if reduce else None)
    sparse = sum(not backend.is_dense_layer(i) for i in range(model.cfg.num_layers))
    # eager: once per sparse layer and step (the released sequence's step too); captured: while capturing
    assert len(calls) == (steps + 1) * sparse if not got_logits.is_cuda else calls
    assert not reduce or reduced and set(reduced) == {torch.float64}  # the partial went through the reduce
    tol = 1e-4 if got_logits.device.type == "cpu" else 2e-3
    torch.testing.assert_close(got_logits, want_logits, rtol=tol, atol=tol)
    assert len(got_picks) == len(want_picks)
    for (got, unit), (want, want_unit) in zip(got_picks, want_picks, strict=True):
        assert unit == want_unit and torch.equal(got[:3], want[:3])  # the real rows; row 3 is padding
