"""Dense attention mass kept by Sketch&Walk's selection, per layer, against one-hop, block oracle and streaming.

One dense prefill of real text records every layer's post-RoPE q and k; each sparse layer then builds, at the
same block budget tau_i = row_budget(density, i + 1) per query block i:
- ``rollout``, ``product`` (SPEC's literal R^k = R^{k-1} W^k) and ``one-hop`` (this layer's W^k alone, no
  walk; the default): Sketch&Walk's own ``select_prefill`` with each ``walk`` mode, same sketches and forced
  blocks, every row from its block mean (``token_query=never`` unless a variant sets it), the default scoring
  (heads=pair-lse, sub_blocks=8) unless a variant sets another (SPEC's: ``heads=mean``);
- ``oracle``: exact top-tau blocks per query block and KV head by summed dense mass (the block upper bound);
- ``streaming``: the sink block plus the last tau_i - 1 blocks.
Selections are made on the dense run's q and k (teacher forcing), so the numbers isolate selection quality.
``mass`` is the dense attention mass (softmax over causal keys, averaged over each KV group's query heads)
on the selected keys, averaged over every query row from the second block on and every KV head.
Extra configurations (``--variants``, e.g. ``residual=0.75,heads=pair-lse;sub_blocks=4``) are measured beside
the default.

Usage: python benchmarks/probe_sketch_walk.py [--tokens 2048] [--density 0.2] [--variants residual=0.75]
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from raysparse.attention import dense_attention
from raysparse.config import ModelConfig
from raysparse.kv_cache import KVCache
from raysparse.methods.base import SparseMethod
from raysparse.methods.budget import row_budget
from raysparse.methods.selection import mask_from_indices, topk_mask
from raysparse.methods.sketch_walk import SketchWalk
from raysparse.methods.sketch_walk_config import WALKS, SketchWalkConfig
from raysparse.methods.views import SeqContext


class Recorder(SparseMethod):
    """Dense everywhere; keeps every layer's prefill q [n, h, d] and k [h_kv, n, d]."""

    name = "recorder"

    def __init__(self, model_cfg: ModelConfig) -> None:
        super().__init__(model_cfg)
        self.config = type(self.config)(dense_layers=tuple(range(model_cfg.num_layers)))
        self.qk: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def dense_seq(self, ctx, q, k, v):
        self.qk[ctx.layer] = (q.detach().float().clone(), k.detach().float().clone())
        return dense_attention(q, k, v)


