"""Perplexity of Delta's modes against its bases and dense on one real-text window, and why (CPU is fine).

Part 1 (perplexity of the last quarter of one window, as the eval harness scores it) runs each setting of
``--runs`` (default: dense, streaming, Delta over streaming in its default mode ``far-merge`` and SPEC's
``delta``, Sketch&Walk, Delta over Sketch&Walk), every one at ``--density`` (the whole model's, as
``--density`` in the CLI; ``none``: SPEC's default base, sinks 64 + window 2048, and Delta's dense rows on top).
It prints the perplexity, the measured density (overall and prefill) and, for Delta, its fitted correction:
the mean alpha over layers and query heads, the fraction of heads that fell back (alpha < 0.05) and the check
rows' out-of-sample error ratio (``Delta.stats_dict``). A setting is ``METHOD`` or ``METHOD:KEY=V;KEY=V``
(e.g. ``delta:mode=delta``, ``delta:base=sketch_walk``, ``delta:mode=recompute``); ``--runs`` is a comma list.

Part 2 (``--diagnose``) tests, per sparse layer on the dense run's own q, k, v (teacher-forced: every layer sees
the dense model's inputs), what each correction does to the attention output. Columns:
- ``cos``, ``reuse``: the paper's premise: the mean cosine of a row's true correction D(i) = O_dense(i) -
  O_sparse(i) and its anchor's D(64 floor(i / 64)), and the error ratio ||D - D_anchor|| / ||D|| (below 1:
  reusing the anchor's correction helps), over the block-level streaming base Delta wraps, and over a
  token-level sliding window (StreamingLLM as the paper runs it: 64 sinks + the last ``window`` tokens of every
  row; window = the block base's mean) for ``tok cos`` / ``tok reuse``;
- per mode of ``--modes`` (default far-merge, delta-shrunk, delta): ||O_delta - O_dense|| / ||O_sparse - O_dense||
  over the rows Delta does not compute densely (from the second block on), Delta and its base at the same
  base budget (the base's, as in part 1; Delta's dense rows are then not inside it): below 1, the correction
  reduces the output error of that layer;
- with ``--variants``, other predictors of the correction, as ||D - D_pred|| / ||D|| (``variant_ratios``).

Usage: python benchmarks/probe_delta.py [--tokens 4096] [--density 0.15|none] [--runs R,R] [--diagnose]
       [--variants] [--no-ppl] [--layers-every 3] [--threads 1] [--json PATH] [--dense-cache PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
from delta_diagnosis import diagnose

from raysparse.kv_cache import KVCache
from raysparse.loader import load_hf_config, load_model, load_tokenizer, materialize, resolve_source
from raysparse.methods.registry import create_backend
from raysparse.workload import load_haystack_text

DEFAULT_RUNS = "dense,streaming,delta,delta:mode=delta,sketch_walk,delta:base=sketch_walk"


def parse_run(spec: str, density: float | None) -> tuple[str, dict[str, object]]:
    """``METHOD`` or ``METHOD:KEY=V;KEY=V`` -> (method, params), the density added to every sparse method."""
    name, _, rest = spec.partition(":")
    params: dict[str, object] = {}
    for kv in filter(None, rest.split(";")):
        key, _, val = kv.partition("=")
        try:  # numbers, null, {"density": 0.15} (a base's parameters)
            params[key] = json.loads(val)
        except ValueError:
            params[key] = None if val == "none" else val
    if name != "dense" and density is not None and "density" not in params and "base_params" not in params:
        params["density"] = density
    return name, params


def load_window(tokens: int, offset: int, threads: int = 0) -> tuple[object, list[int], str]:
    """The default model, and the ids of ``tokens`` tokens of the shared texts from character ``offset`` (with
    where they came from); ``threads`` > 0 sets torch's CPU threads."""
    if threads:
        torch.set_num_threads(threads)
    src = materialize(resolve_source(None))
    cfg = load_hf_config(src)
    tok, model = load_tokenizer(src), load_model(src, hf_config=cfg)
    text, source = load_haystack_text(None)
    return model, tok(text[offset:offset + 40 * tokens])["input_ids"][:tokens], source


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--density", default="0.15", help="the whole model's density, or 'none' for SPEC's default window")
    ap.add_argument("--runs", default=DEFAULT_RUNS, help="comma list of METHOD[:KEY=V;KEY=V] settings")
    ap.add_argument("--diagnose", action="store_true", help="also the per-layer output error of each correction")
    ap.add_argument("--modes", default="far-merge,delta-shrunk,delta", help="Delta's modes for --diagnose")
    ap.add_argument("--layers-every", type=int, default=1, help="--diagnose: every k-th sparse layer")
    ap.add_argument("--variants", action="store_true", help="--diagnose: also the other predictors measured")
    ap.add_argument("--no-ppl", action="store_true", help="skip the perplexity part")
    ap.add_argument("--offset", type=int, default=200000, help="character offset of the window into the text")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--dense-cache", default=None, help="keep the dense run's log-probabilities here and reuse them")
    args = ap.parse_args()
    model, ids, source = load_window(args.tokens, args.offset, args.threads)
    scored = len(ids) * 3 // 4  # perplexity of the last quarter, as the eval harness scores it
    d = None if args.density == "none" else float(args.density)
    record: dict = {"source": source, "tokens": len(ids), "density": d, "offset": args.offset, "runs": []}

    dense_logp: list[torch.Tensor] = []  # KL(dense || run) per scored token, from the dense run

    def ppl(name: str, params: dict) -> dict:
        if name == "dense" and args.dense_cache and os.path.exists(args.dense_cache):
            saved = torch.load(args.dense_cache)
            if saved["ids"] == ids:  # the dense run of this very window, from an earlier invocation
                dense_logp.append(saved["logp"])
                return {**saved["run"], "cached": True}
        cache = KVCache(model.cfg, -(-len(ids) // 64), 64)
        cache.allocate(0, len(ids))
        backend = create_backend(name, model.cfg, **params)
        t0 = time.perf_counter()
        if hasattr(backend, "check_request"):
            backend.check_request(len(ids), len(ids))
        with torch.no_grad():
            logits = model(torch.tensor(ids), cache.prepare([0], [len(ids)], True), cache, backend,
                           all_logits=True)
        nll = torch.nn.functional.cross_entropy(logits[scored:-1], torch.tensor(ids[scored + 1:]))
        logp = torch.log_softmax(logits[scored:-1].float(), -1)
        if not dense_logp:
            dense_logp.append(logp)  # the first run is dense
        kl = float((dense_logp[0].exp() * (dense_logp[0] - logp)).sum(-1).mean())
        out = {"method": name, "params": params, "ppl": math.exp(nll.item()), "kl": kl,
               "density": backend.meter.overall(),
               "density_prefill": backend.meter.prefill_overall(), "seconds": time.perf_counter() - t0}
        stats = backend.stats_dict() if hasattr(backend, "stats_dict") else None
        if stats:
            out["stats"] = stats
        if name == "dense" and args.dense_cache:
            torch.save({"ids": ids, "logp": logp, "run": out}, args.dense_cache)
        return out

    print(f"{source}; {len(ids)} tokens; density {args.density}")
    if not args.no_ppl:
        print("perplexity of the last quarter")
        specs = [x for x in args.runs.split(",") if x]
        for spec in (["dense"] if specs[0] != "dense" else []) + specs:
            name, params = parse_run(spec, d)
            try:
                r = ppl(name, params)
            except ValueError as e:
                r = {"method": name, "params": params, "error": str(e)}
                print(f"{spec:40s} error: {e}", flush=True)
                record["runs"].append(r)
                continue
            record["runs"].append(r)
            st = r.get("stats") or {}
            extra = ""
            if st.get("alpha") is not None:
                extra = (f"  alpha {st['alpha']:.2f} fallback {st['fallback']:.2f} "
                         f"check err {st['check_error_ratio']:.3f}")
            print(f"{spec:40s} ppl {r['ppl']:7.2f}  KL {r['kl']:.4f}  density {r['density']:.3f} "
                  f"prefill {r['density_prefill']:.3f}  ({r['seconds']:.0f}s){extra}", flush=True)
    if args.diagnose:
        record["diagnose"] = diagnose(model, ids, d, args.modes.split(","), args.layers_every, args.variants)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
