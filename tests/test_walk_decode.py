"""Sketch&Walk's fused decode update (kernels/walk_decode.py) against the graph path's PyTorch form.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is
imported). Fresh random state and inputs each run; the rows, the updated sketches and the stored W row are
compared, and the scratch outputs start as NaN so an unwritten element fails."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_hf_config
from triton_env import DEV  # before raysparse.kernels: without a GPU it picks the interpreter

from raysparse.config import ModelConfig
from raysparse.kernels.walk_decode import walk_decode_rows
from raysparse.kv_cache import KVCache
from raysparse.methods.registry import create_backend
from raysparse.methods.sketch_walk import GRAPH_DECODE
from raysparse.methods.sketch_walk_graph import SketchWalkGraphDecode

B = 16


def _path(params: dict, width: int, slots: int = 4) -> SketchWalkGraphDecode:
    cfg = ModelConfig.from_hf(tiny_hf_config(num_kv_heads=2, group=2, layers=4))
    # the graph path runs one-hop through kernels/walk_select.py (and keeps no W for it): the walks here
    method = create_backend("sketch_walk", cfg, block_size=B, **{"walk": "rollout", **GRAPH_DECODE, **params})
    return SketchWalkGraphDecode(method, KVCache(cfg, width, B, device=DEV), max_batch=slots, max_blocks=width)


@pytest.mark.parametrize("params", [{}, {"walk": "product"}, {"token_query": "never"},
                                    {"residual": 0.2, "exponent": 3.0}])
@pytest.mark.parametrize("width", [16, 200])  # one tile; two tiles, the second partial
def test_fused_update_matches_reference(params, width):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    ref, fused = _path(params, width), _path(params, width)
    r = ref.qs.shape[-1]
    # Small integers and power-of-two block counts make every A_hat score exact in both summation orders,
    # so its bf16 rounding (a step function) cannot differ between them; the rest is fp32 arithmetic.
    qs = torch.randint(-4, 5, ref.qs.shape, generator=g).float().to(DEV)
    ks = torch.randint(-4, 5, ref.ks.shape, generator=g).float().to(DEV)
    w = torch.rand(ref.w.shape, generator=g).to(DEV).tril()
    w = w / w.sum(-1, keepdim=True).clamp(min=1e-9)
    for p in (ref, fused):
        p.qs.copy_(qs)
        p.ks.copy_(ks)
        p.w.copy_(w)
    bsz = 3
    slots = torch.randperm(4, generator=g)[:bsz].to(DEV)
    cb = torch.randint(0, width, (bsz,), generator=g)
    cb[0] = width - 1  # the last block of the widest row
    fill = torch.tensor([1, 2, 4, 8, 16])[torch.randint(0, 5, (bsz,), generator=g)]
    n = (cb * B + fill).to(DEV)
    new = torch.randint(-4, 5, (2, bsz, r), generator=g).float().to(DEV)
    first = params.get("walk") == "one-hop"
    # the previous layer's rows of the same rows: mass on causal blocks only
    causal = torch.arange(width, device=DEV) <= ((n - 1) // B)[:, None]
    prev = None if first else torch.rand(bsz, width, generator=g).to(DEV) * causal
    want = ref.rows_reference(0, slots, n, new, width, prev)
    cfg = fused.cfg
    got = walk_decode_rows(fused.qs[:, 0], fused.ks[:, 0], fused.w[:, 0, :width, :width], slots, n, new, prev, B,
                           cfg.exponent, cfg.residual, cfg.walk != "rollout", cfg.token_query != "never")
    assert torch.isfinite(got).all()
    got = got / got.sum(-1, keepdim=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(fused.qs, ref.qs)
    torch.testing.assert_close(fused.ks, ref.ks)
    torch.testing.assert_close(fused.w, ref.w, rtol=1e-4, atol=1e-7)
