"""The fused decoder-layer kernels against the model's PyTorch path, on fresh random inputs with odd sizes.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is
imported). fp32 and fp16 only: the 16-bit roundings the kernels reproduce are the same for bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import random_state, tiny_hf_config
from triton_env import DEV  # before raysparse.kernels: without a GPU it picks the interpreter

from raysparse.attention import DenseAttention
from raysparse.kernels import fused_ops
from raysparse.kv_cache import KVCache
from raysparse.layers import RMSNorm
from raysparse.loader import model_from_state
from raysparse.rope import RotaryEmbedding, apply_rope

# bf16 only on a GPU: the interpreter's bf16 is not what the GPU computes.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV.type == "cuda" else [])


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # 16-bit: one unit in the last place where the fp32 mean or exp differs in its last bit before rounding.
    return {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
            torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}[dtype]


def _norm(n: int, dtype: torch.dtype, weight_dtype: torch.dtype | None = None) -> RMSNorm:
    norm = RMSNorm(n, float(torch.empty(()).uniform_(1e-6, 1e-4)))
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(n))
    return norm.to(device=DEV, dtype=weight_dtype or dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 96), (5, 300), (3, 1000)])
def test_rms_norm_matches_reference(dtype, rows, n):
    norm = _norm(n, dtype)
    x = (torch.randn(rows, n, device=DEV) * float(torch.empty(()).uniform_(0.1, 10))).to(dtype)
    got = fused_ops.rms_norm(x, norm.weight, norm.eps)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, norm.reference(x), **_tol(dtype))


def test_rms_norm_fp32_weight_on_half_input_promotes_and_strided_rows():
    """An fp32 weight on fp16 activations gives fp32 (PyTorch's promotion); rows may be strided views."""
    norm = _norm(200, torch.float16, weight_dtype=torch.float32)
    x = torch.randn(4, 3, 256, device=DEV, dtype=torch.float16)[:, 1, :200]  # row stride 768
    got = fused_ops.rms_norm(x, norm.weight, norm.eps)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, norm.reference(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 130), (2, 3, 515)])
def test_add_rms_norm_matches_reference(dtype, shape):
    norm = _norm(shape[-1], dtype)
    x = torch.randn(shape, device=DEV).to(dtype)
    residual = (torch.randn(shape, device=DEV) * 4).to(dtype)
    normed, h = fused_ops.add_rms_norm(x, residual, norm.weight, norm.eps)
    ref_h = residual + x
    assert torch.equal(h, ref_h)  # one rounded add: bit for bit
    torch.testing.assert_close(normed, norm.reference(ref_h), **_tol(dtype))
    with pytest.raises(ValueError):
        fused_ops.add_rms_norm(x, residual.float() if dtype != torch.float32 else residual.half(), norm.weight, 1e-5)


