"""The CUDA-graph decode path's static, padded batch (run eagerly on the CPU) against the plain decode path,
and multi-step decode plans against one step per plan."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICES, tiny_model

from raysparse.attention import DenseAttention
from raysparse.decode_graphs import DecodeGraphs, bucket, width_bucket
from raysparse.kv_cache import KVCache
from raysparse.orchestration.scheduler import Scheduler, SchedulerConfig
from raysparse.shard_executor import ShardExecutor
from raysparse.step_plan import StepPlan, method_key


@pytest.fixture(scope="module", params=DEVICES)
def model(request):
    return tiny_model(request.param, 3, 2, 3)


def test_bucket():
    assert [bucket(n, 64) for n in (1, 2, 3, 5, 8, 9, 64)] == [1, 2, 4, 8, 8, 16, 64]
    assert bucket(5, 6) == 6
    assert [width_bucket(n, 4096) for n in (16, 17, 21, 25, 29, 33, 2048, 2056, 4000)] == [
        16, 20, 24, 28, 32, 40, 2048, 2560, 4096]
    assert width_bucket(2056, 2300) == 2300


def _prefill(model, cache, backend, lens, g):
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in lens]
    for sid, p in enumerate(prompts):
        cache.allocate(sid, len(p) + 16)
        batch = cache.prepare([sid], [len(p)], True)
        model(torch.tensor(p, device=cache.device), batch, cache, backend)


def test_padded_static_decode_matches_plain_decode(model):
    """Three ragged sequences in a bucket of four (one padded row): logits, the real pages' K/V and the
    density meter equal the plain path's, and the padding wrote only to the scratch page."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    lens = [int(x) for x in torch.randint(1, 150, (3,), generator=g)]
    seed = int(torch.randint(0, 2**31 - 1, ()))
    caches, backends = [], []
    for _ in range(2):
        cache = KVCache(model.cfg, 32, 16, device=model.lm_head.weight.device)
        backend = DenseAttention(model.cfg.num_layers)
        _prefill(model, cache, backend, lens, torch.Generator().manual_seed(seed))
        backend.meter.reset()
        caches.append(cache)
        backends.append(backend)
    graphs = DecodeGraphs(model, caches[1], max_batch=8)
    sids = [2, 0, 1]  # not in admission order: rows map to sequences through the table
    for _ in range(3):
        ids = torch.randint(0, 97, (3,), generator=g).tolist()
        batch = caches[0].prepare(sids, [1, 1, 1], False)
        ref = model(torch.tensor(ids, device=caches[0].device), batch, caches[0], backends[0])
        got = graphs.decode("k", backends[1], sids, ids)
        assert got.shape == ref.shape
        tol = 1e-5 if ref.device.type == "cpu" else 2e-3
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    for sid in sids:
        assert caches[0].seq_len(sid) == caches[1].seq_len(sid) == lens[sid] + 3
    pool = caches[0].num_pages  # every page but the scratch page: the sequences' and the free ones
    for layer in range(model.cfg.num_layers):
        torch.testing.assert_close(caches[1].k[layer][:pool], caches[0].k[layer][:pool], rtol=tol, atol=tol)
        torch.testing.assert_close(caches[1].v[layer][:pool], caches[0].v[layer][:pool], rtol=tol, atol=tol)
    assert caches[1].k[0][caches[1].scratch_page].abs().sum() > 0  # the padded row did write there
    assert backends[1].meter.attended == backends[0].meter.attended
    assert backends[1].meter.decode_causal == backends[0].meter.decode_causal


def test_decode_batch_limits(model):
    graphs = DecodeGraphs(model, KVCache(model.cfg, 8, 16, device=model.lm_head.weight.device), max_batch=2)
    with pytest.raises(ValueError, match="outside 1..2"):
        graphs.decode("k", DenseAttention(model.cfg.num_layers), [0, 1, 2], [1, 2, 3])


def _executor(model, graphs: bool) -> ShardExecutor:
    cache = KVCache(model.cfg, 32, 64, device=model.lm_head.weight.device)
    return ShardExecutor(model, cache, graphs=DecodeGraphs(model, cache, 8) if graphs else None)


