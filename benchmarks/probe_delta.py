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
import torch.nn.functional as F

from raysparse.attention import causal_pairs, dense_attention
from raysparse.kv_cache import KVCache
from raysparse.loader import load_hf_config, load_model, load_tokenizer, materialize, resolve_source
from raysparse.methods.base import SparseMethod
from raysparse.methods.registry import create_backend
from raysparse.methods.views import SeqContext
from raysparse.workload import load_haystack_text

GAMMA = 64
DEFAULT_RUNS = "dense,streaming,delta,delta:mode=delta,sketch_walk,delta:base=sketch_walk"


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


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                     chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row over the keys ``keep`` [h_kv, n, n] allows: out [n, h, d] (zeros where none), lse [n, h]."""
    n, h, d = q.shape
    h_kv = k.shape[0]
    out, lse = torch.zeros(n, h, d), torch.full((n, h), -math.inf)
    for r0 in range(0, n, chunk):
        s = torch.einsum("rkgd,kmd->kgrm", q[r0: r0 + chunk].view(-1, h_kv, h // h_kv, d), k) / math.sqrt(d)
        s = s.masked_fill(~keep[:, None, r0: r0 + chunk], -math.inf)
        m = torch.logsumexp(s, -1)
        out[r0: r0 + chunk] = torch.einsum("kgrm,kmd->rkgd", torch.exp(s - m[..., None]).nan_to_num(0.0),
                                           v).reshape(-1, h, d)
        lse[r0: r0 + chunk] = m.permute(2, 0, 1).reshape(-1, h)
    return out, lse


VARIANTS = ("mid", "interp", "no-taylor", "mid-own", "exact-far-out")


def variant_ratios(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o_dense: torch.Tensor,
                   sel_indices: torch.Tensor) -> dict[str, float]:
    """Other predictors of a row's correction over the block base (selection ``sel_indices``), each as
    ||D - D_pred|| / ||D|| over the rows from the second block on that are neither row 0 nor row 32 of their
    64-block (the rows a variant computing both densely would not have): ``mid``: the paper's difference from
    the anchor 64 j + 32 at or before the row; ``interp``: linear interpolation of D between the dense rows
    64 j and 64 j + 32; ``no-taylor``: far-merge without the first-order term (the anchor's far log-mass as the
    row's); ``mid-own``: far-merge from the row 64 j + 32 of the row's own query block (before or after it);
    ``exact-far-out``: far-merge with the row's own exact far output (an upper bound, not computable cheaply)."""
    from raysparse.methods.delta_rows import far_merge_prediction
    from raysparse.methods.selection import mask_from_indices

    n = q.shape[0]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    blocks = mask_from_indices(sel_indices, -(-n // GAMMA))
    near = blocks.repeat_interleave(GAMMA, 1).repeat_interleave(GAMMA, 2)[:, :n, :n] & causal
    o_s, l_s = masked_attention(q, k, v, near)
    o_f, l_f = masked_attention(q, k, v, causal & ~near)
    kbar = masked_attention(q, k, k, causal & ~near)[0]
    d_true = o_dense - o_s
    pos = torch.arange(n)
    r = pos % GAMMA
    rows = (pos >= GAMMA) & (r != 0) & (r != GAMMA // 2)
    scale = 1 / math.sqrt(q.shape[-1])

    def ratio(pred: torch.Tensor) -> float:
        return float((d_true - pred)[rows].norm() / d_true[rows].norm())

    def far(a: torch.Tensor, taylor: bool = True, exact_out: bool = False) -> torch.Tensor:
        kb = kbar[a] if taylor else torch.zeros_like(kbar[a])  # no first-order term: the anchor's far log-mass
        return far_merge_prediction(q, o_s, l_s, q[a], o_f if exact_out else o_f[a], l_f[a], kb, scale)

    mid = ((pos - GAMMA // 2).div(GAMMA, rounding_mode="floor") * GAMMA + GAMMA // 2).clamp(min=0)
    dense_idx = pos[(r == 0) | (r == GAMMA // 2)]
    j0 = torch.searchsorted(dense_idx, pos, right=True) - 1
    j1 = (j0 + 1).clamp(max=len(dense_idx) - 1)
    p0, p1 = dense_idx[j0], dense_idx[j1]
    w = torch.where(p1 > pos, (pos - p0).float() / (p1 - p0).clamp(min=1).float(), torch.zeros(n))
    own0 = pos // GAMMA * GAMMA
    own_mid = (own0 + GAMMA // 2).clamp(max=n - 1)
    return {"mid": ratio(d_true[mid]),
            "interp": ratio(d_true[p0] * (1 - w)[:, None, None] + d_true[p1] * w[:, None, None]),
            "no-taylor": ratio(far(own0, taylor=False)), "mid-own": ratio(far(own_mid)),
            "exact-far-out": ratio(far(own0, exact_out=True))}


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


def diagnose(model, ids: list[int], density: float | None, modes: list[str], every: int,
             variants: bool = False) -> list[dict]:
    cfg = model.cfg
    params = {} if density is None else {"density": density}
    base = create_backend("streaming", cfg, **params)
    layers = {i for i in range(cfg.num_layers) if not base.is_dense_layer(i)}
    layers = set(sorted(layers)[::every])
    rec = Recorder(cfg, layers)
    n = len(ids)
    cache = KVCache(cfg, -(-n // 64), 64)
    cache.allocate(0, n)
    with torch.no_grad():
        model(torch.tensor(ids), cache.prepare([0], [n], True), cache, rec, all_logits=False)
    # Delta at the base's own budget: the base alone is what Delta corrects here (tail off: rows it would
    # compute densely are not what is measured).
    deltas = {m: create_backend("delta", cfg, mode=m, tail=0, base_params=params) for m in modes}
    cols = modes + (list(VARIANTS) if variants else [])
    head = "layer    cos  reuse | tok cos  tok reuse | " + " ".join(f"{m:>13s}" for m in cols)
    print(head)
    rows_out = []
    for layer in sorted(layers):
        q, k, v = rec.qkv.pop(layer)
        row: dict = {"layer": layer}
        with torch.no_grad():
            o_dense = window_attention(q, k, v, 0, n)
            o_block, pairs = base.prefill_seq(SeqContext(layer, 0, 0, n, {}, {}), q, k, v)
            window = max(1, round(pairs / k.shape[0] / n) - 64)
            o_tok = window_attention(q, k, v, 64, window)
            row["cos"], row["reuse"] = reuse_stats(o_dense, o_block.float())
            row["tok_cos"], row["tok_reuse"] = reuse_stats(o_dense, o_tok)
            err0 = o_block.float() - o_dense
            for m, backend in deltas.items():
                seen = []
                backend.tracer = lambda *a, seen=seen: seen.append(a[4])
                o, _ = backend.prefill_seq(SeqContext(layer, 0, 0, n, {}, {}), q, k, v)
                backend.tracer = None
                keep = ~seen[-1].dense_rows & (torch.arange(n) >= GAMMA)
                row[m] = float((o.float() - o_dense)[keep].norm() / err0[keep].norm())
            if variants:
                row.update(variant_ratios(q, k, v, o_dense, seen[-1].indices))
        rows_out.append(row)
        print(f"{layer:5d} {row['cos']:6.2f} {row['reuse']:6.2f} | {row['tok_cos']:7.2f} {row['tok_reuse']:10.2f} | "
              + " ".join(f"{row[m]:13.3f}" for m in cols), flush=True)
    mean = {key: sum(r[key] for r in rows_out) / len(rows_out) for key in rows_out[0] if key != "layer"}
    print(f" mean {mean['cos']:6.2f} {mean['reuse']:6.2f} | {mean['tok_cos']:7.2f} {mean['tok_reuse']:10.2f} | "
          + " ".join(f"{mean[m]:13.3f}" for m in cols)
          + f"   (token window {window} + 64 sinks; block base density "
            f"{pairs / (causal_pairs(n, n) * k.shape[0]):.3f})")
    return rows_out


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
