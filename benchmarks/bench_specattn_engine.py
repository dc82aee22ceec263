"""SpecAttn through the engine: the draft actor's message per round (bytes), acceptance, and round time.

One engine (default model, TP=2 on CPU unless --tp) answers a real-text retrieval prompt with SpecAttn at
several top-p values; for each it reports what the draft actor sent to the verifier shards per round
(``DraftWorker.stats``), the acceptance the shards measured, and the time per round split between the
draft's proposal and the whole round.

Usage: python benchmarks/bench_specattn_engine.py [--tp 2] [--context-tokens 2048] [--top-p 0.95,0.97,0.99]
Prints a table last and writes JSON to $OUT/bench_specattn_engine.json (default ./results).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--context-tokens", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--top-p", default="0.95,0.97,0.99")
    args = ap.parse_args()
    from raysparse.orchestration.engine import Engine, EngineConfig, EngineRequest
    from raysparse.sampling import SamplingParams
    from raysparse.step_plan import method_key
    from raysparse.workload import build_retrieval_task, load_haystack_text

    rows = []
    cfg = EngineConfig(model=args.model, tp=args.tp, kv_cache_tokens=args.context_tokens + 512, cpus_per_shard=0.5)
    with Engine(cfg) as eng:
        text, source = load_haystack_text(None)
        task = build_retrieval_task(eng.tokenizer, text, source, context_tokens=args.context_tokens)
        step = eng.runners[0].spec_step
        for p in [float(x) for x in args.top_p.split(",")]:
            params = {"top_p": p}
            before = step.stats()
            eng.shard_stats(reset=True)
            fin = eng.submit(EngineRequest(tuple(task.prompt_ids), SamplingParams(max_new_tokens=args.new_tokens),
                                           "specattn", params)).result(1800)
            after = step.stats()
            spec = eng.shard_stats()[0][0]["specattn"][method_key("specattn", params)]
            rounds = after["rounds"] - before["rounds"]
            row = {"top_p": p, "finish": fin.finish_reason, "error": fin.error, "correct": task.is_correct(fin.text),
                   "tokens": len(fin.token_ids), "rounds": rounds,
                   "bytes_per_round": (after["bytes_sent"] - before["bytes_sent"]) / max(rounds, 1),
                   "propose_ms_per_round": 1e3 * (after["propose_s"] - before["propose_s"]) / max(rounds, 1),
                   "round_ms": 1e3 * (after["round_s"] - before["round_s"])
                   / max(after["engine_rounds"] - before["engine_rounds"], 1),
                   "acceptance": spec["acceptance_rate"], "tokens_per_round": spec["tokens_per_round"],
                   "kv_reduction": spec["kv_reduction"], "decode_tok_s": fin.decode_tokens_per_s}
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(os.environ.get("OUT", "results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_specattn_engine.json").write_text(json.dumps({"tp": args.tp, "context": args.context_tokens,
                                                                "rows": rows}, indent=1))
    print(f"\n{'top_p':>6} {'bytes/round':>12} {'propose ms':>11} {'round ms':>9} {'accept':>7} {'tok/round':>10} "
          f"{'KV red.':>8} {'correct':>8}")
    for r in rows:
        print(f"{r['top_p']:>6} {r['bytes_per_round']:>12.0f} {r['propose_ms_per_round']:>11.1f} {r['round_ms']:>9.1f} "
              f"{r['acceptance']:>7.2f} {r['tokens_per_round']:>10.2f} {r['kv_reduction']:>8.2f} {r['correct']!s:>8}")


if __name__ == "__main__":
    main()
