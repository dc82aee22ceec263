"""Where a prefix-cache hit's prefill step goes: one shard in process (no Ray), one long document prefilled,
then rounds of questions that start from its cached pages, in one batched prefill step each; the second
round under the torch profiler (the first pays first-use costs).

    python benchmarks/profile_prefix_hits.py --model configs/llama-3.1-8b --doc 65536 --methods dense,sketch_walk
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="configs/llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=None, help="keep only this many layers")
    ap.add_argument("--doc", type=int, default=65536)
    ap.add_argument("--questions", type=int, default=7)
    ap.add_argument("--methods", default="dense,sketch_walk")
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--rows", type=int, default=25, help="profiler table rows")
    ap.add_argument("--select-ops", action="store_true",
                    help="also count the aten ops each layer's prefill selection dispatches in the profiled step")
    ap.add_argument("--reference", action="store_true",
                    help="Sketch&Walk selects per sequence (its batched selection's reference)")
    a = ap.parse_args()
    from raysparse.kv_cache import KVCache
    from raysparse.loader import build_model, load_hf_config, resolve_source
    from raysparse.shard_executor import ShardExecutor
    from raysparse.step_plan import StepPlan, method_key

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    hf = load_hf_config(resolve_source(a.model))
    if a.layers:
        hf.num_hidden_layers = a.layers
    torch.manual_seed(0)
    model = build_model(hf, dtype=dtype, device=dev)
    page = 64
    doc_pages = a.doc // page
    g = torch.Generator().manual_seed(1)
    doc = torch.randint(100, 1000, (a.doc,), generator=g).tolist()
    summary = []
    for method in a.methods.split(","):
        key = method_key(method, {} if method == "dense" else {"density": a.density})
        cache = KVCache(model.cfg, doc_pages + 2 + 2 * a.questions * 2 + 4, page, dtype, dev)
        ex = ShardExecutor(model, cache)
        select_ops: list[int] = []
        if method != "dense":
            backend = ex.backend(key)
            backend.prefill_reference = a.reference
            if a.select_ops:
                backend.prefill_select = counted(backend.prefill_select, select_ops)
        sp = {"max_new_tokens": 2}
        first = doc + torch.randint(100, 1000, (40,), generator=g).tolist()
        t = time.perf_counter()
        admit = [(0, len(first) + 2, sp, list(range(doc_pages + 2)), 0)]
        res = ex.execute(StepPlan(key, True, [0], [first], admit=admit))
        assert res["error"] is None, res["error"]
        t_first = time.perf_counter() - t
        nxt, times = doc_pages + 2, []
        for rnd in range(2):
            admit, sids, toks = [], [], []
            for i in range(a.questions):
                sid = 1 + rnd * a.questions + i
                q = torch.randint(100, 1000, (30 + i,), generator=g).tolist()
                admit.append((sid, a.doc + len(q) + 2, sp, list(range(doc_pages)) + [nxt], a.doc))
                sids.append(sid)
                toks.append(q)
                nxt += 1
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                          + ([torch.profiler.ProfilerActivity.CUDA] if dev == "cuda" else []))
            if rnd:
                select_ops.clear()
                prof.__enter__()
            if dev == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            res = ex.execute(StepPlan(key, True, sids, toks, admit=admit))
            if dev == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            if rnd:
                prof.__exit__(None, None, None)
            assert res["error"] is None, res["error"]
            ex.free(sids)
            nxt -= a.questions
        print(f"\n== {method}: whole prefill {t_first:.3f} s; {a.questions} hits in one step: "
              f"{times[0]:.3f} s, then {times[1]:.3f} s")
        avg = prof.key_averages()
        print(avg.table(sort_by="cpu_time_total", row_limit=a.rows, max_name_column_width=60))
        # every aten call (nested ones included) and, on GPUs, every kernel launch of the profiled step
        ops = sum(e.count for e in avg if e.key.startswith("aten::"))
        launches = sum(e.count for e in avg if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
        summary.append((method, t_first, *times, ops, launches))
        if select_ops:
            print(f"{method}: aten ops per layer's prefill selection in the profiled step: {select_ops}")
        ex.free([0])
        del ex, cache
        if dev == "cuda":
            torch.cuda.empty_cache()
    print(f"\n{'method':<14}{'whole s':>9}{'hits 1 s':>10}{'hits 2 s':>10}{'aten ops':>10}{'launches':>10}")
    for m, f, h1, h2, ops, launches in summary:
        print(f"{m:<14}{f:>9.3f}{h1:>10.3f}{h2:>10.3f}{ops:>10}{launches:>10}")
    return 0


def counted(select, into: list[int]):
    """``select`` wrapped to append the number of aten ops each call dispatches to ``into``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    def run(*args, **kwargs):
        with Count() as c:
            out = select(*args, **kwargs)
        into.append(c.n)
        return out

    return run


if __name__ == "__main__":
    raise SystemExit(main())
