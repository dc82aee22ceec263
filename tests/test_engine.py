"""The distributed engine on a local Ray instance (gloo, CPU): TP=2 against TP=1 for every method, the walk
coordinator's agreement across shards, admission, abort, bad requests, and a killed shard."""

from __future__ import annotations

import time

import pytest
import torch
from engine_helpers import (
    SHARED_SELECTION,
    assert_same_selections,
    kill_shard_mid_request,
    record_selections,
    tp1_and_tp2,
)
from engine_helpers import run as run_one_at_a_time
from helpers import random_state, tiny_hf_config, whole_model_density

from raysparse.methods.registry import get_method, method_names
from raysparse.orchestration.engine import Engine, EngineConfig, EngineRequest
from raysparse.orchestration.engine_api import CapacityExceededError, InvalidRequestError, RequestHandle
from raysparse.orchestration.scheduler import Scheduler, SchedulerConfig
from raysparse.sampling import SamplingParams
from raysparse.step_plan import method_key

pytestmark = pytest.mark.timeout(600)

# Every method that runs through plain engine steps; specattn has its own test (draft actor).
METHODS = [m for m in method_names() if m != "specattn"]
# --density is the whole model's: layers 0 and 1 of the tiny model's 5 are dense, so 0.64 is 0.4 at each sparse
# layer; its prompts (700 to 1100 tokens, 64-token blocks) leave every method's forced units inside that budget
LAYERS = 5
PARAMS = {"density": whole_model_density(0.4, LAYERS)}


# Methods compared across shard counts over short prompts (300, 197, 130 tokens), where rounding differences
# between one and two shards cannot flip near-ties among many candidates: SOCKET with no scored keys (top_k 0:
# its 128 sinks and 128-token window alone), the oracle at a density its short prefill keeps (nearly) whole
# (its exact masses round differently on two shards), its decode still choosing tokens.
SHORT_PROMPTS = {"socket": {"top_k": 0}, "socket_hard": {"top_k": 0},
                 "oracle": {"density": whole_model_density(0.85, LAYERS)}}


