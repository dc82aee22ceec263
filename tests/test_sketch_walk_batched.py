"""Sketch&Walk's batched prefill selection (``sketch_walk_batch``) against the per-sequence reference
(``SketchWalk.prefill_select_per_sequence``): on ragged batches - different lengths, a prompt in chunks,
prompts that start from another prompt's cached pages, one-token prompts - every layer's packed selection,
the page-indexed block sums, the step's logits and the greedy tokens (decode steps included) are equal."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model

from raysparse.kv_cache import KVCache
from raysparse.methods.sketch_walk_batch import batched_mode
from raysparse.methods.sketch_walk_config import SketchWalkConfig
from raysparse.methods.sketch_walk_prefix import prefix_pools
from raysparse.shard_executor import ShardExecutor
from raysparse.step_plan import StepPlan, method_key

MODES = {
    "default": {},
    "pair": {"heads": "pair"},
    "kv-block": {"heads": "kv", "decode_unit": "block"},
    "never-parts1": {"token_query": "never", "sub_blocks": 1, "decode_unit": "block"},
    "decode-parts4": {"token_query": "decode", "sub_blocks": 4, "local_blocks": 2},
}
PAGE = 64


class Recorder:
    """Every layer's packed selection and every step's logits of one executor."""

    def __init__(self, ex: ShardExecutor, key: str, reference: bool) -> None:
        self.sels: list[tuple[int, torch.Tensor]] = []
        self.logits: list[torch.Tensor] = []
        backend = ex.backend(key)
        backend.prefill_reference = reference
        select = backend.prefill_select

        def record(layer, q, view):
            sel = select(layer, q, view)
            self.sels.append((layer, sel.indices.clone()))
            return sel

        backend.prefill_select = record
        forward = ex._forward

        def fwd(*a, **k):
            out = forward(*a, **k)
            self.logits.append(out.clone())
            return out

        ex._forward = fwd


def _plans(g: torch.Generator, key: str) -> list[StepPlan]:
    """Two ragged prefill steps, then decode: A whole (700), B in two chunks (200 + 250), D a 5-token prompt;
    then C from A's first 10 pages plus 37 tokens, E a one-token prompt, F one token after A's first 3 pages."""
    sp = {"max_new_tokens": 3}

    def toks(n: int) -> list[int]:
        return torch.randint(0, 97, (n,), generator=g).tolist()

    a, b, d, e = toks(700), toks(450), toks(5), toks(1)
    c, f = a[:640] + toks(37), a[:192] + toks(1)

    def pages(first: int, n: int) -> list[int]:
        return list(range(first, first + -(-(n + 3) // PAGE)))

    step1 = StepPlan(key, True, [0, 1, 3], [a, b[:200], d], sample=[True, False, True],
                     admit=[(0, 703, sp, pages(0, 700), 0), (1, 453, sp, pages(20, 450), 0),
                            (3, 8, sp, pages(30, 5), 0)])
    step2 = StepPlan(key, True, [1, 2, 4, 5], [b[200:], c[640:], e, f[192:]],
                     admit=[(2, len(c) + 3, sp, list(range(10)) + [40], 640), (4, 4, sp, [41], 0),
                            (5, len(f) + 3, sp, [0, 1, 2, 42], 192)])
    decode = StepPlan(key, False, [0, 1, 2, 3, 4, 5], [], steps=2)
    return [step1, step2, decode]


def _run(model, key: str, seed: int, reference: bool):
    ex = ShardExecutor(model, KVCache(model.cfg, 48, PAGE))
    rec = Recorder(ex, key, reference)
    plans = _plans(torch.Generator().manual_seed(seed), key)
    tokens: dict[int, list[int]] = {}
    states = None
    for plan in plans:
        if not plan.prefill:  # the decode feeds each sequence its last sampled token
            states = _pool_states(ex, key)
            plan.tokens = [[tokens[s][-1]] for s in plan.seq_ids]
        res = ex.execute(plan)
        assert res["error"] is None, res["error"]
        for sid, t in zip(plan.seq_ids, res["tokens"], strict=True):
            if t is not None:
                tokens.setdefault(sid, []).extend(t if isinstance(t, list) else [t])
    return rec, tokens, states


def _pool_states(ex: ShardExecutor, key: str) -> dict:
    """Each sequence's block sums at every sparse layer, read from its pages, and its metadata's length."""
    backend, cache = ex.backend(key), ex.cache
    cfg = backend.config
    out = {}
    for layer in backend.sparse_layers():
        for sid in cache.metadata[layer]:
            st = cache.metadata[layer][sid]
            n = st["n"]
            nb = -(-n // cfg.block_size)
            width = cache.num_kv_heads * backend.srht.sketch_dim
            qpool, kpool = prefix_pools(backend, layer, cache, width)
            at = torch.tensor(cache.page_list(sid)[:nb])
            out[layer, sid] = (n, qpool[at].clone(), kpool[at].clone())
    return out


def _ties_only(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Rows that differ differ by one block swapped at the budget's edge (the same count)."""
    rows = (got != want).any(-1)
    for g_row, w_row in zip(got[rows], want[rows], strict=True):
        gs, ws = set(g_row.tolist()) - {-1}, set(w_row.tolist()) - {-1}
        if len(gs) != len(ws) or len(gs ^ ws) > 2:
            return False
    return rows.float().mean().item() <= 0.02


