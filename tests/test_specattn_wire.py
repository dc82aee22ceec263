"""SpecAttn's draft-to-verifier message: plans made by the backend survive the wire bit for bit, per shard."""

from __future__ import annotations

import torch

from raysparse.config import ModelConfig
from raysparse.specattn.method import SpecAttn, SpecAttnConfig
from raysparse.specattn.wire import pack_round, unpack_round


def test_plans_round_trip_through_chunk_bitmaps_for_every_shard_split():
    cfg = ModelConfig(vocab_size=50, hidden_size=96, intermediate_size=64, num_layers=9, num_heads=6,
                      num_kv_heads=3, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    b = SpecAttn(cfg, SpecAttnConfig(top_p=0.9, gamma=3))
    plans, drafts = [], []
    for sid, ctx in enumerate(int(x) for x in torch.randint(20, 700, (3,))):
        rows = {d: [torch.rand(3, ctx + s + 1) ** 8 for s in range(3)] for d in b.needed_draft_layers()}
        rows = {d: [r / r.sum(-1, keepdim=True) for r in rs] for d, rs in rows.items()}
        plans.append(b.plan(sid, ctx, 4, rows))
        drafts.append(torch.randint(0, 50, (3,)).tolist())
    sparse_map = {j: b.layer_map.mapping[j] for j in b.stats.sparse_layers}
    msg = pack_round(drafts, plans, sparse_map, b.config.chunk_size)
    assert len(msg) < 2000  # bits per chunk, not token ids
    for lo, hi in ((0, 3), (0, 2), (2, 3), (1, 2)):
        got_drafts, got = unpack_round(msg, lo, hi)
        assert got_drafts == drafts
        for p, q in zip(plans, got, strict=True):
            assert (q.ctx_len, q.n_new, q.full) == (p.ctx_len, p.n_new, p.full)
            for j in sparse_map:
                want = p.tokens[j][lo:hi]
                width = int((want != -1).sum(-1).max())
                assert torch.equal(q.tokens[j][:, :width], want[:, :width].to(torch.int32))
                assert (q.tokens[j][:, width:] == -1).all()
                assert q.ctx_read[j] == int((want != -1).sum()) - want.shape[0] * p.n_new
