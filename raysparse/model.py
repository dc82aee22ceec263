"""A compact Llama-family model for one device.

Parameter names mirror transformers' ``LlamaForCausalLM`` so its state dict loads unchanged. Tensor
parallelism is a separate transform (``raysparse.tensor_parallel``); this file knows nothing about it
except that attention and MLP outputs pass through ``self.reduce`` (identity on one device).

On CUDA the decoder layer's small elementwise ops run as fused Triton kernels (``raysparse.kernels.fused_ops``):
each residual add with the norm after it (the MLP's output is carried to the next layer's input norm or the
final norm as ``pending``), RoPE with the paged cache write, SiLU * up. They round as the PyTorch code here
does, which is their oracle and the path everywhere else. ``set_fused_ops`` (the engine's
``RuntimeConfig.fused_ops``) picks: ``auto`` (default: fused on CUDA tensors when Triton is installed),
``triton`` (always, so the CPU tests run the kernels in Triton's interpreter) or ``torch`` (never). With
rows frozen by early token freezing the layer's residual adds stay separate PyTorch ops over the live rows.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from raysparse.attention import AttentionBackend
from raysparse.config import ModelConfig
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.rope import RotaryEmbedding, apply_rope

FUSED_MODES = ("auto", "triton", "torch")
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def fused_ops(x: torch.Tensor, mode: str = "auto") -> ModuleType | None:
    """The fused kernels' module when ``mode`` chooses them for ``x``'s device, else None. Imported on first
    use: CPU processes never import Triton, and tests set TRITON_INTERPRET before it."""
    if mode not in FUSED_MODES:
        raise ValueError(f"fused ops mode must be auto, triton or torch, got {mode!r}")
    if mode == "torch" or not _HAS_TRITON or (mode == "auto" and not x.is_cuda):
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
        return list(F.linear(x, self.w, self.b).split(self.sizes, -1))


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
        q, k, v = qkv if qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        ops = fused_ops(x, self.fused_mode)
        # The kernel takes a power-of-two head dim and one dtype for q, k, cos and sin (the model's).
        if (ops is not None and isinstance(cache, KVCache) and self.head_dim & (self.head_dim - 1) == 0
                and q.dtype == k.dtype == cos.dtype):
            q = ops.rope_and_cache_write(q, k, v, cos, sin, cache.k[self.layer], cache.v[self.layer],
                                         batch.slot_pages, batch.slot_offsets)
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            cache.write(self.layer, k, v, batch)
        if batch.is_prefill:
            o = backend.prefill(self.layer, q, cache, batch)
        else:
            o = backend.decode(self.layer, q, cache, batch)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


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
        gate, up = gu if gu is not None else (self.gate_proj(x), self.up_proj(x))
        ops = fused_ops(x, self.fused_mode)
        return self.down_proj(ops.silu_mul(gate, up) if ops is not None else F.silu(gate) * up)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Replaced by an all-reduce over the tensor-parallel group; one per attention block and per MLP.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = _identity
        # Set by tensor parallelism where the group has it: all-reduce + residual add + norm in one launch,
        # (partial, residual, norm) -> (norm(h), h). The MLP's output then stays a partial sum until the next
        # norm (the next layer's, or the final one) reduces it (``finish``).
        self.reduce_norm: Callable[[torch.Tensor, torch.Tensor, RMSNorm], tuple[torch.Tensor, torch.Tensor]] | None \
            = None

    def add_norm(self, x: torch.Tensor, h: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(h + reduce(x)), h + reduce(x)) for x a partial sum across the group."""
        if self.reduce_norm is not None:
            return self.reduce_norm(x, h, norm)
        return norm.add_forward(self.reduce(x), h)

    def finish(self, mlp: torch.Tensor) -> torch.Tensor:
        """The MLP output that ``forward_pending`` left pending, reduced where it is still a partial sum."""
        return self.reduce(mlp) if self.reduce_norm is not None else mlp

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                batch: BatchMeta, backend: AttentionBackend) -> torch.Tensor:
        h, mlp = self.forward_pending(h, None, cos, sin, cache, batch, backend)
        return h if mlp is None else h + self.finish(mlp)

    def forward_pending(self, h: torch.Tensor, pending: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                        cache: KVCache, batch: BatchMeta,
                        backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer over the input ``h + pending`` (``pending``: the previous layer's MLP output not yet
        added, or None). Returns (h, mlp) whose sum is the output: the MLP's residual add is left to the
        next norm, which fuses it (``RMSNorm.add_forward``); mlp is None when the add was done here. With
        ``reduce_norm`` the pending MLP output is a partial sum still to be reduced (every layer of a model
        is set alike)."""
        # Optional backend hook (early token freezing): bool [T] of rows whose hidden state is carried
        # unchanged through this layer. Their K/V are still projected and cached (the backend decides what
        # they attend, usually nothing); the residual updates and the MLP run on the other rows only.
        hook = getattr(backend, "frozen_rows", None)
        frozen = hook(self.self_attn.layer, batch) if hook is not None else None
        if frozen is None:
            if pending is None:
                x = self.input_layernorm(h)
            else:
                x, h = self.add_norm(pending, h, self.input_layernorm)
            x, h = self.add_norm(self.self_attn(x, cos, sin, cache, batch, backend), h, self.post_attention_layernorm)
            mlp = self.mlp(x)
            return h, (mlp if self.reduce_norm is not None else self.reduce(mlp))
        if pending is not None:
            h = h + self.finish(pending)
        attn = self.reduce(self.self_attn(self.input_layernorm(h), cos, sin, cache, batch, backend))
        live = (~frozen).nonzero().squeeze(1)
        hl = h[live] + attn[live]
        hl = hl + self.reduce(self.mlp(self.post_attention_layernorm(hl)))
        return h.index_copy(0, live, hl), None


class LlamaBody(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    fused_mode = "auto"

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = rotary
        # Set by tensor parallelism (a vocab-parallel head): assembles every rank's slice of the logits.
        self.gather_logits: Callable[[torch.Tensor], torch.Tensor] | None = None

    def set_fused_ops(self, mode: str) -> None:
        """The fused elementwise kernels' mode (``fused_ops``) for every module of the model."""
        if mode not in FUSED_MODES:
            raise ValueError(f"fused ops mode must be auto, triton or torch, got {mode!r}")
        for m in self.modules():
            if isinstance(m, (RMSNorm, Attention, MLP, LlamaForCausalLM)):
                m.fused_mode = mode

    @property
    def num_kv_heads(self) -> int:
        """KV heads held on this device (fewer than the config's under tensor parallelism)."""
        return self.model.layers[0].self_attn.num_kv_heads

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        batch: BatchMeta,
        cache: KVCache,
        backend: AttentionBackend,
        all_logits: bool = False,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """input_ids: packed [T]. Returns logits of each sequence's last token [num_seqs, V], or of
        every token [T, V] with ``all_logits``; fp32 either way."""
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(batch.positions, h.dtype)
        mlp = None
        fused = fused_ops(h, self.fused_mode) is not None
        for i, layer in enumerate(self.model.layers):
            if fused:  # each MLP's residual add rides in the next layer's fused input norm
                h, mlp = layer.forward_pending(h, mlp, cos, sin, cache, batch, backend)
            else:  # the plain path calls the module, so forward hooks (tests, tracing) see every layer
                h = layer(h, cos, sin, cache, batch, backend)
            if on_layer is not None:
                on_layer(i)
        if not all_logits:
            rows = batch.last_token_rows()
            h, mlp = h[rows], (None if mlp is None else mlp[rows])
        x = self.model.norm(h) if mlp is None else self.model.layers[-1].add_norm(mlp, h, self.model.norm)[0]
        logits = self.lm_head(x)
        if self.gather_logits is not None:
            logits = self.gather_logits(logits)
        return logits.float()