@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
def test_batched_prefill_equals_the_per_sequence_reference(mode):
    params = {"density": 0.6, **MODES[mode]}
    assert batched_mode(SketchWalkConfig(**params))
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    torch.manual_seed(seed)
    model = tiny_model("cpu", 3, 2, 5)
    key = method_key("sketch_walk", params)
    ref, ref_tokens, ref_state = _run(model, key, seed, reference=True)
    got, got_tokens, got_state = _run(model, key, seed, reference=False)
    msg = f"seed {seed}, mode {mode}"
    assert len(got.sels) == len(ref.sels) > 0, msg
    exact = all(torch.equal(g, w) for (_, g), (_, w) in zip(got.sels, ref.sels, strict=True))
    if not exact:  # a matrix product of another shape may round a score's last bit: ties at the edge only
        for (layer, g), (_, w) in zip(got.sels, ref.sels, strict=True):
            assert g.shape == w.shape, f"{msg}, layer {layer}: {g.shape} != {w.shape}"
            assert _ties_only(g, w), f"{msg}, layer {layer}: selections differ beyond ties"
    assert got_state.keys() == ref_state.keys(), msg
    for k, (n, qs, ks) in ref_state.items():
        n2, qs2, ks2 = got_state[k]
        assert n == n2 and torch.equal(qs, qs2) and torch.equal(ks, ks2), f"{msg}: state of {k}"
    if exact:
        for a, b in zip(got.logits, ref.logits, strict=True):
            assert torch.equal(a, b), msg
        assert got_tokens == ref_tokens, msg
    print(f"{mode}: seed {seed}: selections {'equal' if exact else 'equal up to ties'}")


def test_rollout_and_head_mean_stay_per_sequence():
    assert not batched_mode(SketchWalkConfig(density=0.5, walk="rollout", decode_unit="block"))
    assert not batched_mode(SketchWalkConfig(density=0.5, heads="mean", sub_blocks=1, decode_unit="block"))
    assert batched_mode(SketchWalkConfig(density=0.5))


@pytest.mark.parametrize("heads", ["pair-lse", "pair"])
def test_batched_prefill_under_tensor_parallelism_reduces_once_and_matches_one_device(heads):
    """Two shards of one KV head each: per layer one ``head_reduce`` of the whole batch's partials, and both
    shards select what one device selects (a ragged batch: a fresh prompt, a chunk continuing one)."""
    from raysparse.config import ModelConfig
    from raysparse.methods.sketch_walk import SketchWalk
    from raysparse.methods.views import PrefillView

    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    g = torch.Generator().manual_seed(seed)
    cfg = ModelConfig(vocab_size=97, hidden_size=96, intermediate_size=80, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=24, rms_norm_eps=1e-5, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    kw = dict(block_size=8, sketch_dim=16, dense_layers=(0,), density=0.4, heads=heads, sub_blocks=2, seed=seed)
    steps = [[(0, 45), (1, 20)], [(1, 17), (2, 3)]]  # (sequence, new tokens) per step
    qk = [(torch.randn(sum(n for _, n in s), 4, 24, generator=g), torch.randn(sum(n for _, n in s), 2, 24,
                                                                             generator=g)) for s in steps]

    def run(method: SketchWalk, heads_of: slice, kv_of: slice, kv_heads: int) -> list[torch.Tensor]:
        cache = KVCache(cfg, 24, 8, num_kv_heads=kv_heads)
        for sid in (0, 1, 2):
            cache.allocate(sid, 40 if sid == 1 else 48)
        out = []
        for s, (q, k) in zip(steps, qk, strict=True):
            batch = cache.prepare([sid for sid, _ in s], [n for _, n in s], True)
            cache.write(1, k[:, kv_of], k[:, kv_of], batch)
            view = PrefillView.of(1, batch, cache)
            out.append(method.prefill_select(1, q[:, heads_of].contiguous(), view).indices[0])
        return out

    want = run(SketchWalk(cfg, SketchWalkConfig(**kw)), slice(None), slice(None), 2)
    reference = SketchWalk(cfg, SketchWalkConfig(**kw))
    reference.prefill_reference = True
    for gsel, wsel in zip(run(reference, slice(None), slice(None), 2), want, strict=True):
        assert torch.equal(gsel, wsel) or _ties_only(gsel, wsel), f"seed {seed}: one device, against the reference"
    shards = [SketchWalk(cfg, SketchWalkConfig(**kw)) for _ in range(2)]
    sent: list[list[torch.Tensor]] = [[], []]
    peer: list[list[torch.Tensor]] = [[], []]
    for rank, sh in enumerate(shards):
        def reduce(x: torch.Tensor, rank: int = rank) -> torch.Tensor:
            sent[rank].append(x)
            return x + peer[rank].pop(0) if peer[rank] else x
        sh.head_reduce = reduce
    parts = [(slice(2 * r, 2 * r + 2), slice(r, r + 1)) for r in range(2)]
    for rank in range(2):  # pass 1: each shard's partials
        run(shards[rank], *parts[rank], 1)
    assert [len(x) for x in sent] == [len(steps)] * 2, f"seed {seed}: one reduce per layer and step"
    peer[0], peer[1] = sent[1][:], sent[0][:]
    for rank in range(2):  # pass 2: each reduce with the peer's partial of the same call
        got = run(shards[rank], *parts[rank], 1)
        for gsel, wsel in zip(got, want, strict=True):
            assert torch.equal(gsel, wsel), f"seed {seed}, rank {rank}"