def _slots(t: int, pages: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """t distinct random (page, offset) slots of a pool of ``pages`` pages."""
    flat = torch.randperm(pages * page_size)[:t]
    return (flat // page_size).to(DEV), (flat % page_size).to(DEV)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                               (torch.float16, torch.float32), (torch.float32, torch.float16)]
                         + ([(torch.bfloat16, torch.bfloat16)] if DEV.type == "cuda" else []))
def test_rope_and_cache_write_matches_apply_rope_and_cache_write(dtype, cache_dtype):
    t, hq, hk, d, pages, page_size = 7, 6, 3, 32, 5, 4
    inv_freq = 1.0 / (5e5 ** (torch.arange(0, d, 2).float() / d))
    rotary = RotaryEmbedding(inv_freq, float(torch.empty(()).uniform_(0.8, 1.2)))
    positions = torch.randint(0, 70_000, (t,), device=DEV)
    cos, sin = rotary(positions, dtype)
    qkv = torch.randn(t, (hq + 2 * hk) * d + 5, device=DEV).to(dtype)  # strided views, as of a packed projection
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d: (hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d: (hq + 2 * hk) * d].view(t, hk, d)
    kc, vc = (torch.randn(pages, hk, page_size, d, device=DEV).to(cache_dtype) for _ in range(2))
    ref_k, ref_v = kc.clone(), vc.clone()
    sp, so = _slots(t, pages, page_size)
    got_q = fused_ops.rope_and_cache_write(q, k, v, cos, sin, kc, vc, sp, so)
    ref_k[sp, :, so, :] = apply_rope(k, cos, sin).to(cache_dtype)
    ref_v[sp, :, so, :] = v.to(cache_dtype)
    # 16-bit: the same roundings exactly in the interpreter; compiled, the GPU may contract a multiply-add
    # (one ulp)
    # (one ulp of the products' magnitude, |x| < ~5 here, which near a cancellation is all of a small result)
    def tol(dt: torch.dtype) -> dict[str, float]:
        if dt == torch.float32:
            return dict(atol=1e-5, rtol=1e-5)
        if DEV.type == "cpu" and dtype == dt:
            return dict(atol=0, rtol=0)
        return dict(atol=4 * 5 * torch.finfo(dt).eps, rtol=torch.finfo(dt).eps)
    assert got_q.dtype == dtype
    torch.testing.assert_close(got_q, apply_rope(q, cos, sin), **tol(dtype))
    coarser = max(dtype, cache_dtype, key=lambda dt: torch.finfo(dt).eps)  # rotated in one, stored in the other
    torch.testing.assert_close(kc, ref_k, **tol(coarser))  # the whole pool: written slots and untouched rows
    assert torch.equal(vc, ref_v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_reference(dtype):
    gate = (torch.randn(3, 1001, device=DEV) * 4).to(dtype)  # more than one block, a partial last one
    up = torch.randn(3, 1001, device=DEV).to(dtype)
    got = fused_ops.silu_mul(gate, up)
    assert got.dtype == dtype
    torch.testing.assert_close(got, F.silu(gate) * up, **_tol(dtype))
    # the two halves of one merged gate/up GEMM's output: strided rows, read in place
    gu = torch.cat((gate, up), -1)
    g, u = gu.split(1001, -1)
    strided = fused_ops.silu_mul(g, u)
    assert strided.is_contiguous() and torch.isfinite(strided.float()).all()
    torch.testing.assert_close(strided, got, rtol=0, atol=0)


class _Freezing(DenseAttention):
    """Dense attention that freezes every other prefill row from layer 1 on (the early-freezing hook)."""

    def frozen_rows(self, layer: int, batch) -> torch.Tensor | None:
        if not batch.is_prefill or layer == 0:
            return None
        frozen = torch.zeros(batch.positions.shape[0], dtype=torch.bool, device=batch.positions.device)
        frozen[::2] = True
        return frozen


def _run(model, prompt: list[int], steps: list[int], freeze: bool) -> tuple[torch.Tensor, KVCache]:
    """Prefill logits of every position, then one decode step per token; returns them and the cache."""
    cache = KVCache(model.cfg, 8, 16, dtype=model.lm_head.weight.dtype, device=DEV)
    backend = (_Freezing if freeze else DenseAttention)(model.cfg.num_layers)
    cache.allocate(3, len(prompt) + len(steps))
    out = [model(torch.tensor(prompt, device=DEV), cache.prepare([3], [len(prompt)], True), cache, backend,
                 all_logits=True)]
    for tok in steps:
        out.append(model(torch.tensor([tok], device=DEV), cache.prepare([3], [1], False), cache, backend))
    return torch.cat(out), cache


@pytest.mark.parametrize("dtype,freeze", [(d, False) for d in DTYPES] + [(torch.float32, True)])
def test_model_forward_fused_matches_plain(dtype, freeze):
    """A tiny model's prefill and decode steps with the fused path forced on equal the PyTorch path's."""
    cfg = tiny_hf_config(num_kv_heads=2, group=3, layers=2)
    model = model_from_state(cfg, random_state(cfg, seed=int(torch.randint(0, 10_000, ()))).state_dict(),
                             dtype=dtype).to(DEV)
    prompt = torch.randint(0, cfg.vocab_size, (int(torch.randint(5, 20, ())),)).tolist()
    steps = torch.randint(0, cfg.vocab_size, (3,)).tolist()
    model.set_fused_ops("torch")
    ref, ref_cache = _run(model, prompt, steps, freeze)
    model.set_fused_ops("triton")
    got, cache = _run(model, prompt, steps, freeze)
    scale = ref.abs().max().item()
    tol = {torch.float32: 1e-5 if DEV.type == "cpu" else 1e-4, torch.float16: 5e-3, torch.bfloat16: 5e-2}[dtype]
    assert (got - ref).abs().max().item() <= tol * scale
    for layer in range(cfg.num_hidden_layers):
        for a, b in ((cache.k[layer], ref_cache.k[layer]), (cache.v[layer], ref_cache.v[layer])):
            torch.testing.assert_close(a, b, **_tol(dtype))


def test_switch_values():
    from raysparse.layers import fused_ops as choose

    x = torch.zeros(1, device=DEV)
    assert choose(x, "torch") is None
    assert choose(x, "triton") is fused_ops
    assert (choose(x) is fused_ops) == x.is_cuda  # "auto", the default
    with pytest.raises(ValueError):
        choose(x, "fast")


def test_set_fused_ops_reaches_every_module():
    """The model's mode is what its norms, attention and MLP blocks use; a bad mode is refused."""
    cfg = tiny_hf_config(num_kv_heads=2, group=2, layers=2)
    model = model_from_state(cfg, random_state(cfg).state_dict())
    model.set_fused_ops("torch")
    layer = model.model.layers[1]
    modes = {m.fused_mode for m in (model, model.model.norm, layer.input_layernorm, layer.self_attn, layer.mlp)}
    assert modes == {"torch"}
    assert RMSNorm(4, 1e-5).fused_mode == "auto"  # other models keep the default
    with pytest.raises(ValueError, match="fused ops mode"):
        model.set_fused_ops("fast")
