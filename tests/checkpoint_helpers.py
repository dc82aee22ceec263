"""Random-weight Llama checkpoints in sharded safetensors, as Hugging Face writes them, and gloo ranks that
load one shard by shard (``shard_load.load_model_shard``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def llama_config(hidden: int, heads: int, kv_heads: int, intermediate: int, layers: int, vocab: int, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                       max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **extra)


def random_llama_tensors(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random tensors under transformers' LlamaForCausalLM names (a tied head is left out, as
    ``save_pretrained`` leaves it out); norms near 1 so their handling matters."""
    g = torch.Generator().manual_seed(seed)
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv, ff = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    def norm() -> torch.Tensor:
        return 1.0 + torch.randn(h, generator=g) * 0.1

    t = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, h, generator=g)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm()
        for name, shape in (("q_proj", (q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)), ("o_proj", (h, q))):
            t[p + f"self_attn.{name}.weight"] = w(*shape)
            if getattr(cfg, "attention_bias", False):
                t[p + f"self_attn.{name}.bias"] = w(shape[0])
        t[p + "post_attention_layernorm.weight"] = norm()
        for name, shape in (("gate_proj", (ff, h)), ("up_proj", (ff, h)), ("down_proj", (h, ff))):
            t[p + f"mlp.{name}.weight"] = w(*shape)
            if getattr(cfg, "mlp_bias", False):
                t[p + f"mlp.{name}.bias"] = w(shape[0])
    t["model.norm.weight"] = norm()
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = w(cfg.vocab_size, h)
    return t


def write_sharded_checkpoint(directory: Path, cfg, shard_bytes: int, seed: int = 0) -> int:
    """Writes ``config.json``, ``model-0000k-of-0000n.safetensors`` files of about ``shard_bytes`` each and
    ``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``), as ``save_pretrained`` does
    with ``max_shard_size``. Returns the bytes of all the tensors."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(directory)
    tensors = random_llama_tensors(cfg, seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    wmap = {}
    for k, shard in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        wmap.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": wmap}, indent=2))
    return total


def tp_load_worker(rank: int, world: int, port: int, model_dir: str, ids: list[int], out_dir: str) -> None:
    """One gloo rank: loads its part of the checkpoint (``load_model_shard``), joins the group, runs one
    prefill; every rank saves its ``LoadStats``, rank 0 the logits of every position."""
    import torch.distributed as dist
    from helpers import full_logits

    from raysparse.loader import resolve_source
    from raysparse.shard_load import load_model_shard
    from raysparse.tensor_parallel import connect_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model, stats = load_model_shard(resolve_source(model_dir), rank, world)
        connect_group(model)
        logits = full_logits(model, ids)
        torch.save({"load": stats.as_dict(), "logits": logits if rank == 0 else None,
                    "kv_heads": model.num_kv_heads}, f"{out_dir}/rank{rank}.pt")
        dist.barrier()  # leave together (``helpers.tp_worker`` says why)
    finally:
        dist.destroy_process_group()


def run_tp_load(world: int, model_dir: Path, ids: list[int], out_dir: Path) -> list[dict]:
    """Every rank's saved result (``tp_load_worker``), in rank order."""
    import torch.multiprocessing as mp
    from helpers import free_port

    out_dir.mkdir(parents=True, exist_ok=True)
    mp.spawn(tp_load_worker, args=(world, free_port(), str(model_dir), ids, str(out_dir)), nprocs=world, join=True)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]
