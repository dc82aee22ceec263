"""Every decode-sparse method through the K/V tiers, on the engine's step path: the scheduler's plans run by the
shard executors (one shard in-process, two over a gloo group in spawned processes), with a device pool smaller
than one sequence's K/V, on ragged batches. Greedy tokens equal those without the tier; the pool copied pages and
staged rows; dense is refused with one line. The two-shard test spawns a gloo group (about 100 s on two cores):
``-m slow``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import free_port, random_state, tiny_hf_config, whole_model_density

from raysparse.decode_graphs import DecodeGraphs
from raysparse.kv_cache import KVCache
from raysparse.kv_tiers import KVOffloadConfig
from raysparse.loader import model_from_state
from raysparse.methods.registry import get_method
from raysparse.orchestration.engine_api import EngineRequest, RequestHandle
from raysparse.orchestration.scheduler import Scheduler, SchedulerConfig
from raysparse.sampling import SamplingParams
from raysparse.shard_executor import ShardExecutor
from raysparse.step_plan import method_key

LAYERS, PAGE, HOST_TOKENS = 4, 64, 8192
METHODS = ["streaming", "quest", "sketch_walk", "socket", "socket_hard", "cis", "psaw"]
# 7 pages per layer: less than any prompt's K/V here (8 to 10 pages), 2 sequences' pinned pages (3 each), so the
# scheduler runs ragged batches of 2 while the others wait
OFFLOAD = KVOffloadConfig(device_tokens=7 * PAGE, sink_pages=1, window_pages=2)
LENS, NEW = [610, 470, 530, 500], 7


def params_of(method: str) -> dict:
    if method == "psaw":  # its windows from layer 2 of 4 (its default starts at 3N/4, where its window is whole)
        return {"start_layer": 1}
    return {"density": whole_model_density(0.4, LAYERS, 2)} if get_method(method).takes_density else {}


def drive(ex: ShardExecutor, cfg: SchedulerConfig, reqs: list[EngineRequest], share=None) -> list[list[int]]:
    """The replica runner's loop without Ray: the scheduler's plans executed on ``ex``, sampled tokens fed back
    (``share``: rank 0's tokens given to every rank of a group). Returns each request's generated tokens."""
    sched = Scheduler(cfg)
    seqs = [sched.make_sequence(RequestHandle(r, lambda _: None), method_key(r.method, r.method_params),
                                frozenset(), 0.0) for r in reqs]
    for s in seqs:
        sched.add(s)
    by_id = {s.seq_id: s for s in seqs}
    while sched.has_work():
        plan = sched.next_plan()
        if plan is None:
            break
        out = ex.execute(plan)
        assert out["error"] is None, out["error"]
        tokens = share(out["tokens"]) if share is not None else out["tokens"]
        if not plan.seq_ids:
            continue
        if plan.prefill:
            sched.prefill_succeeded(plan)
        for sid, new in zip(plan.seq_ids, tokens if plan.steps > 1 else [[t] for t in tokens], strict=True):
            seq = by_id[sid]
            seq.tokens.extend(t for t in new if t is not None)
            del seq.tokens[seq.request.params.max_new_tokens:]
            if len(seq.tokens) >= seq.request.params.max_new_tokens:
                sched.release(seq)
    return [s.tokens for s in seqs]


def requests(method: str, seed: int, lens: list[int] = LENS) -> list[EngineRequest]:
    g = torch.Generator().manual_seed(seed)
    return [EngineRequest(tuple(torch.randint(0, 97, (n,), generator=g).tolist()),
                          SamplingParams(max_new_tokens=NEW, ignore_eos=True), method, params_of(method))
            for n in lens]


def scheduler_config(offload: KVOffloadConfig | None) -> SchedulerConfig:
    extra = {} if offload is None else dict(device_pages=offload.device_pages(PAGE), pinned_pages=offload.pinned_pages)
    return SchedulerConfig(HOST_TOKENS // PAGE, PAGE, max_batch=8, max_prefill_tokens=1024, decode_steps=2, **extra)


def run_method(model, method: str, seed: int, offload: KVOffloadConfig | None, rank: int = 0, world: int = 1,
               reduce=None, share=None, separate: bool = False, graphs: bool = False,
               admit: KVOffloadConfig = OFFLOAD, lens: list[int] = LENS) -> tuple[list[list[int]], dict | None]:
    """``separate``: the tiers in the GPU's layout (host tier in its own memory, a working layer, write-back). With
    or without the tier the scheduler admits as the tier's pool allows, so both runs take the same plans: a
    method's prefill is not bit-identical across batch compositions (Sketch&Walk's), and the tier is what is
    compared (``admit``: the tier the scheduler admits by). ``graphs``: decode steps through the graph runner's padded
    path (what a GPU captures)."""
    cache = KVCache(model.cfg, HOST_TOKENS // PAGE, PAGE, torch.float32, "cpu", model.num_kv_heads,
                    offload=offload if separate else None, separate_host=separate)
    runner = DecodeGraphs(model, cache, 8) if graphs else None
    ex = ShardExecutor(model, cache, rank, world, reduce, graphs=runner, offload=offload)
    assert ex.use_graphs == graphs
    tokens = drive(ex, scheduler_config(admit), requests(method, seed, lens), share)
    return tokens, ex.stats().get("kv_offload")


def tiny(seed: int):
    cfg = tiny_hf_config(num_kv_heads=3, group=2, layers=LAYERS)
    cfg.max_position_embeddings = 2048
    return cfg, random_state(cfg, seed=seed).state_dict()


@pytest.fixture(scope="module")
def model():
    seed = int(torch.randint(0, 2**31 - 1, ()))
    print(f"weights seed {seed}")
    cfg, state = tiny(seed)
    return model_from_state(cfg, state).eval()


def _check_stats(stats: dict, method: str) -> None:
    assert stats["device_slots"] * PAGE < min(LENS), "the pool is smaller than one sequence's K/V"
    assert stats["page_copies"] + stats["row_copies"] > 0 and stats["bytes_copied"] > 0, method
    assert stats["decode_steps"] > 0 and 0.0 <= stats["hit_rate"] <= 1.0
    assert stats["prefill_kept_pages"] > 0, f"{method}: a finished prompt's pinned pages stay on the device"


@pytest.mark.parametrize("method", METHODS)
def test_tokens_through_the_tiers_equal_the_one_tier_tokens(model, method):
    seed = int(torch.randint(0, 2**31 - 1, ()))
    with torch.no_grad():
        plain, none = run_method(model, method, seed, None)
        tiered, stats = run_method(model, method, seed, OFFLOAD)
    assert none is None and all(len(t) == NEW for t in plain)
    assert tiered == plain, f"prompt seed {seed}"
    _check_stats(stats, method)


SEPARATE = [m for m in METHODS if m != "cis"]


@pytest.mark.parametrize("fetch", KVOffloadConfig.FETCHES)
@pytest.mark.parametrize("method", SEPARATE)
def test_tokens_through_the_separate_layout_equal_the_one_tier_tokens(model, method, fetch):
    """The GPU's layout of the tiers on the CPU: the same tokens as without the tier, with either decode fetch."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    offload = OFFLOAD if fetch == OFFLOAD.fetch else dataclasses.replace(OFFLOAD, fetch=fetch)
    with torch.no_grad():
        plain, _ = run_method(model, method, seed, None)
        tiered, stats = run_method(model, method, seed, offload, separate=True)
    assert tiered == plain, f"prompt seed {seed}"
    _check_stats(stats, method)
    if fetch == "rows":
        assert stats["pages_needed"] == 0 and stats["staged_layer_rows"] > 0, stats


