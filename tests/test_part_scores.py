"""Sketch&Walk's paired part scores (kernels/part_scores.py) against their PyTorch reference, and the paired
graph decode with the kernel against its PyTorch form.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is
imported). Fresh random part sums and sketches each run: three real rows on distinct slots (one at the full
width, one shorter than a part, lengths ending in partial parts) and two padded rows on the scratch slot;
the output starts as NaN so every element must be written; the updated state is compared exactly (the
scratch slot's current part aside: padded rows' updates may mix there)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from helpers import DEVICES, tiny_model
from triton_env import DEV  # before raysparse.kernels: without a GPU it picks the interpreter

import raysparse.kernels.part_scores as ps
from raysparse.kernels.common import interpreting
from raysparse.methods.sketch_walk_graph_paired import PAIRED_ENV, PART_SCORES_ENV, PairedGraphDecode

B = 16  # tokens per block
SLOTS = 4  # 3 real slots + the scratch slot


def _draw(g: torch.Generator, h_kv: int, r: int, parts: int, width: int):
    size = B // parts
    # one layer of a two-layer state with spare parts beyond the width: strides as the graph path's view
    state = torch.randn(SLOTS, 2, width + 3, h_kv, r, generator=g)
    real = 3
    slots = torch.cat((torch.randperm(SLOTS - 1, generator=g)[:real], torch.full((2,), SLOTS - 1)))
    n = torch.randint(1, width * size + 1, (real + 2,), generator=g)
    n[0] = width * size - int(torch.randint(0, size, (), generator=g))  # the last part, full or partial
    n[1] = int(torch.randint(1, size + 1, (), generator=g))  # within the first part
    n[real + 1] = n[real]  # padded rows decode one length and one key
    q, k = torch.randn(2, real + 2, h_kv, r, generator=g)
    k[real + 1] = k[real]
    return state.to(DEV), slots.to(DEV), n.to(DEV), q.to(DEV), k.to(DEV)


@pytest.mark.parametrize("h_kv,r,parts,width,tile", [
    (1, 16, 1, 7, None),
    (2, 32, 4, 40, 16),  # a row over three programs, the last tile partial
    (3, 64, 8, 24, None),
    (2, 16, 8, 70, 32),
])
def test_part_scores_match_reference(h_kv, r, parts, width, tile):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    state, slots, n, q, k = _draw(g, h_kv, r, parts, width)
    want_state = state.clone()
    want = ps.part_scores_reference(want_state[:, 1], slots, n, q, k, B // parts, width)
    out = torch.full((h_kv, len(n), width), float("nan"), device=DEV)
    got = ps.part_scores(state[:, 1], slots, n, q, k, B // parts, width, out=out, tile=tile)
    assert got.data_ptr() == out.data_ptr()
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # -inf where empty, on both sides
    # every real row's slot updated exactly; the scratch slot's current part is any mix of the padded rows'
    keep = torch.ones_like(state, dtype=torch.bool)
    keep[-1, 1, (n[-1] - 1) // (B // parts)] = False
    assert torch.equal(state[keep], want_state[keep])


def test_part_scores_refuse_bad_shapes():
    ks = torch.zeros(2, 8, 2, 24, device=DEV)
    one = torch.ones(1, dtype=torch.long, device=DEV)
    with pytest.raises(ValueError, match="power-of-two"):
        ps.part_scores(ks, one, one, torch.zeros(1, 2, 24, device=DEV), torch.zeros(1, 2, 24, device=DEV), 2, 8)
    ks = torch.zeros(2, 8, 2, 16, device=DEV)
    with pytest.raises(ValueError, match="width"):
        ps.part_scores(ks, one, one, torch.zeros(1, 2, 16, device=DEV), torch.zeros(1, 2, 16, device=DEV), 2, 9)


def test_switch_picks_the_kernel(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.setenv("RAYSPARSE_KERNELS", "triton")  # as if the tensors were on CUDA
    for mode, want in (("on", True), ("off", False)):
        monkeypatch.setenv(PART_SCORES_ENV, mode)
        assert PairedGraphDecode._wanted(cpu, PART_SCORES_ENV, "on", None) is want
    monkeypatch.delenv(PART_SCORES_ENV)
    assert PairedGraphDecode._wanted(cpu, PART_SCORES_ENV, "on", None)  # on by default
    monkeypatch.setenv("RAYSPARSE_KERNELS", "auto")
    assert not PairedGraphDecode._wanted(cpu, PART_SCORES_ENV, "on", None)  # CPU tensors keep PyTorch
    monkeypatch.setenv(PART_SCORES_ENV, "maybe")
    with pytest.raises(ValueError, match=PART_SCORES_ENV):
        PairedGraphDecode._wanted(cpu, PART_SCORES_ENV, "on", None)


@pytest.fixture(scope="module", params=DEVICES)
def model(request):
    return tiny_model(request.param, 2, 2, 5)


@pytest.mark.parametrize("scoring", [{"heads": "pair-lse", "sub_blocks": 8, "decode_unit": "part"},
                                     {"heads": "pair", "sub_blocks": 4, "decode_unit": "block"}],
                         ids=["pair-lse-P8-part", "pair-P4-block"])
def test_paired_graph_decode_with_the_kernel(model, scoring, monkeypatch):
    """The same decode (lists, units, logits) through the kernel as through the PyTorch form."""
    from test_sketch_walk_graph_paired import _run

    if model.lm_head.weight.device.type == "cpu" and not interpreting():
        pytest.skip("CPU tensors run the kernels only in Triton's interpreter")
    monkeypatch.setenv(PAIRED_ENV, "on")
    seed = int(torch.randint(0, 2**31 - 1, ()))
    params = {**scoring, "density": float(torch.empty(()).uniform_(0.15, 0.5)), "local_blocks": 1 + seed % 2}
    lens, steps = [100, 14, 158], 3
    monkeypatch.setattr(PairedGraphDecode, "select_kernel", False)  # the per-head scores (test_part_select: the rest)
    monkeypatch.setattr(PairedGraphDecode, "part_kernel", False)
    want_picks, want_logits, _ = _run(model, params, lens, steps, True, seed)
    calls = []
    real = ps.part_scores
    monkeypatch.setattr(ps, "part_scores", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(PairedGraphDecode, "part_kernel", True)
    got_picks, got_logits, backend = _run(model, params, lens, steps, True, seed)
    sparse = sum(not backend.is_dense_layer(i) for i in range(model.cfg.num_layers))
    # eager: once per sparse layer and step; captured graphs call it only while capturing
    assert len(calls) == steps * sparse if not got_logits.is_cuda else calls
    tol = 1e-4 if got_logits.device.type == "cpu" else 2e-3
    torch.testing.assert_close(got_logits, want_logits, rtol=tol, atol=tol)
    assert len(got_picks) == len(want_picks)
    for (got, unit), (want, want_unit) in zip(got_picks, want_picks, strict=True):
        assert unit == want_unit and torch.equal(got[:3], want[:3])  # the real rows; row 3 is padding


def test_bench_part_scores_smoke(tmp_path, monkeypatch):
    """``benchmarks/bench_part_scores.py --smoke`` times every form at a tiny size, agrees and writes its JSON."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_part_scores.py"
    spec = importlib.util.spec_from_file_location("bench_part_scores", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setenv("OUT", str(tmp_path))
    bench.main(["--smoke", "--batch", "2", "--context", "200"])
    (row,) = json.loads((tmp_path / "bench_part_scores.json").read_text())["rows"]
    assert row["inf_equal"] and row["state_equal"] and row["max_abs_diff"] < 1e-5 and row["lists_diff"] == 0
    assert row["ms_ref"] > 0 and row["ms_kernel"] > 0 and row["ms_rest"] > 0
    assert row["sel_bits_diff"] == 0 and row["sel_lists_diff"] == 0
    assert all(row[key] > 0 for key in ("ms_sel_ref", "ms_sel_mixed", "ms_sel_kernel", "ms_combine", "ms_select"))
