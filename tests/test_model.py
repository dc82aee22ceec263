"""The one-device model against transformers' LlamaForCausalLM on the same weights."""

from __future__ import annotations

import pytest
import torch
from helpers import fresh_cache, full_logits, random_state, tiny_hf_config

from raysparse.attention import DenseAttention
from raysparse.generate import GenerationRequest, Generator
from raysparse.loader import model_from_state
from raysparse.sampling import SamplingParams


def test_smollm_logits_match_transformers_on_real_text(smollm, real_text):
    hf, ours, tok = smollm
    ids = tok(real_text[20000:40000])["input_ids"][:256]
    assert len(ids) == 256
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    out = full_logits(ours, ids)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() < 1e-3


def test_smollm_32_greedy_tokens_match_transformers(smollm, real_text):
    hf, ours, tok = smollm
    ids = tok(real_text[60000:70000])["input_ids"][:256]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
    gen = Generator(ours, fresh_cache(ours, 512), DenseAttention(ours.cfg.num_layers), tok)
    events = list(gen.generate([GenerationRequest(tuple(ids), SamplingParams(32, ignore_eos=True), "a")]))
    assert list(events[-1].token_ids) == ref
    assert gen.cache.free_pages == gen.cache.num_pages  # everything released


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128},
])
def test_tiny_random_llama_matches_transformers_with_rope_variants(rope):
    cfg = tiny_hf_config(rope_parameters=rope)
    hf = random_state(cfg, seed=int(torch.randint(0, 10_000, ()).item()))
    ours = model_from_state(cfg, hf.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (300,)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (full_logits(ours, ids) - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_close_to_fp32(dtype):
    cfg = tiny_hf_config()
    hf = random_state(cfg)
    ids = torch.randint(0, cfg.vocab_size, (64,)).tolist()
    ref = full_logits(model_from_state(cfg, hf.state_dict()), ids)
    half = full_logits(model_from_state(cfg, hf.state_dict(), dtype=dtype), ids)
    assert half.dtype == torch.float32
    assert (half - ref).abs().max().item() < 0.05 * ref.abs().max().item()


def _decode_logits(model, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Prefill the prompt, then feed the continuation one token at a time through the KV cache."""
    cache = fresh_cache(model, 1024)
    backend = DenseAttention(model.cfg.num_layers)
    cache.allocate(7, len(prompt) + len(continuation))
    out = [model(torch.tensor(prompt), cache.prepare([7], [len(prompt)], True), cache, backend)[0]]
    for t in continuation[:-1]:
        out.append(model(torch.tensor([t]), cache.prepare([7], [1], False), cache, backend)[0])
    return torch.stack(out)


def test_decode_with_kv_cache_equals_full_recompute():
    cfg = tiny_hf_config()
    model = model_from_state(cfg, random_state(cfg).state_dict())
    ids = torch.randint(0, cfg.vocab_size, (150,)).tolist()
    prompt, cont = ids[:100], ids[100:]
    stepped = _decode_logits(model, prompt, cont)
    full = full_logits(model, ids)[99:149]
    assert torch.allclose(stepped, full, atol=1e-4, rtol=1e-4)


def test_batched_ragged_sequences_equal_running_alone():
    cfg = tiny_hf_config()
    model = model_from_state(cfg, random_state(cfg).state_dict())
    lens = [37, 130, 5, 64]
    prompts = [tuple(torch.randint(0, cfg.vocab_size, (n,)).tolist()) for n in lens]
    params = [SamplingParams(12, ignore_eos=True), SamplingParams(3, ignore_eos=True),
              SamplingParams(20, ignore_eos=True), SamplingParams(7, ignore_eos=True)]

    def run(reqs):
        gen = Generator(model, fresh_cache(model, 2048), DenseAttention(model.cfg.num_layers))
        return {e.request_id: e.token_ids for e in gen.generate(reqs) if hasattr(e, "finish_reason")}

    reqs = [GenerationRequest(p, sp, str(i)) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    together = run(reqs)
    alone = {r.request_id: run([r])[r.request_id] for r in reqs}
    assert together == alone
    assert [len(together[str(i)]) for i in range(4)] == [12, 3, 20, 7]


def test_merged_projections_alias_and_fall_back_after_a_move():
    """q/k/v and gate/up run as one GEMM each once merged; the separate modules stay views of the merged
    weight, and a model whose parts stopped aliasing it (``.to()``) runs them one by one, same outputs."""
    from helpers import tiny_model

    from raysparse.layers import Attention

    model = tiny_model("cpu", num_kv_heads=2, group=2, layers=2)
    attn = next(m for m in model.modules() if isinstance(m, Attention))
    assert attn.merged is not None and attn.merged.valid()
    assert attn.k_proj.weight.data_ptr() == attn.merged.w[attn.q_proj.out_features:].data_ptr()
    x = torch.randn(5, model.cfg.hidden_size)
    q, k, v = attn.merged(x)
    torch.testing.assert_close(torch.cat((q, k, v), -1),
                               torch.cat((attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)), -1))
    ids = torch.randint(0, model.cfg.vocab_size, (30,)).tolist()
    before = full_logits(model, ids)
    model.to(torch.float64).to(torch.float32)  # new storage for every parameter: the merge no longer holds
    assert not attn.merged.valid()
    torch.testing.assert_close(full_logits(model, ids), before)
