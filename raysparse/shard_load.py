"""A tensor-parallel rank's part of a model, read slice by slice, and what reading it cost.

A tensor-parallel shard loads with ``load_model_shard``: from safetensors (one file or shards listed by
``model.safetensors.index.json``; a GGUF source's converted copy too) each rank reads only its own slices
(``raysparse.checkpoint``) into an empty model sharded as ``tensor_parallel.shard_plan`` says, and reports
the bytes it read and its peak host memory (``LoadStats``). Model sources, the GGUF conversion and the
whole-model loads it falls back on are ``raysparse.loader``'s.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from raysparse.checkpoint import (
    LoadStats,
    PeakHostMemory,
    checkpoint_bytes,
    read_parts,
    weight_files,
    weight_map,
)
from raysparse.layers import merge_projections
from raysparse.loader import ModelSource, build_model, load_hf_config, load_model, materialize
from raysparse.model import LlamaForCausalLM
from raysparse.rope import RotaryEmbedding, rope_parameters
from raysparse.tensor_parallel import shard_layers, shard_plan


def load_model_shard(src: ModelSource, rank: int = 0, world_size: int = 1, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu", hf_config: Any | None = None
                     ) -> tuple[LlamaForCausalLM, LoadStats]:
    """``rank``'s part of the model for a tensor-parallel group of ``world_size`` (the layout of
    ``tensor_parallel.shard_layers``, projections merged; ``tensor_parallel.connect_group`` wires it to the
    group), and what loading it cost (``LoadStats``).

    Safetensors weights are read part by part (``checkpoint.read_parts``): an empty model on the meta
    device is sharded first, then each of its tensors is read as the rank's slice of the checkpoint's, cast
    and placed on ``device`` one at a time, so no rank ever holds the whole model (at world size 1 the one
    rank reads everything, still without transformers building a model of its own). Other weights
    (``pytorch_model.bin``) cannot be sliced on read, nor can quantized ones be read without transformers'
    dequantization: transformers loads those whole, then they are sliced."""
    if src.gguf_file is not None:
        src = materialize(src)
    hf_config = hf_config if hf_config is not None else load_hf_config(src)
    wmap = weight_map(src.directory)
    if getattr(hf_config, "quantization_config", None):  # quantized tensors: transformers dequantizes them whole
        wmap = None
    t0 = time.perf_counter()
    if wmap is not None:  # the empty sharded model first: what it imports is no part of the load's memory
        model = shard_layers(build_model(hf_config, dtype=dtype, device="meta"), rank, world_size)
    with PeakHostMemory() as mem:
        if wmap is None:
            model = shard_layers(load_model(src, dtype, device, hf_config), rank, world_size)
            merge_projections(model)
            weights = weight_files(src.directory)
            total = sum(f.stat().st_size for f in weights)
            source, read, tensors, files = "whole", total, len(model.state_dict()), len(weights)
        else:
            plan = shard_plan(model.cfg, rank, world_size)
            # a tied head the files leave out: its rows are the embedding's, which every rank reads whole
            head = (plan.pop("lm_head.weight") if model.cfg.tie_word_embeddings and "lm_head.weight" in plan
                    and "lm_head.weight" not in wmap else None)
            state, read, opened = read_parts(src.directory, wmap, plan, dtype, device)
            if head is not None:
                dim, lo, hi = head
                state["lm_head.weight"] = state["model.embed_tokens.weight"].narrow(dim, lo, hi - lo).clone()
            tied = model.cfg.tie_word_embeddings and world_size == 1
            missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
            missing = [m for m in missing if not (tied and m == "lm_head.weight")]
            if missing or unexpected:
                raise ValueError(f"checkpoint does not match the Llama layout: missing={missing[:5]} "
                                 f"unexpected={unexpected[:5]}")
            del state
            if tied:
                model.lm_head.weight = model.model.embed_tokens.weight
            model.rotary = RotaryEmbedding(*rope_parameters(hf_config))  # built on the meta device above
            model = model.to(device=device).eval()
            merge_projections(model)
            total = checkpoint_bytes(src.directory, set(wmap.values()))
            source, tensors, files = "safetensors", len(plan), len(opened)
        stats = LoadStats(source=source, rank=rank, world_size=world_size, bytes_read=read, checkpoint_bytes=total,
                          tensors=tensors, files=files, host_rss_before_bytes=mem.before,
                          host_peak_bytes=mem.peak(), host_peak_exact=mem.exact,
                          seconds=time.perf_counter() - t0)
    return model, stats
