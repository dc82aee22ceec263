"""The K/V tiers on a GPU: decode speed with the tier on and off, and the batch each fits at a long context.

In-process, no Ray: the scheduler's plans run on one shard's executor, as a replica runs them, on the Llama-3.1-8B
config (``configs/llama-3.1-8b``) with seeded random bf16 weights built on the GPU, random prompts. With
``--weights real`` the model's own weights are loaded instead (``--model``: a GGUF file or a checkpoint directory)
and each request is a needle-retrieval prompt over real text (``--text``), so the selections, and with them the
tier's hit rate, follow real query statistics.

(a) One request (``--batch`` requests) of ``--context`` tokens (default 131072): decode tokens/s of dense (no
    tier) and of each method (``--methods``, default quest, sketch_walk, socket) with the tier off and on, and the
    tier's hit rate, bytes copied per step and stall time.
(b) The largest batch at that context: dense without the tier (its whole K/V in device memory), each method with
    the tier (bounded by the host tier's memory, ``--host-gib``, and by the device memory of what stays there: the
    dense layers' K/V, the methods' per-page state, the working layer, the staging buffer and the pool). Computed
    from free device memory and host RAM, then run at that batch where its estimated time fits ``--budget-s``
    (else at the largest batch that does), with the decode throughput (generated tokens/s over the batch).

Every decode runs eagerly (the tier cannot be captured in a CUDA graph, so the untiered runs are eager as well, for
one comparison). Prints a table and writes JSON to ``$OUT/kv_offload_gpu.json`` (``--out``).

    python benchmarks/bench_kv_offload_gpu.py --quick            # 32768 tokens, a first smoke run
    python benchmarks/bench_kv_offload_gpu.py --parts a          # 131072 tokens, one request
    python benchmarks/bench_kv_offload_gpu.py --parts b          # the largest batches
    python benchmarks/bench_kv_offload_gpu.py --parts c          # the bus alone
    python benchmarks/bench_kv_offload_gpu.py --parts a --weights real --model M.gguf --context 7680 --batch 8
                                                                 # a real model's weights on real text

(c) The bus: host-to-device bandwidth of one bulk copy from pinned memory, and of token rows (one token of one KV
    head, K and V) gathered from a pinned host tier by the GPU's own loads (``copy_rows``, what a staged step does)
    and by the host (``index_select`` into a pinned buffer, then one copy: what it did before). With part (a) it
    turns each method's bytes per step into the least time the bus needs for them.

Needs only torch, triton, transformers and msgpack (no Ray, no gRPC).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from bench_common import device_us, environment, out_dir

from raysparse.decode_graphs import DecodeGraphs
from raysparse.kv_cache import KVCache
from raysparse.kv_tiers import KVOffloadConfig
from raysparse.loader import build_model, load_hf_config, load_model, load_tokenizer, resolve_source
from raysparse.methods.registry import get_method
from raysparse.orchestration.engine_api import EngineRequest, RequestHandle
from raysparse.orchestration.scheduler import Scheduler, SchedulerConfig
from raysparse.sampling import SamplingParams
from raysparse.shard_executor import ShardExecutor
from raysparse.step_plan import method_key
from raysparse.workload import build_retrieval_task, load_haystack_text

PAGE = 64
ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def host_ram() -> tuple[int, int]:
    """(MemTotal, MemAvailable) of this machine in bytes."""
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value = line.split(":", 1)
        info[name] = int(value.split()[0]) * 1024
    return info["MemTotal"], info["MemAvailable"]


class Runner:
    """One shard's cache and executor, reused by the runs of one configuration (tier on or off)."""

    def __init__(self, model: Any, host_tokens: int, offload: KVOffloadConfig | None, prefill_tokens: int,
                 device: str = "cuda", graphs_batch: int = 0, decode_steps: int = 1,
                 max_batch: int | None = None) -> None:
        # decode_steps: the scheduler's steps per decode plan while no prompt waits (the engine's --decode-steps);
        # max_batch: the sequences in flight at once (None: every prompt of a run)
        self.model, self.offload, self.prefill_tokens = model, offload, prefill_tokens
        self.decode_steps, self.max_batch = decode_steps, max_batch
        self.pages = -(-host_tokens // PAGE)
        t0 = time.perf_counter()
        dtype = next(model.parameters()).dtype
        self.cache = KVCache(model.cfg, self.pages, PAGE, dtype, device, model.num_kv_heads, offload=offload)
        self.alloc_s = time.perf_counter() - t0
        sync = torch.cuda.synchronize if device == "cuda" else None
        # graphs_batch > 0: decode steps replay from captured graphs of up to that many rows where the executor
        # allows it (without the tier, or with fetch="rows"; fetch="pages" decodes eagerly)
        graphs = DecodeGraphs(model, self.cache, graphs_batch) if graphs_batch > 0 else None
        self.ex = ShardExecutor(model, self.cache, sync=sync, graphs=graphs, offload=offload)
        self.graphs = self.ex.use_graphs

    def run(self, method: str, params: dict, prompts: list[list[int]], new: int,
            profile: bool = False, keep_outputs: bool = False, clean: bool = True,
            replay_timing: bool = False) -> dict[str, Any]:
        """The prompts through the scheduler's plans; the decode steps after the last prefill step are timed, the
        first two left out (they compile the kernels): generated tokens over their time, and the mean batch they
        decoded (a decode step between two prefill steps, where the batch's rows change, is in the TPOT alone).
        ``profile``: the fourth of those decode plans (its ``steps``) also runs under the PyTorch profiler
        (untimed), whose busiest ops are printed.
        ``keep_outputs``: the generated tokens of each request come back as ``outputs``. ``clean=False`` keeps the
        method's backends, per-page state and captured graphs for the next run of the same method (a warm-up run:
        the next run replays what this one captured instead of capturing inside its timed steps).
        ``replay_timing``: right after the profiled step (else after the last step), the widest captured decode
        graph is replayed alone (``replay_timing``) for where a step's time goes between the host's launch and the
        device. The replays re-run that step's inputs: the same K/V rewritten, the method's state advanced (this
        run's outputs are then not the method's)."""
        extra = {} if self.offload is None else dict(device_pages=self.offload.device_pages(PAGE),
                                                     pinned_pages=self.offload.pinned_pages)
        sched = Scheduler(SchedulerConfig(self.pages, PAGE, max_batch=self.max_batch or len(prompts),
                                          max_prefill_tokens=self.prefill_tokens, decode_steps=self.decode_steps,
                                          **extra))
        key = method_key(method, params)
        if key in self.ex.backends:  # a warm-up run's backend: this run's own statistics
            self.ex.backends[key].reset_stats()
        seqs = [sched.make_sequence(RequestHandle(EngineRequest(tuple(p), SamplingParams(max_new_tokens=new,
                                                                                      ignore_eos=True),
                                                               method, params), lambda _: None), key, frozenset(), 0.0)
                for p in prompts]
        for s in seqs:
            sched.add(s)
        by_id = {s.seq_id: s for s in seqs}
        prefill_s, steps, rows, seen, n_steps = 0.0, [], 0, 0, 0
        step_profile: dict[str, Any] | None = None
        replays: dict[str, Any] | None = None
        g0: dict[str, int] | None = None  # the graphs' counters when the timed steps began
        first: dict[int, float] = {}  # when each request's first and latest tokens came back
        last: dict[int, float] = {}
        t_start = time.perf_counter()
        while sched.has_work():
            plan = sched.next_plan()
            if plan is None:
                break
            if not plan.seq_ids:
                self.ex.execute(plan)
                continue
            if plan.prefill:  # the timed steps are the decode steps after the last prompt's last chunk
                seen, rows, n_steps = 0, 0, 0
                steps.clear()
            else:
                seen += 1
                if seen == 3:
                    g0 = self.ex.stats(reset=True)["graphs"]  # the tier's counts over the timed steps
            profiled = profile and not plan.prefill and seen == 4
            if profiled:
                from torch.profiler import ProfilerActivity
                from torch.profiler import profile as torch_profile

                t_prof = time.perf_counter()
                with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    out = self.ex.execute(plan)
                wall_us = 1e6 * (time.perf_counter() - t_prof)
                avgs = prof.key_averages()
                dev = {e.key: device_us(e) for e in avgs}
                step_profile = {"steps": plan.steps, "wall_us": wall_us, "device_us": sum(dev.values()),
                                "top_device": sorted(((round(v, 1), k[:80]) for k, v in dev.items() if v > 0),
                                                     reverse=True)[:15]}
                print(f"{method}: one decode step under the profiler ({wall_us:.0f} us of wall time, "
                      f"{step_profile['device_us']:.0f} us on the device), by self CPU time")
                print(avgs.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=40))
                print("by device time: " + "; ".join(f"{k} {v:.0f} us" for v, k in step_profile["top_device"]))
                if replay_timing:  # over the profiled step's own inputs: the steady batch, every sequence alive
                    replays = self.replay_timing()
            t0 = time.perf_counter()
            if not profiled:
                out = self.ex.execute(plan)
            dt = time.perf_counter() - t0
            if out["error"]:
                raise RuntimeError(f"{method}: {out['error']}")
            if plan.prefill:
                prefill_s += dt
                sched.prefill_succeeded(plan)
            elif seen >= 3 and not profiled:
                steps.append(dt)
                n_steps += plan.steps
                rows += len(plan.seq_ids) * plan.steps
            now = time.perf_counter()
            for sid, t in zip(plan.seq_ids, out["tokens"], strict=True):
                seq = by_id[sid]
                if t is not None:  # a token, or a plan of several decode steps' list of them
                    seq.tokens.extend(t if plan.steps > 1 and not plan.prefill else [t])
                    first.setdefault(sid, now)
                    last[sid] = now
                if len(seq.tokens) >= new:
                    sched.release(seq)
        if replay_timing and replays is None:
            replays = self.replay_timing()
        backend = self.ex.backends.get(key)
        cis = backend.item_sums().get("cis") if backend is not None else None  # CIS's (retrievals, head steps)
        rho = sum(cis[0]) / sum(cis[1]) if cis and sum(cis[1]) else None
        stats = self.ex.stats(reset=True)
        g1 = stats["graphs"]
        # captures and replays during the timed steps (a capture there would count its cost in them)
        timed_graphs = ({k: g1[k] - g0[k] for k in ("captures", "replays")}
                        if g0 is not None and g1 is not None else None)
        state = sum(t.numel() * t.element_size() for t in self.cache.shared_state.values()
                    if isinstance(t, torch.Tensor))
        self.ex.free([s.seq_id for s in seqs])
        if clean:  # the next method starts from a clean device: this one's backends and state go, with its captures
            self.ex.backends.clear()
            if self.ex.graphs is not None:
                self.ex.graphs.reset()
            self.cache.shared_state.clear()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        tps = rows / sum(steps) if steps else float("nan")
        # per request, as a serving client sees it: every request arrived at t_start
        ttft = [first[s.seq_id] - t_start for s in seqs if s.seq_id in first]
        tpot = [(last[s.seq_id] - first[s.seq_id]) / (len(s.tokens) - 1) for s in seqs if len(s.tokens) > 1]
        return {"method": method, "batch": len(prompts), "tiered": self.offload is not None, "graphs": self.graphs,
                "prefill_s": prefill_s, "decode_steps_timed": n_steps, "decode_plans_timed": len(steps),
                "decode_ms_per_step": 1e3 * sum(steps) / n_steps if steps else float("nan"),
                "mean_decode_batch": rows / n_steps if steps else 0.0,
                "decode_tokens_per_s": tps, "wall_s": time.perf_counter() - t_start,
                "mean_ttft_ms": 1e3 * sum(ttft) / len(ttft) if ttft else float("nan"),
                "mean_tpot_ms": 1e3 * sum(tpot) / len(tpot) if tpot else float("nan"),
                **({"outputs": [list(s.tokens) for s in seqs]} if keep_outputs else {}),
                **({"step_profile": step_profile} if step_profile is not None else {}),
                **({"replay_timing": replays} if replays is not None else {}),
                "timed_graphs": timed_graphs, "retrieval_ratio": rho,
                "density_decode": stats["density_decode"].get(key),
                "kv_offload": stats.get("kv_offload"), "state_bytes_per_token": state / ((self.pages + 1) * PAGE)}

    def replay_timing(self, reps: int = 20) -> dict[str, float] | None:
        """The widest captured decode graph replayed alone, medians over ``reps`` (us): the host's time inside
        the launch call, launch to the device's end of one replay (from an idle device), the same over two
        replays back to back, and CUDA events around one replay. One replay's end to end against the launch
        plus the device's own time says whether the launch is paid before the device starts; two replays say
        whether the second launch hides behind the first's execution."""
        g = self.ex.graphs
        if g is None or not g.graphs or not torch.cuda.is_available():
            return None
        widest = max(g.graphs, key=lambda k: (k[1], k[2], not k[3]))  # (key, batch, width, chained)
        graph = g.graphs[widest]
        sync, now = torch.cuda.synchronize, time.perf_counter
        launch, one, two, events = [], [], [], []
        for _ in range(reps):
            sync()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = now()
            e0.record()
            graph.replay()
            e1.record()
            t1 = now()
            sync()
            t2 = now()
            graph.replay()
            graph.replay()
            sync()
            t3 = now()
            launch.append(t1 - t0)
            one.append(t2 - t0)
            two.append(t3 - t2)
            events.append(e0.elapsed_time(e1) / 1e3)
        med = lambda xs: 1e6 * sorted(xs)[len(xs) // 2]  # noqa: E731
        return {"launch_us": med(launch), "one_replay_us": med(one), "two_replays_us": med(two),
                "events_us": med(events), "graph": str(widest[1:])}

    def close(self) -> None:
        del self.ex, self.cache
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def kv_bytes_per_token_layer(cfg: Any) -> int:
    return 2 * cfg.num_kv_heads * cfg.head_dim * 2  # K and V in bf16


def state_bytes_per_token(model: Any, method: str, params: dict) -> float:
    """The method's per-page state on the device (``KVCache.page_pool``), all layers, per token of cache: measured
    on a small cache by one short request (which also compiles the method's kernels)."""
    run = Runner(model, 8192, None, 8192)
    g = torch.Generator().manual_seed(1)
    r = run.run(method, params, [torch.randint(0, model.cfg.vocab_size, (1024,), generator=g).tolist()], 4)
    run.close()
    return r["state_bytes_per_token"]


def bus(rows: int = 1 << 21, d: int = 128, host_gib: float = 8.0) -> dict[str, float]:
    """Part (c): GB/s host to device, bulk and as scattered token rows (K and V of ``d`` bf16 each) out of a pinned
    slab of ``host_gib`` GiB."""
    from raysparse.kernels.dispatch import copy_rows
    from raysparse.kv_tiers import host_tier

    per = int(host_gib * GIB) // (2 * d * 2)  # rows in each of K and V
    hk, hv, slab = host_tier((per, d), 1, torch.bfloat16, pinned=True)
    out: dict[str, float] = {"host_slab_gib": slab.numel() * 2 / GIB, "rows": rows, "row_bytes": 2 * d * 2}
    bulk = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(bulk, device="cuda")

    def timed(fn, reps: int = 5) -> float:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps

    out["bulk_gb_s"] = bulk.numel() / timed(lambda: dev.copy_(bulk, non_blocking=True)) / 1e9
    src = torch.randint(0, per, (rows,), device="cuda")
    at = torch.arange(rows, device="cuda")
    sk = torch.empty(rows, d, dtype=torch.bfloat16, device="cuda")
    sv = torch.empty_like(sk)
    nbytes = rows * 2 * d * 2
    out["gpu_gather_gb_s"] = nbytes / timed(lambda: copy_rows([(hk[0], sk), (hv[0], sv)], src, at)) / 1e9
    runs = (torch.randint(0, per // 16, (rows // 16, 1), device="cuda") * 16
            + torch.arange(16, device="cuda")).flatten()  # 16 consecutive tokens: a Quest page of one KV head
    out["gpu_gather_runs16_gb_s"] = nbytes / timed(lambda: copy_rows([(hk[0], sk), (hv[0], sv)], runs, at)) / 1e9
    src_h = src.cpu()
    pk = torch.empty(rows, d, dtype=torch.bfloat16, pin_memory=True)
    pv = torch.empty_like(pk, pin_memory=True)

    def host_gather() -> None:
        torch.index_select(hk[0], 0, src_h, out=pk)
        torch.index_select(hv[0], 0, src_h, out=pv)
        sk.copy_(pk, non_blocking=True)
        sv.copy_(pv, non_blocking=True)

    out["host_gather_gb_s"] = nbytes / timed(host_gather, 2) / 1e9
    copy_rows([(hk[0], sk), (hv[0], sv)], src, at)
    ok = torch.equal(sk[:4096].cpu(), hk[0][src_h[:4096]]) and torch.equal(sv[:4096].cpu(), hv[0][src_h[:4096]])
    out["gpu_gather_checked"] = float(ok)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "configs" / "llama-3.1-8b"))
    p.add_argument("--methods", default="quest,sketch_walk,socket")
    p.add_argument("--context", type=int, default=131072,
                   help="tokens of each request: its prompt and the tokens it decodes")
    p.add_argument("--quick", action="store_true", help="32768 tokens and fewer decode steps: a smoke run")
    p.add_argument("--new", type=int, default=12, help="tokens each request decodes (the first two are not timed)")
    p.add_argument("--parts", default="a,b",
                   help="a: one request, tier on and off; b: the largest batches; c: the bus")
    p.add_argument("--device-share", type=float, default=0.2,
                   help="the device pool per layer as a share of the running sequences' K/V")
    p.add_argument("--row-share", type=float, default=None,
                   help="the row cache per layer as a share of the running sequences' K/V (default: --device-share; "
                        "0: no row cache)")
    p.add_argument("--host-gib", type=float, default=None,
                   help="host memory for the host tier (default: the available RAM less 16 GiB, at most 80%% of it)")
    p.add_argument("--reserve-gib", type=float, default=12.0, help="device memory left for activations")
    p.add_argument("--budget-s", type=float, default=None,
                   help="time for part (b)'s runs, estimated beforehand (default 420 s alone, 240 s after part a)")
    p.add_argument("--prefill-tokens", type=int, default=65536, help="prompt tokens per prefill step")
    p.add_argument("--density", type=float, default=None, help="the whole model's density (default: each method's)")
    p.add_argument("--weights", choices=("random", "real"), default="random",
                   help="random: seeded bf16 weights in --model's config, random prompts; real: --model's weights, "
                        "retrieval prompts over --text")
    p.add_argument("--text", default=None, help="real text for --weights real (default: the project's haystack)")
    p.add_argument("--fetch", default="pages",
                   help="the tier's decode fetch (KVOffloadConfig.fetch): pages, rows, or both as pages,rows (part "
                        "(a) runs each; part (b) the last)")
    p.add_argument("--batch", type=int, default=1, help="part (a)'s requests, decoded together")
    p.add_argument("--profile", action="store_true", help="profile one decode step of each tiered run in part (a)")
    p.add_argument("--graphs", action="store_true",
                   help="decode steps replay from captured CUDA graphs where the executor allows it (tier off, and "
                        "tier on with fetch=rows; fetch=pages stays eager)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.batch < 1:
        raise SystemExit("--batch must be at least 1")
    fetches = args.fetch.split(",")
    if not fetches or any(f not in KVOffloadConfig.FETCHES for f in fetches):
        raise SystemExit(f"--fetch takes {', '.join(KVOffloadConfig.FETCHES)} (comma-separated), got {args.fetch!r}")
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a GPU; benchmarks/bench_kv_offload.py is the CPU one")
    context = 32768 if args.quick and args.context == 131072 else args.context
    new = min(args.new, 6) if args.quick else args.new
    parts = set(args.parts.split(","))
    t_all = time.perf_counter()
    src = resolve_source(args.model)
    hf = load_hf_config(src)
    torch.manual_seed(0)
    if args.weights == "real":
        model = load_model(src, dtype=torch.bfloat16, device="cuda", hf_config=hf).eval()
        tokenizer = load_tokenizer(src)
        text, source = load_haystack_text(args.text)
    else:
        model = build_model(hf, dtype=torch.bfloat16, device="cuda")
    cfg = model.cfg
    methods = args.methods.split(",")
    params = {m: ({"density": args.density} if args.density is not None and get_method(m).takes_density else {})
              for m in methods}
    g = torch.Generator().manual_seed(0)

    def prompts(n: int) -> list[list[int]]:  # the decoded tokens end at ``context``: within the model's positions
        if args.weights == "real":  # a retrieval prompt a few percent under its size, cut to the tokens left
            return [list(build_retrieval_task(tokenizer, text, source, context - new - 256, seed=i).prompt_ids)
                    [:context - new] for i in range(n)]
        return [torch.randint(0, cfg.vocab_size, (context - new,), generator=g).tolist() for _ in range(n)]

    total = context
    seq_tokens = -(-total // PAGE) * PAGE + PAGE
    kv_tl = kv_bytes_per_token_layer(cfg)
    mem_total, mem_avail = host_ram()
    host_budget = int(args.host_gib * GIB) if args.host_gib else int(min(mem_avail - 16 * GIB, 0.8 * mem_avail))
    record: dict[str, Any] = {"env": environment(), "model": args.model, "context": context, "new_tokens": new,
                              "host_ram_total_gib": mem_total / GIB, "host_ram_available_gib": mem_avail / GIB,
                              "host_tier_budget_gib": host_budget / GIB, "device_share": args.device_share,
                              "row_share": args.device_share if args.row_share is None else args.row_share,
                              "methods": methods, "params": params, "eager": not args.graphs, "a": [], "b": []}
    row_share = args.device_share if args.row_share is None else args.row_share

    def offload_for(seqs: int, fetch: str = fetches[-1]) -> KVOffloadConfig:
        return KVOffloadConfig(device_tokens=max(4 * PAGE, math.ceil(args.device_share * seqs * total / PAGE) * PAGE),
                               row_tokens=math.ceil(row_share * seqs * total / PAGE) * PAGE, fetch=fetch)

    offload_cfg = offload_for(1)
    tiered_layers = len(offload_cfg.tiered_layers(cfg.num_layers))
    print(f"{args.model}: {args.weights} bf16 weights; context {context} ({new} decoded); K/V "
          f"{kv_tl * cfg.num_layers * total / 1e9:.2f} GB per sequence; host RAM {mem_total / GIB:.0f} GiB "
          f"({mem_avail / GIB:.0f} available): host tier "
          f"budget {host_budget / GIB:.0f} GiB = {host_budget // (kv_tl * tiered_layers * seq_tokens)} sequences of "
          f"{tiered_layers} tiered layers", flush=True)

    if "c" in parts:
        record["c"] = bus()
        c = record["c"]
        print(f"(c) bus: bulk {c['bulk_gb_s']:.1f} GB/s; {c['rows']} rows of {c['row_bytes']} B gathered by the GPU "
              f"{c['gpu_gather_gb_s']:.1f} GB/s at random, {c['gpu_gather_runs16_gb_s']:.1f} GB/s in runs of 16 "
              f"(checked: {bool(c['gpu_gather_checked'])}), by the host "
              f"{c['host_gather_gb_s']:.1f} GB/s", flush=True)

    if "a" in parts:
        gb = args.batch if args.graphs else 0
        plain = Runner(model, seq_tokens * args.batch, None, args.prefill_tokens, graphs_batch=gb)
        for m in ["dense", *methods]:
            r = plain.run(m, params.get(m, {}), prompts(args.batch), new)
            record["a"].append(r)
            print(f"(a) {m:12s} tier off{' (graphs)' if r['graphs'] else ''}  {r['decode_tokens_per_s']:8.2f} tok/s  "
                  f"{r['decode_ms_per_step']:7.2f} ms/step  prefill {r['prefill_s']:6.1f} s", flush=True)
        plain.close()
        for fetch in fetches:
            offload_cfg = offload_for(args.batch, fetch)
            tier = Runner(model, seq_tokens * args.batch, offload_cfg, args.prefill_tokens, graphs_batch=gb)
            for m in methods:
                try:
                    r = tier.run(m, params[m], prompts(args.batch), new, profile=args.profile)
                except RuntimeError as e:  # a method the tier refuses here: its row says why, the others go on
                    record["a"].append({"method": m, "tiered": True, "fetch": fetch,
                                        "error": str(e).splitlines()[0][:300]})
                    print(f"(a) {m:12s} {fetch:5s} on refused: {record['a'][-1]['error']}", flush=True)
                    continue
                off = next(x for x in record["a"] if x["method"] == m and not x["tiered"])
                r["vs_tier_off"] = r["decode_tokens_per_s"] / off["decode_tokens_per_s"]
                r["fetch"] = fetch
                record["a"].append(r)
                st = r["kv_offload"] or {}
                print(f"(a) {m:12s} {fetch:5s} on{' (graphs)' if r['graphs'] else ''} "
                      f"{r['decode_tokens_per_s']:8.2f} tok/s  "
                      f"{r['decode_ms_per_step']:7.2f} ms/step  x{r['vs_tier_off']:.2f} of tier off  hit "
                      f"{st.get('hit_rate', float('nan')):.3f}  {st.get('bytes_per_step', 0) / 1e6:8.1f} MB/step"
                      f"  stall "
                      f"{1e3 * st.get('stall_s_per_step', 0):6.2f} ms/step  (pool {offload_cfg.device_tokens} "
                      f"tokens/layer, row cache {offload_cfg.row_cache_tokens};"
                      f" host tier allocated in {tier.alloc_s:.1f} s)", flush=True)
                if "c" in record:  # the least time the bus needs for the step's copies (at its bulk rate, the best it
                    # does), against the step without the tier
                    r["bus_ms_per_step"] = 1e3 * st.get("bytes_per_step", 0) / (record["c"]["bulk_gb_s"] * 1e9)
                    r["bus_bound_vs_tier_off"] = off["decode_ms_per_step"] / (off["decode_ms_per_step"]
                                                                               + r["bus_ms_per_step"])
                    print(f"    the bus alone needs {r['bus_ms_per_step']:.1f} ms/step for those bytes: at best "
                          f"x{r['bus_bound_vs_tier_off']:.2f} of tier off unoverlapped, "
                          f"x{min(1.0, off['decode_ms_per_step'] / r['bus_ms_per_step']):.2f} fully overlapped",
                          flush=True)
            tier.close()

    if "b" in parts:
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info()[0] - int(args.reserve_gib * GIB)
        dense_seq = kv_tl * cfg.num_layers * seq_tokens
        plans = [("dense", False, max(0, free // dense_seq), {"device_bytes_per_seq": dense_seq})]
        for m in methods:
            state = state_bytes_per_token(model, m, params[m]) * seq_tokens
            dev_layers = len(offload_cfg.device_layers)
            # on the device per sequence: the dense layers' K/V, the per-page state, its share of the working layer
            # and of the staging buffer (one layer each), and its share of the pool and of the row cache
            per_dev = seq_tokens * kv_tl * (dev_layers + 2 + (args.device_share + row_share) * tiered_layers) + state
            per_host = seq_tokens * kv_tl * tiered_layers
            b_dev, b_host = int(free // per_dev), int(host_budget // per_host)
            plans.append((m, True, min(b_dev, b_host), {"device_bytes_per_seq": per_dev, "host_bytes_per_seq": per_host,
                                                        "device_bound": b_dev, "host_bound": b_host,
                                                        "state_bytes_per_seq": state}))
        # prefill (dense attention at 400 TFLOP/s, the linear layers at 500) and decode, per sequence
        flops = 2 * sum(x.numel() for x in model.parameters()) * context
        attn = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context * context / 2  # causal
        per_seq_s = flops / 500e12 + attn / 400e12 + new * 0.05
        budget = args.budget_s if args.budget_s is not None else (420.0 if parts == {"b"} else 240.0)
        share = budget / len(plans)  # part (b)'s budget, shared by its runs
        runs = {m: max(0, min(fit, int(share // per_seq_s))) for m, _, fit, _ in plans}
        # the tiered runs share one host tier (pinning it is slow), sized for the largest of them
        tier_b = max([runs[m] for m, tiered, _, _ in plans if tiered] + [0])
        shared: Runner | None = None
        for m, tiered, fit, info in plans:
            run_b = runs[m]
            row: dict[str, Any] = {"method": m, "tiered": tiered, "max_batch": fit, "estimated_s_per_seq": per_seq_s,
                                   **info}
            print(f"(b) {m:12s} tier {'on ' if tiered else 'off'} largest batch {fit} "
                  + (f"(device {info['device_bound']}, host {info['host_bound']})" if tiered else "(device)")
                  + f"; running {run_b}", flush=True)
            if run_b >= 1:
                runner = shared if tiered else None
                try:
                    if runner is None:
                        b = tier_b if tiered else run_b
                        off = offload_for(b) if tiered else None
                        runner = Runner(model, seq_tokens * b, off, args.prefill_tokens,
                                        graphs_batch=b if args.graphs else 0)
                        row["host_tier_alloc_s"] = runner.alloc_s
                        if tiered:
                            shared = runner
                    r = runner.run(m, params.get(m, {}), prompts(run_b), new)
                except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # the row records it; the others go on
                    r = {"error": f"batch {run_b}: {str(e).splitlines()[0][:300]}"}
                if runner is not None and runner is not shared:
                    runner.close()
                row.update(r)
                row["ran_batch"] = run_b
                print(f"    {r.get('decode_tokens_per_s', float('nan')):8.2f} tok/s over the batch "
                      f"{r.get('decode_ms_per_step', float('nan')):7.2f} ms/step {r.get('error', '')}", flush=True)
            record["b"].append(row)
        if shared is not None:
            shared.close()
        dense_row = record["b"][0]
        for row in record["b"][1:]:
            if "decode_tokens_per_s" in row and "decode_tokens_per_s" in dense_row:
                row["vs_dense"] = row["decode_tokens_per_s"] / dense_row["decode_tokens_per_s"]
                print(f"(b) {row['method']:12s} x{row['vs_dense']:.2f} of dense's throughput at their batches")

    record["wall_s"] = time.perf_counter() - t_all
    path = args.out or out_dir() / "kv_offload_gpu.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str))
    print(f"wrote {path} ({record['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
