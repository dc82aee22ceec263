"""The batched decode seam (``SparseMethod.decode_select`` over per-page state, the shared paged attend) against
each method's per-sequence reference (``select_decode`` over gathered K/V), on ragged batches, and through the
model's padded graph-decode path against the reference path's greedy tokens."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICES, prefill_then_decode, tiny_model, whole_model_density

from raysparse.config import ModelConfig
from raysparse.decode_graphs import DecodeGraphs
from raysparse.kernels.formats import PagedKV
from raysparse.kernels.paged_torch import paged_decode_fp32, paged_decode_torch
from raysparse.kv_cache import KVCache
from raysparse.methods.registry import create_backend
from raysparse.methods.selection import SENTINEL, TokenSelection
from raysparse.methods.sparse_attention import sparse_decode_attention
from raysparse.methods.views import DecodeView, SeqContext

# (method, parameters): every method with a batched decode, at budgets where selection matters; a density here is
# each sparse layer's (``per_layer``: the whole-model density that gives it, layer 0 dense).
CASES = [
    ("streaming", {}),
    ("streaming", {"density": 0.2, "sink_tokens": 8}),
    ("quest", {"density": 0.2}),
    ("quest", {"density": 0.05}),
    ("psaw", {"start_layer": 1, "phi": 0.3, "sink": 8}),
    ("etf", {"start_layer": 1}),
    ("socket", {"density": 0.2, "sink_tokens": 8, "local_tokens": 16, "tables": 12}),
    ("socket_hard", {"density": 0.2, "sink_tokens": 8, "local_tokens": 16, "tables": 6, "planes": 4}),
    ("delta", {"base": "quest", "density": 0.2}),
    ("socket", {"top_k": 24, "sink_tokens": 4, "local_tokens": 4, "tables": 8, "value_norm": True}),  # the paper's
    # a budget within the sinks and the local window at every length: no token scored, no collision computed
    ("socket", {"density": 0.05, "sink_tokens": 8, "local_tokens": 16, "tables": 12}),
    ("cis", {"density": 0.15, "sink": 4, "local": 8, "share_block": 4, "threshold": 0.1}),
    ("cis", {"topk": 12, "sink": 2, "local": 3, "share_block": 5, "radius": 2, "threshold": 0.05}),
    # a density limits each anchor's set, its neighbours included, to the middle budget (priority order)
    ("cis", {"density": 0.3, "sink": 2, "local": 3, "share_block": 5, "radius": 2, "threshold": 0.05}),
    # every pair shares after a block's first step: the CPU's all-share steps, which skip the retrieval
    ("cis", {"density": 0.15, "sink": 4, "local": 8, "share_block": 3, "threshold": -1.0}),
    ("cpe", {"start_layer": 1, "phi": 0.3, "density": 0.15, "sink": 4, "local": 8, "share_block": 4,
             "threshold": 0.1}),
]


def per_layer(params: dict, num_layers: int) -> dict:
    if "density" not in params:
        return params
    return {**params, "density": whole_model_density(params["density"], num_layers, dense_layers=1)}


def _cfg(layers: int = 3) -> ModelConfig:
    return ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=80, num_layers=layers, num_heads=4,
                       num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=4096,
                       tie_word_embeddings=False)


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()))


def _rows(indices: torch.Tensor) -> list[list[int]]:
    """Each row's valid entries (a selection's padding width is not part of what it selects)."""
    return [[x for x in row if x != SENTINEL] for row in indices.tolist()]


def _widen(batch, cache: KVCache, width: int) -> None:
    """Pads the step's page table to ``width`` pages with the scratch page, as a graph bucket does."""
    cache.paged(0, batch)
    table, seqlens, blocks = batch.extras["paged"]
    wide = torch.full((table.shape[0], width), cache.scratch_page, dtype=table.dtype)
    wide[:, : table.shape[1]] = table
    batch.extras["paged"] = (wide, seqlens, blocks)


