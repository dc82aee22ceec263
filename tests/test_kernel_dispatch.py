"""Methods reach the kernels through ``kernels/dispatch.py``: each entry point picks Triton or the PyTorch form
there (``RAYSPARSE_KERNELS`` and the tensors' device), so a method names no kernel path of its own."""

from __future__ import annotations

import math

import pytest
import torch
from triton_env import DEV  # before raysparse.kernels: without a GPU it picks the interpreter

from raysparse.kernels import dispatch, paged_quest, quest_bounds, quest_prefill


def _recording(monkeypatch, module, name: str, path: str, calls: list[str]) -> None:
    monkeypatch.setattr(module, name, lambda *args, **kwargs: calls.append(path))


@pytest.mark.parametrize("mode,want", [("torch", "torch"), ("auto", "cuda"), ("triton", "triton")])
def test_quest_entry_points_choose_the_path(monkeypatch, mode, want):
    if want == "cuda":
        want = "triton" if DEV.type == "cuda" else "torch"  # auto: Triton on CUDA tensors only
    monkeypatch.setenv("RAYSPARSE_KERNELS", mode)
    calls: list[str] = []
    _recording(monkeypatch, paged_quest, "paged_quest_scores", "triton", calls)
    _recording(monkeypatch, paged_quest, "paged_quest_scores_torch", "torch", calls)
    _recording(monkeypatch, quest_prefill, "quest_prefill_scores", "triton", calls)
    _recording(monkeypatch, quest_prefill, "quest_prefill_scores_torch", "torch", calls)
    _recording(monkeypatch, quest_bounds, "update_page_bounds", "triton", calls)
    q, lo = torch.zeros(1, 2, 16, device=DEV), torch.zeros(3, 2, 4, 16, device=DEV)
    none = torch.zeros(1, dtype=torch.int32, device=DEV)
    dispatch.paged_quest_scores(q, lo, lo, none, none, 16)
    dispatch.quest_prefill_scores(q, lo, lo, none, none, none, none, none, 64, 16, 1)
    k = torch.zeros(2, 2, 64, 16, device=DEV)
    dispatch.update_quest_bounds(k, lo, lo.clone(), none.long(), none.long(), 16)
    assert calls == [want, want] + ([want] if want == "triton" else [])  # the bounds' PyTorch form is dispatch's own


def test_quest_bounds_pytorch_form_recomputes_the_pages_listed(monkeypatch):
    """The bounds of the Quest page each listed token ends, over its keys up to that token; other pages kept."""
    monkeypatch.setenv("RAYSPARSE_KERNELS", "torch")
    g = torch.Generator().manual_seed(11)
    pages, h_kv, size, d, qp = 3, 2, 64, 16, 16
    k = torch.randn(pages, h_kv, size, d, generator=g)
    lo, hi = torch.full((pages + 1, h_kv, size // qp, d), 7.0), torch.full((pages + 1, h_kv, size // qp, d), 7.0)
    page, slot = torch.tensor([1, 2]), torch.tensor([37, 5])
    dispatch.update_quest_bounds(k, lo, hi, page, slot, qp)
    for p, s in zip(page.tolist(), slot.tolist(), strict=True):
        keys = k[p, :, (s // qp) * qp:s + 1]  # [h_kv, tokens, d]
        assert torch.equal(lo[p, :, s // qp], keys.amin(1)) and torch.equal(hi[p, :, s // qp], keys.amax(1))
    untouched = torch.ones_like(lo[..., 0], dtype=torch.bool)
    untouched[page, :, slot // qp] = False
    assert (lo[..., 0][untouched] == 7.0).all() and (hi[..., 0][untouched] == 7.0).all()
    assert not math.isinf(float(lo.abs().max()))


@pytest.mark.parametrize("mode", ["torch", "triton"])
def test_socket_entry_points_choose_the_path(monkeypatch, mode):
    from raysparse.kernels import lsh_scorer, paged_collision

    monkeypatch.setenv("RAYSPARSE_KERNELS", mode)
    calls: list[str] = []
    _recording(monkeypatch, paged_collision, "paged_collision", "triton", calls)
    _recording(monkeypatch, paged_collision, "paged_collision_torch", "torch", calls)
    _recording(monkeypatch, lsh_scorer, "bucket_ids_into_slots", "triton", calls)
    probs, ids = torch.zeros(1, 2, 3, 4, device=DEV), torch.zeros(2, 2, 3, 16, dtype=torch.uint8, device=DEV)
    seqlens, none = torch.tensor([5], device=DEV), torch.zeros(1, dtype=torch.long, device=DEV)
    dispatch.paged_collision_scores(probs, ids, None, none, seqlens, (none, none), bias=None)
    assert calls == [mode]
    bias = dispatch.collision_bias((none, none), seqlens, 16, ids)
    assert (bias is None) == (mode == "triton")  # the Triton scorer folds the bias in
    if mode == "torch":
        assert bias.shape == (1, 1, 16) and bool((bias[0, 0, 5:] == -math.inf).all())
        assert bool((bias[0, 0, :5] == 0).all())  # no sink, no local window: nothing forced
        w, keys = torch.randn(2, 3, 2, 16, device=DEV), torch.randn(2, 2, 16, 16, device=DEV)
        pool = torch.zeros_like(ids)
        dispatch.lsh_bucket_ids_into_slots(w, keys, none, seqlens - 1, pool)  # page 0, slot 4
        want = dispatch.lsh_bucket_ids(w, keys[0, :, 4:5])[..., 0]  # [h_kv, L]
        assert torch.equal(pool[0, :, :, 4], want.to(pool.dtype)) and not pool[1].any()
    else:
        dispatch.lsh_bucket_ids_into_slots(torch.zeros(1), ids, none, none, ids)
        assert calls == [mode, mode]
