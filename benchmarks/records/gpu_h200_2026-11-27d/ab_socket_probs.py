# ruff: noqa  (a measurement record: the script as it ran, with the path of the file it reads updated)
"""A/B of SOCKET's decode step variants on one GPU: graph replay ms of an 8-layer step at 4 x 32768 (run from the repo root
at 62e98e1: python3 benchmarks/records/gpu_h200_2026-11-27d/ab_socket_probs.py). "old" = the forms before 62e98e1: the einsum
projections with the corner matrix built per call, and the selection's encoding by two torch.where (that file)."""
import math, sys, time
import torch
from raysparse.attention import ShardContext
from raysparse.kv_cache import KVCache
from raysparse.loader import build_model, load_hf_config, resolve_source
from raysparse.methods import lsh, socket_batched as sb
from raysparse.methods.registry import create_backend
from raysparse.shard_executor import bind_backend
from raysparse.decode_graphs import DecodeGraphs
from raysparse.kernels.dispatch import triton_wanted
from raysparse.kernels.paged_collision import paged_collision, paged_collision_torch
from raysparse.kernels.row_select import select_list

def old_probs(w, q, tau):
    u = torch.tanh(torch.einsum("hlpd,hgd->hglp", w, q.float())) / math.sqrt(q.shape[-1])
    return torch.softmax(u @ lsh.corners(w.shape[2], q.device).T / tau, dim=-1)

exec("from __future__ import annotations\n" + open("benchmarks/records/gpu_h200_2026-11-27d/ab_socket_old_select.py").read().replace("def batched_select", "def old_batched_select"), sb.__dict__)
new_probs, new_bs = lsh.soft_bucket_probs, sb.batched_select
VARIANTS = {"new": (new_probs, new_bs), "old_probs": (old_probs, new_bs), "old_select": (new_probs, sb.old_batched_select),
            "old_both": (old_probs, sb.old_batched_select)}
hf = load_hf_config(resolve_source("configs/llama-3.1-8b")); hf.num_hidden_layers = 8
torch.manual_seed(0)
model = build_model(hf, dtype=torch.bfloat16, device="cuda")
B, N = 4, 32768
order = sys.argv[1].split(",") if len(sys.argv) > 1 else list(VARIANTS)
res = {}
for method in ("socket", "socket_hard"):
    be = create_backend(method, model.cfg, density=0.1, dense_layers=())
    cache = KVCache(model.cfg, B * -(-(N + 256) // 64), 64, torch.bfloat16, "cuda")
    bind_backend(be, ShardContext(cache=cache, max_batch=B))
    toks = []
    for sid in range(B):
        cache.allocate(sid, N + 200)
        ids = torch.randint(100, 1000, (N,), device="cuda")
        toks.append(model(ids, cache.prepare([sid], [N], True), cache, be).argmax(-1)[-1:])
    tok = torch.cat(toks).view(-1).tolist()
    for rnd in range(2):
        for v in order:
            lsh.soft_bucket_probs, sb.batched_select = VARIANTS[v]
            graphs = DecodeGraphs(model, cache, max_batch=B)
            graphs.decode(method, be, list(range(B)), tok)
            (graph,) = graphs.graphs.values()
            for _ in range(5): graph.replay()
            torch.cuda.synchronize(); t = time.perf_counter()
            for _ in range(40): graph.replay()
            torch.cuda.synchronize()
            ms = 1e3 * (time.perf_counter() - t) / 40
            res.setdefault((method, v), []).append(ms)
            del graphs, graph
for (m, v), ms in res.items():
    print(f"{m:12s} {v:11s} replay ms {' '.join(f'{x:.3f}' for x in ms)}")
