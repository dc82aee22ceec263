"""Decode steps of methods against dense on the CPU, interleaved in one process, on the embedded default model.

A rate over the ~18 tokens of one ``raysparse run`` is noisy on a shared machine; this prefills one prompt per
method (each on its own cache), then runs rounds of one decode step per method, in a rotating order, and
reports each method's median step time and its rate against dense's median:

    python benchmarks/bench_cpu_decode_ab.py --context-tokens 4096 --methods socket,cis --rounds 40 --threads 2

``--profile M`` prints the top operators of a few more decode steps of method M (torch.profiler, host time).
``--stages`` adds where each method's step goes in the batched seam, in ms a step: its per-page state update
(``update_state``), its selection (``decode_select``), the shared attend (``paged_decode_attention``, dense's
decode included) and the rest (the weights' products, norms, the head).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

import raysparse.methods.base as method_base
from raysparse.kernels import dispatch
from raysparse.kv_cache import KVCache
from raysparse.loader import load_model, resolve_source
from raysparse.methods.registry import create_backend, get_method


class Lane:
    """One method's backend, cache and sequence after the prompt; ``step`` decodes one token greedily.

    The prompt's K/V are dense's, copied (``source``), and the method's per-page state is built from them
    (``update_state``): the decode's cost does not depend on how the prefill attended, and one prefill
    instead of one per method keeps a run short. Without ``source`` the lane prefills itself."""

    def __init__(self, model: Any, name: str, density: float, prompt: list[int], steps: int,
                 source: Lane | None = None) -> None:
        self.model, self.name = model, name
        budgeted = name != "dense" and get_method(name).takes_density  # PSAW's and ETF's schedule is their budget
        self.backend = create_backend(name, model.cfg, **({"density": density} if budgeted else {}))
        total = len(prompt) + steps + 64
        self.cache = KVCache(model.cfg, num_pages=-(-total // 64), page_size=64, dtype=model.lm_head.weight.dtype,
                             num_kv_heads=model.num_kv_heads)
        self.cache.allocate(0, total)
        batch = self.cache.prepare([0], [len(prompt)], True)
        if source is None:
            logits = model(torch.tensor(prompt), batch, self.cache, self.backend)
            self.tok = logits[-1:].argmax(-1)
        else:
            for layer in range(model.cfg.num_layers):
                self.cache.k[layer].copy_(source.cache.k[layer])
                self.cache.v[layer].copy_(source.cache.v[layer])
                if getattr(self.backend, "batched_decode", False) and not self.backend.is_dense_layer(layer):
                    self.backend.update_state(layer, self.cache, batch)
            self.tok = source.tok.clone()
        self.times: list[float] = []
        self.stages: dict[str, float] = defaultdict(float)  # host seconds per seam stage, over the timed steps

    def _timed(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.stages[stage] += time.perf_counter() - t
        return run

    def step(self, stages: bool = False) -> None:
        attend = dispatch.paged_decode_attention
        hooks = [h for h in ("update_state", "decode_select") if stages and hasattr(self.backend, h)]
        for h in hooks:  # timed for this lane's step only: the backend's own attributes shadow its class's
            setattr(self.backend, h, self._timed(h, getattr(self.backend, h)))
        if stages:
            method_base.paged_decode_attention = dispatch.paged_decode_attention = self._timed("attend", attend)
        t = time.perf_counter()
        try:
            batch = self.cache.prepare([0], [1], False)
            self.tok = self.model(self.tok, batch, self.cache, self.backend).argmax(-1)
        finally:
            self.times.append(time.perf_counter() - t)
            for h in hooks:
                delattr(self.backend, h)
            method_base.paged_decode_attention = dispatch.paged_decode_attention = attend


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="socket,socket_hard,cis,cpe,psaw,etf")
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--context-tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", default=None, help="a method whose decode steps to profile after the rounds")
    ap.add_argument("--stages", action="store_true", help="also time the seam's stages of every step")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(resolve_source(None))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, model.cfg.vocab_size - 100, (args.context_tokens,), generator=g).tolist()
    names = ["dense"] + [m for m in args.methods.split(",") if m and m != "dense"]
    with torch.inference_mode():
        steps = args.rounds + args.warmup + 8
        lanes = [Lane(model, "dense", args.density, prompt, steps)]
        lanes += [Lane(model, m, args.density, prompt, steps, source=lanes[0]) for m in names[1:]]
        for _ in range(args.warmup):
            for lane in lanes:
                lane.step()
        for lane in lanes:
            lane.times.clear()
        for r in range(args.rounds):  # rotate the order so no method always follows the same one
            for i in range(len(lanes)):
                lanes[(i + r) % len(lanes)].step(args.stages)
        dense = statistics.median(lanes[0].times)
        print(f"\n{args.context_tokens} tokens, {args.rounds} rounds, {args.threads} threads, "
              f"torch {torch.__version__}")
        print("| method | median ms/step | tok/s | vs dense |")
        print("|---|---:|---:|---:|")
        for lane in lanes:
            med = statistics.median(lane.times)
            print(f"| {lane.name} | {1e3 * med:.1f} | {1 / med:.1f} | {dense / med:.2f}x |")
        if args.stages:
            print("\n| method | mean ms/step | state | select | attend | rest |")
            print("|---|---:|---:|---:|---:|---:|")
            for lane in lanes:
                per = {k: 1e3 * v / len(lane.times) for k, v in lane.stages.items()}
                mean = 1e3 * statistics.fmean(lane.times)
                parts = [per.get(k, 0.0) for k in ("update_state", "decode_select", "attend")]
                cells = " | ".join(f"{x:.1f}" for x in [*parts, mean - sum(parts)])
                print(f"| {lane.name} | {mean:.1f} | {cells} |")
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            lane = lanes[names.index(args.profile)]
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(4):
                    lane.step()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=48))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