def params_of(method: str) -> dict:
    """PARAMS for a method with a density budget; nothing for one without (it refuses --density)."""
    if method in SHORT_PROMPTS:
        return SHORT_PROMPTS[method]
    return PARAMS if get_method(method).takes_density else {}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    cfg = tiny_hf_config(num_kv_heads=3, group=2, layers=LAYERS)
    cfg.max_position_embeddings = 2048
    model = random_state(cfg, seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def engines(tiny_dir):
    # TP=2 decodes three steps per call (rank 0's draws shared with the other shard between steps)
    yield from tp1_and_tp2({"decode_steps": 3}, model=tiny_dir, kv_cache_tokens=4096, page_size=64,
                           cpus_per_shard=0.5, draft=False)


def prompts(n: int = 2, method: str = "") -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    lens = ([300, 197, 130] if method in SHORT_PROMPTS else [1100, 900, 700])[:n]
    return [tuple(torch.randint(0, 97, (n_,), generator=g).tolist()) for n_ in lens]


def run(engine: Engine, method: str, ps: list[tuple[int, ...]], new: int = 6,
        params: dict | None = None) -> list[tuple[int, ...]]:
    return run_one_at_a_time(engine, method, params_of(method) if params is None else params,
                             ps, new)


CASES = [(m, params_of(m)) for m in METHODS] + [
    ("delta", {**PARAMS, "base": "sketch_walk"})]  # the coordinator reaches a wrapped base too


@pytest.mark.parametrize("method, params", CASES, ids=[f"{m}-{p.get('base', '')}".rstrip("-") for m, p in CASES])
def test_tp2_matches_tp1_with_identical_selections(engines, method, params):
    e1, e2 = engines
    if method != "dense":
        for e in engines:
            record_selections(e, method_key(method, params))
    ps = prompts(method=method)
    assert run(e2, method, ps, params=params) == run(e1, method, ps, params=params)
    if method != "dense":
        shared = method in SHARED_SELECTION or (method == "delta" and params.get("base", "streaming")
                                                 in SHARED_SELECTION)
        assert_same_selections(e1, e2, shared)


SEAM_METHODS = ["streaming", "quest", "sketch_walk", "socket", "socket_hard", "psaw", "etf", "cis", "cpe"]
# (method, its extra parameters): Delta decodes on its base's seam, Sketch&Walk's page-indexed state included
SEAM_CASES = [(m, {}) for m in SEAM_METHODS] + [("delta", {"base": "sketch_walk"})]
SEAM_IDS = [f"{m}-{p['base']}" if p else m for m, p in SEAM_CASES]


def _budget(method: str, density: float) -> dict:
    """The whole-model density that gives each sparse layer ``density``, for a method with a budget; PSAW's and
    ETF's budget is their depth schedule."""
    return {"density": whole_model_density(density, LAYERS)} if get_method(method).takes_density else {}


@pytest.mark.parametrize("method, extra", SEAM_CASES, ids=SEAM_IDS)
def test_tp2_matches_tp1_on_the_batched_seam(engines, method, extra):
    """Without a selection recorder (a tracer sends a method to its per-sequence reference path) both engines
    decode through the batched seam, each shard selecting over its own KV heads' per-page state: TP=2's greedy
    tokens (multi-step plans) equal TP=1's. A density of its own gives a backend no recorder has touched."""
    e1, e2 = engines
    ps = prompts(method=method)
    params = {**(SHORT_PROMPTS.get(method) or _budget(method, 0.45)), **extra}
    assert run(e2, method, ps, params=params) == run(e1, method, ps, params=params)


@pytest.mark.parametrize("method, extra", SEAM_CASES, ids=SEAM_IDS)
def test_batched_seam_tokens_equal_the_reference_path(engines, method, extra):
    """Through one engine (TP=1): the batched seam's greedy tokens equal the per-sequence reference path's.
    The two method keys select alike (the second spells out the registry's default dense layers: none for a
    method with a density budget, the paper's 0 and 1 for PSAW and ETF) but are two backends:
    the first records selections, which sends it down the reference path."""
    e1, _ = engines
    spelled = [] if get_method(method).takes_density else [0, 1]
    ref, seam = {**_budget(method, 0.5), **extra}, {**_budget(method, 0.5), "dense_layers": spelled, **extra}
    record_selections(e1, method_key(method, ref))
    ps = prompts()
    assert run(e1, method, ps, params=seam) == run(e1, method, ps, params=ref)


def test_walk_coordinator_time_is_measured(engines):
    _, e2 = engines
    run(e2, "sketch_walk", prompts(1), new=2)
    stats = e2.shard_stats()[0]
    assert all(s["coord_s"] > 0 for s in stats)


def test_bad_requests_are_refused_up_front(engines):
    e1, _ = engines
    p = prompts(1)[0]
    with pytest.raises(InvalidRequestError, match="unknown attention method"):
        e1.submit(EngineRequest(p, method="nope"))
    with pytest.raises(InvalidRequestError, match="density"):
        e1.submit(EngineRequest(p, method="quest", method_params={"density": 7.0}))
    with pytest.raises(InvalidRequestError, match="specattn needs the draft actor"):  # its declared needs_draft
        e1.submit(EngineRequest(p, method="specattn"))
    with pytest.raises(InvalidRequestError, match="positions"):
        e1.submit(EngineRequest(p, SamplingParams(max_new_tokens=1000)))
    # two 64-token blocks are all forced: served at the density it really has, reported, not refused
    fin = e1.submit(EngineRequest(p[:120], SamplingParams(max_new_tokens=2, ignore_eos=True), method="quest",
                                  method_params=PARAMS)).result(300)
    assert fin.finish_reason == "length" and fin.stats["density"]["prefill"] > PARAMS["density"], fin
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        e1.submit(EngineRequest((5, 1000)))
    with pytest.raises(InvalidRequestError, match="empty"):
        EngineRequest(())
    sched = Scheduler(SchedulerConfig(4, 64))  # admission alone: 256 KV tokens
    with pytest.raises(CapacityExceededError, match="KV tokens"):
        sched.make_sequence(RequestHandle(EngineRequest(p, SamplingParams(max_new_tokens=8)), print), "k",
                            frozenset(), 0.0)
    # the engine still serves after all of that
    assert run(e1, "dense", prompts(1), new=3)[0]


def test_logprobs_and_penalties_equal_across_shard_counts_and_a_plain_forward(engines, tiny_dir):
    """Prompt and token log-probabilities through TP=1 and TP=2 (its vocabulary-sharded head gathered on every
    rank, its decode steps three a call): every element against transformers' forward of the same tokens.
    The prompt spans several prefill chunks; penalized greedy decoding gives the same tokens on both."""
    from transformers import LlamaForCausalLM

    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    g = torch.Generator().manual_seed(seed)
    prompt = tuple(torch.randint(0, 97, (int(torch.randint(600, 1100, (), generator=g)),), generator=g).tolist())
    params = SamplingParams(max_new_tokens=5, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    model = LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    for eng in engines:
        # a request decoding meanwhile holds the prefill to CPU chunks (512 tokens; idle, the prompt goes whole)
        background = eng.submit(EngineRequest((5, 6, 7), SamplingParams(max_new_tokens=200, ignore_eos=True)))
        assert background.started.wait(120)
        handle = eng.submit(EngineRequest(prompt, params))
        events = list(handle)
        background.abort()
        fin, toks = events[-1], events[:-1]
        assert fin.finish_reason == "length", fin
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([list(prompt) + list(fin.token_ids)])).logits[0].float(), -1)
        plp = fin.stats["prompt_logprobs"]
        assert len(plp) == len(prompt) and plp[0] is None, seed
        for i in range(1, len(prompt)):
            tid, lp, top = plp[i]
            assert tid == prompt[i] and abs(lp - float(ref[i - 1, tid])) <= 1e-4, (seed, eng.cfg.tp, i, lp)
            want = torch.topk(ref[i - 1], 2)
            assert [t for t, _ in top] == want.indices.tolist(), (seed, eng.cfg.tp, i)
            assert all(abs(v - w) <= 1e-4 for (_, v), w in zip(top, want.values.tolist(), strict=True)), seed
        assert len(toks) == 5
        for j, ev in enumerate(toks):
            row = ref[len(prompt) - 1 + j]
            assert abs(ev.logprob - float(row[ev.token_id])) <= 1e-4, (seed, eng.cfg.tp, j)
            assert [t for t, _ in ev.top_logprobs] == torch.topk(row, 3).indices.tolist(), (seed, eng.cfg.tp, j)
    penalized = SamplingParams(max_new_tokens=8, presence_penalty=0.5, frequency_penalty=1.5, ignore_eos=True)
    outs = [eng.submit(EngineRequest(prompt[:150], penalized)).result(300).token_ids for eng in engines]
    assert outs[0] == outs[1], seed


