"""SpecAttn's draft-to-verifier message: draft tokens and verification plans, msgpack framed.

One message per round carries, per sequence, the draft tokens and the plan: for every draft layer the
plan uses, the selected key indices per KV head ([h_kv, S] int32, SENTINEL-padded, new positions included)
once, and for every sparse verifier layer the draft layer whose selection it takes. Sparse verifier layers
mapped to one draft layer share one array, so the message grows with the number of draft layers used, not
with the verifier's depth. A shard takes the rows of its own KV heads.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import torch

from raysparse.methods.selection import SENTINEL
from raysparse.specattn.method import VerifyPlan


def pack_round(drafts: list[list[int]], plans: list[VerifyPlan], layer_map: dict[int, int]) -> bytes:
    """``layer_map``: sparse verifier layer -> draft layer (the layer map restricted to the sparse layers)."""
    seqs = []
    for toks, plan in zip(drafts, plans, strict=True):
        sel: dict[int, Any] = {}
        if not plan.full:
            for j, d in layer_map.items():
                if d not in sel:
                    a = plan.tokens[j].to(torch.int32).cpu().numpy()
                    sel[d] = [list(a.shape), a.tobytes()]
        seqs.append({"draft": [int(t) for t in toks], "ctx": plan.ctx_len, "new": plan.n_new, "full": plan.full,
                     "sel": sel})
    return msgpack.packb({"seqs": seqs, "map": [[j, d] for j, d in layer_map.items()]}, use_bin_type=True)


def unpack_round(data: bytes, kv_lo: int, kv_hi: int,
                 device: torch.device | str = "cpu") -> tuple[list[list[int]], list[VerifyPlan]]:
    """The draft tokens and this shard's plans (rows kv_lo:kv_hi of every selection)."""
    msg = msgpack.unpackb(data, raw=False, strict_map_key=False)
    layer_map = {int(j): int(d) for j, d in msg["map"]}
    drafts, plans = [], []
    for s in msg["seqs"]:
        plan = VerifyPlan(int(s["ctx"]), int(s["new"]), bool(s["full"]))
        if not plan.full:
            local: dict[int, torch.Tensor] = {}
            for d, (shape, raw) in s["sel"].items():
                a = np.frombuffer(raw, dtype=np.int32).reshape(shape)[kv_lo:kv_hi]
                local[int(d)] = torch.from_numpy(a.copy()).to(device)
            for j, d in layer_map.items():
                tok = local[d]
                plan.tokens[j] = tok
                plan.ctx_read[j] = int((tok != SENTINEL).sum()) - tok.shape[0] * plan.n_new
        drafts.append([int(t) for t in s["draft"]])
        plans.append(plan)
    return drafts, plans
