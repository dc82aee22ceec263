"""Tensor parallelism as a transform of the one-device model.

Column-parallel q/k/v and gate/up, row-parallel o and down, and one all-reduce after each attention
block and each MLP (the decoder layer's ``reduce`` hook). Heads are split by whole KV groups so a query
head always lives with its KV head. The split may be uneven (SmolLM2's 3 KV heads over 2 ranks give
2 + 1), so any world size up to the number of KV heads works.

The LM head is vocab-parallel: each rank computes the logits of its slice of the vocabulary and one
all-gather assembles them, so every rank holds the full logits (each rank samples or checks the same
tokens) while reading 1/N of the head's weights, which at batch 1 is a decode step's largest single read
after the layers (1 GB for Llama-3.1-8B). The embedding stays whole: a lookup reads only its rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from raysparse.all_reduce import ReduceNorm, collective_all_reduce
from raysparse.model import LlamaForCausalLM, merge_projections


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


def _column(linear: nn.Linear, lo: int, hi: int) -> nn.Linear:
    out = nn.Linear(linear.in_features, hi - lo, bias=linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype)
    out.weight.data.copy_(linear.weight.data[lo:hi])
    if linear.bias is not None:
        out.bias.data.copy_(linear.bias.data[lo:hi])
    return out


def _row(linear: nn.Linear, lo: int, hi: int, keep_bias: bool) -> nn.Linear:
    # The bias is added once across the group: only rank 0 keeps it.
    has_bias = linear.bias is not None and keep_bias
    out = nn.Linear(hi - lo, linear.out_features, bias=has_bias,
                    device=linear.weight.device, dtype=linear.weight.dtype)
    out.weight.data.copy_(linear.weight.data[:, lo:hi])
    if has_bias:
        out.bias.data.copy_(linear.bias.data)
    return out


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


def apply_tensor_parallel(model: LlamaForCausalLM, rank: int, world_size: int,
                          group: dist.ProcessGroup | None = None,
                          reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                          reduce_norm: ReduceNorm | None = None) -> LlamaForCausalLM:
    """Shards ``model`` in place for ``rank`` of ``world_size``. World size 1 leaves it unchanged.
    ``reduce``: the group's SUM all-reduce (``raysparse.all_reduce.make_all_reduce``); default: the process
    group's own. ``reduce_norm``: the all-reduce fused with the residual add and norm after it, if the group
    has one (``raysparse.all_reduce.make_reduce_norm``)."""
    cfg = model.cfg
    kv_lo, kv_hi = kv_head_range(cfg.num_kv_heads, rank, world_size)
    if world_size == 1:
        return model
    g, d = cfg.group_size, cfg.head_dim
    ff_lo, ff_hi = shard_range(cfg.intermediate_size, rank, world_size)
    reduce = reduce if reduce is not None else collective_all_reduce(group)
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.q_proj = _column(attn.q_proj, kv_lo * g * d, kv_hi * g * d)
        attn.k_proj = _column(attn.k_proj, kv_lo * d, kv_hi * d)
        attn.v_proj = _column(attn.v_proj, kv_lo * d, kv_hi * d)
        attn.o_proj = _row(attn.o_proj, kv_lo * g * d, kv_hi * g * d, keep_bias=rank == 0)
        attn.num_kv_heads = kv_hi - kv_lo
        attn.num_heads = (kv_hi - kv_lo) * g
        mlp = layer.mlp
        mlp.gate_proj = _column(mlp.gate_proj, ff_lo, ff_hi)
        mlp.up_proj = _column(mlp.up_proj, ff_lo, ff_hi)
        mlp.down_proj = _row(mlp.down_proj, ff_lo, ff_hi, keep_bias=rank == 0)
        layer.reduce = reduce
        layer.reduce_norm = reduce_norm
    sizes = [hi - lo for lo, hi in (shard_range(cfg.vocab_size, r, world_size) for r in range(world_size))]
    v_lo, v_hi = shard_range(cfg.vocab_size, rank, world_size)
    model.lm_head = _column(model.lm_head, v_lo, v_hi)  # a copy: a tied embedding stays whole
    model.gather_logits = all_gather_last_fn(sizes, group)
    merge_projections(model)  # the shards' own slices, merged again
    model.tp_rank, model.tp_world_size = rank, world_size
    model.kv_head_offset = kv_lo
    return model
