"""Sketch&Walk's one-hop decode selection (kernels/walk_select.py) against the graph path's PyTorch form
(``rows_reference`` + ``_choose``).

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is
imported). Fresh random state and inputs each run: a batch with two padded rows on the scratch slot,
lengths ending in full and partial blocks, rows shorter than the forced blocks, every ``token_query``.
The block lists, the updated sketches and every output element (the output starts as a sentinel) are
compared exactly.

The kernel ranks by the bf16 logits with the entries whose reference value underflows to 0 tied; the
reference ranks by its fp32 values. Where the reference's rounding merges two distinct logits the two
rankings may differ (the kernel's documented difference), so such draws are redrawn; the test checks that
they stay rare."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import tiny_hf_config, tiny_model, whole_model_density
from triton_env import DEV  # before raysparse.kernels: without a GPU it picks the interpreter

from raysparse.config import ModelConfig
from raysparse.kernels import dispatch
from raysparse.kernels.walk_select import ZERO_Y, walk_select
from raysparse.kv_cache import KVCache
from raysparse.methods.registry import create_backend
from raysparse.methods.sketch_walk_config import GRAPH_DECODE, SketchWalkConfig
from raysparse.methods.sketch_walk_rows import RowsDecode

B = 16
SLOTS = 4  # 3 real slots + the scratch slot


def _path(params: dict, width: int) -> RowsDecode:
    cfg = ModelConfig.from_hf(tiny_hf_config(num_kv_heads=2, group=2, layers=4))
    # No dense layer: --density is then each layer's budget exactly, which the kernel takes (and its ties need)
    method = create_backend("sketch_walk", cfg, block_size=B,
                            **{"walk": "one-hop", "dense_layers": (), **GRAPH_DECODE, **params})
    return RowsDecode(method, KVCache(cfg, width, B, device=DEV), max_batch=SLOTS - 1, max_blocks=width)


def _draw(g: torch.Generator, path: RowsDecode, width: int, local: int):
    """Small integers (and power-of-two block scales and counts) make every A_hat score exact in any
    summation order, so its bf16 rounding cannot differ between the two; scaled blocks spread the logits
    far enough that the reference's exp underflows for some entries, copied blocks tie."""
    r = path.qs.shape[-1]
    qs = torch.randint(-4, 5, path.qs.shape, generator=g).float()
    scale = torch.tensor([1.0, 8.0, 64.0])[torch.randint(0, 3, path.ks.shape[:3], generator=g)]
    ks = torch.randint(-4, 5, path.ks.shape, generator=g).float() * scale[..., None]
    src, dst = torch.randint(0, width, (2, width // 4), generator=g)
    ks[:, :, dst] = ks[:, :, src]  # equal key blocks: tied scores, which go to the lower block
    real = 3
    slots = torch.cat((torch.randperm(SLOTS - 1, generator=g)[:real], torch.full((2,), SLOTS - 1)))
    cb = torch.randint(0, width, (real,), generator=g)
    cb[0] = width - 1  # the last block of the widest row
    cb[1] = int(torch.randint(0, local + 2, (), generator=g))  # no more blocks than the forced ones (or one more)
    if width > 24:
        cb[2] = 24  # 25 blocks: density 0.1's fp32 budget is exactly half-way (2.5) and rounds to even
    fill = torch.tensor([1, 2, 4, 8, 16])[torch.randint(0, 5, (real,), generator=g)]  # partial and full blocks
    n = torch.cat((cb * B + fill, torch.ones(2, dtype=torch.long)))  # padded rows: length one, as the graphs pad
    new = torch.randint(-4, 5, (2, real + 2, r), generator=g).float()
    new[:, real + 1] = new[:, real]  # padded rows decode the same token
    return qs.to(DEV), ks.to(DEV), slots.to(DEV), n.to(DEV), new.to(DEV)


def _faithful(path: RowsDecode, qs, ks, slots, n, new, rows, width: int) -> bool:
    """Whether the reference's fp32 row values order the candidates as (not underflowed, bf16 logit) does,
    i.e. no rounding merged two distinct logits and no entry sits at the underflow threshold."""
    cfg = path.cfg
    cb = (n - 1) // B
    cols = torch.arange(width, device=DEV)
    cnt = (n[:, None] - cols * B).clamp(min=1, max=B).float()
    ksum = ks[slots, 0, :width].clone()
    ksum[torch.arange(len(n)), cb] += new[1]
    k_mean = ksum / cnt[..., None]
    q = new[0] if cfg.token_query != "never" else (qs[slots, 0, cb] + new[0]) / cnt.gather(1, cb[:, None])
    causal = cols <= cb[:, None]
    x = ((k_mean @ q[:, :, None])[..., 0] / math.sqrt(q.shape[-1])).masked_fill(~causal, 0.0)
    x = x.to(torch.bfloat16).float().masked_fill(~causal, float("-inf"))
    y = cfg.exponent * torch.log_softmax(x, -1)
    cand = causal & (cols >= 1) & (cols <= cb[:, None] - cfg.local_blocks)
    if ((y - ZERO_Y).abs() < 1e-3)[cand].any():
        return False
    assert torch.equal((rows == 0)[cand], (y <= ZERO_Y)[cand]), "the underflow threshold is wrong"
    key = torch.where(y > ZERO_Y, x, float("-inf"))  # all underflowed entries as one lowest key
    pair = cand[:, :, None] & cand[:, None, :]
    same_order = torch.sign(rows[:, :, None] - rows[:, None, :]) == torch.sign(key[:, :, None] - key[:, None, :])
    return bool(same_order[pair].all())


@pytest.mark.parametrize("params", [{}, {"token_query": "decode"}, {"token_query": "never"},
                                    {"token_query": "never", "local_blocks": 3, "density": 0.5},
                                    {"local_blocks": 2, "exponent": 1.0, "density": 0.2}, {"density": 0.1}])
@pytest.mark.parametrize("width", [16, 40])  # one score tile; three, the last partial (and not a power of two)
def test_select_matches_reference(params, width):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    ref, fused = _path(params, width), _path(params, width)
    cfg = ref.cfg
    for _ in range(10):
        qs, ks, slots, n, new = _draw(g, ref, width, cfg.local_blocks)
        ref.qs.copy_(qs)
        ref.ks.copy_(ks)
        rows = ref.rows_reference(0, slots, n, new, width, None)
        if _faithful(ref, qs, ks, slots, n, new, rows, width):
            break
    else:
        pytest.fail("the reference merged distinct logits in 10 draws out of 10: not rare")
    want = ref._choose(rows, ref.step_constants(n, width))
    fused.qs.copy_(qs)
    fused.ks.copy_(ks)
    out_width = 1 + cfg.local_blocks + fused.top_width(width)
    out = torch.full((len(n), out_width), -7, dtype=torch.int32, device=DEV)
    got = walk_select(fused.qs[:, 0], fused.ks[:, 0], slots, n, new, B, cfg.density, cfg.local_blocks,
                      cfg.exponent, cfg.token_query != "never", width, out_width, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, want)
    # the scratch slot is left out: padded rows all add into it, the reference once, the kernel racing
    assert torch.equal(fused.qs[:-1], ref.qs[:-1])
    assert torch.equal(fused.ks[:-1], ref.ks[:-1])


@pytest.mark.slow  # ~20 s each in the interpreter
@pytest.mark.parametrize("token_query", ["last", "never"])
def test_graph_decode_with_the_kernel(monkeypatch, token_query):
    """The graph path's steps (eager on the CPU, captured on a GPU) with the kernel switched on, against the
    per-sequence reference decode on a tiny model: same block lists, logits and metered density."""
    from test_sketch_walk_rows import _run

    import raysparse.kernels.walk_select as ws

    monkeypatch.setattr(RowsDecode, "select", True)
    picks: list[torch.Tensor] = []
    real = ws.walk_select
    monkeypatch.setattr(ws, "walk_select", lambda *a, **k: picks.append(real(*a, **k)) or picks[-1])
    params = {"density": whole_model_density(0.3, 5), "walk": "one-hop", "token_query": token_query}
    seed = int(torch.randint(0, 2**31 - 1, ()))
    model = tiny_model(DEV.type, 2, 2, 5)
    lens, steps = [100, 47, 160], 4
    ref_picks, ref_logits, ref_b = _run(model, params, lens, steps, False, seed)
    got_picks, got_logits, got_b = _run(model, params, lens, steps, True, seed)
    assert not got_picks  # the kernel, not _choose, made every list
    tol = 1e-4 if DEV.type == "cpu" else 2e-3
    torch.testing.assert_close(got_logits, ref_logits, rtol=tol, atol=tol)
    assert got_b.meter.attended == pytest.approx(ref_b.meter.attended)
    if DEV.type == "cuda":
        return  # replays run no Python: the lists are compared on the CPU
    assert len(picks) == len(ref_picks) // len(lens)
    for j, got in enumerate(picks):
        for row in range(len(lens)):
            want = ref_picks[j * len(lens) + row][2]
            assert torch.equal(got[row][got[row] >= 0].long(), want[want >= 0].long())


def test_one_hop_state_has_no_w(monkeypatch):
    """One-hop never reads W: the graph path allocates none and budgets none; the parameter ``walk_select``
    switches the kernel."""
    hop, roll = _path({}, 16), _path({"walk": "rollout"}, 16)
    assert hop.w is None and roll.w is not None
    layers, r = len(hop.index), hop.qs.shape[-1]
    assert RowsDecode.state_bytes(hop.m, 16) == layers * 8 * 16 * r
    assert RowsDecode.state_bytes(roll.m, 16) == layers * (4 * 16**2 + 8 * 16 * r)
    q = torch.zeros(1, 4, 16, device=DEV)
    monkeypatch.setenv("RAYSPARSE_KERNELS", "triton")  # as if the tensors were on CUDA
    assert hop.cfg.walk_select and dispatch.triton_chosen(hop.cfg.walk_select, hop.select, q)  # on by default
    off = _path({"walk_select": False}, 16)
    assert not dispatch.triton_chosen(off.cfg.walk_select, off.select, q)
    with pytest.raises(ValueError, match="walk_select"):
        SketchWalkConfig(walk_select="yes")