@pytest.mark.parametrize("name,params", CASES)
def test_batched_decode_matches_reference(name, params):
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    cfg = _cfg()
    method = create_backend(name, cfg, dense_layers=(0,), **per_layer(params, cfg.num_layers))
    cache = KVCache(cfg, num_pages=80, page_size=32)
    lens = [int(x) for x in torch.randint(1, 400, (4,), generator=g)]
    sids = [3, 0, 2, 1]
    for sid, n in zip(sids, lens, strict=True):
        cache.allocate(sid, n + 40)
    batch = cache.prepare(sids, lens, True)  # one ragged prefill writes every prompt's K/V and the state
    t = sum(lens)
    for layer in range(cfg.num_layers):
        cache.write(layer, torch.randn(t, 2, 16, generator=g), torch.randn(t, 2, 16, generator=g), batch)
        method.update_state(layer, cache, batch) if not method.is_dense_layer(layer) else None
    width = (16, 20, 24, 28)[int(torch.randint(4, (), generator=g))]  # graph widths are quarter-octave steps
    for step in range(37):  # crosses Quest-page and cache-page boundaries
        batch = cache.prepare(sids, [1] * 4, False)
        _widen(batch, cache, width)
        method.graph_prepare(sids, cache)  # per-row state (CIS's anchors) placed as a graph runner does
        for layer in range(1, cfg.num_layers):
            cache.write(layer, torch.randn(4, 2, 16, generator=g), torch.randn(4, 2, 16, generator=g), batch)
            q = torch.randn(4, 4, 16, generator=g)
            method.update_state(layer, cache, batch)
            kv, _ = cache.paged(layer, batch)
            got = method.decode_select(layer, q, DecodeView(kv, batch, cache))
            assert got.dtype == torch.int32 and got.shape[:2] == (4, 2)
            unit = method.decode_unit
            for i, sid in enumerate(sids):
                n = batch.ctx_lens[i]
                k, v = cache.gather(layer, batch, i)
                ctx = SeqContext(layer, sid, n - 1, n, cache.metadata[layer].setdefault(sid, {}))
                ref = getattr(method, "base", method).select_decode(ctx, q[i], k, v)  # Delta: its base's
                want = ref.to_tokens(n).indices
                have = TokenSelection(got[i], unit).to_tokens(n).indices
                where = f"seed {seed}: {name} step {step} layer {layer} seq {sid}"
                if name == "socket" and _rows(have) != _rows(want):
                    # soft collision scores are float sums in another order: two tokens within rounding of each
                    # other may swap at the budget's edge (one swap per head at most), never more
                    assert all(len(a) == len(b) and len(set(a) ^ set(b)) <= 2
                               for a, b in zip(_rows(have), _rows(want), strict=True)), where
                    continue
                assert _rows(have) == _rows(want), where
                row = got[i]
                assert ((row != SENTINEL).cumprod(-1).sum(-1) == (row != SENTINEL).sum(-1)).all(), "valid prefix"
                # CIS's selection size is data-dependent: the step counts it on the device
                cis = getattr(method, "use_cis", False)
                keys = method.step_keys(layer)[i] if cis else method.decode_keys(layer, n) * 2
                assert sum(map(len, _rows(have))) == keys
                out, _ = paged_decode_torch(q[i : i + 1], PagedKV(kv.k, kv.v, kv.page_table[i : i + 1],
                                                                  kv.seqlens[i : i + 1]), got[i : i + 1], unit)
                ref_out, _ = sparse_decode_attention(q[i], k, v, ref)
                torch.testing.assert_close(out[0], ref_out, rtol=1e-5, atol=1e-5,
                                           msg=lambda m, seed=seed: f"seed {seed}: {m}")


def test_paged_decode_torch_matches_gathering_reference():
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    cfg = _cfg(1)
    cache = KVCache(cfg, num_pages=80, page_size=16)
    lens = [int(x) for x in torch.randint(1, 200, (5,), generator=g)]
    for sid, n in enumerate(lens):
        cache.allocate(sid, n)
    batch = cache.prepare(list(range(5)), lens, True)
    cache.write(0, torch.randn(sum(lens), 2, 16, generator=g), torch.randn(sum(lens), 2, 16, generator=g), batch)
    kv, _ = cache.paged(0, batch)
    for unit in (1, 4, 16):
        width = 12
        sel = torch.full((5, 2, width), SENTINEL, dtype=torch.int32)
        for i, n in enumerate(lens):
            units = -(-n // unit)
            for h in range(2):
                m = int(torch.randint(1, min(units, width) + 1, (), generator=g))
                sel[i, h, :m] = torch.randperm(units, generator=g)[:m].sort().values.to(torch.int32)
        q = torch.randn(5, 4, 16, generator=g)
        # The CPU's fused path and the fp32 form (the CUDA fallback), each against the gathering reference.
        for out, lse in (paged_decode_torch(q, kv, sel, unit), paged_decode_fp32(q, kv, sel, unit)):
            for i in range(5):
                k, v = cache.gather(0, batch, i)
                o, s = sparse_decode_attention(q[i], k, v, TokenSelection(sel[i], unit))
                for got, want in ((out[i], o), (lse[i], s)):
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                               msg=lambda m, seed=seed: f"seed {seed}: {m}")


