"""A compact Llama-family model for one device.

Parameter names mirror transformers' ``LlamaForCausalLM`` so its state dict loads unchanged. Tensor
parallelism is a separate transform (``raysparse.tensor_parallel``); this file knows nothing about it
except that attention and MLP outputs pass through ``self.reduce`` (identity on one device).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from raysparse.attention import AttentionBackend
from raysparse.config import ModelConfig
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.rope import RotaryEmbedding, apply_rope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the weight, exactly as transformers does.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class Attention(nn.Module):
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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                batch: BatchMeta, backend: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        q = apply_rope(self.q_proj(x).view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        cache.write(self.layer, k, v, batch)
        if batch.is_prefill:
            o = backend.prefill(self.layer, q, cache, batch)
        else:
            o = backend.decode(self.layer, q, cache, batch)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                batch: BatchMeta, backend: AttentionBackend) -> torch.Tensor:
        # Optional backend hook (early token freezing): bool [T] of rows whose hidden state is carried
        # unchanged through this layer. Their K/V are still projected and cached (the backend decides what
        # they attend, usually nothing); the residual updates and the MLP run on the other rows only.
        hook = getattr(backend, "frozen_rows", None)
        frozen = hook(self.self_attn.layer, batch) if hook is not None else None
        if frozen is None:
            h = h + self.reduce(self.self_attn(self.input_layernorm(h), cos, sin, cache, batch, backend))
            return h + self.reduce(self.mlp(self.post_attention_layernorm(h)))
        attn = self.reduce(self.self_attn(self.input_layernorm(h), cos, sin, cache, batch, backend))
        live = (~frozen).nonzero().squeeze(1)
        hl = h[live] + attn[live]
        hl = hl + self.reduce(self.mlp(self.post_attention_layernorm(hl)))
        return h.index_copy(0, live, hl)


class LlamaBody(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = rotary

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
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, cache, batch, backend)
            if on_layer is not None:
                on_layer(i)
        if not all_logits:
            h = h[batch.last_token_rows()]
        return self.lm_head(self.model.norm(h)).float()
