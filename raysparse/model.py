"""A compact Llama-family model for one device.

Parameter names mirror transformers' ``LlamaForCausalLM`` so its state dict loads unchanged. Tensor
parallelism is a separate transform (``raysparse.tensor_parallel``); this file knows nothing about it
except that attention and MLP outputs pass through ``self.reduce`` (identity on one device).

The building blocks (RMSNorm, attention, MLP, merged projections, the choice of fused kernels) are
``raysparse.layers``'s. With fused kernels (on CUDA by default) each residual add runs with the norm after
it, so the MLP's output is carried to the next layer's input norm or the final norm as ``pending``.
``set_fused_ops`` (the engine's ``RuntimeConfig.fused_ops``) picks ``auto``, ``triton`` or ``torch`` for
every module of the model. With rows frozen by early token freezing the layer's residual adds stay separate
PyTorch ops over the live rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from raysparse.attention import AttentionBackend
from raysparse.config import ModelConfig
from raysparse.kernels.dispatch import linear
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.layers import FUSED_MODES, MLP, Attention, RMSNorm, fused_ops
from raysparse.rope import RotaryEmbedding


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
        # (partial, residual, norm) -> (norm(h), h). ``forward_pending`` leaves the MLP's output a partial sum
        # either way; the next norm (the next layer's, or the final one) reduces it (``add_norm``, ``finish``).
        self.reduce_norm: Callable[[torch.Tensor, torch.Tensor, RMSNorm], tuple[torch.Tensor, torch.Tensor]] | None \
            = None

    def add_norm(self, x: torch.Tensor, h: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(h + reduce(x)), h + reduce(x)) for x a partial sum across the group."""
        if self.reduce_norm is not None:
            return self.reduce_norm(x, h, norm)
        return norm.add_forward(self.reduce(x), h)

    def finish(self, mlp: torch.Tensor) -> torch.Tensor:
        """The MLP output that ``forward_pending`` left pending (a partial sum across the group), reduced."""
        return self.reduce(mlp)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                batch: BatchMeta, backend: AttentionBackend) -> torch.Tensor:
        h, mlp = self.forward_pending(h, None, cos, sin, cache, batch, backend)
        return h if mlp is None else h + self.finish(mlp)

    def forward_pending(self, h: torch.Tensor, pending: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                        cache: KVCache, batch: BatchMeta,
                        backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer over the input ``h + pending`` (``pending``: the previous layer's MLP output not yet
        added, or None), both as partial sums across the tensor-parallel group. Returns (h, mlp) with
        ``h + reduce(mlp)`` the output: the MLP's all-reduce and residual add are left to the next norm, which
        fuses them (``add_norm``); mlp is None when the add was done here."""
        # Early token freezing (``AttentionBackend.frozen_rows``): the residual updates and the MLP run on the
        # other rows only.
        frozen = backend.frozen_rows(self.self_attn.layer, batch)
        if frozen is None:
            if pending is None:
                x = self.input_layernorm(h)
            else:
                x, h = self.add_norm(pending, h, self.input_layernorm)
            x, h = self.add_norm(self.self_attn(x, cos, sin, cache, batch, backend), h, self.post_attention_layernorm)
            mlp = self.mlp(x)
            return h, mlp  # reduced once, by the norm that adds it (reducing here too summed it twice)
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
        backend.begin_step(cache, batch)  # the method's per-step state, once, before the layers read it
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
        logits = linear(x, self.lm_head.weight)
        if self.gather_logits is not None:
            logits = self.gather_logits(logits)
        return logits.float()