@pytest.mark.parametrize("mode", ["torch", "triton"])
def test_rows_of_a_sequence_over_one_selection_match_the_rows_expanded(mode, monkeypatch):
    """A verification step's rows (ragged: 4, 1 and 3 new positions after ragged contexts) over each sequence's
    selection, each row seeing the listed keys below its own length: the CPU's one gather a sequence
    (``paged_rows_decode_cpu``) and the dispatch's other paths (decode rows of their own: Triton, under the
    interpreter without a GPU; on a GPU also the fp32 form) give every row what the per-row decode gives over
    the rows expanded, outputs and lse."""
    from raysparse.kernels.dispatch import attend_rounding, paged_rows_attention
    from raysparse.kernels.paged_rows import paged_rows_decode_cpu

    monkeypatch.setenv("RAYSPARSE_KERNELS", mode)
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # on CUDA "torch" is the per-row fp32 form
    cache = KVCache(_cfg(1), num_pages=60, page_size=16, device=dev)
    ctx, new = [int(x) for x in torch.randint(20, 200, (3,), generator=g)], [4, 1, 3]
    lens = [c + m for c, m in zip(ctx, new, strict=True)]
    for sid, n in enumerate(lens):
        cache.allocate(sid, n)
    batch = cache.prepare([0, 1, 2], lens, True)
    k, v = (torch.randn(sum(lens), 2, 16, generator=g).to(dev) for _ in range(2))
    cache.write(0, k, v, batch)
    kv, blocks = cache.paged(0, batch)
    row_seq = torch.repeat_interleave(torch.arange(3), torch.tensor(new)).to(dev)
    row_len = torch.tensor([c + r + 1 for c, m in zip(ctx, new, strict=True) for r in range(m)], dtype=torch.int32,
                           device=dev)
    width = max(lens)
    sel = torch.full((3, 2, width), SENTINEL, dtype=torch.int32)
    for i, (c, n) in enumerate(zip(ctx, lens, strict=True)):  # a planned list: some context keys, every new one
        for h in range(2):
            m = int(torch.randint(1, c + 1, (), generator=g))
            listed = torch.cat([torch.randperm(c, generator=g)[:m].sort().values, torch.arange(c, n)])
            sel[i, h, : listed.numel()] = listed.to(torch.int32)
    q = torch.randn(row_seq.numel(), 4, 16, generator=g).to(dev)
    rows = PagedKV(kv.k, kv.v, kv.page_table[row_seq].contiguous(), row_len)
    tol = max(1e-4, 4 * attend_rounding(q))  # Triton's fp32 dots on a GPU are TF32's (max error 9e-4 seen here)
    for unit, indices in ((1, sel.to(dev)), (16, blocks)):
        want = paged_decode_fp32(q, rows, indices[row_seq].contiguous(), unit)
        forms = [paged_rows_attention(q, kv, indices, unit, row_seq, row_len)]
        if mode == "torch" and dev == "cpu":
            forms.append(paged_rows_decode_cpu(q, kv, indices, unit, row_seq, row_len))
        for got in forms:
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=tol, atol=tol,
                                           msg=lambda m, u=unit: f"seed {seed} unit {u}: {m}")


