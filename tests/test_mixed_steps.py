"""Mixed steps: running sequences' decode tokens riding in a prefill step as one-token rows (dense's
``mixed_steps``). Dense's prefill attends those rows by the paged decode over their pages in place; its output,
and a mixed step's logits through the shard, must equal the reference and the separate steps."""

from __future__ import annotations

import torch
from helpers import DEVICES, tiny_model

from raysparse.attention import DenseAttention
from raysparse.kv_cache import KVCache
from raysparse.methods.registry import method_capabilities
from raysparse.sampling import SamplingParams
from raysparse.shard_executor import ShardExecutor
from raysparse.step_plan import StepPlan, method_key


def _seed() -> int:
    seed = int(torch.randint(0, 2**31 - 1, ()))
    print(f"seed {seed}")
    torch.manual_seed(seed)
    return seed


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention in fp64 of q [n_q, h, d] (the last n_q positions) over k, v [h_kv, n, d]."""
    n_q, h, d = q.shape
    h_kv, n = k.shape[0], k.shape[1]
    kk = k.double().repeat_interleave(h // h_kv, 0)
    vv = v.double().repeat_interleave(h // h_kv, 0)
    s = torch.einsum("qhd,hkd->hqk", q.double(), kk) / d ** 0.5
    pos = torch.arange(n - n_q, n)[:, None]
    s = s.masked_fill(torch.arange(n)[None, :] > pos, float("-inf"))
    return torch.einsum("hqk,hkd->qhd", s.softmax(-1), vv)


def test_only_dense_mixes():
    assert method_capabilities("dense").mixed_steps
    assert not any(method_capabilities(m).mixed_steps for m in ("streaming", "quest", "sketch_walk", "specattn"))


def test_dense_prefill_of_one_token_rows_matches_the_reference():
    seed = _seed()
    model = tiny_model("cpu", 3, 3, 1, seed=seed)
    cfg = model.cfg
    cache = KVCache(cfg, 64, 16)
    backend = DenseAttention(cfg.num_layers)
    lens = [(40, 1), (5, 17), (77, 1), (1, 1), (30, 12)]  # (tokens cached before, new tokens): one-token rows
    for sid, (before, new) in enumerate(lens):
        cache.allocate(sid, before + new)
        if before:
            b = cache.prepare([sid], [before], True)
            k = torch.randn(before, cfg.num_kv_heads, cfg.head_dim)
            cache.write(0, k, torch.randn_like(k), b)
    batch = cache.prepare(list(range(len(lens))), [n for _, n in lens], True)
    t = sum(n for _, n in lens)
    k = torch.randn(t, cfg.num_kv_heads, cfg.head_dim)
    cache.write(0, k, torch.randn_like(k), batch)
    q = torch.randn(t, cfg.num_heads, cfg.head_dim)
    out = backend.prefill(0, q, cache, batch)
    for i in range(len(lens)):
        kk, vv = cache.gather(0, batch, i)
        lo, hi = batch.cu_q[i], batch.cu_q[i + 1]
        want = _reference(q[lo:hi], kk, vv)
        assert torch.allclose(out[lo:hi].double(), want, atol=1e-5), (seed, i, (out[lo:hi] - want).abs().max())


def test_a_mixed_step_gives_the_tokens_and_logprobs_of_a_prefill_and_a_decode_step():
    seed = _seed()
    for dev in DEVICES:
        model = tiny_model(dev, 2, 2, 3, seed=seed)
        vocab = model.cfg.vocab_size
        g = torch.Generator().manual_seed(seed)
        first = torch.randint(0, vocab, (50,), generator=g).tolist()
        second = torch.randint(0, vocab, (70,), generator=g).tolist()
        key = method_key("dense")
        params = SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=0).__dict__
        runs = []
        for mixed in (False, True):
            ex = ShardExecutor(model, KVCache(model.cfg, 32, 16, device=dev))
            ex.admit([(0, 60, params), (1, 80, params)], key)
            steps = [ex.execute(StepPlan(key, True, [0], [first], sample=[True]))]
            tok = steps[0]["tokens"][0]
            if mixed:
                steps.append(ex.execute(StepPlan(key, True, [0, 1], [[tok], second], sample=[True, True],
                                                 decode_rows=1)))
                toks = steps[-1]["tokens"]
            else:
                steps.append(ex.execute(StepPlan(key, False, [0], [[tok]])))
                steps.append(ex.execute(StepPlan(key, True, [1], [second], sample=[True])))
                toks = [steps[-2]["tokens"][0], steps[-1]["tokens"][0]]
            steps.append(ex.execute(StepPlan(key, False, [0, 1], [[toks[0]], [toks[1]]])))
            assert all(s["error"] is None for s in steps), steps
            lps = {sid: [lp for s in steps for lp in s["logprobs"].get(sid, [])] for sid in (0, 1)}
            runs.append(lps)
        for sid in (0, 1):
            a, b = runs[0][sid], runs[1][sid]
            assert len(a) == len(b) == (3 if sid == 0 else 2)
            assert [x[0] for x in a] == [x[0] for x in b], (seed, dev, sid)
            assert torch.allclose(torch.tensor([x[1] for x in a]), torch.tensor([x[1] for x in b]), atol=1e-4), \
                (seed, dev, sid, a, b)