def block_mass(q: torch.Tensor, k: torch.Tensor, block: int, chunk: int = 256) -> torch.Tensor:
    """Dense causal mass per (KV head, query row, key block), group-averaged: [h_kv, n, nb] (fp32)."""
    n, h, d = q.shape
    h_kv = k.shape[0]
    nb = -(-n // block)
    out = torch.empty(h_kv, n, nb)
    kpos = torch.arange(n)
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        s = torch.einsum("rkgd,knd->kgrn", q[r0:r1].view(r1 - r0, h_kv, h // h_kv, d), k) / math.sqrt(d)
        p = s.masked_fill(kpos[None, :] > torch.arange(r0, r1)[:, None], -math.inf).softmax(-1).mean(1)
        out[:, r0:r1] = torch.nn.functional.pad(p, (0, nb * block - n)).view(h_kv, r1 - r0, nb, block).sum(-1)
    return out


def kept(mass: torch.Tensor, sel: torch.Tensor, block: int) -> float:
    """Mean mass on the selected blocks; sel: bool [h_kv or 1, nqb, nb]; rows of block 0 are skipped."""
    rows = torch.arange(mass.shape[1]) // block
    got = (mass * sel.expand(mass.shape[0], -1, -1)[:, rows].float()).sum(-1)
    return float(got[:, block:].mean())


def selections(layer_qk: dict[int, tuple[torch.Tensor, torch.Tensor]], model_cfg: ModelConfig, density: float,
               params: dict) -> dict[str, dict[int, torch.Tensor]]:
    """Per walk mode and layer: Sketch&Walk's own prefill selection, bool [h_kv, nqb, nb]."""
    out: dict[str, dict[int, torch.Tensor]] = {}
    for walk in WALKS:
        cfg = SketchWalkConfig(**{"density": density, "token_query": "never", "decode_unit": "block", **params,
                                  "walk": walk})
        method = SketchWalk(model_cfg, cfg)
        seq_state: dict = {}
        out[walk] = {}
        for layer in sorted(layer_qk):
            if method.is_dense_layer(layer):
                continue
            q, k = layer_qk[layer]
            n = q.shape[0]
            sel = method.select_prefill(SeqContext(layer, 0, 0, n, {}, seq_state), q, k, k)
            out[walk][layer] = mask_from_indices(sel.indices.long(), -(-n // cfg.block_size))  # per KV head
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--density", type=float, default=0.2)
    ap.add_argument("--offset", type=int, default=200000, help="character offset into the text")
    ap.add_argument("--variants", default="", help="comma list of key=value Sketch&Walk overrides, each its own run")
    ap.add_argument("--json", default="", help="also write the numbers to this file")
    ap.add_argument("--tiny", action="store_true", help="a random 4-layer model (a CPU smoke test of the script)")
    args = ap.parse_args()

    if args.tiny:
        from transformers import LlamaConfig, LlamaForCausalLM

        from raysparse.loader import model_from_state
        hf = LlamaConfig(vocab_size=97, hidden_size=96, intermediate_size=160, num_hidden_layers=4,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
        torch.manual_seed(0)
        model = model_from_state(hf, LlamaForCausalLM(hf).state_dict(), torch.float32, "cpu")
        ids, source = torch.randint(0, 97, (args.tokens,)).tolist(), "random tokens, random 4-layer model"
    else:
        from raysparse.loader import load_hf_config, load_model, load_tokenizer, materialize, resolve_source
        from raysparse.workload import load_haystack_text
        src = materialize(resolve_source(None))
        hf = load_hf_config(src)
        tok, model = load_tokenizer(src), load_model(src, hf_config=hf)
        text, source = load_haystack_text(None)
        ids = tok(text[args.offset: args.offset + 40 * args.tokens])["input_ids"][: args.tokens]
    mcfg = model.cfg
    block = SketchWalkConfig().block_size
    rec = Recorder(mcfg)
    cache = KVCache(mcfg, -(-len(ids) // 64), 64)
    cache.allocate(0, len(ids))
    with torch.no_grad():
        model(torch.tensor(ids), cache.prepare([0], [len(ids)], True), cache, rec, all_logits=False)

    runs = {"default": {}}
    for item in filter(None, args.variants.split(",")):  # a variant: key=value[;key=value...]
        runs[item] = {}
        for pair in item.split(";"):
            key, val = pair.split("=")
            runs[item][key] = (float(val) if key in ("exponent", "residual") else val if key in ("token_query", "heads")
                               else int(val))
    sels = {name: selections(rec.qk, mcfg, args.density, params) for name, params in runs.items()}
    layers = sorted(sels["default"]["rollout"])
    n = len(ids)
    nb = -(-n // block)
    qb = torch.arange(nb)
    # Blocks per query block, forced ones included; the sink + diagonal pair wins over a smaller budget.
    tau = torch.maximum(row_budget(args.density, qb + 1), (qb + 1).clamp(max=2))
    kb = torch.arange(nb)[None, :]
    causal = kb <= qb[:, None]
    stream = causal & ((kb == 0) | (kb > qb[:, None] - tau[:, None].clamp(min=2) + 1))
    table: dict[str, list[float]] = {}
    for layer in layers:
        q, k = rec.qk[layer]
        mass = block_mass(q, k, block)
        qmass = torch.stack([mass[:, i * block:(i + 1) * block].sum(1) for i in range(nb)], 1)  # [h_kv, nqb, nb]
        oracle = topk_mask(qmass, tau, causal.expand_as(qmass))
        row = {"oracle": kept(mass, oracle, block), "streaming": kept(mass, stream[None], block)}
        for name, s in sels.items():
            tag = "" if name == "default" else f" [{name}]"
            for walk in WALKS:
                row[walk + tag] = kept(mass, s[walk][layer], block)
        for key, val in row.items():
            table.setdefault(key, []).append(val)

    cols = list(table)
    print(f"{source}; {n} tokens; density {args.density}; dense mass kept per layer (rows from block 1 on)")
    print("layer " + " ".join(f"{c:>22s}" for c in cols))
    for i, layer in enumerate(layers):
        print(f"{layer:5d} " + " ".join(f"{table[c][i]:22.3f}" for c in cols))
    print(" mean " + " ".join(f"{sum(table[c]) / len(layers):22.3f}" for c in cols))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"source": source, "tokens": n, "density": args.density, "layers": layers,
                       "mass_kept": table}, f, indent=1)


if __name__ == "__main__":
    main()
