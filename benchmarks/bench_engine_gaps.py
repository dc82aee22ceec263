"""Token gaps of one request per method through the engine on Ray, the retrieval job's prompt, CPU or GPU.

``raysparse run`` reports one decode rate over a few tokens; this streams one request per method through one
engine, in turn, and reports the median gap between its tokens (a decode step with the engine's own overheads:
the shard actor, its messages, the driver), against dense's in the same engine:

    python benchmarks/bench_engine_gaps.py --methods dense,cis,cpe,dense --new-tokens 64

``--new-tokens`` tokens are generated past EOS. With ``specattn`` among the methods the engine starts its draft
actor, and SpecAttn's rounds are reported too (their wall time, the draft's share, tokens a round). Each method's
prompt is the same, so from the second request on a method's prefix cache may hold it. Prints a table last and
writes JSON to ``--out`` (default ./results/engine_gaps.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="dense,cis,cpe,dense")
    ap.add_argument("--density", type=float, default=0.1, help="for methods that take one")
    ap.add_argument("--context-tokens", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default="results/engine_gaps.json")
    args = ap.parse_args()
    from raysparse.generate import FinishEvent
    from raysparse.methods.registry import get_method
    from raysparse.orchestration.engine import Engine, EngineConfig
    from raysparse.orchestration.engine_api import EngineRequest
    from raysparse.sampling import SamplingParams
    from raysparse.workload import build_retrieval_task, load_haystack_text

    methods = args.methods.split(",")
    # SpecAttn needs the draft actor; its rounds' split (the draft's propose time, the round's wall time) is
    # reported from the engine's SpecAttn step
    speculative = any(get_method(m).capabilities.needs_draft for m in methods)
    engine = Engine(EngineConfig(kv_cache_tokens=args.context_tokens + args.new_tokens + 256, draft=speculative))
    engine.start()
    rows = []
    try:
        text, source = load_haystack_text(None)
        task = build_retrieval_task(engine.tokenizer, text, source, context_tokens=args.context_tokens, depth=0.5,
                                    seed=0)
        for m in methods:
            spec_before = engine.runners[0].spec_step.stats() if get_method(m).capabilities.needs_draft else None
            params = (("density", args.density),) if m != "dense" and get_method(m).takes_density else ()
            req = EngineRequest(tuple(task.prompt_ids),
                                SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True), m, params)
            stamps = []
            for ev in engine.submit(req):
                stamps.append(time.perf_counter())
                if isinstance(ev, FinishEvent):
                    break
            tokens = stamps[:-1]  # the last event is the finish
            gaps = [b - a for a, b in zip(tokens[:-1], tokens[1:], strict=True)]
            rows.append({"method": m, "median_gap_ms": 1e3 * statistics.median(gaps),
                         "mean_gap_ms": 1e3 * statistics.fmean(gaps), "tokens": len(tokens)})
            if spec_before is not None:
                after = engine.runners[0].spec_step.stats()
                rounds = after["rounds"] - spec_before["rounds"]  # the draft's proposals: the decode rounds
                rows[-1]["spec_rounds"] = rounds
                rows[-1]["round_ms"] = 1e3 * (tokens[-1] - tokens[0]) / max(1, rounds)
                rows[-1]["propose_ms"] = 1e3 * (after["propose_s"] - spec_before["propose_s"]) / max(1, rounds)
                rows[-1]["tokens_per_round"] = (len(tokens) - 1) / max(1, rounds)
    finally:
        engine.shutdown()
    dense = statistics.fmean(r["median_gap_ms"] for r in rows if r["method"] == "dense") if any(
        r["method"] == "dense" for r in rows) else None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print("| method | median gap ms | mean gap ms | vs dense |")
    print("|---|---:|---:|---:|")
    for r in rows:
        ratio = f"{dense / r['median_gap_ms']:.2f}x" if dense else "-"
        print(f"| {r['method']} | {r['median_gap_ms']:.1f} | {r['mean_gap_ms']:.1f} | {ratio} |")
    for r in rows:
        if "spec_rounds" in r:
            print(f"{r['method']}: {r['spec_rounds']} rounds of {r['round_ms']:.0f} ms (the draft's propose "
                  f"{r['propose_ms']:.0f} ms), {r['tokens_per_round']:.2f} tokens a round")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
