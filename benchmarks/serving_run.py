"""The in-process serving run of the GPU benchmarks: one shard's K/V cache and executor driven by the scheduler's
plans, as a replica runs them (no Ray, no gRPC), with the decode steps after the last prefill step timed, and
optionally one of them profiled. ``bench_kv_offload_gpu.py`` (the K/V tiers) and ``bench_kv_bound.py`` (KV-bound
and 32K serving) run their workloads through it."""

from __future__ import annotations

import gc
import time
from typing import Any

import torch
from bench_common import device_us

from raysparse.decode_graphs import DecodeGraphs
from raysparse.kv_cache import KVCache
from raysparse.kv_tiers import KVOffloadConfig
from raysparse.orchestration.engine_api import EngineRequest, RequestHandle
from raysparse.orchestration.scheduler import Scheduler, SchedulerConfig
from raysparse.sampling import SamplingParams
from raysparse.shard_executor import ShardExecutor
from raysparse.step_plan import method_key

PAGE = 64  # tokens per cache page


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
