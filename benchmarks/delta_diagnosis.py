"""Part 2 of ``probe_delta.py`` (``--diagnose``): per sparse layer, on the dense run's own q, k, v (teacher-forced),
what each of Delta's corrections does to the attention output; with the recorder of those q, k, v and the
attention forms the errors are measured against (``probe_delta_layers.py`` uses the recorder and the window
attention too)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from raysparse.attention import causal_pairs, dense_attention
from raysparse.config import ModelConfig
from raysparse.kv_cache import KVCache
from raysparse.methods.base import SparseMethod
from raysparse.methods.registry import create_backend
from raysparse.methods.views import SeqContext
from raysparse.model import LlamaForCausalLM

GAMMA = 64


class Recorder(SparseMethod):
    """Dense everywhere; keeps the prefill q, k, v of the sparse layers (fp32)."""

    name = "recorder"

    def __init__(self, model_cfg: ModelConfig, layers: set[int]) -> None:
        super().__init__(model_cfg)
        self.config = type(self.config)(dense_layers=tuple(range(model_cfg.num_layers)))
        self.layers = layers
        self.qkv: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def dense_seq(self, ctx: SeqContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
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


def diagnose(model: LlamaForCausalLM, ids: list[int], density: float | None, modes: list[str], every: int,
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
