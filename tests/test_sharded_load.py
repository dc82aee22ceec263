"""Big checkpoints: a sharded safetensors checkpoint is read slice by slice, each tensor-parallel rank reading
only its own part (``shard_load.load_model_shard``), and gives the logits of one device and of transformers."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from checkpoint_helpers import llama_config, run_tp_load, write_sharded_checkpoint
from helpers import fresh_cache, full_logits, random_state, tiny_hf_config

from raysparse.checkpoint import LoadStats, PeakHostMemory, weight_map
from raysparse.loader import model_from_state, resolve_source
from raysparse.shard_load import load_model_shard
from raysparse.tensor_parallel import shard_layers, shard_plan

# Sizes in the proportions of a real Llama (the whole embedding is a few percent of the weights), so a rank
# of two reads a little over half. "large" is the few-hundred-MB checkpoint; "small" the same test in seconds.
SIZES = {
    "small": dict(hidden=512, heads=8, kv_heads=4, intermediate=1408, layers=8, vocab=4000),  # 110 MB
    "large": dict(hidden=1024, heads=16, kv_heads=4, intermediate=2816, layers=8, vocab=16000),  # 490 MB
}


def _biased_tied_config():
    cfg = tiny_hf_config(num_kv_heads=3, group=2, layers=2)  # 3 KV heads over 2 ranks: a 2 + 1 split
    cfg.attention_bias = cfg.mlp_bias = cfg.tie_word_embeddings = True
    return cfg


@pytest.mark.parametrize("make_cfg", [tiny_hf_config, _biased_tied_config], ids=["plain", "biased-tied"])
def test_shard_plan_is_what_sharding_a_whole_model_keeps(make_cfg):
    """The plan the loader reads by names exactly the tensors, and the parts of them, that slicing a whole
    in-memory model keeps on each rank (``shard_layers``, which ``apply_tensor_parallel`` runs)."""
    cfg = make_cfg()
    full = {k: v.clone() for k, v in model_from_state(cfg, random_state(cfg, seed=3).state_dict()).state_dict().items()}
    for world in (1, 2, 3):
        for rank in range(world):
            model = shard_layers(model_from_state(cfg, random_state(cfg, seed=3).state_dict()), rank, world)
            held = model.state_dict()
            plan = shard_plan(model.cfg, rank, world)
            tied_here = cfg.tie_word_embeddings and world == 1
            assert set(plan) == set(held) - ({"lm_head.weight"} if tied_here else set())
            for name, part in plan.items():
                want = full[name] if part is None else full[name].narrow(part[0], part[1], part[2] - part[1])
                assert torch.equal(held[name], want), (world, rank, name)
            if cfg.attention_bias and rank > 0:  # row-parallel biases are added once, by rank 0
                assert "model.layers.0.self_attn.o_proj.bias" not in plan


def test_biased_tied_checkpoint_loads_each_ranks_part_in_process(tmp_path):
    """Biases, a head tied to the embedding (absent from the files, so its rows come from the embedding) and
    uneven heads, over many small files: every rank's loaded part equals the in-memory sharding of the
    transformers model saved there, TP=1's logits equal transformers', and each rank reads only its part."""
    cfg = _biased_tied_config()
    hf = random_state(cfg, seed=11)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and "lm_head.weight" not in weight_map(tmp_path)
    src = resolve_source(tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (40,)).tolist()
    one, stats = load_model_shard(src)
    assert one.lm_head.weight is one.model.embed_tokens.weight  # still tied on one device
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (full_logits(one, ids) - ref).abs().max().item() < 1e-4
    assert stats.source == "safetensors" and stats.bytes_read == stats.checkpoint_bytes and stats.files > 1
    for rank in range(2):
        part, stats = load_model_shard(src, rank, 2)
        whole = shard_layers(model_from_state(cfg, hf.state_dict()), rank, 2)
        a, b = part.state_dict(), whole.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert part.kv_head_offset == (0, 2)[rank] and part.num_kv_heads == (2, 1)[rank]
        assert stats.bytes_read < stats.checkpoint_bytes


def test_bin_weights_load_whole_then_sliced(tmp_path):
    """Weights that cannot be sliced on read (``pytorch_model.bin``) still load, whole through transformers,
    then sliced: the same part as the in-memory sharding, reported as source ``whole``."""
    cfg = tiny_hf_config(num_kv_heads=2, group=2, layers=2)
    hf = random_state(cfg, seed=5)
    cfg.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    assert weight_map(tmp_path) is None
    part, stats = load_model_shard(resolve_source(tmp_path), 1, 2)
    whole = shard_layers(model_from_state(cfg, hf.state_dict()), 1, 2)
    a, b = part.state_dict(), whole.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert stats.source == "whole" and stats.bytes_read == stats.checkpoint_bytes > 0 and stats.files == 1


def test_peak_host_memory_sees_an_allocation():
    # The process frees memory of its own meanwhile (the garbage collector, other threads), which lowers the
    # resident size under ``before``: the allocation is large against that noise, and the collector is idle.
    gc.collect()
    gc.disable()
    try:
        with PeakHostMemory() as mem:
            x = torch.ones(256 * 2**20 // 4)  # 256 MiB, touched
            del x
    finally:
        gc.enable()
    if not mem.exact:
        pytest.skip("this kernel does not reset the peak resident memory")
    assert mem.peak() - mem.before >= 192 * 2**20


@pytest.mark.parametrize("size", ["small", pytest.param("large", marks=pytest.mark.slow)])
def test_sharded_checkpoint_tp2_gloo_reads_its_slices_and_matches_tp1_and_transformers(size, tmp_path):
    """A random-weight Llama written as sharded safetensors (``model.safetensors.index.json``) loads at TP=2
    over gloo with each rank reading at most 60% of the weight bytes and holding well under the whole model
    at its peak, and the logits equal TP=1's and a transformers LlamaForCausalLM's built from the same
    directory."""
    from transformers import LlamaForCausalLM

    cfg = llama_config(**SIZES[size])
    model_dir = tmp_path / "ckpt"
    total = write_sharded_checkpoint(model_dir, cfg, shard_bytes=(4 if size == "small" else 100) * 2**20)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 4 and index["metadata"]["total_size"] == total
    ids = torch.randint(0, cfg.vocab_size, (48,), generator=torch.Generator().manual_seed(7)).tolist()

    # each size in fresh processes, so the peak host memory is the load's, not this process's history
    (tp1_out,) = run_tp_load(1, model_dir, ids, tmp_path / "tp1")
    tp1, tp1_logits = LoadStats.from_dict(tp1_out["load"]), tp1_out["logits"]
    assert tp1.bytes_read == tp1.checkpoint_bytes == total
    print(f"\nTP=1 {tp1.summary()}")

    tp2 = run_tp_load(2, model_dir, ids, tmp_path / "tp2")
    for out in tp2:
        print(f"TP=2 {LoadStats.from_dict(out['load']).summary()}")
    for r, out in enumerate(tp2):
        load = out["load"]
        assert load["source"] == "safetensors" and load["rank"] == r and load["checkpoint_bytes"] == total
        assert load["bytes_read"] <= 0.6 * total, load
    assert sum(out["load"]["bytes_read"] for out in tp2) >= total  # between them they read every tensor
    assert (tp2[0]["logits"] - tp1_logits).abs().max().item() < 1e-4

    if tp1.host_peak_exact and all(out["load"]["host_peak_exact"] for out in tp2):
        # one device holds the whole model at its peak; a rank of two never does (its part and one tensor)
        assert tp1.host_peak_bytes - tp1.host_rss_before_bytes >= 0.9 * total
        for out in tp2:
            assert out["load"]["host_peak_bytes"] - out["load"]["host_rss_before_bytes"] <= 0.75 * total, out["load"]

    ref = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids])).logits[0]
    assert (tp1_logits - ref_logits).abs().max().item() < 1e-4


@pytest.mark.timeout(600)
def test_engine_shards_read_their_slices_and_report_it(tmp_path):
    """The engine's shard actors load a sharded checkpoint slice by slice at TP=2: the server info (and its
    gRPC form) carries each shard's bytes read and peak host memory, and greedy tokens equal one device's."""
    import ray

    from raysparse.attention import DenseAttention
    from raysparse.generate import GenerationRequest, Generator
    from raysparse.orchestration.engine import Engine, EngineConfig, EngineRequest
    from raysparse.orchestration.ray_env import start_ray
    from raysparse.sampling import SamplingParams
    from raysparse.serving.servicer import server_info_to_proto

    cfg = llama_config(**SIZES["small"])
    total = write_sharded_checkpoint(tmp_path, cfg, shard_bytes=4 * 2**20, seed=2)
    prompt = tuple(torch.randint(0, cfg.vocab_size, (60,), generator=torch.Generator().manual_seed(1)).tolist())
    one, _ = load_model_shard(resolve_source(tmp_path))
    gen = Generator(one, fresh_cache(one, 256), DenseAttention(one.cfg.num_layers))
    want = list(gen.generate([GenerationRequest(prompt, SamplingParams(8, ignore_eos=True), "a")]))[-1].token_ids

    owns = start_ray(None, num_cpus=2)
    engine = Engine(EngineConfig(model=str(tmp_path), tp=2, kv_cache_tokens=1024, cpus_per_shard=0.5,
                                 draft=False)).start()
    try:
        fin = engine.submit(EngineRequest(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))).result(300)
        assert fin.finish_reason == "length", fin.error
        assert list(fin.token_ids) == list(want)
        shards = engine.server_info()["replicas"][0]["shards"]
        loads = [s["load"] for s in shards]
        assert [s["rank"] for s in loads] == [0, 1]
        for load in loads:
            assert load["source"] == "safetensors" and load["checkpoint_bytes"] == total
            assert 0 < load["bytes_read"] <= 0.6 * total and load["host_peak_bytes"] > 0
        proto = server_info_to_proto(engine.server_info()).replicas[0].shards
        assert [s.load.bytes_read for s in proto] == [s["bytes_read"] for s in loads]
        assert all(s.load.source == "safetensors" and s.load.checkpoint_bytes == total for s in proto)
    finally:
        engine.shutdown()
        if owns:
            ray.shutdown()