def test_concurrent_requests_match_one_at_a_time(engines):
    e1, _ = engines
    ps = prompts(3)
    alone = run(e1, "dense", ps, new=5)
    handles = [e1.submit(EngineRequest(p, SamplingParams(max_new_tokens=5, ignore_eos=True))) for p in ps]
    together = [h.result(120).token_ids for h in handles]
    assert together == alone
    info = e1.server_info()
    assert info["running"] == 0 and info["kv_used_tokens"] == 0


def test_abort_frees_the_request(engines):
    e1, _ = engines
    h = e1.submit(EngineRequest(prompts(1)[0], SamplingParams(max_new_tokens=150, ignore_eos=True)))
    h.get(60)  # the first token: the request is running
    h.abort()
    fin = h.result(60)
    assert fin.finish_reason == "abort" and len(fin.token_ids) < 150
    deadline = time.time() + 30
    while e1.server_info()["kv_used_tokens"] and time.time() < deadline:
        time.sleep(0.1)
    assert e1.server_info()["kv_used_tokens"] == 0


def test_killed_shard_fails_its_request_and_the_group_is_rebuilt(engines):
    _, e2 = engines
    kill_shard_mid_request(e2, prompts(1)[0])
    assert len(run(e2, "dense", prompts(1), new=3)[0]) == 3


def test_specattn_through_the_draft_actor_matches_greedy(tiny_dir):
    """The draft actor proposes, the TP=2 shards verify: p = 1 must be plain greedy decoding, and p < 1 runs
    sparse verification end to end with acceptance statistics and bytes per round reported. On CPUs the draft
    takes the prompts' and the verified tokens' K/V from the shards instead of running them."""
    eng = Engine(EngineConfig(model=tiny_dir, tp=2, kv_cache_tokens=4096, cpus_per_shard=0.5)).start()
    try:
        ps = prompts(2)
        greedy = run(eng, "dense", ps, new=9)
        outs = []
        for p in ps:
            fin = eng.submit(EngineRequest(p, SamplingParams(max_new_tokens=9, ignore_eos=True), "specattn",
                                           {"top_p": 1.0})).result(120)
            assert fin.finish_reason == "length", fin.error
            outs.append(fin.token_ids)
        assert outs == greedy
        fin = eng.submit(EngineRequest(ps[0], SamplingParams(max_new_tokens=9, ignore_eos=True), "specattn",
                                       {"top_p": 0.9})).result(120)
        assert fin.finish_reason == "length" and len(fin.token_ids) == 9, fin.error
        st = eng.runners[0].spec_step.stats()
        assert st["rounds"] > 0 and st["bytes_per_round"] > 0
        # on CPUs the draft runs no forward to fill its cache: every prompt's K/V, and every round's verified
        # tokens', came from the two shards' halves of the heads
        assert st["adopted_tokens"] == sum(len(p) for p in ps) + len(ps[0]) and st["copied_tokens"] > 0
        shard = eng.shard_stats()[0][0]["specattn"]
        assert sum(s["rounds"] for s in shard.values()) >= st["rounds"] - 0  # rank 0 counts every round
    finally:
        eng.shutdown()
