"""Where Delta's correction helps and where it hurts: per layer, teacher-forced output error against the base at its
whole budget, and the perplexity with Delta in only some layers (the default model on one real-text window; CPU).

Part 1 (``--errors``): on the dense run's own q, k, v of every ``--layers-every``-th sparse layer, the output error
against dense attention, ||O - O_dense||, of Delta (its base at the share its dense rows leave, d_b, plus the
correction and the exact dense rows) and of the base alone at the whole budget d (what Delta must beat at equal
density), as the ratio delta / base over the rows Delta does not compute densely, over the last quarter of those
(the rows the perplexity scores), and the mean per-row relative error of each. Below 1: the correction more than
pays for the budget its rows take, in that layer's output.

Part 2 (``--layer-sets``): the perplexity of the window's last quarter and KL(dense || run) per scored token (as
``probe_delta.py``) with Delta in the listed layers only (``;``-separated sets of ``,``-separated layers, or
``A-B`` ranges); every other sparse layer runs the base alone at the whole budget. Each set runs each
``--runs`` setting (``probe_delta.py``'s syntax, e.g. ``delta`` or ``delta:base=sketch_walk``, or
``delta:mode=recompute`` for the dense rows without a correction); the base alone runs once first.

Usage: python benchmarks/probe_delta_layers.py [--tokens 4096] [--density 0.15] [--base streaming] [--errors]
       [--layers-every 3] [--layer-sets '2;5;20;29;15-29'] [--runs delta] [--threads 2] [--json PATH]
       [--dense-cache PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
from delta_diagnosis import Recorder, window_attention
from probe_delta import load_window, parse_run

from raysparse.kv_cache import KVCache
from raysparse.methods.delta import Delta
from raysparse.methods.registry import create_backend
from raysparse.methods.views import SeqContext


class DeltaIn(Delta):
    """Delta in the layers of ``only``; every other layer runs the base alone at its whole budget (the base's
    batched prefill, which meters into the base's own meter: this probe reads perplexity, not density)."""

    only: frozenset[int] = frozenset()

    def _prefill_batched(self, layer, q, cache, batch):
        if layer in self.only:
            return super()._prefill_batched(layer, q, cache, batch)
        return self.base._prefill_batched(layer, q, cache, batch)


def parse_layers(spec: str) -> frozenset[int]:
    out: set[int] = set()
    for part in filter(None, spec.split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(out)


def layer_errors(model, ids: list[int], density: float, base_name: str, every: int) -> list[dict]:
    cfg, n = model.cfg, len(ids)
    base = create_backend(base_name, cfg, density=density)
    delta = create_backend("delta", cfg, density=density, base=base_name)
    layers = sorted(i for i in range(cfg.num_layers) if not base.is_dense_layer(i))[::every]
    rec = Recorder(cfg, set(layers))
    cache = KVCache(cfg, -(-n // 64), 64)
    cache.allocate(0, n)
    with torch.no_grad():
        model(torch.tensor(ids), cache.prepare([0], [n], True), cache, rec, all_logits=False)
    pos = torch.arange(n)
    print("layer  delta / base (rows not dense)  (last quarter)  mean rel. error delta  base")
    rows = []
    for layer in layers:
        q, k, v = rec.qkv.pop(layer)
        with torch.no_grad():
            o = window_attention(q, k, v, 0, n)
            o_base, _ = base.prefill_seq(SeqContext(layer, 0, 0, n, {}, {}), q, k, v)
            seen: list = []
            delta.tracer = lambda *a, seen=seen: seen.append(a[4])
            o_delta, _ = delta.prefill_seq(SeqContext(layer, 0, 0, n, {}, {}), q, k, v)
            delta.tracer = None
        keep = ~seen[-1].dense_rows & (pos >= 64)
        last = keep & (pos >= 3 * n // 4)

        def err(x: torch.Tensor, m: torch.Tensor, o: torch.Tensor = o) -> float:
            return float((x.float() - o)[m].norm())

        def rel(x: torch.Tensor, m: torch.Tensor, o: torch.Tensor = o) -> float:
            return float(((x.float() - o).norm(dim=-1) / o.norm(dim=-1))[m].mean())

        row = {"layer": layer, "ratio": err(o_delta, keep) / err(o_base, keep),
               "ratio_last_quarter": err(o_delta, last) / err(o_base, last),
               "rel_delta": rel(o_delta, last), "rel_base": rel(o_base, last)}
        rows.append(row)
        print(f"{layer:5d}  {row['ratio']:29.3f}  {row['ratio_last_quarter']:14.3f}  {row['rel_delta']:20.3f}  "
              f"{row['rel_base']:5.3f}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--density", type=float, default=0.15, help="the whole model's density")
    ap.add_argument("--base", default="streaming", help="part 1's base (part 2 takes it from --runs)")
    ap.add_argument("--errors", action="store_true", help="part 1: per-layer errors against the base at d")
    ap.add_argument("--layers-every", type=int, default=3)
    ap.add_argument("--layer-sets", default="", help="part 2: ';'-separated layer sets, e.g. '2;5;15-29'")
    ap.add_argument("--runs", default="delta", help="part 2: comma list of Delta settings (probe_delta.py's syntax)")
    ap.add_argument("--offset", type=int, default=200000, help="character offset of the window into the text")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dense-cache", default=None, help="keep the dense run's log-probabilities here and reuse them")
    args = ap.parse_args()
    model, ids, source = load_window(args.tokens, args.offset, args.threads)
    scored = len(ids) * 3 // 4
    record: dict = {"source": source, "tokens": len(ids), "density": args.density, "offset": args.offset}
    print(f"{source}; {len(ids)} tokens; density {args.density}")
    if args.errors:
        record["errors"] = layer_errors(model, ids, args.density, args.base, args.layers_every)

    dense_logp: list[torch.Tensor] = []

    def ppl(backend, label: str) -> dict:
        cache = KVCache(model.cfg, -(-len(ids) // 64), 64)
        cache.allocate(0, len(ids))
        t0 = time.perf_counter()
        with torch.no_grad():
            logits = model(torch.tensor(ids), cache.prepare([0], [len(ids)], True), cache, backend, all_logits=True)
        nll = torch.nn.functional.cross_entropy(logits[scored:-1], torch.tensor(ids[scored + 1:]))
        logp = torch.log_softmax(logits[scored:-1].float(), -1)
        if not dense_logp:
            dense_logp.append(logp)
        kl = float((dense_logp[0].exp() * (dense_logp[0] - logp)).sum(-1).mean())
        out = {"run": label, "ppl": math.exp(nll.item()), "kl": kl, "seconds": time.perf_counter() - t0}
        print(f"{label:60s} ppl {out['ppl']:7.2f}  KL {kl:.4f}  ({out['seconds']:.0f}s)", flush=True)
        return out

    sets = [s for s in args.layer_sets.split(";") if s]
    if sets:
        runs = []
        if args.dense_cache and os.path.exists(args.dense_cache) and torch.load(args.dense_cache)["ids"] == ids:
            dense_logp.append(torch.load(args.dense_cache)["logp"])
        else:
            runs.append(ppl(create_backend("dense", model.cfg), "dense"))
            if args.dense_cache:
                torch.save({"ids": ids, "logp": dense_logp[0]}, args.dense_cache)
        specs = [parse_run(s, args.density) for s in args.runs.split(",") if s]
        bases_done: set[str] = set()
        for name, params in specs:
            if name != "delta":
                raise SystemExit(f"--runs takes Delta settings only, got {name!r}")
            base_name = str(params.get("base", "streaming"))
            if base_name not in bases_done:  # the base alone at the whole budget, once
                bases_done.add(base_name)
                runs.append(ppl(create_backend(base_name, model.cfg, density=args.density), base_name))
            for layers in sets:
                # Built by the registry (which turns the whole-model density into each layer's), then narrowed.
                backend = create_backend("delta", model.cfg, **params)
                backend.__class__ = DeltaIn
                backend.only = parse_layers(layers)
                spec = ";".join(f"{k}={v}" for k, v in params.items() if k != "density")
                runs.append({**ppl(backend, f"delta[{spec}] in layers {layers}"), "layers": layers})
        record["runs"] = runs
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