# the counts a step's staging makes on the device: the graph path's padded rows must add none of them
DEVICE_COUNTS = ("decode_steps", "layer_steps", "staged_layer_rows", "rows_needed", "row_hits", "row_cache_hits",
                 "row_copies", "bytes_copied", "evictions")


# Sequences pin two pages each, so the pool's 7 pages run batches of 3, which the graph runner pads to 4; three of
# these lengths cross a page during their decode (a new page made resident before a step's replay writes it).
GRAPH_OFFLOAD = KVOffloadConfig(device_tokens=7 * PAGE, sink_pages=0, window_pages=2, fetch="rows")
GRAPH_LENS = [635, 470, 509, 530, 636]


@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize("method", ["quest", "sketch_walk", "socket"])
def test_graph_steps_through_the_tiers_equal_those_without_them(model, method, separate):
    """fetch="rows" under the graph runner (the padded step a GPU captures, eager here): the same tokens as the
    runner without the tier, and the same counts as the tier's eager steps (padded rows stage and count nothing;
    the host side of each step ran before it, in ``advance_decode``)."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    run = dict(separate=separate, admit=GRAPH_OFFLOAD, lens=GRAPH_LENS)
    with torch.no_grad():
        plain, _ = run_method(model, method, seed, None, graphs=True, admit=GRAPH_OFFLOAD, lens=GRAPH_LENS)
        tiered, stats = run_method(model, method, seed, GRAPH_OFFLOAD, graphs=True, **run)
        _, eager = run_method(model, method, seed, GRAPH_OFFLOAD, **run)
    assert tiered == plain, f"prompt seed {seed}"
    _check_stats(stats, method)
    assert stats["staged_layer_rows"] > 0 and stats["layer_steps"] > 0, stats
    assert {k: stats[k] for k in DEVICE_COUNTS} == {k: eager[k] for k in DEVICE_COUNTS}, f"prompt seed {seed}"


def test_the_separate_layout_refuses_what_it_cannot_serve(model):
    """CIS's selection reads every key, and a dense decode of a tiered layer reads every page: neither is on the
    device in the separate layout; each is refused with one line."""
    for method, params, match in (("cis", {}, "reads every cached key"),
                                  ("quest", {"dense_layers": [0, 1, 2], "density": 0.9}, "decodes layers [2] densely")):
        cache = KVCache(model.cfg, HOST_TOKENS // PAGE, PAGE, torch.float32, "cpu", model.num_kv_heads,
                        offload=OFFLOAD, separate_host=True)
        ex = ShardExecutor(model, cache, offload=OFFLOAD)
        sched = Scheduler(scheduler_config(OFFLOAD))
        req = EngineRequest(tuple(range(90)), SamplingParams(max_new_tokens=2), method, params)
        sched.add(sched.make_sequence(RequestHandle(req, lambda _: None), method_key(method, params), frozenset(),
                                      0.0))
        out = ex.execute(sched.next_plan())
        assert out["tokens"] is None and match in out["error"] and "\n" not in out["error"], out["error"]


def test_dense_is_refused_with_one_line(model):
    cache = KVCache(model.cfg, HOST_TOKENS // PAGE, PAGE, torch.float32, "cpu", model.num_kv_heads)
    ex = ShardExecutor(model, cache, offload=OFFLOAD)
    sched = Scheduler(scheduler_config(OFFLOAD))
    req = EngineRequest(tuple(range(90)), SamplingParams(max_new_tokens=2), "dense")
    sched.add(sched.make_sequence(RequestHandle(req, lambda _: None), method_key("dense"), frozenset(), 0.0))
    out = ex.execute(sched.next_plan())
    assert out["tokens"] is None and "cannot decode with --kv-offload" in out["error"] and "\n" not in out["error"]


def test_admission_counts_the_device_pool():
    cfg = SchedulerConfig(64, PAGE, device_pages=7, pinned_pages=3)  # 2 sequences' pins at once
    sched = Scheduler(cfg)
    for first in (0, 1, 2):  # three different prompts (equal ones would wait for each other's cached pages)
        req = EngineRequest(tuple(range(first, first + 300)), SamplingParams(max_new_tokens=4), "streaming")
        sched.add(sched.make_sequence(RequestHandle(req, lambda _: None), method_key("streaming"), frozenset(), 0.0))
    plan = sched.next_plan()
    assert len(plan.admit) == 2 and len(sched.waiting) == 1
    with pytest.raises(ValueError, match="must exceed"):
        SchedulerConfig(64, PAGE, device_pages=3, pinned_pages=3)


def _tp_worker(rank: int, world: int, port: int, seed: int, prompt_seed: int, out_path: str) -> None:
    import torch.distributed as dist

    from raysparse.all_reduce import collective_all_reduce
    from raysparse.tensor_parallel import apply_tensor_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        cfg, state = tiny(seed)
        model = apply_tensor_parallel(model_from_state(cfg, state).eval(), rank, world)

        def share(tokens):
            box = [tokens]
            dist.broadcast_object_list(box, src=0)
            return box[0]

        results = {}
        with torch.no_grad():
            for method in METHODS:
                for name, offload in (("plain", None), ("tiered", OFFLOAD)):
                    results[method, name] = run_method(model, method, prompt_seed, offload, rank, world,
                                                       collective_all_reduce(None), share)
        if rank == 0:
            torch.save(results, out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_tp2_tokens_through_the_tiers_equal_those_without_them(tmp_path):
    """Two shards, each with its own device pool over its KV heads' pages: every method's tokens through the tiers
    equal its tokens without them on the same two shards. (Two shards against one is the engine tests' question:
    rounding over split heads flips SOCKET's near-ties at these densities.)"""
    import torch.multiprocessing as mp

    seed = int(torch.randint(0, 2**31 - 1, ()))
    prompt_seed = int(torch.randint(0, 2**31 - 1, ()))
    out = str(tmp_path / "tp2.pt")
    mp.spawn(_tp_worker, args=(2, free_port(), seed, prompt_seed, out), nprocs=2, join=True)
    results = torch.load(out, weights_only=False)
    for method in METHODS:
        msg = f"{method}: weights seed {seed}, prompt seed {prompt_seed}"
        assert all(len(t) == NEW for t in results[method, "plain"][0]), msg
        assert results[method, "tiered"][0] == results[method, "plain"][0], msg
        _check_stats(results[method, "tiered"][1], method)


@pytest.mark.slow
def test_the_engine_decodes_through_the_tiers(tmp_path):
    """``EngineConfig.kv_offload`` reaches the engine's Ray shards and its scheduler: greedy tokens through the
    real engine with a pool smaller than one prompt's K/V equal the engine's tokens without it, the shards
    report the pool's copies, and dense is refused with its one line."""
    from raysparse.orchestration.engine import Engine, EngineConfig

    seed = int(torch.randint(0, 2**31 - 1, ()))
    cfg = tiny_hf_config(num_kv_heads=2, group=2, layers=LAYERS)
    cfg.max_position_embeddings = 2048
    random_state(cfg, seed=seed).save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(seed)
    prompts = [tuple(torch.randint(0, 97, (n,), generator=g).tolist()) for n in LENS[:2]]
    method, params = "quest", params_of("quest")

    def answers(offload: KVOffloadConfig | None) -> tuple[list[tuple[int, ...]], list[dict], str]:
        eng = Engine(EngineConfig(model=str(tmp_path), kv_cache_tokens=HOST_TOKENS, page_size=PAGE, draft=False,
                                  kv_offload=offload)).start()
        try:
            out = []
            for p in prompts:
                fin = eng.submit(EngineRequest(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True), method,
                                               params)).result(300)
                assert fin.finish_reason == "length", (fin.error, seed)
                out.append(fin.token_ids)
            dense = eng.submit(EngineRequest(prompts[0], SamplingParams(max_new_tokens=2, ignore_eos=True))).result(300)
            return out, eng.runners[0].group.stats(), dense.error or ""
        finally:
            eng.shutdown()

    plain, _, _ = answers(None)
    tiered, stats, refused = answers(OFFLOAD)
    assert tiered == plain, f"seed {seed}"
    tiers = stats[0]["kv_offload"]
    assert tiers["page_copies"] + tiers["row_copies"] > 0 and tiers["bytes_copied"] > 0, (tiers, seed)
    assert "--kv-offload" in refused and "\n" not in refused, refused
