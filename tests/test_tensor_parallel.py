"""Tensor parallelism over a gloo group of 2 processes gives the one-device logits."""

from __future__ import annotations

import pytest
import torch
from helpers import full_logits, random_state, run_tp, tiny_hf_config

from raysparse.loader import model_from_state
from raysparse.tensor_parallel import apply_tensor_parallel, kv_head_range, shard_range


def test_head_ranges_cover_every_kv_head_once():
    for kvh in range(1, 9):
        for world in range(1, kvh + 1):
            ranges = [kv_head_range(kvh, r, world) for r in range(world)]
            owned = [h for lo, hi in ranges for h in range(lo, hi)]
            assert owned == list(range(kvh))
            assert max(hi - lo for lo, hi in ranges) - min(hi - lo for lo, hi in ranges) <= 1
    assert shard_range(10, 2, 3) == (7, 10)
    with pytest.raises(ValueError, match="exceeds"):
        kv_head_range(3, 0, 4)


def test_world_size_one_is_identity():
    cfg = tiny_hf_config()
    model = model_from_state(cfg, random_state(cfg).state_dict())
    ids = torch.randint(0, cfg.vocab_size, (40,)).tolist()
    before = full_logits(model, ids)
    assert torch.equal(full_logits(apply_tensor_parallel(model, 0, 1), ids), before)


def test_tp2_gloo_tiny_uneven_heads_matches_tp1(tmp_path):
    cfg = tiny_hf_config(num_kv_heads=3, group=2)  # 3 KV heads over 2 ranks: a 2 + 1 split
    state = random_state(cfg, seed=int(torch.randint(0, 1000, ())))
    ids = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in (50, 17, 90)]
    # Packed prefill of three separate sequences: compare sequence by sequence against running alone.
    tp1 = run_tp(1, cfg, state.state_dict(), ids, tmp_path)["logits"]
    tp2 = run_tp(2, cfg, state.state_dict(), ids, tmp_path)
    assert tp2["kv_heads"] == 2
    assert (tp2["logits"] - tp1).abs().max().item() < 1e-4
    alone = full_logits(model_from_state(cfg, state.state_dict()), ids[0])
    assert (tp1[: len(ids[0])] - alone).abs().max().item() < 1e-4
    assert tp1.shape == (sum(len(s) for s in ids), cfg.vocab_size)


def test_tp2_gloo_smollm_matches_tp1_on_real_text(smollm, real_text, tmp_path):
    hf, ours, tok = smollm
    ids = [tok(real_text[100000:110000])["input_ids"][:256]]
    tp1 = full_logits(ours, ids[0])
    tp2 = run_tp(2, hf.config, hf.state_dict(), ids, tmp_path)
    assert (tp2["logits"] - tp1).abs().max().item() < 1e-4


@pytest.mark.parametrize("fused_ops", ["torch", "native"])
def test_tp2_fused_layer_loop_without_reduce_norm_matches_tp1(fused_ops, tmp_path):
    """The fused-ops layer loop leaves each MLP output pending for the next norm; without a fused reduce-norm
    (gloo, NCCL) that norm's add reduces it, exactly once (a second reduce in the layer summed it twice)."""
    cfg = tiny_hf_config(num_kv_heads=2, group=2, layers=3)
    state = random_state(cfg, seed=int(torch.randint(0, 1000, ())))
    ids = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in (12, 7)]
    tp1 = run_tp(1, cfg, state.state_dict(), ids, tmp_path, fused_ops=fused_ops)["logits"]
    tp2 = run_tp(2, cfg, state.state_dict(), ids, tmp_path, fused_ops=fused_ops)
    assert (tp2["logits"] - tp1).abs().max().item() < 1e-4


# the Triton kernels under the interpreter take ~20 s on 2 cores: with `-m slow` (GPUs run them natively)
@pytest.mark.parametrize("fused_ops", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_tp2_fused_reduce_norm_seam_matches_tp1(fused_ops, tmp_path, monkeypatch):
    """With the group's all-reduce fused into the following add + norm, the MLP output is carried as a
    partial sum into the next layer's norm (the fused-ops layer loop) or reduced at the layer's end (the
    plain one), and the last layer's into the final norm: the logits stay those of one device."""
    if fused_ops == "triton":  # the spawned ranks run the kernels in Triton's interpreter
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = tiny_hf_config(num_kv_heads=2, group=2, layers=2)
    state = random_state(cfg, seed=int(torch.randint(0, 1000, ())))
    ids = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in (12, 7)]
    tp1 = run_tp(1, cfg, state.state_dict(), ids, tmp_path, fused_ops=fused_ops)["logits"]
    tp2 = run_tp(2, cfg, state.state_dict(), ids, tmp_path, reduce_norm=True, fused_ops=fused_ops)
    # plain loop: the post-attention norm per layer; fused loop: also the next layer's and the final norm
    assert tp2["reduce_norm_calls"] == (2 if fused_ops == "torch" else 4)
    assert (tp2["logits"] - tp1).abs().max().item() < 1e-4