@pytest.mark.parametrize("graphs", [False, True])
def test_multi_step_plan_matches_single_steps(model, graphs):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (70, 33)]
    key = method_key("dense")
    runs = []
    for steps in (1, 4):
        ex = _executor(model, graphs and steps > 1)
        admit = [(i, len(p) + 8, {"max_new_tokens": 8}) for i, p in enumerate(prompts)]
        first = ex.execute(StepPlan(key, True, [0, 1], prompts, admit=admit))["tokens"]
        toks = [[t] for t in first]
        while len(toks[0]) < 5:
            n = steps if steps > 1 else 1
            res = ex.execute(StepPlan(key, False, [0, 1], [[t[-1]] for t in toks], steps=n))
            assert res["error"] is None
            new = res["tokens"] if n > 1 else [[t] for t in res["tokens"]]
            for row, extra in zip(toks, new, strict=True):
                row.extend(extra)
        runs.append([t[:5] for t in toks])
    assert runs[0] == runs[1]


def test_greedy_chain_matches_single_steps(model):
    """decode_greedy (on a GPU: back-to-back replays advancing on the device) against one step at a time."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    lens = [int(x) for x in torch.randint(1, 150, (3,), generator=g)]
    seed = int(torch.randint(0, 2**31 - 1, ()))
    firsts = torch.randint(0, 97, (3,), generator=g).tolist()
    outs = []
    for chained in (False, True):
        cache = KVCache(model.cfg, 32, 16, device=model.lm_head.weight.device)
        backend = DenseAttention(model.cfg.num_layers)
        _prefill(model, cache, backend, lens, torch.Generator().manual_seed(seed))
        graphs = DecodeGraphs(model, cache, max_batch=8)
        sids = [1, 2, 0]
        if chained:
            outs.append(graphs.decode_greedy("k", backend, sids, firsts, 5))
        else:
            toks, rows = firsts, [[] for _ in sids]
            for _ in range(5):
                toks = graphs.decode("k", backend, sids, toks).argmax(-1).tolist()
                for r, t in zip(rows, toks, strict=True):
                    r.append(t)
            outs.append(rows)
        assert [cache.seq_len(s) for s in sids] == [lens[s] + 5 for s in sids]
    assert outs[0] == outs[1]


def test_scheduler_plans_several_steps_only_when_nothing_waits():
    sched = Scheduler(SchedulerConfig(capacity_pages=4, page_size=64, decode_steps=8))
    from raysparse.orchestration.engine_api import EngineRequest, RequestHandle
    from raysparse.sampling import SamplingParams

    def add(n_new: int, prompt_len: int = 10):
        h = RequestHandle(EngineRequest(tuple(range(prompt_len)), SamplingParams(max_new_tokens=n_new)), lambda _: True)
        seq = sched.make_sequence(h, method_key("dense"), frozenset(), 0.0)
        sched.add(seq)
        return seq

    a = add(5)
    assert sched.next_plan().prefill
    a.tokens.append(1)
    b = add(3, prompt_len=64 * 2)  # admissible (3 of 4 pages free): decode goes one step at a time
    plan = sched.next_plan()  # dense's mixed step: a's one-token row rides first in b's prefill
    assert plan.prefill and plan.steps == 1 and plan.decode_rows == 1 and plan.seq_ids == [a.seq_id, b.seq_id]
    a.tokens.append(2)
    b.tokens.append(1)
    plan = sched.next_plan()
    # nothing waits any more; never past a request's max_new_tokens (b: 3 - 1 generated)
    assert not plan.prefill and plan.seq_ids == [a.seq_id, b.seq_id] and plan.steps == 2


def test_chained_greedy_tokens_are_checked_across_shards(model):
    """Under tensor parallelism each shard draws its own greedy tokens; a disagreement fails loudly."""
    cache = KVCache(model.cfg, 8, 64, device=model.lm_head.weight.device)
    tokens = [[3, 5, 7], [2, 4, 6]]
    same = ShardExecutor(model, cache, rank=0, world_size=2, reduce=lambda t: t * 2)  # the peer agrees
    same._check_agreement(tokens)
    differ = ShardExecutor(model, cache, rank=0, world_size=2, reduce=lambda t: t + 1)  # the peer does not
    with pytest.raises(RuntimeError, match="different greedy tokens"):
        differ._check_agreement(tokens)