def _graph_path_against_reference(device: str, name: str, params: dict, seed: int) -> None:
    model = tiny_model(device, 2, 2, 3, seed=seed)
    # 16-token pages: the longest row needs up to 23, so most batches run in a 20- or 24-page width bucket
    lens = [int(x) for x in torch.randint(40, 360, (3,), generator=torch.Generator().manual_seed(seed))]
    out, meters = [], []
    for graph in (False, True):
        backend = create_backend(name, model.cfg, dense_layers=(0,), **per_layer(params, model.cfg.num_layers))
        assert backend.graph_decode
        if not graph and device == "cpu":
            backend.tracer = lambda *a: None  # forces the per-sequence reference path
        cache = KVCache(model.cfg, 96, 16, device=device)
        graphs = DecodeGraphs(model, cache, max_batch=4)
        out.append(prefill_then_decode(model, cache, backend, graphs, lens, 6, torch.Generator().manual_seed(seed),
                                       graph))
        meters.append(backend.meter)
    tol = 1e-4 if device == "cpu" else 2e-2
    torch.testing.assert_close(out[1], out[0], rtol=tol, atol=tol, msg=lambda m: f"seed {seed}: {m}")
    assert torch.equal(out[1].argmax(-1), out[0].argmax(-1)), f"seed {seed}"
    assert meters[1].decode_attended == pytest.approx(meters[0].decode_attended)
    assert meters[1].decode_causal == pytest.approx(meters[0].decode_causal)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,params", CASES)
def test_graph_decode_tokens_match_reference_path(device, name, params):
    """Through the model: the padded graph step (eager on the CPU, captured on a GPU) gives the reference
    path's logits (and so its greedy tokens) and density on a ragged batch. On a GPU the captured replay is
    held to the same batched step run eagerly: there the per-sequence reference's scores differ from the
    batched ones in the last bits (other GEMM shapes), which can flip near-tied selections; the CPU run
    holds the batched selection to the reference.

    On the CPU too the two paths' activations differ in the last bits from the first layer on (the reference
    attends gathered K/V, the batched path pages in place), and the tiny random model's near-uniform attention
    puts fp32 near-ties at selection cuts: about one seed in 2500 flips one CIS anchor entry that way (replay:
    ``_graph_path_against_reference(..., seed)``). A seed that fails is therefore tried once more with fresh
    inputs; a wrong batched path fails both, and both seeds are reported."""
    failures = []
    for _ in range(2):
        seed = _seed()
        try:
            _graph_path_against_reference(device, name, params, seed)
            return
        except AssertionError as e:
            failures.append(str(e) if f"seed {seed}" in str(e) else f"seed {seed}: {e}")
    raise AssertionError("\n".join(failures))


@pytest.mark.parametrize("name,params", [
    ("socket", {"density": 0.2, "sink_tokens": 8, "local_tokens": 16, "tables": 12}),
    ("cis", {"density": 0.3, "sink": 4, "local": 8, "share_block": 3, "radius": 1})])
def test_single_sequence_decode_on_the_kernels(name, params, monkeypatch):
    """One sequence, its KV heads' budgets a broadcast view (at one sequence an expanded [B, 1] has stride 0):
    the Triton kernels (on a GPU where there is one, else under the interpreter) select what the PyTorch forms
    select, head by head."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    cfg = _cfg()
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # compiled kernels take device tensors only
    n = int(torch.randint(150, 400, (), generator=g))
    k, v = torch.randn(n + 3, 2, 16, generator=g).to(dev), torch.randn(n + 3, 2, 16, generator=g).to(dev)
    qs = torch.randn(3, 1, 4, 16, generator=g).to(dev)
    got = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv("RAYSPARSE_KERNELS", mode)
        method = create_backend(name, cfg, dense_layers=(0,), **per_layer(params, cfg.num_layers))
        cache = KVCache(cfg, num_pages=20, page_size=32, device=dev)
        cache.allocate(7, n + 3)
        batch = cache.prepare([7], [n], True)
        cache.write(1, k[:n], v[:n], batch)
        method.update_state(1, cache, batch)
        sels = []
        for step in range(3):
            batch = cache.prepare([7], [1], False)
            method.graph_prepare([7], cache)
            cache.write(1, k[n + step: n + step + 1], v[n + step: n + step + 1], batch)
            method.update_state(1, cache, batch)
            kv, _ = cache.paged(1, batch)
            sels.append(_rows(method.decode_select(1, qs[step], DecodeView(kv, batch, cache))[0]))
        got[mode] = sels
    for step, (a, b) in enumerate(zip(got["torch"], got["triton"], strict=True)):
        assert len(a) == 2 and all(len(row) > 8 + 16 for row in b), f"seed {seed} step {step}: {b}"  # not forced only
        assert a == b, f"seed {seed} step {step}"
