"""Perplexity of Delta's modes against its streaming base and dense on one real-text window (CPU is fine).

Isolates the Delta correction from the rest of the eval: sparse-only must equal the base, recompute only
swaps the strided rows, delta adds the correction; `tail=0` turns the dense tail off.
Usage: python benchmarks/probe_delta.py [--tokens 2048] [--density 0.2]
"""

from __future__ import annotations

import argparse
import math

import torch

from raysparse.kv_cache import KVCache
from raysparse.loader import load_hf_config, load_model, load_tokenizer, materialize, resolve_source
from raysparse.methods.registry import create_backend
from raysparse.workload import load_haystack_text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--density", type=float, default=0.2)
    args = ap.parse_args()
    src = materialize(resolve_source(None))
    cfg = load_hf_config(src)
    tok, model = load_tokenizer(src), load_model(src, hf_config=cfg)
    text, source = load_haystack_text(None)
    ids = tok(text[200000:200000 + 40 * args.tokens])["input_ids"][: args.tokens]
    scored = len(ids) * 3 // 4  # perplexity of the last quarter, as the eval harness scores it

    def ppl(name: str, **params: object) -> tuple[float, float]:
        cache = KVCache(model.cfg, -(-len(ids) // 64), 64)
        cache.allocate(0, len(ids))
        backend = create_backend(name, model.cfg, **params)
        logits = model(torch.tensor(ids), cache.prepare([0], [len(ids)], True), cache, backend, all_logits=True)
        nll = torch.nn.functional.cross_entropy(logits[scored:-1], torch.tensor(ids[scored + 1:]))
        return math.exp(nll.item()), backend.meter.overall()

    d = args.density
    print(f"{source}; {len(ids)} tokens; perplexity of the last quarter")
    for name, params in [("dense", {}), ("streaming", {"density": d}),
                         ("delta", {"density": d, "mode": "sparse-only"}),
                         ("delta", {"density": d, "mode": "recompute"}), ("delta", {"density": d, "mode": "delta"}),
                         ("delta", {"density": d, "mode": "recompute", "tail": 0}),
                         ("delta", {"density": d, "mode": "delta", "tail": 0})]:
        p, dens = ppl(name, **params)
        print(f"{name:10s} {str(params):50s} ppl {p:7.2f}  density {dens:.3f}", flush=True)


if __name__ == "__main__":
    main()
