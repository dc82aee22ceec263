"""SpecAttn's draft-to-verifier message: draft tokens and verification plans, msgpack framed.

One message per round carries, per sequence, the draft tokens and the plan: for every draft layer the
plan uses, its context selection as one bit per ``chunk``-token chunk and KV head (the selection is whole
aligned chunks clipped at the context length, ``topp.round_to_chunks``; the new positions are always
attended and not sent), and for every sparse verifier layer the draft layer whose selection it takes.
Sparse verifier layers mapped to one draft layer share one bitmap, so a 2K-token context costs 16 bytes per
KV head and draft layer. A shard rebuilds the key lists of its own KV heads.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import torch

from raysparse.methods.selection import SENTINEL
from raysparse.specattn.verify import VerifyPlan


def chunk_bits(tok: torch.Tensor, ctx_len: int, chunk: int) -> tuple[list[int], bytes]:
    """[h_kv, S] key lists -> (shape, packed bits) of the context chunks they cover."""
    n_chunks = -(-ctx_len // chunk)
    h_kv = tok.shape[0]
    mask = torch.zeros(h_kv, n_chunks + 1, dtype=torch.bool)
    t = tok.long().cpu()
    ctx = (t != SENTINEL) & (t < ctx_len)
    rows = torch.arange(h_kv)[:, None].expand_as(t)
    mask[rows[ctx], t[ctx] // chunk] = True
    return [h_kv, n_chunks], np.packbits(mask[:, :n_chunks].numpy(), axis=-1).tobytes()


def chunk_tokens(bits: np.ndarray, ctx_len: int, n_new: int, chunk: int) -> torch.Tensor:
    """Bits [h_kv, n_chunks] -> key lists [h_kv, S] (SENTINEL-padded): the chunks' tokens below ``ctx_len``,
    then the ``n_new`` new positions."""
    h_kv = bits.shape[0]
    pos = torch.arange(ctx_len + n_new)
    keep = torch.ones(h_kv, ctx_len + n_new, dtype=torch.bool)
    keep[:, :ctx_len] = torch.from_numpy(bits.astype(bool)).repeat_interleave(chunk, dim=-1)[:, :ctx_len]
    width = int(keep.sum(-1).max())
    out = torch.full((h_kv, width), SENTINEL, dtype=torch.int32)
    for h in range(h_kv):  # a few heads per shard; each row is already ascending
        sel = pos[keep[h]]
        out[h, : sel.numel()] = sel.to(torch.int32)
    return out


def pack_round(drafts: list[list[int]], plans: list[VerifyPlan], layer_map: dict[int, int], chunk: int) -> bytes:
    """``layer_map``: sparse verifier layer -> draft layer (the layer map restricted to the sparse layers)."""
    seqs = []
    for toks, plan in zip(drafts, plans, strict=True):
        sel: dict[int, Any] = {}
        if not plan.full:
            for j, d in layer_map.items():
                if d not in sel:
                    sel[d] = chunk_bits(plan.tokens[j], plan.ctx_len, chunk)
        seqs.append({"draft": [int(t) for t in toks], "ctx": plan.ctx_len, "new": plan.n_new, "full": plan.full,
                     "sel": sel})
    return msgpack.packb({"seqs": seqs, "map": [[j, d] for j, d in layer_map.items()], "chunk": chunk},
                         use_bin_type=True)


def unpack_round(data: bytes, kv_lo: int, kv_hi: int,
                 device: torch.device | str = "cpu") -> tuple[list[list[int]], list[VerifyPlan]]:
    """The draft tokens and this shard's plans (rows kv_lo:kv_hi of every selection)."""
    msg = msgpack.unpackb(data, raw=False, strict_map_key=False)
    layer_map = {int(j): int(d) for j, d in msg["map"]}
    chunk = int(msg["chunk"])
    drafts, plans = [], []
    for s in msg["seqs"]:
        plan = VerifyPlan(int(s["ctx"]), int(s["new"]), bool(s["full"]))
        if not plan.full:
            local: dict[int, torch.Tensor] = {}
            for d, (shape, raw) in s["sel"].items():
                bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8).reshape(shape[0], -1), axis=-1,
                                     count=shape[1])[kv_lo:kv_hi]
                local[int(d)] = chunk_tokens(bits, plan.ctx_len, plan.n_new, chunk).to(device)
            for j, d in layer_map.items():
                tok = local[d]
                plan.tokens[j] = tok
                plan.draft_of[j] = d
                plan.ctx_read[j] = int((tok != SENTINEL).sum()) - tok.shape[0] * plan.n_new
        drafts.append([int(t) for t in s["draft"]])
        plans.append(plan)
    return drafts, plans
