"""Perplexity of Delta's modes against its streaming base and dense on one real-text window, and why (CPU is fine).

Part 1 isolates the Delta correction from the rest of the eval: sparse-only must equal the base, recompute only
swaps the strided rows, delta adds the correction; `tail=0` turns the dense tail off. ``--density none`` runs
SPEC's default base (sinks 64 + window 2048) instead of a budget.

Part 2 (``--diagnose``) tests the one assumption Delta rests on, per layer, on the dense run's own q, k, v:
that the true correction of a row, D(i) = O_dense(i) - O_sparse(i), is close to that of its anchor a = gamma
floor(i / gamma), the row whose D Delta reuses. For every row outside R (from the second block on) it reports
the mean cosine of D(i) and D(a), and the error ratio ||D - D_anchor|| / ||D||: the output error after the
correction over the error before it (below 1: Delta helps that layer). Two sparse bases at the same budget:
the registered block-level streaming base (the one Delta wraps) and a token-level sliding window (StreamingLLM
as the paper runs it: 64 sinks + the last ``window`` tokens of every row; window = the block base's mean).

``--also quest,oracle,sketch_walk`` adds other methods' perplexity at the same density on the same window.

Usage: python benchmarks/probe_delta.py [--tokens 2048] [--density 0.2|none] [--diagnose] [--no-ppl] [--also M,M]
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from raysparse.attention import causal_pairs, dense_attention
from raysparse.kv_cache import KVCache
from raysparse.loader import load_hf_config, load_model, load_tokenizer, materialize, resolve_source
from raysparse.methods.base import SeqContext, SparseMethod
from raysparse.methods.registry import create_backend
from raysparse.workload import load_haystack_text

GAMMA = 64


class Recorder(SparseMethod):
    """Dense everywhere; keeps the prefill q, k, v of the sparse layers (fp32)."""

    name = "recorder"

    def __init__(self, model_cfg, layers: set[int]) -> None:
        super().__init__(model_cfg)
        self.config = type(self.config)(dense_layers=tuple(range(model_cfg.num_layers)))
        self.layers, self.qkv = layers, {}

    def dense_seq(self, ctx, q, k, v):
        if ctx.layer in self.layers:
            self.qkv[ctx.layer] = (q.float().clone(), k.float().clone(), v.float().clone())
        return dense_attention(q, k, v)


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: int, window: int,
                     chunk: int = 512) -> torch.Tensor:
    """Token-level causal attention of every row over the first ``sinks`` keys and its last ``window`` keys."""
    n, h, d = q.shape
    h_kv = k.shape[0]
    out = torch.empty(n, h, d)
    kpos = torch.arange(n)[None, :]
    for r0 in range(0, n, chunk):
        pos = torch.arange(r0, min(n, r0 + chunk))[:, None]
        ok = (kpos <= pos) & ((kpos < sinks) | (kpos > pos - window))
        s = torch.einsum("rkgd,kmd->kgrm", q[r0: r0 + chunk].view(-1, h_kv, h // h_kv, d), k) / math.sqrt(d)
        p = s.masked_fill(~ok, -math.inf).softmax(-1)
        out[r0: r0 + chunk] = torch.einsum("kgrm,kmd->rkgd", p, v).reshape(-1, h, d)
    return out


def reuse_stats(o_dense: torch.Tensor, o_sparse: torch.Tensor) -> tuple[float, float]:
    """(mean cosine of D(i) and D(anchor), ||D - D_anchor|| / ||D||) over rows outside R from the 2nd block."""
    n = o_dense.shape[0]
    d_true = o_dense - o_sparse
    d_anchor = d_true[::GAMMA].repeat_interleave(GAMMA, 0)[:n]
    rows = (torch.arange(n) % GAMMA != 0) & (torch.arange(n) >= GAMMA)
    cos = F.cosine_similarity(d_true[rows], d_anchor[rows], dim=-1).mean()
    return float(cos), float((d_true - d_anchor)[rows].norm() / d_true[rows].norm())


def diagnose(model, ids: list[int], density: float | None) -> None:
    cfg = model.cfg
    params = {} if density is None else {"density": density}
    base = create_backend("streaming", cfg, **params)
    layers = {i for i in range(cfg.num_layers) if not base.is_dense_layer(i)}
    rec = Recorder(cfg, layers)
    n = len(ids)
    cache = KVCache(cfg, -(-n // 64), 64)
    cache.allocate(0, n)
    with torch.no_grad():
        model(torch.tensor(ids), cache.prepare([0], [n], True), cache, rec, all_logits=False)
    print("layer  block base: cos  err ratio | token window base: cos  err ratio")
    sums = [0.0] * 4
    for layer in sorted(layers):
        q, k, v = rec.qkv.pop(layer)
        with torch.no_grad():
            o_dense = window_attention(q, k, v, 0, n)
            o_block, pairs = base.prefill_seq(SeqContext(layer, 0, 0, n, {}, {}), q, k, v)
            # The token window with the block base's density: mean keys per row minus the sinks.
            window = max(1, round(pairs / k.shape[0] / n) - 64)
            o_tok = window_attention(q, k, v, 64, window)
        stats = reuse_stats(o_dense, o_block.float()) + reuse_stats(o_dense, o_tok)
        sums = [a + b for a, b in zip(sums, stats, strict=True)]
        print(f"{layer:5d}  {stats[0]:16.2f} {stats[1]:10.2f} | {stats[2]:23.2f} {stats[3]:10.2f}", flush=True)
    m = len(layers)
    print(f" mean  {sums[0] / m:16.2f} {sums[1] / m:10.2f} | {sums[2] / m:23.2f} {sums[3] / m:10.2f}"
          f"   (token window {window} + 64 sinks; block base density {pairs / (causal_pairs(n, n) * k.shape[0]):.3f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--density", default="0.2", help="the base's budget, or 'none' for SPEC's default window")
    ap.add_argument("--diagnose", action="store_true", help="also the per-layer test of Delta's reuse assumption")
    ap.add_argument("--no-ppl", action="store_true", help="skip the perplexity part")
    ap.add_argument("--also", default="", help="comma list of other methods whose perplexity to print at the density")
    ap.add_argument("--offset", type=int, default=200000, help="character offset of the window into the text")
    args = ap.parse_args()
    src = materialize(resolve_source(None))
    cfg = load_hf_config(src)
    tok, model = load_tokenizer(src), load_model(src, hf_config=cfg)
    text, source = load_haystack_text(None)
    ids = tok(text[args.offset:args.offset + 40 * args.tokens])["input_ids"][: args.tokens]
    scored = len(ids) * 3 // 4  # perplexity of the last quarter, as the eval harness scores it
    d = None if args.density == "none" else float(args.density)
    base = {} if d is None else {"density": d}

    def ppl(name: str, **params: object) -> tuple[float, float]:
        cache = KVCache(model.cfg, -(-len(ids) // 64), 64)
        cache.allocate(0, len(ids))
        backend = create_backend(name, model.cfg, **params)
        with torch.no_grad():
            logits = model(torch.tensor(ids), cache.prepare([0], [len(ids)], True), cache, backend,
                           all_logits=True)
        nll = torch.nn.functional.cross_entropy(logits[scored:-1], torch.tensor(ids[scored + 1:]))
        return math.exp(nll.item()), backend.meter.overall()

    print(f"{source}; {len(ids)} tokens; base density {args.density}")
    if not args.no_ppl:
        print("perplexity of the last quarter")
        for name, params in [("dense", {}), ("streaming", base), ("delta", {**base, "mode": "sparse-only"}),
                             ("delta", {**base, "mode": "recompute"}), ("delta", {**base, "mode": "delta"}),
                             ("delta", {**base, "mode": "recompute", "tail": 0}),
                             ("delta", {**base, "mode": "delta", "tail": 0})] + [
                                 (m, base) for m in filter(None, args.also.split(","))]:
            p, dens = ppl(name, **params)
            print(f"{name:10s} {str(params):50s} ppl {p:7.2f}  density {dens:.3f}", flush=True)
    if args.diagnose:
        diagnose(model, ids, d)


if __name__ == "__main__":
    main()
