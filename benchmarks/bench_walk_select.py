"""Sketch&Walk's one-hop decode selection per sparse layer: the graph path's PyTorch form (``rows_reference``
+ ``_choose``, ~40 kernels) against the two Triton launches of ``kernels/walk_select.py``.

Timing (default; the GPU machine): Llama-3.1-8B's attention layout (r = 64, blocks of 64), density 0.1,
batch sizes x contexts (w = context / 64 blocks), one sparse layer's selection from the sketched token on,
each side captured in a CUDA graph as decode runs it (median replay, L2 flushed). ``ms_consts`` is the
reference's per-step share (``step_constants``, once per step for all layers), which the kernel needs not.

Agreement (``--agreement``): the default model decodes real text through the graph path (eagerly); at every
sparse layer of every step both sides select from the same state and the block lists are compared.
``diff_rule`` counts differences the kernel's ranking rule explains (it ranks by bf16 logit where the
reference's fp32 values merge two of them), ``diff_scores`` those from a score rounded to the other bf16
neighbour (the dot product summed in another order). ``rule_diff`` applies the ranking rule to the
reference's own scores (``--rule-only``: that alone, without the kernel, fast in the CPU interpreter's place).

    python benchmarks/bench_walk_select.py [--batch 1 4 8] [--context 16384 32768 65536 131072]
    python benchmarks/bench_walk_select.py --agreement [--tokens 8192] [--steps 16] [--batch 2] [--rule-only]
    python benchmarks/bench_walk_select.py --smoke [--agreement]   # CPU, tiny sizes, Triton interpreter

Writes ``$OUT/bench_walk_select.json`` (or ``..._agreement.json``; ``OUT`` defaults to ./results).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():  # the interpreter has to be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common when run from elsewhere

from bench_common import environment, table, time_ms, wall_ms, write_json  # noqa: E402

from raysparse.methods.sketch_walk_config import GRAPH_DECODE  # noqa: E402
from raysparse.methods.sketch_walk_rows import RowsDecode  # noqa: E402

BLOCK, DENSITY = 64, 0.1


def _layer_path(heads: int, kv_heads: int, head_dim: int, width: int, batch: int, dev: str,
                block: int) -> RowsDecode:
    """A graph path of one sparse layer (only its config and state are used)."""
    from transformers import LlamaConfig

    from raysparse.config import ModelConfig
    from raysparse.kv_cache import KVCache
    from raysparse.methods.registry import create_backend

    hf = LlamaConfig(vocab_size=128, hidden_size=heads * head_dim, intermediate_size=128, num_hidden_layers=1,
                     num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    cfg = ModelConfig.from_hf(hf)
    method = create_backend("sketch_walk", cfg, block_size=block, density=DENSITY, walk="one-hop", dense_layers=(),
                            **GRAPH_DECODE)
    cache = KVCache(cfg, width + 1, block, torch.bfloat16, dev, num_kv_heads=1)
    return RowsDecode(method, cache, max_batch=batch, max_blocks=width)


def timing_case(batch: int, context: int, smoke: bool) -> dict[str, Any]:
    from raysparse.kernels.walk_select import walk_select

    dev = "cpu" if smoke else "cuda"
    block = 16 if smoke else BLOCK
    width = -(-context // block)
    path = _layer_path(4, 2, 16, width, batch, dev, block) if smoke else _layer_path(32, 8, 128, width, batch, dev,
                                                                                     block)
    g = torch.Generator().manual_seed(0)
    path.qs.copy_(torch.randn(path.qs.shape, generator=g))
    path.ks.copy_(torch.randn(path.ks.shape, generator=g))
    r, cfg = path.qs.shape[-1], path.cfg
    slots = torch.arange(batch, device=dev)
    n = torch.tensor([context - 37 * i for i in range(batch)], device=dev)  # ragged, partial last blocks
    new = torch.randn(2, batch, r, generator=g).to(dev)
    out_width = 1 + cfg.local_blocks + path.top_width(width)
    st = path.step_constants(n, width)

    def ref() -> torch.Tensor:
        return path._choose(path.rows_reference(0, slots, n, new, width, None, st), st)

    def kernel() -> torch.Tensor:
        return walk_select(path.qs[:, 0], path.ks[:, 0], slots, n, new, block, cfg.density, cfg.local_blocks,
                           cfg.exponent, cfg.token_query != "never", width, out_width)

    def consts() -> dict[str, Any]:
        return path.step_constants(n, width)

    rec: dict[str, Any] = {"batch": batch, "context": context, "w": width, "r": r}
    timer = (lambda fn: wall_ms(fn, reps=1)) if smoke else (lambda fn: time_ms(fn, graph=True))
    rec["ms_ref"], rec["ms_kernel"], rec["ms_consts"] = timer(ref), timer(kernel), timer(consts)
    rec["speedup"] = rec["ms_ref"] / rec["ms_kernel"]
    return rec


def _rule_rows(scores: torch.Tensor, st: dict[str, Any], r: int, exponent: float) -> torch.Tensor:
    """Non-negative rows that ``_choose`` ranks as the kernel does: by bf16 logit (dense rank), the entries
    whose reference value underflows at 0."""
    from raysparse.kernels.walk_select import ZERO_Y

    off = ~st["causal"]
    x = (scores / math.sqrt(r)).masked_fill(off, 0.0).to(torch.bfloat16).float().masked_fill(off, float("-inf"))
    key = torch.where(exponent * torch.log_softmax(x, -1) > ZERO_Y, x, float("-inf"))
    rank = torch.searchsorted(key.sort(-1).values, key).float()
    return torch.where(key > float("-inf"), rank + 1.0, 0.0)


def agreement(args: argparse.Namespace) -> dict[str, Any]:
    import raysparse.kernels.walk_select as ws
    from raysparse.decode_graphs import DecodeGraphs
    from raysparse.kv_cache import KVCache
    from raysparse.methods.registry import create_backend

    dev = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    if args.smoke:  # a random 4-layer model on random tokens: the script's CPU test
        from transformers import LlamaConfig, LlamaForCausalLM

        from raysparse.loader import model_from_state
        hf = LlamaConfig(vocab_size=97, hidden_size=96, intermediate_size=160, num_hidden_layers=4,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
        torch.manual_seed(0)
        model = model_from_state(hf, LlamaForCausalLM(hf).state_dict(), torch.float32, dev)
        prompts = [torch.randint(0, 97, (args.tokens - 37 * i,)).tolist() for i in range(args.batch)]
        source = "random tokens, random 4-layer model"
    else:
        from raysparse.loader import load_hf_config, load_model, load_tokenizer, materialize, resolve_source
        from raysparse.workload import load_haystack_text
        src = materialize(resolve_source(None))
        hf = load_hf_config(src)
        tok = load_tokenizer(src)
        model = load_model(src, torch.bfloat16 if dev == "cuda" else torch.float32, dev, hf_config=hf)
        text, source = load_haystack_text(None)
        prompts = [tok(text[100000 * (i + 1):][: 8 * args.tokens])["input_ids"][: args.tokens - 37 * i]
                   for i in range(args.batch)]
    block = 16 if args.smoke else BLOCK
    backend = create_backend("sketch_walk", model.cfg, block_size=block, density=args.density, walk="one-hop",
                             token_query=args.token_query, **GRAPH_DECODE)
    cache = KVCache(model.cfg, args.batch * -(-(args.tokens + args.steps + 1) // block) + 1, block,
                    model.lm_head.weight.dtype, dev)
    with torch.no_grad():
        for sid, p in enumerate(prompts):
            cache.allocate(sid, len(p) + args.steps + 1)
            model(torch.tensor(p, device=dev), cache.prepare([sid], [len(p)], True), cache, backend)
    assert backend.build_batched(cache, max_batch=args.batch)
    path: RowsDecode = backend.batch_decoder
    graphs = DecodeGraphs(model, cache, max_batch=args.batch, capture=False)  # eager: Python sees every layer
    counts = {"lists": 0, "rule_diff": 0, "diff": 0, "diff_rule": 0, "diff_scores": 0, "blocks": 0, "blocks_diff": 0,
              "state_diff": 0}
    real = ws.walk_select

    def compare(qs, ks, slots, n, new, blk, density, local, exponent, token, width, out_width, out=None):
        shim = copy.copy(path)  # the reference on copies of this layer's state
        shim.qs, shim.ks = qs.clone()[:, None], ks.clone()[:, None]
        scores: list[torch.Tensor] = []
        shim._w_rows = lambda s, st: scores.append(s) or RowsDecode._w_rows(shim, s, st)
        st = shim.step_constants(n, width)
        want = shim._choose(shim.rows_reference(0, slots, n, new, width, None, st), st)
        rule = shim._choose(_rule_rows(scores[-1][:, -1], st, qs.shape[-1], exponent), st)
        live = slots != path.scratch
        counts["rule_diff"] += int(((rule != want).any(-1) & live).sum())
        if args.rule_only:  # the ranking rule alone, on the reference's scores (no interpreter on the CPU)
            qs.copy_(shim.qs[:, 0])
            ks.copy_(shim.ks[:, 0])
            counts["lists"] += int(live.sum())
            return want
        got = real(qs, ks, slots, n, new, blk, density, local, exponent, token, width, out_width, out)
        diff = (got != want).any(-1) & live
        counts["lists"] += int(live.sum())
        counts["diff"] += int(diff.sum())
        counts["diff_rule"] += int((diff & (rule == got).all(-1)).sum())
        counts["diff_scores"] += int((diff & (rule != got).any(-1)).sum())
        counts["blocks"] += int(((want >= 0) & live[:, None]).sum())
        for b in torch.nonzero(diff).flatten().tolist():
            counts["blocks_diff"] += len(set(want[b].tolist()) ^ set(got[b].tolist())) // 2
        keep = torch.ones(qs.shape[0], dtype=torch.bool, device=qs.device)
        keep[path.scratch] = False
        counts["state_diff"] += int(not (torch.equal(qs[keep], shim.qs[keep, 0])
                                         and torch.equal(ks[keep], shim.ks[keep, 0])))
        return want

    ws.walk_select = compare
    RowsDecode.select = True  # the kernel, also on the CPU (in the interpreter)
    sids = list(range(args.batch))
    ids = [int(p[-1]) for p in prompts]
    with torch.no_grad():
        for _ in range(args.steps):
            ids = graphs.decode("sketch_walk", backend, sids, ids).argmax(-1).tolist()
    counts["share_lists_diff"] = counts["diff"] / max(counts["lists"], 1)
    counts["share_lists_rule_diff"] = counts["rule_diff"] / max(counts["lists"], 1)
    counts["share_blocks_diff"] = counts["blocks_diff"] / max(counts["blocks"], 1)
    return {"source": source, "tokens": args.tokens, "steps": args.steps, "batch": args.batch,
            "density": args.density, "token_query": args.token_query, "device": dev, **counts}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, the Triton interpreter")
    ap.add_argument("--agreement", action="store_true", help="count differing block lists on real decode")
    ap.add_argument("--batch", type=int, nargs="+", help="timing: batch sizes; agreement: the first is used")
    ap.add_argument("--context", type=int, nargs="+", help="timing: context lengths")
    ap.add_argument("--tokens", type=int, default=8192, help="agreement: prompt length")
    ap.add_argument("--steps", type=int, default=16, help="agreement: decode steps")
    ap.add_argument("--rule-only", action="store_true", help="agreement: the ranking rule alone, no kernel")
    ap.add_argument("--density", type=float, default=DENSITY)
    ap.add_argument("--token-query", default="last", choices=["decode", "last", "never"])
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available() and not args.agreement:
        sys.exit("bench_walk_select.py times on a CUDA GPU (or --smoke)")
    if args.agreement:
        args.batch = (args.batch or [2])[0]
        if args.smoke:
            args.tokens, args.steps = min(args.tokens, 400), min(args.steps, 2)
        rec = agreement(args)
        path = write_json("bench_walk_select_agreement.json", {"env": environment(), **rec})
        print({k: v for k, v in rec.items() if k != "source"}, f"\n({rec['source']}; {path})")
        return rec
    batches = args.batch or ([1, 3] if args.smoke else [1, 4, 8])
    contexts = args.context or ([256, 640] if args.smoke else [16384, 32768, 65536, 131072])
    rows = [timing_case(b, c, args.smoke) for c in contexts for b in batches]
    path = write_json("bench_walk_select.json", {"env": environment(), "smoke": args.smoke, "rows": rows})
    how = "CPU wall time, the kernel interpreted" if args.smoke else "CUDA-graph replays"
    print(f"one-hop selection per sparse layer, reference vs kernel ({how}; {path})")
    print(table(rows, [("batch", "batch"), ("context", "context"), ("w", "w"), ("ms_ref", "ref ms"),
                       ("ms_kernel", "kernel ms"), ("speedup", "speedup"), ("ms_consts", "consts ms/step")]))
    return {"rows": rows}


if __name__ == "__main__":
    main()
