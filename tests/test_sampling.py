"""Sampling parameters, the top-p filter against brute force, seeded reproducibility, stop tokens."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import fresh_cache, random_state, tiny_hf_config

from raysparse.attention import DenseAttention
from raysparse.generate import FinishEvent, GenerationRequest, Generator, TokenEvent
from raysparse.loader import model_from_state
from raysparse.sampling import MIN_TEMPERATURE, MIN_TOP_P, Sampler, SamplingParams, top_p_filter


@pytest.mark.parametrize("bad", [
    {"max_new_tokens": 0}, {"temperature": -1.0}, {"temperature": float("nan")}, {"top_p": 0.0},
    {"top_p": 1.5}, {"seed": -3}, {"stop_token_ids": (-1,)},
    {"logprobs": -1}, {"logprobs": 21}, {"logprobs": True}, {"prompt_logprobs": 1.5},
    {"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"presence_penalty": True}, {"frequency_penalty": None},
])
def test_bad_sampling_params_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_top_p_keeps_the_minimal_most_likely_set():
    for _ in range(50):
        probs = torch.softmax(torch.randn(7) * 2, -1)
        p = float(torch.rand(()) * 0.98 + 0.01)
        kept = top_p_filter(probs, p) > 0
        # Brute force: the smallest subset by size whose mass reaches p, made of the most likely tokens.
        order = probs.argsort(descending=True).tolist()
        size = next(s for s in range(1, 8) if probs[order[:s]].sum() >= p - 1e-7)
        assert kept.sum().item() == size
        assert set(torch.nonzero(kept).flatten().tolist()) == set(order[:size])
        best = min(sum(probs[list(c)]) for c in itertools.combinations(range(7), size)
                   if sum(probs[list(c)]) >= p - 1e-7)
        assert best >= p - 1e-6


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    logits = torch.randn(1, 50)
    draws = {}
    for seed in (1, 1, 2):
        s = Sampler()
        s.add(0, SamplingParams(temperature=1.0, top_p=0.9, seed=seed))
        draws.setdefault(seed, []).append([s.sample(logits, [0], [SamplingParams(temperature=1.0, top_p=0.9,
                                                                                 seed=seed)])[0]
                                           for _ in range(20)])
    assert draws[1][0] == draws[1][1]
    assert draws[1][0] != draws[2][0]


def test_stop_tokens_end_the_request_and_stream_every_token():
    cfg = tiny_hf_config()
    model = model_from_state(cfg, random_state(cfg).state_dict())
    prompt = tuple(torch.randint(0, cfg.vocab_size, (20,)).tolist())
    gen = Generator(model, fresh_cache(model, 256), DenseAttention(model.cfg.num_layers))
    free = list(gen.generate([GenerationRequest(prompt, SamplingParams(10, ignore_eos=True), "x")]))
    tokens = [e.token_id for e in free if isinstance(e, TokenEvent)]
    assert tokens == list(free[-1].token_ids) and len(tokens) == 10 and free[-1].finish_reason == "length"
    stop = tokens[4]
    first = tokens.index(stop)
    stopped = list(gen.generate([GenerationRequest(prompt, SamplingParams(10, stop_token_ids=(stop,)), "y")]))
    fin = stopped[-1]
    assert isinstance(fin, FinishEvent) and fin.finish_reason == "stop"
    assert list(fin.token_ids) == tokens[:first]
    assert gen.cache.free_pages == gen.cache.num_pages


def test_seeded_requests_sample_the_same_alone_and_batched():
    cfg = tiny_hf_config()
    model = model_from_state(cfg, random_state(cfg).state_dict())
    reqs = [GenerationRequest(tuple(torch.randint(0, cfg.vocab_size, (n,)).tolist()),
                              SamplingParams(8, temperature=0.8, top_p=0.9, seed=n, ignore_eos=True), str(n))
            for n in (9, 33)]

    def run(rs):
        gen = Generator(model, fresh_cache(model, 512), DenseAttention(model.cfg.num_layers))
        return {e.request_id: e.token_ids for e in gen.generate(rs) if isinstance(e, FinishEvent)}

    both = run(reqs)
    assert both == {**run(reqs[:1]), **run(reqs[1:])}


@pytest.mark.parametrize("bad", [
    {"temperature": 1e-300}, {"temperature": MIN_TEMPERATURE / 2}, {"top_p": 1e-300}, {"top_p": MIN_TOP_P / 2},
])
def test_values_that_would_underflow_in_the_sampler_are_refused(bad):
    # Accepted, these used to fail only later, inside the sampler (NaN probabilities or no token kept).
    with pytest.raises(ValueError, match=f"{next(iter(bad))} must be"):
        SamplingParams(**bad)


@pytest.mark.parametrize("kw", [
    {"temperature": MIN_TEMPERATURE}, {"temperature": 1.0, "top_p": MIN_TOP_P},
    {"temperature": MIN_TEMPERATURE, "top_p": MIN_TOP_P},
])
def test_the_smallest_accepted_values_sample_the_most_likely_token(kw):
    logits = torch.randn(4, 128, generator=torch.Generator().manual_seed(0)) * 30
    params = [SamplingParams(seed=i, **kw) for i in range(4)]
    sampler = Sampler()
    for i, p in enumerate(params):
        sampler.add(i, p)
    # Both limits leave a single plausible token: the sampler must agree with argmax, not fail.
    assert sampler.sample(logits, list(range(4)), params) == logits.argmax(-1).tolist()


def test_penalties_follow_the_counts_of_generated_tokens_and_logprobs_are_the_raw_log_softmax():
    """presence once per token that appeared, frequency per appearance, on the sampler's logits only: the
    log-probabilities stay the model's own distribution."""
    from raysparse.sampling import logprob_rows

    logits = torch.tensor([[3.0, 2.9, 2.0, -1.0]])
    s = Sampler()
    p = SamplingParams(presence_penalty=0.05, frequency_penalty=0.5)
    s.add(7, p)
    drawn = [s.sample(logits, [7], [p])[0] for _ in range(5)]
    # 0 (3.0); 1 (2.9 over 0's 3.0 - 0.55); 0 (2.45 over 1's 2.35); 1 (2.35 over 0's 1.95); 2 (2.0 over 1's 1.85)
    assert drawn == [0, 1, 0, 1, 2]
    plain = Sampler()
    assert [plain.sample(logits, [1], [SamplingParams()])[0] for _ in range(3)] == [0, 0, 0]
    (tid, lp, top), = logprob_rows(logits, [2], 2)
    ref = torch.log_softmax(logits[0], -1)
    assert tid == 2 and lp == pytest.approx(float(ref[2]))
    assert [t for t, _ in top] == [0, 1] and [v for _, v in top] == pytest.approx(ref[:2].tolist())
    assert logprob_rows(logits, [3], 0)[0][2] == ()
