"""Tensor parallelism as a transform of the one-device model.

Column-parallel q/k/v and gate/up, row-parallel o and down, and one all-reduce after each attention
block and each MLP (the decoder layer's ``reduce`` hook). Heads are split by whole KV groups so a query
head always lives with its KV head. The split may be uneven (SmolLM2's 3 KV heads over 2 ranks give
2 + 1), so any world size up to the number of KV heads works.

The LM head is vocab-parallel: each rank computes the logits of its slice of the vocabulary and one
all-gather assembles them, so every rank holds the full logits (each rank samples or checks the same
tokens) while reading 1/N of the head's weights, which at batch 1 is a decode step's largest single read
after the layers (1 GB for Llama-3.1-8B). The embedding stays whole: a lookup reads only its rows.

``shard_plan`` names the part of every checkpoint tensor a rank holds. ``apply_tensor_parallel`` slices a
whole in-memory model by it; ``shard_load.load_model_shard`` reads only those parts of a safetensors
checkpoint into an empty model sharded the same way (``shard_layers`` on the meta device), so no rank
ever holds the whole model, and ``connect_group`` then wires either to the group's collectives.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from raysparse.all_reduce import ReduceNorm, collective_all_reduce
from raysparse.config import ModelConfig
from raysparse.layers import merge_projections
from raysparse.model import LlamaForCausalLM


def kv_head_range(num_kv_heads: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of the KV heads owned by ``rank``; earlier ranks take the remainder."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    if world_size > num_kv_heads:
        raise ValueError(f"tensor parallel size {world_size} exceeds the model's {num_kv_heads} KV heads")
    return shard_range(num_kv_heads, rank, world_size)


def shard_range(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of ``rank``'s share of n items; earlier ranks take the remainder."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


# Where a rank's part of a full tensor lies: (dim, start, end) along one dimension, or None for the whole.
Part = tuple[int, int, int] | None


def shard_plan(cfg: ModelConfig, rank: int, world_size: int) -> dict[str, Part]:
    """The part of each full (transformers-named) tensor that ``rank``'s model holds: column-parallel q/k/v
    and gate/up (rows), row-parallel o and down (columns), the vocab-parallel head (rows), the rest whole.
    A name left out is not held by this rank: the row-parallel biases live on rank 0 only (the group adds
    them once), and a head tied to the embedding is the embedding itself on one device. ``shard_layers``
    slices an in-memory model by this plan and ``shard_load.load_model_shard`` reads a checkpoint by it."""
    kv_lo, kv_hi = kv_head_range(cfg.num_kv_heads, rank, world_size)
    g, d = cfg.group_size, cfg.head_dim
    q = (kv_lo * g * d, kv_hi * g * d)
    kv = (kv_lo * d, kv_hi * d)
    ff = shard_range(cfg.intermediate_size, rank, world_size)
    plan: dict[str, Part] = {"model.embed_tokens.weight": None, "model.norm.weight": None}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        plan[p + "input_layernorm.weight"] = plan[p + "post_attention_layernorm.weight"] = None
        column = {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv,
                  "mlp.gate_proj": ff, "mlp.up_proj": ff}
        for name, (lo, hi) in column.items():
            plan[p + name + ".weight"] = (0, lo, hi)
            if cfg.mlp_bias if name.startswith("mlp.") else cfg.attention_bias:
                plan[p + name + ".bias"] = (0, lo, hi)
        for name, (lo, hi), bias in (("self_attn.o_proj", q, cfg.attention_bias), ("mlp.down_proj", ff, cfg.mlp_bias)):
            plan[p + name + ".weight"] = (1, lo, hi)
            if bias and rank == 0:
                plan[p + name + ".bias"] = None
    if world_size > 1 or not cfg.tie_word_embeddings:
        plan["lm_head.weight"] = (0, *shard_range(cfg.vocab_size, rank, world_size))
    return plan


def _part(t: torch.Tensor, part: Part) -> torch.Tensor:
    return t if part is None else t.narrow(part[0], part[1], part[2] - part[1])


def _sliced(linear: nn.Linear, prefix: str, plan: dict[str, Part]) -> nn.Linear:
    """A new linear holding the plan's part of ``linear`` (weight and, where the plan keeps it, bias)."""
    w = _part(linear.weight.data, plan[prefix + ".weight"])
    has_bias = linear.bias is not None and prefix + ".bias" in plan
    out = nn.Linear(w.shape[1], w.shape[0], bias=has_bias, device=w.device, dtype=w.dtype)
    out.weight.data.copy_(w)
    if has_bias:
        out.bias.data.copy_(_part(linear.bias.data, plan[prefix + ".bias"]))
    return out


