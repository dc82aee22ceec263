"""The batched prefill seam (``SparseMethod.prefill_select`` for the whole batch, one varlen attend over the
paged cache) against each method's per-sequence reference (``select_prefill`` over gathered K/V, one
sequence at a time), on ragged batches in chunks: the same logits, the same density, the same state after."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import DEVICES, tiny_model, whole_model_density

from raysparse.kernels.selection import block_pairs, indices_from_mask, packed_block_pairs
from raysparse.kv_cache import KVCache
from raysparse.methods.registry import create_backend
from raysparse.methods.sketch_walk_config import GRAPH_DECODE

B = 16  # block size = page size: the varlen kernel reads key blocks through the page table

CASES = [
    ("streaming", {"sink_tokens": 16, "window": 48}),
    ("streaming", {"density": 0.3, "sink_tokens": 8}),
    ("quest", {"density": 0.3, "page_size": 4}),
    ("quest", {"density": 0.15, "page_size": 16}),
    ("psaw", {"start_layer": 1, "phi": 0.3, "sink": 8}),  # windows cut into blocks: a per-row bound in the kernel
    ("psaw", {"start_layer": 2, "phi": 0.05, "alpha": 2.0, "sink": 20}),
    # frozen rows: whole frozen query blocks attend their sink block alone, partly frozen ones their window
    ("etf", {"start_layer": 1, "psi": 0.2, "sink": 8}),
    ("cpe", {"start_layer": 1, "phi": 0.3, "psi": 0.2, "sink": 8, "density": 0.3}),
    ("sketch_walk", {"density": 0.3}),  # the default: paired heads, key parts, one-hop
    ("sketch_walk", {**GRAPH_DECODE, "density": 0.25, "walk": "product", "local_blocks": 2}),
    ("sketch_walk", {"density": 0.3, "heads": "kv", "sub_blocks": 2, "decode_unit": "block"}),
    # Delta: the base's packed selection, then anchors every gamma rows (carried across the chunks), check rows
    # and the fitted far-merge correction; the other modes; a tail; bases other than streaming
    ("delta", {"gamma": B, "check_every": 2, "tail": 0, "base_params": {"sink_tokens": 16, "window": 32}}),
    ("delta", {"gamma": 8, "check_every": 1, "density": 0.4, "base": "sketch_walk"}),
    ("delta", {"gamma": B, "mode": "delta-shrunk", "tail": 20, "base": "quest",
               "base_params": {"density": 0.3, "page_size": 4}}),
    ("delta", {"gamma": 32, "mode": "delta", "tail": 0, "base_params": {"sink_tokens": 8, "window": 40}}),
    ("delta", {"gamma": B, "mode": "recompute", "density": 0.4}),
]


@pytest.fixture(scope="module", params=DEVICES)
def model(request):
    return tiny_model(request.param, 2, 2, 4)


def _prefill(model, name: str, params: dict, chunks: list[list[int]], seed: int, reference: bool):
    """Prefills the prompts of ``chunks`` (tokens per sequence per step) as one ragged batch per step."""
    g = torch.Generator().manual_seed(seed)
    dev = model.lm_head.weight.device
    if "density" in params:  # the cases give each sparse layer's budget: the whole model's that yields it
        params = {**params, "density": whole_model_density(params["density"], model.cfg.num_layers, 1)}
    backend = create_backend(name, model.cfg, block_size=B, dense_layers=(0,), **params)
    if reference:
        backend.tracer = lambda *a, **k: None  # a tracer sends every layer down the per-sequence path
    seam: list[int] = []  # the layers of this step that ran the batched seam
    real = backend._prefill_batched

    def prefill_batched(layer: int, *args: Any) -> torch.Tensor:
        seam.append(layer)
        return real(layer, *args)

    backend._prefill_batched = prefill_batched  # type: ignore[method-assign]
    cache = KVCache(model.cfg, num_pages=2048 // B, page_size=B, dtype=model.lm_head.weight.dtype, device=dev)
    total = [sum(c) for c in zip(*chunks, strict=True)]
    sids = list(range(len(total)))
    for sid, n in zip(sids, total, strict=True):
        cache.allocate(sid, n)
    ids = [torch.randint(0, 97, (n,), generator=g) for n in total]
    done = [0] * len(total)
    logits = []
    for step in chunks:
        rows = [i for i, m in enumerate(step) if m > 0]
        if not rows:  # every prompt was whole in the first step: nothing left to prefill
            continue
        batch = cache.prepare([sids[i] for i in rows], [step[i] for i in rows], True)
        tok = torch.cat([ids[i][done[i]: done[i] + step[i]] for i in rows]).to(dev)
        seam.clear()
        logits.append(model(tok, batch, cache, backend, all_logits=True))
        # the seam ran wherever a sparse layer selects in this step (ETF's prefill is dense in a step that
        # freezes no row, e.g. a short last chunk)
        selects = any(backend.prefill_selects(layer, batch) for layer in backend.sparse_layers())
        ran = bool(seam)
        assert reference or ran == selects, f"seed {seed}: seam ran {ran}, a layer selects {selects}"
        for i in rows:
            done[i] += step[i]
    return torch.cat(logits), backend


@pytest.mark.parametrize("name,params", CASES)
def test_batched_prefill_matches_reference(model, name, params):
    seed = int(torch.randint(0, 2**31 - 1, ()))
    g = torch.Generator().manual_seed(seed)
    # the first prompt is long enough that every method's budget leaves some blocks out (the last assert)
    lens = [int(torch.randint(130, 160, (), generator=g))] + [int(x) for x in torch.randint(1, 160, (2,), generator=g)]
    # two steps: whole prompts for some, a first chunk for others, then the rest (q_start > 0, mid-block)
    first = [n if i == 0 else int(torch.randint(1, n + 1, (), generator=g)) for i, n in enumerate(lens)]
    chunks = [first, [n - f for n, f in zip(lens, first, strict=True)]]
    got, b_got = _prefill(model, name, params, chunks, seed, False)
    want, b_want = _prefill(model, name, params, chunks, seed, True)
    tol = 1e-4 if got.device.type == "cpu" else 2e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m: f"seed {seed}: {m}")
    assert b_got.meter.attended == pytest.approx(b_want.meter.attended), f"seed {seed}"
    assert b_got.meter.causal == pytest.approx(b_want.meter.causal), f"seed {seed}"
    assert b_got.meter.overall() < 1.0, f"seed {seed}"


def test_packed_block_pairs_equals_block_pairs():
    seed = int(torch.randint(0, 2**31 - 1, ()))
    g = torch.Generator().manual_seed(seed)
    for _ in range(20):
        b = int(2 ** torch.randint(0, 5, (), generator=g))
        n = int(torch.randint(1, 300, (), generator=g))
        q_start = int(torch.randint(0, n, (), generator=g))
        qb0, qb1 = q_start // b, (n - 1) // b
        nkb = qb1 + 1
        mask = torch.rand(3, qb1 - qb0 + 1, nkb, generator=g) < 0.5
        mask &= torch.arange(nkb)[None, None, :] <= torch.arange(qb0, qb1 + 1)[None, :, None]
        idx = indices_from_mask(mask).to(torch.int32)
        rows = qb1 - qb0 + 1
        got = packed_block_pairs(idx, torch.arange(qb0, qb1 + 1), torch.full((rows,), q_start),
                                 torch.full((rows,), n), b).sum()
        assert int(got) == int(block_pairs(idx, b, q_start, n).sum()), f"seed {seed}"
