"""The scheduler and a replica's loop without Ray: an in-process shard group over a tiny random model."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import random_state, tiny_hf_config

from raysparse.kv_cache import KVCache
from raysparse.loader import model_from_state
from raysparse.orchestration.engine_api import EngineRequest, RequestHandle
from raysparse.orchestration.runner import ReplicaRunner
from raysparse.orchestration.scheduler import Scheduler, SchedulerConfig
from raysparse.sampling import SamplingParams
from raysparse.shard_executor import ShardExecutor
from raysparse.step_plan import StepPlan, method_key

POISON = 13  # a prompt holding this token id makes the fake shard fail its whole step


def _poison(module, args) -> None:
    if bool((args[0] == POISON).any()):
        raise ValueError("poisoned prompt")


class LocalGroup:
    """One in-process shard with ReplicaGroup's step interface; a step holding a poisoned prompt fails inside
    the shard's forward, as a real step's error does."""

    def __init__(self, model, pages: int) -> None:
        if not model.model.embed_tokens._forward_pre_hooks:
            model.model.embed_tokens.register_forward_pre_hook(_poison)
        self.executor = ShardExecutor(model, KVCache(model.cfg, pages, 64))
        self.pages = pages
        self.info: list[dict] = []
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> dict:
        self.plans.append(plan)
        return self.executor.execute(plan)

    def stop(self) -> None:
        pass

    def start(self) -> None:  # a rebuild: the new group's cache is empty
        self.executor = ShardExecutor(self.executor.model, KVCache(self.executor.model.cfg, self.pages, 64))


def make_runner(pages: int = 32, max_prefill_tokens: int = 65536, model=None) -> tuple[ReplicaRunner, LocalGroup]:
    if model is None:
        cfg = tiny_hf_config(layers=2)
        model = model_from_state(cfg, random_state(cfg, seed=int(torch.randint(0, 2**31 - 1, ()))).state_dict())
    group = LocalGroup(model, pages)
    sched = Scheduler(SchedulerConfig(pages, 64, max_batch=8, max_prefill_tokens=max_prefill_tokens))
    runner = ReplicaRunner(0, group, sched, None)
    runner.state = "ready"
    runner.thread.start()
    return runner, group


def submit(runner: ReplicaRunner, prompt: tuple[int, ...], new: int = 4) -> RequestHandle:
    h = RequestHandle(EngineRequest(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True)), runner.abort)
    runner.add(runner.sched.make_sequence(h, method_key("dense"), frozenset(), time.perf_counter()))
    return h


def test_one_bad_request_in_a_batched_prefill_fails_alone():
    runner, group = make_runner()
    try:
        with runner.cond:  # queue all three before the loop looks, so they share one prefill
            good = [RequestHandle(EngineRequest(tuple(range(20, 60)), SamplingParams(max_new_tokens=4,
                                                                                    ignore_eos=True)), runner.abort)
                    for _ in range(2)]
            bad = RequestHandle(EngineRequest((POISON, 5, 6), SamplingParams(max_new_tokens=4)), runner.abort)
            for h in (good[0], bad, good[1]):
                runner.sched.add(runner.sched.make_sequence(h, method_key("dense"), frozenset(), 0.0))
        results = [h.result(60) for h in good]
        assert [r.finish_reason for r in results] == ["length", "length"]
        assert results[0].token_ids == results[1].token_ids and len(results[0].token_ids) == 4
        fin = bad.result(60)
        assert fin.finish_reason == "error" and "poisoned" in fin.error
        assert len(group.plans[0].seq_ids) == 3  # they were batched, then retried one by one
        deadline = time.time() + 10
        while runner.info()["kv_used_tokens"] and time.time() < deadline:
            time.sleep(0.05)
        assert runner.info()["kv_used_tokens"] == 0 and group.executor.cache.free_pages == 32
    finally:
        runner.stop()


def test_prefill_and_decode_alternate_and_admission_waits_for_pages():
    sched = Scheduler(SchedulerConfig(capacity_pages=4, page_size=64, max_batch=8))
    handles = [RequestHandle(EngineRequest(tuple(range(1, 100)), SamplingParams(max_new_tokens=20)), print)
               for _ in range(3)]
    seqs = [sched.make_sequence(h, "k", frozenset(), 0.0) for h in handles]  # 2 pages each
    for s in seqs:
        sched.add(s)
    p1 = sched.next_plan()
    assert p1.prefill and p1.seq_ids == [seqs[0].seq_id, seqs[1].seq_id]  # the third does not fit yet
    seqs[0].tokens.append(7)
    seqs[1].tokens.append(7)
    p2 = sched.next_plan()
    assert not p2.prefill and len(p2.seq_ids) == 2
    assert sched.next_plan().prefill is False  # still no pages for the third: decode again
    sched.release(seqs[0])
    p4 = sched.next_plan()  # pages came back: the waiting request is admitted, the finished one freed
    assert p4.prefill and p4.seq_ids == [seqs[2].seq_id] and p4.free == [seqs[0].seq_id]


def test_chunked_prefill_gives_the_same_tokens_and_lets_decodes_through():
    cfg = tiny_hf_config(layers=3)
    model = model_from_state(cfg, random_state(cfg, seed=int(torch.randint(0, 2**31 - 1, ()))).state_dict())
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    long_prompt = tuple(torch.randint(POISON + 1, 97, (300,), generator=g).tolist())
    short = tuple(torch.randint(POISON + 1, 97, (20,), generator=g).tolist())
    outs = {}
    for budget in (4096, 64):
        runner, group = make_runner(max_prefill_tokens=budget, model=model)
        try:
            first = submit(runner, short, new=200)
            first.get(30)  # running: decoding while the long prompt arrives
            second = submit(runner, long_prompt, new=4)
            outs[budget] = (first.result(60).token_ids, second.result(60).token_ids)
            prefills = [p for p in group.plans if p.prefill][1:]  # the first one is the short prompt's
            if budget == 64:
                # 300 tokens in chunks of at most 64 with the short one decoding in the same steps (dense's mixed
                # steps: its one-token row first, counted in the budget)
                assert [p.decode_rows for p in prefills][:5] == [1] * 5
                assert all(p.seq_ids[0] == prefills[0].seq_ids[0] and len(p.tokens[0]) == 1 for p in prefills[:5])
                assert [len(p.tokens[1]) for p in prefills][:5] == [63, 63, 63, 63, 48]
                assert [p.sample for p in prefills][:5] == [[True, False]] * 4 + [[True, True]]
        finally:
            runner.stop()
    assert outs[64] == outs[4096]


def test_method_capabilities_decide_chunked_prefill_and_multi_step_decode():
    """The scheduler asks the method's registry entry, never its name: dense prompts are chunked and its
    decodes run several steps per call; SpecAttn (whose draft prefills whole prompts, and whose decode step is
    a round) gets neither."""
    from raysparse.methods.registry import method_capabilities

    for method in ("dense", "specattn"):
        caps = method_capabilities(method)
        sched = Scheduler(SchedulerConfig(32, 64, max_batch=8, max_prefill_tokens=100, decode_steps=4))
        h = RequestHandle(EngineRequest(tuple(range(1, 251)), SamplingParams(max_new_tokens=8, ignore_eos=True),
                                        method), lambda _rid: False)
        seq = sched.make_sequence(h, method_key(method), frozenset(), 0.0)
        sched.add(seq)
        chunks = []
        while not seq.prompt_done:
            plan = sched.next_plan()
            assert plan is not None and plan.prefill
            chunks.append(len(plan.tokens[0]))
        assert chunks == ([100, 100, 50] if caps.chunked_prefill else [250])
        seq.tokens.append(1)
        plan = sched.next_plan()
        assert plan is not None and not plan.prefill and plan.steps == (4 if caps.multi_step_decode else 1)
    assert not method_capabilities("specattn").chunked_prefill and method_capabilities("dense").multi_step_decode


class HookedGroup(LocalGroup):
    """A LocalGroup that calls ``hook(plan)`` before each step; the hook may raise (e.g. a lost shard)."""

    def __init__(self, model, pages: int, hook) -> None:
        super().__init__(model, pages)
        self.hook = hook

    def execute(self, plan: StepPlan) -> dict:
        self.hook(plan)
        return super().execute(plan)


def _hooked_runner(hook, max_prefill_tokens: int) -> tuple[ReplicaRunner, HookedGroup]:
    cfg = tiny_hf_config(layers=2)
    model = model_from_state(cfg, random_state(cfg, seed=int(torch.randint(0, 2**31 - 1, ()))).state_dict())
    group = HookedGroup(model, 32, hook)
    runner = ReplicaRunner(0, group, Scheduler(SchedulerConfig(32, 64, max_batch=8,
                                                               max_prefill_tokens=max_prefill_tokens)), None)
    runner.state = "ready"
    runner.thread.start()
    return runner, group


def test_cancel_takes_effect_at_the_next_chunk():
    """A request aborted while one chunk of its prompt is on the shards gets no further chunk: the next step
    frees it, and its pages come back."""
    handles: dict = {}

    def hook(plan: StepPlan) -> None:
        if plan.prefill and "long" in handles and len(plan.tokens[0]) == 32:
            handles["long"].abort()  # as a client's cancel or passed deadline does, mid-prefill

    runner, group = _hooked_runner(hook, max_prefill_tokens=32)
    try:
        handles["long"] = submit(runner, tuple(range(POISON + 1, 97)) * 4, new=4)  # 332 tokens: 11 chunks
        fin = handles["long"].result(30)
        assert fin.finish_reason == "abort" and fin.token_ids == ()
        chunks = [p for p in group.plans if p.prefill]
        assert len(chunks) == 1, [len(p.tokens[0]) for p in chunks]
        deadline = time.time() + 10
        while group.executor.cache.free_pages != 32 and time.time() < deadline:
            time.sleep(0.02)
        assert group.executor.cache.free_pages == 32 and runner.info()["kv_used_tokens"] == 0
        ok = submit(runner, (20, 21, 22), new=3).result(30)
        assert ok.finish_reason == "length"
    finally:
        runner.stop()


def test_a_request_that_had_not_started_when_its_group_died_is_retried_once():
    """The group dies while one request decodes (its tokens are out) and another is part-way through its
    prompt: the first fails with an error naming the dead actor, in plain text; the second starts afresh on
    the rebuilt group and finishes. A request whose retry dies too fails."""
    from raysparse.orchestration.replica import ShardLostError

    state = {"kill": None, "kills": 0}
    colour = "\x1b[36mray::ShardWorker.execute()\x1b[39m"

    def hook(plan: StepPlan) -> None:
        if state["kill"] is not None and state["kill"](plan):
            state["kills"] += 1
            raise ShardLostError(f"shard actor rs-replica0-shard0-g1 of replica 0 died: killed {colour}")

    runner, group = _hooked_runner(hook, max_prefill_tokens=32)
    try:
        decoding = submit(runner, (20, 21, 22), new=400)
        decoding.get(30)  # its first token is out
        # a step with a chunk of the prompt (the decoding request's token rides in it: a mixed step)
        state["kill"] = lambda plan: plan.prefill and any(len(t) > 1 for t in plan.tokens) and state["kills"] == 0
        fresh = submit(runner, tuple(range(POISON + 1, 97)) * 2, new=5)  # 166 tokens: several chunks
        lost = decoding.result(30)
        assert lost.finish_reason == "error" and "shard actor rs-replica0-shard0-g1" in lost.error
        assert "\x1b" not in lost.error and "[36m" not in lost.error
        fin = fresh.result(30)
        assert fin.finish_reason == "length" and len(fin.token_ids) == 5 and state["kills"] == 1
        assert runner.rebuilds == 1 and runner.state == "ready" and "\x1b" not in runner.last_error
        # once only: a request whose retry loses its group again fails with the error
        state["kill"] = lambda plan: plan.prefill and any(len(t) > 1 for t in plan.tokens)
        twice = submit(runner, tuple(range(POISON + 1, 97)) * 2, new=5).result(30)
        assert twice.finish_reason == "error" and "died" in twice.error
        deadline = time.time() + 10
        while runner.rebuilds < 3 and time.time() < deadline:  # counted once the group is up again
            time.sleep(0.02)
        assert runner.rebuilds == 3
    finally:
        runner.stop()


@pytest.mark.parametrize("method", ["dense", "streaming"])
def test_idle_prefill_gives_the_head_prompt_the_idle_budget_while_nothing_decodes(method):
    """With no sequence decoding, the head prompt takes up to ``idle_prefill_tokens`` in one step and the
    prompts behind it wait for the next step; once a sequence decodes, prompts go in ``max_prefill_tokens``
    chunks again: with dense's mixed steps the decoding sequence's token rides in each chunk's step (first,
    counted in the budget), otherwise decode steps run between the chunks."""
    sched = Scheduler(SchedulerConfig(32, 64, max_batch=8, max_prefill_tokens=100, idle_prefill_tokens=300))
    seqs = []
    for n in (250, 230):
        h = RequestHandle(EngineRequest(tuple(range(1, n + 1)), SamplingParams(max_new_tokens=8, ignore_eos=True),
                                        method), lambda _rid: False)
        seqs.append(sched.make_sequence(h, method_key(method), frozenset(), 0.0))
        sched.add(seqs[-1])
    plan = sched.next_plan()
    assert plan.prefill and plan.seq_ids == [seqs[0].seq_id] and [len(t) for t in plan.tokens] == [250]
    assert plan.sample == [True] and plan.decode_rows == 0
    seqs[0].tokens.append(1)  # the first prompt's token: it decodes from now on
    kinds = []
    while not seqs[1].prompt_done:
        plan = sched.next_plan()
        if plan.prefill:
            assert plan.seq_ids[:plan.decode_rows] == [seqs[0].seq_id] * plan.decode_rows
            assert plan.tokens[:plan.decode_rows] == [[seqs[0].tokens[-1]]] * plan.decode_rows
            kinds.append((plan.decode_rows, len(plan.tokens[plan.decode_rows])))
        else:
            kinds.append("decode")
        seqs[0].tokens.append(1)
    if method == "dense":
        assert kinds == [(1, 99), (1, 99), (1, 32)]
    else:
        assert kinds == ["decode", (0, 100), "decode", (0, 100), "decode", (0, 30)]
    with pytest.raises(ValueError, match="idle_prefill_tokens"):
        SchedulerConfig(32, 64, max_prefill_tokens=100, idle_prefill_tokens=50)
    # a longer head prompt than the idle budget: that budget per step
    sched = Scheduler(SchedulerConfig(32, 64, max_batch=8, max_prefill_tokens=100, idle_prefill_tokens=200))
    h = RequestHandle(EngineRequest(tuple(range(1, 451)), SamplingParams(max_new_tokens=8, ignore_eos=True),
                                    "dense"), lambda _rid: False)
    seq = sched.make_sequence(h, method_key("dense"), frozenset(), 0.0)
    sched.add(seq)
    chunks = []
    while not seq.prompt_done:
        chunks.append(len(sched.next_plan().tokens[0]))
    assert chunks == [200, 200, 50]


def test_a_bad_prompt_in_a_mixed_step_fails_alone_and_the_decodes_riding_in_it_go_on():
    """A prompt's chunk whose step fails while a running sequence decodes in the same (mixed) step: the prompt
    fails, and the decoding sequence is rolled back on the shard and goes on, its tokens those of a run
    without the bad prompt."""
    cfg = tiny_hf_config(layers=2)
    model = model_from_state(cfg, random_state(cfg, seed=int(torch.randint(0, 2**31 - 1, ()))).state_dict())
    prompt = tuple(range(20, 40))
    outs = []
    for bad in (False, True):
        runner, group = make_runner(model=model, max_prefill_tokens=64)
        try:
            first = RequestHandle(EngineRequest(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True,
                                                                       logprobs=0)), runner.abort)
            runner.add(runner.sched.make_sequence(first, method_key("dense"), frozenset(), time.perf_counter()))
            first.get(30)  # decoding
            if bad:
                fin = submit(runner, (POISON,) + tuple(range(50, 149)), new=4).result(30)
                assert fin.finish_reason == "error" and "poisoned" in fin.error
                assert any(p.prefill and p.decode_rows == 1 and POISON in p.tokens[1] for p in group.plans)
            first.result(60)
            outs.append([ev for ev in first])  # its log-probabilities tell a shifted position apart too
        finally:
            runner.stop()
    fin = [evs[-1] for evs in outs]
    assert fin[1].finish_reason == "length" and fin[1].token_ids == fin[0].token_ids
    lps = [torch.tensor([ev.logprob for ev in evs[:-1]]) for evs in outs]
    assert len(lps[0]) == 39 and torch.allclose(lps[1], lps[0], atol=1e-5), (lps[1] - lps[0]).abs().max()