def shard_layers(model: LlamaForCausalLM, rank: int, world_size: int) -> LlamaForCausalLM:
    """Keeps ``rank``'s part of every weight (``shard_plan``) and its heads, in place; no collectives yet
    (``connect_group``) and no merged projections (``merge_projections``, once the weights are final). Works
    on a model on the meta device too: the loader shards the empty model, then reads only those parts."""
    cfg = model.cfg
    kv_lo, kv_hi = kv_head_range(cfg.num_kv_heads, rank, world_size)
    model.tp_rank, model.tp_world_size, model.kv_head_offset = rank, world_size, kv_lo
    if world_size == 1:
        return model
    plan = shard_plan(cfg, rank, world_size)
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(attn, name, _sliced(getattr(attn, name), p + "self_attn." + name, plan))
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(mlp, name, _sliced(getattr(mlp, name), p + "mlp." + name, plan))
        attn.merged = mlp.merged = None
        attn.num_kv_heads = kv_hi - kv_lo
        attn.num_heads = (kv_hi - kv_lo) * cfg.group_size
    model.lm_head = _sliced(model.lm_head, "lm_head", plan)  # a copy: a tied embedding stays whole
    return model


def all_gather_last_fn(sizes: list[int], group: dist.ProcessGroup | None
                       ) -> Callable[[torch.Tensor], torch.Tensor]:
    """Concatenates every rank's [..., sizes[rank]] along the last dim. Parts are padded to the largest so
    one fixed-shape all-gather (capturable in a CUDA graph) does it on NCCL; gloo gathers a list."""
    width, world = max(sizes), len(sizes)
    nccl = dist.get_backend(group) == "nccl"

    def gather(x: torch.Tensor) -> torch.Tensor:
        part = x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))
        part = part.contiguous()
        if nccl:
            out = torch.empty((world, *part.shape), dtype=part.dtype, device=part.device)
            dist.all_gather_into_tensor(out, part, group=group)
            parts = list(out.unbind(0))
        else:
            parts = [torch.empty_like(part) for _ in range(world)]
            dist.all_gather(parts, part, group=group)
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes, strict=True)], -1)

    return gather


def connect_group(model: LlamaForCausalLM, group: dist.ProcessGroup | None = None,
                  reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  reduce_norm: ReduceNorm | None = None) -> LlamaForCausalLM:
    """Wires a sharded model (``shard_layers``) to its group: the all-reduce after each attention block and
    MLP (``reduce``, default: the process group's own), the fused all-reduce + add + norm where the group
    has one (``reduce_norm``), the all-gather of the vocab-parallel logits. One device: nothing to wire."""
    world_size = getattr(model, "tp_world_size", 1)
    if world_size == 1:
        return model
    cfg = model.cfg
    reduce = reduce if reduce is not None else collective_all_reduce(group)
    for layer in model.model.layers:
        layer.reduce = reduce
        layer.reduce_norm = reduce_norm
    sizes = [hi - lo for lo, hi in (shard_range(cfg.vocab_size, r, world_size) for r in range(world_size))]
    model.gather_logits = all_gather_last_fn(sizes, group)
    return model


def apply_tensor_parallel(model: LlamaForCausalLM, rank: int, world_size: int,
                          group: dist.ProcessGroup | None = None,
                          reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                          reduce_norm: ReduceNorm | None = None) -> LlamaForCausalLM:
    """Shards a whole in-memory ``model`` in place for ``rank`` of ``world_size`` (``shard_layers``), merges
    the shard's projections and wires it to the group (``connect_group``). World size 1 leaves it unchanged.
    ``reduce``: the group's SUM all-reduce (``raysparse.all_reduce.make_all_reduce``); default: the process
    group's own. ``reduce_norm``: the all-reduce fused with the residual add and norm after it, if the group
    has one (``raysparse.all_reduce.make_reduce_norm``). A checkpoint too big to hold whole on every rank is
    read already sharded instead (``shard_load.load_model_shard``), then wired with ``connect_group``."""
    shard_layers(model, rank, world_size)
    if world_size == 1:
        return model
    merge_projections(model)  # the shards' own slices, merged again
    return connect_group(model, group, reduce, reduce_norm)
