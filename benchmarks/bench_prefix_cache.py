"""Prefix caching: questions about one long document through the JSONL job, with the cache on and off.

One Ray instance; for each cache setting an engine, and for each method one JSONL file of ``--questions``
``document`` + ``question`` lines run by the job's own loop (``raysparse.jobs.longcontext.run_job``: lines
grouped by document, the first question prefilled before the others are submitted), after the same job
about two other documents of the same length (untimed: first-use costs). The record holds every
line's ``ttft_s`` and ``cached_tokens``; the table gives, per method, the first question's TTFT, the mean TTFT
of the others and their ratios (to the first, and cache on against off, from the same run):

    python benchmarks/bench_prefix_cache.py --model DIR --random-weights --device cuda --dtype bfloat16
    python benchmarks/bench_prefix_cache.py --quick     # the default model on CPU, a 1024-token document

``--model`` is a local directory with a config and a tokenizer (with ``--random-weights`` the config alone
sets the shapes, e.g. Llama-3.1-8B's config beside a tokenizer).
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
import time
from pathlib import Path
from statistics import mean
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ["Who is the first person named in the text?", "What is the weather like in the text?",
             "Summarise the last paragraph in one sentence.", "Which places does the text mention?",
             "What does the main character want?", "Name two characters who meet.",
             "What happens at the beginning?", "What is the tone of the text?"]


def document(text: str, tokenizer: Any, tokens: int) -> str:
    """The first ``tokens`` tokens of ``text`` as text."""
    ids = tokenizer(text[: tokens * 8], add_special_tokens=False)["input_ids"][:tokens]
    return tokenizer.decode(ids)


def run_method(engine: Any, method: str, params: dict[str, Any], doc: str, n: int, new: int, work: Path,
               tag: str) -> list[dict[str, Any]]:
    from raysparse.jobs.longcontext import build_parser, run_job

    inp, out = work / f"{tag}.in.jsonl", work / f"{tag}.out.jsonl"
    with inp.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"q{i + 1}", "document": doc, "question": QUESTIONS[i % len(QUESTIONS)],
                                "method": method, "method_params": params,
                                "sampling": {"max_new_tokens": new, "ignore_eos": True}}) + "\n")
    args = build_parser().parse_args(["--input", str(inp), "--output", str(out), "--timeout", "1800"])
    counts = run_job(args, engine)
    if counts["errors"]:
        raise RuntimeError(f"{tag}: {counts['errors']} error line(s): {out.read_text()[:2000]}")
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    return [{k: rows[f"q{i + 1}"][k] for k in ("id", "ttft_s", "cached_tokens", "prompt_tokens")} for i in range(n)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the default model on CPU, a short document")
    p.add_argument("--model", default=None, help="local model directory (config + tokenizer)")
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--methods", default="dense,sketch_walk:0.1", help="METHOD[:DENSITY] list")
    p.add_argument("--doc-tokens", type=int, default=65536)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--text", default=None, help="text file or folder (default: the shared prose)")
    p.add_argument("--out", default=None, help="record directory")
    a = p.parse_args()
    if a.quick:
        a.doc_tokens, a.device = 1024, "cpu"
    from raysparse.loader import load_tokenizer, resolve_source
    from raysparse.orchestration.engine import Engine, EngineConfig
    from raysparse.orchestration.prefix_cache import PrefixCacheConfig
    from raysparse.orchestration.ray_env import start_ray, stop_ray
    from raysparse.workload import load_haystack_text

    text, _ = load_haystack_text(a.text)
    tokenizer = load_tokenizer(resolve_source(a.model))
    doc = document(text, tokenizer, a.doc_tokens)
    # the same job about two other documents first, untimed: kernels compiled and decode graphs captured for
    # these shapes, so the timed run measures the cache rather than first-use costs. Twice, because the first
    # pass's compiles make its first question slow, so the others all arrive in one batched step; the second
    # pass meets the timed run's step shapes (a hit alone in a step, then the rest), which Triton may compile
    # apart (it specialises integer arguments equal to 1)
    warm_docs = [document(text[len(text) * i // 4:], tokenizer, a.doc_tokens) for i in (2, 1)]
    methods = []
    for spec in a.methods.split(","):
        name, _, density = spec.partition(":")
        methods.append((name, {"density": float(density)} if density else {}))
    kv = 2 * (a.doc_tokens + 1024) + a.questions * 256  # two whole prompts at once, or one and the questions
    owns = start_ray(None, num_cpus=2 if a.quick else None)
    record: dict[str, Any] = {"date": datetime.date.today().isoformat(), "doc_tokens": a.doc_tokens,
                              "questions": a.questions, "model": "default" if a.model is None else Path(a.model).name,
                              "random_weights": a.random_weights, "dtype": a.dtype, "runs": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for cache in (True, False):
                cfg = EngineConfig(model=a.model, dtype=a.dtype, device=a.device, random_weights=a.random_weights,
                                   kv_cache_tokens=kv, draft=False, max_prefill_tokens=a.doc_tokens + 1024,
                                   prefix_cache=PrefixCacheConfig(enabled=cache),
                                   cpus_per_shard=0.5 if a.quick else 1.0)
                engine = Engine(cfg).start()
                try:
                    record["device"] = engine.model_info()["device"]
                    for name, params in methods:
                        for w, warm_doc in enumerate(warm_docs):
                            run_method(engine, name, params, warm_doc, a.questions, a.max_new_tokens, Path(tmp),
                                       f"warm{w}-{name}-{'on' if cache else 'off'}")
                        t0 = time.perf_counter()
                        rows = run_method(engine, name, params, doc, a.questions, a.max_new_tokens, Path(tmp),
                                          f"{name}-{'on' if cache else 'off'}")
                        record["runs"].append({"method": name, "params": params, "prefix_cache": cache,
                                               "wall_s": time.perf_counter() - t0, "lines": rows})
                finally:
                    engine.shutdown()
    finally:
        if owns:
            stop_ray()
    table = []
    for name, params in methods:
        by = {r["prefix_cache"]: r["lines"] for r in record["runs"] if r["method"] == name and r["params"] == params}
        row: dict[str, Any] = {"method": name, **params}
        for cache, lines in by.items():
            tag = "on" if cache else "off"
            first, rest = lines[0]["ttft_s"], mean(x["ttft_s"] for x in lines[1:])
            row.update({f"{tag}_first_s": first, f"{tag}_rest_mean_s": rest, f"{tag}_rest_max_s":
                        max(x["ttft_s"] for x in lines[1:]), f"{tag}_rest_over_first": rest / first,
                        f"{tag}_cached_tokens": [x["cached_tokens"] for x in lines]})
        row["rest_on_over_off"] = row["on_rest_mean_s"] / row["off_rest_mean_s"]
        table.append(row)
    record["table"] = table
    out = Path(a.out or ROOT / "benchmarks" / "records" / f"prefix_cache_{'cpu_quick' if a.quick else 'gpu'}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefix_cache.json").write_text(json.dumps(record, indent=1))
    print(f"\n{record['device']}: {a.questions} questions about one {a.doc_tokens}-token document (JSONL job)")
    print(f"{'method':<14}{'on: q1 s':>10}{'q2-8 s':>9}{'q2-8/q1':>9}{'off: q1 s':>11}{'q2-8 s':>9}"
          f"{'q2-8/q1':>9}{'on/off q2-8':>13}")
    for r in table:
        print(f"{r['method']:<14}{r['on_first_s']:>10.3f}{r['on_rest_mean_s']:>9.3f}{r['on_rest_over_first']:>9.3f}"
              f"{r['off_first_s']:>11.3f}{r['off_rest_mean_s']:>9.3f}{r['off_rest_over_first']:>9.3f}"
              f"{r['rest_on_over_off']:>13.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
