"""The CPU's fused decoder-layer ops (C, fp32) against the model's PyTorch path, on fresh random inputs with odd
sizes and strided rows, and a tiny model's steps through them against its plain steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import random_state, tiny_hf_config

from raysparse.attention import DenseAttention
from raysparse.kernels import cpu_fused
from raysparse.kv_cache import KVCache
from raysparse.layers import RMSNorm, fused_ops
from raysparse.loader import model_from_state
from raysparse.rope import RotaryEmbedding, apply_rope

TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(autouse=True)
def _built():
    x = torch.zeros(1)
    if not cpu_fused.available(x):
        pytest.fail("no C compiler: the CPU's fused ops are not built")
    assert fused_ops(x, "native") is cpu_fused and fused_ops(x, "auto") is cpu_fused and fused_ops(x, "torch") is None
    assert fused_ops(x.double(), "auto") is None  # fp64 keeps PyTorch's


def _seed() -> int:
    seed = int(torch.randint(0, 2**31 - 1, ()))
    print(f"seed {seed}")
    torch.manual_seed(seed)
    return seed


@pytest.mark.parametrize("rows,n", [(1, 96), (5, 300), (33, 1000)])
def test_norms_match_reference(rows, n):
    seed = _seed()
    norm = RMSNorm(n, float(torch.empty(()).uniform_(1e-6, 1e-4)))
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(n))
    wide = torch.randn(rows, n + 7) * 3
    x, res = wide[:, :n], torch.randn(rows, n)  # a strided row, read in place
    torch.testing.assert_close(cpu_fused.rms_norm(x, norm.weight, norm.eps), norm.reference(x), **TOL,
                               msg=lambda m: f"seed {seed}: {m}")
    out, h = cpu_fused.add_rms_norm(x.contiguous(), res, norm.weight, norm.eps)
    torch.testing.assert_close(h, res + x, rtol=0, atol=0, msg=lambda m: f"seed {seed}: {m}")
    torch.testing.assert_close(out, norm.reference(res + x), **TOL, msg=lambda m: f"seed {seed}: {m}")


def test_rope_and_cache_write_matches_apply_rope_and_cache_write():
    seed = _seed()
    t, hq, hk, d, pages, page_size = 11, 6, 3, 32, 5, 4
    inv_freq = 1.0 / (5e5 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = RotaryEmbedding(inv_freq, 1.0)(torch.randint(0, 70_000, (t,)), torch.float32)
    qkv = torch.randn(t, (hq + 2 * hk) * d + 5)  # strided views, as of a packed projection
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d: (hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d: (hq + 2 * hk) * d].view(t, hk, d)
    kc, vc = torch.randn(pages, hk, page_size, d), torch.randn(pages, hk, page_size, d)
    ref_k, ref_v = kc.clone(), vc.clone()
    slot = torch.randperm(pages * page_size)[:t]
    sp, so = slot // page_size, slot % page_size
    got_q = cpu_fused.rope_and_cache_write(q, k, v, cos, sin, kc, vc, sp, so)
    ref_k[sp, :, so, :] = apply_rope(k, cos, sin)
    ref_v[sp, :, so, :] = v
    torch.testing.assert_close(got_q, apply_rope(q, cos, sin), **TOL, msg=lambda m: f"seed {seed}: {m}")
    torch.testing.assert_close(kc, ref_k, **TOL, msg=lambda m: f"seed {seed}: {m}")  # untouched rows too
    assert torch.equal(vc, ref_v), seed


def test_silu_mul_matches_reference():
    seed = _seed()
    gate, up = torch.randn(3, 1001) * 4, torch.randn(3, 1001)
    gu = torch.cat((gate, up), -1)
    g, u = gu.split(1001, -1)  # the halves of one merged GEMM's output: strided rows
    torch.testing.assert_close(cpu_fused.silu_mul(g, u), F.silu(gate) * up, **TOL, msg=lambda m: f"seed {seed}: {m}")


def test_model_steps_through_the_fused_ops_match_plain():
    """A tiny model's prefill logits of every position and its decode steps, and the caches they wrote."""
    seed = _seed()
    cfg = tiny_hf_config(num_kv_heads=2, group=3, layers=2)
    model = model_from_state(cfg, random_state(cfg, seed=seed % 10_000).state_dict(), dtype=torch.float32)
    prompt = torch.randint(0, cfg.vocab_size, (int(torch.randint(5, 40, ())),)).tolist()
    steps = torch.randint(0, cfg.vocab_size, (3,)).tolist()

    def run() -> tuple[torch.Tensor, KVCache]:
        cache = KVCache(model.cfg, 8, 16, dtype=torch.float32, device="cpu")
        backend = DenseAttention(model.cfg.num_layers)
        cache.allocate(3, len(prompt) + len(steps))
        out = [model(torch.tensor(prompt), cache.prepare([3], [len(prompt)], True), cache, backend, all_logits=True)]
        for tok in steps:
            out.append(model(torch.tensor([tok]), cache.prepare([3], [1], False), cache, backend))
        return torch.cat(out), cache

    model.set_fused_ops("torch")
    ref, ref_cache = run()
    model.set_fused_ops("native")
    got, cache = run()
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item(), seed
    for layer in range(cfg.num_hidden_layers):
        torch.testing.assert_close(cache.k[layer], ref_cache.k[layer], **TOL)
        torch.testing.assert_close(cache.v[layer], ref_cache.v[layer], **TOL)
