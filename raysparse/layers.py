"""The one-device Llama model's building blocks, which ``raysparse.model`` assembles into decoder layers:
RMSNorm, attention (RoPE, the paged cache write, the backend's attend), the SwiGLU MLP, and the merged
q/k/v and gate/up projections (``Merged``).

On CUDA the decoder layer's small elementwise ops run as fused Triton kernels (``raysparse.kernels.fused_ops``),
on CPUs in fp32 as C ones with the same interface (``raysparse.kernels.cpu_fused``): each
residual add with the norm after it (``RMSNorm.add_forward``), RoPE with the paged cache write, SiLU * up. They
round as the PyTorch code here does (the C ones up to the order of a sum), which is their oracle and the path
everywhere else.
``fused_ops`` picks by each module's ``fused_mode`` (set for a whole model by ``LlamaForCausalLM.set_fused_ops``,
the engine's ``RuntimeConfig.fused_ops``): ``auto`` (default: Triton on CUDA tensors when it is installed, C on
fp32 CPU tensors where a compiler built them), ``triton`` (always, so the CPU tests run the kernels in Triton's
interpreter), ``native`` (C on fp32 CPU tensors, PyTorch on others) or ``torch`` (never).
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from raysparse.attention import AttentionBackend
from raysparse.config import ModelConfig
from raysparse.kernels import cpu_fused
from raysparse.kernels.dispatch import linear
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.rope import apply_rope

FUSED_MODES = ("auto", "triton", "torch", "native")
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def fused_ops(x: torch.Tensor, mode: str = "auto") -> ModuleType | None:
    """The fused kernels' module when ``mode`` chooses them for ``x``'s device, else None: in ``auto`` the
    Triton kernels on CUDA and the C ones on CPUs for fp32 (``kernels.cpu_fused``, where a compiler built them);
    ``native`` the C ones only. Triton is imported on first use: CPU processes never import it, and tests set
    TRITON_INTERPRET before it."""
    if mode not in FUSED_MODES:
        raise ValueError(f"fused ops mode must be auto, triton, torch or native, got {mode!r}")
    if mode == "native" or (mode == "auto" and not x.is_cuda):
        return cpu_fused if not x.is_cuda and cpu_fused.available(x) else None
    if mode == "torch" or not _HAS_TRITON:
        return None
    from raysparse.kernels import fused_ops as ops

    return ops


class RMSNorm(nn.Module):
    fused_mode = "auto"  # ``fused_ops``'s mode; ``LlamaForCausalLM.set_fused_ops`` sets the model's

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = fused_ops(x, self.fused_mode)
        if ops is not None:
            return ops.rms_norm(x, self.weight, self.eps)
        return self.reference(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(h), h) for h = residual + x: the residual add fused with the norm that follows it."""
        ops = fused_ops(x, self.fused_mode)
        if ops is not None and x.dtype == residual.dtype:
            return ops.add_rms_norm(x, residual, self.weight, self.eps)
        h = residual + x
        return self.reference(h), h

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the weight, exactly as transformers does.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def _apply(proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A projection through the kernels' ``linear`` (oneDNN on CPUs), its module keeping the weights."""
    return linear(x, proj.weight, proj.bias)


class Merged:
    """Several linears that read the same input as one GEMM: at decode batch sizes a layer's launches, not
    its bytes, set much of a step's time. The parts keep their modules (loading, sharding and the state
    dict see the usual layout), re-pointed at views of the merged weight, so nothing is stored twice.
    ``weight()`` is None once a part no longer aliases it (e.g. after ``.to()`` or a reload), and the
    caller then runs the parts one by one."""

    def __init__(self, parts: list[nn.Linear]) -> None:
        with torch.no_grad():
            self.w = torch.cat([p.weight for p in parts])
            self.b = torch.cat([p.bias for p in parts]) if parts[0].bias is not None else None
            off = 0
            for p in parts:
                n = p.out_features
                p.weight = nn.Parameter(self.w[off:off + n], requires_grad=False)
                if self.b is not None:
                    p.bias = nn.Parameter(self.b[off:off + n], requires_grad=False)
                off += n
        self.parts, self.sizes = parts, [p.out_features for p in parts]

    def valid(self) -> bool:
        off, base, size = 0, self.w.data_ptr(), self.w.element_size() * self.w.shape[1]
        for p, n in zip(self.parts, self.sizes, strict=True):
            if p.weight.data_ptr() != base + off * size or p.out_features != n:
                return False
            off += n
        return True

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        if not self.valid():
            return None
        return list(linear(x, self.w, self.b).split(self.sizes, -1))


def merge_projections(model: nn.Module) -> None:
    """Merges every layer's q/k/v and gate/up projections (``Merged``); call once the weights are final
    (loaded, moved, sharded)."""
    for m in model.modules():
        if isinstance(m, Attention):
            m.merged = Merged([m.q_proj, m.k_proj, m.v_proj])
        elif isinstance(m, MLP):
            m.merged = Merged([m.gate_proj, m.up_proj])


class Attention(nn.Module):
    fused_mode = "auto"

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        d = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, cfg.hidden_size, bias=cfg.attention_bias)
        self.merged: Merged | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                batch: BatchMeta, backend: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.merged(x) if self.merged is not None else None
        q, k, v = qkv if qkv is not None else (_apply(self.q_proj, x), _apply(self.k_proj, x), _apply(self.v_proj, x))
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        ops = fused_ops(x, self.fused_mode)
        # The kernel takes a power-of-two head dim and one dtype for q, k, cos and sin (the model's).
        if (ops is not None and isinstance(cache, KVCache) and self.head_dim & (self.head_dim - 1) == 0
                and q.dtype == k.dtype == cos.dtype):
            q = ops.rope_and_cache_write(q, k, v, cos, sin, cache.k[self.layer], cache.v[self.layer],
                                         batch.slot_pages, batch.slot_offsets)
            cache.written(self.layer, batch)
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            cache.write(self.layer, k, v, batch)
        if batch.is_prefill:
            o = backend.prefill(self.layer, q, cache, batch)
        else:
            o = backend.decode(self.layer, q, cache, batch)
        return _apply(self.o_proj, o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    fused_mode = "auto"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.merged: Merged | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.merged(x) if self.merged is not None else None
        gate, up = gu if gu is not None else (_apply(self.gate_proj, x), _apply(self.up_proj, x))
        ops = fused_ops(x, self.fused_mode)
        return _apply(self.down_proj, ops.silu_mul(gate, up) if ops is not None else F.silu(gate) * up)
