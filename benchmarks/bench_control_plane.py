"""The engine's control plane alone: one step's round trip from the driver to a TP group and back.

Compares plain actor calls (what the engine uses: ``execute.remote(plan)`` on every shard, then wait) with a
Ray compiled graph over the same actors, on a step plan the size of a decode step (batch of 8 sequences)
and an actor method that does no work, so the figure is pure control-plane cost per step.

Usage: python benchmarks/bench_control_plane.py [--tp 2] [--steps 300]
Prints a table last and writes JSON to $OUT/bench_control_plane.json (default ./results).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any


class Echo:
    def execute(self, plan: Any) -> dict[str, Any]:
        return {"tokens": [0] * len(plan.seq_ids), "error": None, "forward_s": 0.0}


def percentiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"median_us": 1e6 * statistics.median(xs), "p99_us": 1e6 * xs[int(0.99 * (len(xs) - 1))],
            "mean_us": 1e6 * statistics.fmean(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    import ray

    from raysparse.orchestration.ray_env import start_ray
    from raysparse.step_plan import StepPlan

    start_ray(None)
    actors = [ray.remote(Echo).options(num_cpus=0).remote() for _ in range(args.tp)]
    plan = StepPlan('["dense", []]', False, list(range(8)), [[1]] * 8)
    ray.get([a.execute.remote(plan) for a in actors])
    results: dict[str, Any] = {"tp": args.tp, "steps": args.steps}

    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        ray.get([a.execute.remote(plan) for a in actors])
        times.append(time.perf_counter() - t)
    results["actor_calls"] = percentiles(times)

    try:
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as inp:
            dag = MultiOutputNode([a.execute.bind(inp) for a in actors])
        compiled = dag.experimental_compile()
        for _ in range(10):
            ray.get(compiled.execute(plan))
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            ray.get(compiled.execute(plan))
            times.append(time.perf_counter() - t)
        results["compiled_graph"] = percentiles(times)
        compiled.teardown()
    except Exception as e:  # reported, not hidden: compiled graphs need shared-memory channels
        results["compiled_graph"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}

    out = Path(os.environ.get("OUT", "results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_control_plane.json").write_text(json.dumps(results, indent=1))
    print(f"\ncontrol plane per step, TP={args.tp}, {args.steps} steps")
    for name in ("actor_calls", "compiled_graph"):
        r = results[name]
        if "error" in r:
            print(f"{name:>15}: {r['error']}")
        else:
            print(f"{name:>15}: median {r['median_us']:.0f} us, p99 {r['p99_us']:.0f} us, mean {r['mean_us']:.0f} us")
    ray.shutdown()


if __name__ == "__main__":
    main()
