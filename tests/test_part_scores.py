"""Sketch&Walk's paired part scores (kernels/part_scores.py) against their PyTorch reference, and the paired
graph decode with the kernel against its PyTorch form.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is
imported). Fresh random, page-indexed part sums (stale everywhere, as pages reused from freed sequences) and
sketches each run: three real rows whose pages are non-contiguous and interleaved (one at the full width,
one shorter than a part, one whose new token starts a part over a stale sum) and two padded rows on the
scratch page, which holds NaN so any read of it by a real row shows; the output starts as NaN so every
element must be written; the updated state is compared exactly, and only the real rows' current parts and
the scratch page's first part may change."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from helpers import DEVICES, tiny_model, whole_model_density
from triton_env import DEV  # before raysparse.kernels: without a GPU it picks the interpreter

import raysparse.kernels.part_scores as ps
from raysparse.kernels import dispatch
from raysparse.kernels.common import interpreting
from raysparse.methods.sketch_walk_config import SketchWalkConfig
from raysparse.methods.sketch_walk_parts import PartsDecode

B = 16  # tokens per block (a KV page)
REAL = 3  # real rows; two padded rows follow


def _draw(g: torch.Generator, h_kv: int, r: int, parts: int, width: int):
    """(state [2 layers, (pages + 1) * P, h_kv, r], table [5, w] int32, n, q, k) for ``width`` = w * P parts."""
    size, w = B // parts, width // parts
    pages = REAL * w + 2  # two spare pages
    state = torch.randn(2, (pages + 1) * parts, h_kv, r, generator=g)
    state[:, pages * parts:] = float("nan")  # the scratch page
    n = torch.randint(1, width * size + 1, (REAL + 2,), generator=g)
    n[0] = width * size - int(torch.randint(0, size, (), generator=g))  # the last part, full or partial
    n[1] = int(torch.randint(1, size + 1, (), generator=g))  # within the first part
    n[2] = size * int(torch.randint(0, width, (), generator=g)) + 1  # a fresh part: its stale sum is replaced
    n[REAL:] = 1  # padded rows decode token 0 at position 0, as decode_graphs pads
    # the real rows' pages interleaved in one random permutation: row i holds perm[i], perm[i + REAL], ...
    perm = torch.randperm(pages, generator=g)[: REAL * w].view(w, REAL).T
    table = torch.full((REAL + 2, w), pages, dtype=torch.int32)
    for i in range(REAL):
        used = -(-int(n[i]) // B)
        table[i, :used] = perm[i, :used]  # beyond its pages: the scratch page, as decode_graphs fills it
    q, k = torch.randn(2, REAL + 2, h_kv, r, generator=g)
    k[REAL + 1] = k[REAL]  # padded rows decode one key
    return state.to(DEV), table.to(DEV), n.to(DEV), q.to(DEV), k.to(DEV)


def check_state(got: torch.Tensor, want: torch.Tensor, start: torch.Tensor, table: torch.Tensor, n: torch.Tensor,
                parts: int, layer: int = 1) -> None:
    """``got`` is the reference's state bit for bit (NaN alike), and only the real rows' current parts and the
    scratch page's first part (padded rows') differ from ``start``: a padded row never writes a real page."""
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    same = (got == start) | (got.isnan() & start.isnan())
    changed = {tuple(x) for x in torch.nonzero(~same.flatten(2).all(-1)).tolist()}
    cur = (n - 1) // (B // parts)
    rows = ps.part_rows(table, parts).gather(1, cur[:, None]).squeeze(1)
    scratch = got.shape[1] - parts
    assert rows[REAL:].eq(scratch).all()
    assert changed <= {(layer, int(x)) for x in rows} and (layer, scratch) in changed


def query_heads(g: torch.Generator, q: torch.Tensor, group: int) -> torch.Tensor:
    """``group`` query sketches per KV head [bsz, h_kv * group, r] (KV-head major), each KV head's first one
    ``q``'s, as a group's query heads (``decode_query="heads"``)."""
    if group == 1:
        return q
    more = torch.randn(q.shape[0], q.shape[1], group - 1, q.shape[2], generator=g).to(q.device)
    return torch.cat((q[:, :, None], more), 2).flatten(1, 2)


@pytest.mark.parametrize("h_kv,r,parts,width,tile,group", [
    (1, 16, 1, 7, None, 1),
    (2, 32, 4, 40, 16, 1),  # a row over three programs, the last tile partial
    (3, 64, 8, 24, None, 1),
    (2, 16, 8, 72, 32, 1),
    (2, 32, 4, 40, 16, 3),  # every query head of a group scored on its own
    (3, 16, 2, 18, None, 2),
])
def test_part_scores_match_reference(h_kv, r, parts, width, tile, group):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    state, table, n, q, k = _draw(g, h_kv, r, parts, width)
    q = query_heads(g, q, group)
    start, want_state = state.clone(), state.clone()
    want = ps.part_scores_reference(want_state[1], table, n, q, k, B // parts, parts)
    assert not want[:, :REAL].isnan().any()  # no real row read the scratch page
    if group > 1:  # the grouped form is each query head's own one-query form, KV-head major
        for j in range(group):
            one = ps.part_scores_reference(start[1].clone(), table, n, q.unflatten(1, (h_kv, group))[:, :, j], k,
                                           B // parts, parts)
            # (another matmul shape: the last bit may round differently)
            torch.testing.assert_close(want.unflatten(0, (h_kv, group))[:, j], one, rtol=1e-6, atol=1e-6)
    out = torch.full((h_kv * group, len(n), width), float("nan"), device=DEV)
    got = ps.part_scores(state[1], table, n, q, k, B // parts, parts, out=out, tile=tile)
    assert got.data_ptr() == out.data_ptr()
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # -inf where empty, on both sides
    check_state(state, want_state, start, table, n, parts)


def test_fresh_part_stores_over_stale_sums():
    """A part's first token replaces whatever the (reused) page held there; later tokens add."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    state, table, n, q, k = _draw(g, 2, 16, 4, 12)
    ps.part_scores(state[1], table, n, q, k, B // 4, 4)
    row = ps.part_rows(table, 4).gather(1, ((n - 1) // 4)[:, None]).squeeze(1)
    fresh = (n - 1) % 4 == 0
    assert fresh[2] and torch.equal(state[1, row[2]], k[2])  # the stale sum is gone
    assert fresh[REAL:].all() and torch.equal(state[1, row[REAL]], k[REAL])


def test_part_scores_refuse_bad_shapes():
    ks = torch.zeros(8, 2, 24, device=DEV)
    one = torch.ones(1, dtype=torch.long, device=DEV)
    table = torch.zeros(1, 2, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="power-of-two"):
        ps.part_scores(ks, table, one, torch.zeros(1, 2, 24, device=DEV), torch.zeros(1, 2, 24, device=DEV), 2, 4)
    ks = torch.zeros(8, 2, 16, device=DEV)
    q = torch.zeros(1, 2, 16, device=DEV)
    with pytest.raises(ValueError, match="page table"):
        ps.part_scores(ks, table.long(), one, q, q, 2, 4)  # int64 table
    with pytest.raises(ValueError, match="pages"):
        ps.part_scores(ks, table, one, q, q, 2, 3)  # rows not whole pages


@pytest.mark.parametrize("flag", ["part_scores", "part_select"])
def test_switch_picks_the_kernel(monkeypatch, flag):
    cpu = torch.zeros(1)
    monkeypatch.setenv("RAYSPARSE_KERNELS", "triton")  # as if the tensors were on CUDA
    for on in (True, False):
        assert dispatch.triton_chosen(getattr(SketchWalkConfig(**{flag: on}), flag), None, cpu) is on
    assert dispatch.triton_chosen(getattr(SketchWalkConfig(), flag), None, cpu)  # on by default
    assert dispatch.triton_chosen(False, True, cpu)  # a forced kernel wins over the config
    monkeypatch.setenv("RAYSPARSE_KERNELS", "auto")
    assert not dispatch.triton_chosen(True, None, cpu)  # CPU tensors keep PyTorch
    with pytest.raises(ValueError, match=flag):
        SketchWalkConfig(**{flag: "maybe"})


@pytest.fixture(scope="module", params=DEVICES)
def model(request):
    return tiny_model(request.param, 2, 2, 5)


@pytest.mark.parametrize("scoring", [{"heads": "pair-lse", "sub_blocks": 8, "decode_unit": "part"},
                                     {"heads": "pair", "sub_blocks": 4, "decode_unit": "block"}],
                         ids=["pair-lse-P8-part", "pair-P4-block"])
def test_paired_graph_decode_with_the_kernel(model, scoring, monkeypatch):
    """The same decode (lists, units, logits) through the kernel as through the PyTorch form."""
    from test_sketch_walk_parts import _run

    if model.lm_head.weight.device.type == "cpu" and not interpreting():
        pytest.skip("CPU tensors run the kernels only in Triton's interpreter")
    seed = int(torch.randint(0, 2**31 - 1, ()))
    params = {**scoring, "density": whole_model_density(float(torch.empty(()).uniform_(0.15, 0.5)), 5),
              "local_blocks": 1 + seed % 2}
    lens, steps = [100, 14, 158], 3
    monkeypatch.setattr(PartsDecode, "select_kernel", False)  # the per-head scores (test_part_select: the rest)
    monkeypatch.setattr(PartsDecode, "part_kernel", False)
    want_picks, want_logits, _ = _run(model, params, lens, steps, True, seed)
    calls = []
    real = ps.part_scores
    monkeypatch.setattr(ps, "part_scores", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(PartsDecode, "part_kernel", True)
    got_picks, got_logits, backend = _run(model, params, lens, steps, True, seed)
    sparse = sum(not backend.is_dense_layer(i) for i in range(model.cfg.num_layers))
    # eager: once per sparse layer and step (the released sequence's step too); captured: while capturing
    assert len(calls) == (steps + 1) * sparse if not got_logits.is_cuda else calls
    tol = 1e-4 if got_logits.device.type == "cpu" else 2e-3
    torch.testing.assert_close(got_logits, want_logits, rtol=tol, atol=tol)
    assert len(got_picks) == len(want_picks)
    for (got, unit), (want, want_unit) in zip(got_picks, want_picks, strict=True):
        assert unit == want_unit and torch.equal(got[:3], want[:3])  # the real rows; row 3 is padding


def test_bench_part_scores_smoke(tmp_path, monkeypatch):
    """``benchmarks/bench_part_scores.py --smoke`` times every form at a tiny size, agrees and writes its JSON
    (on CUDA where present, else on the CPU in the interpreter)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_part_scores.py"
    spec = importlib.util.spec_from_file_location("bench_part_scores", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    if bench.smoke_device() == "cpu" and not interpreting():
        pytest.skip("CPU tensors run the kernels only in Triton's interpreter")
    monkeypatch.setenv("OUT", str(tmp_path))
    bench.main(["--smoke", "--batch", "2", "--context", "200"])
    (row,) = json.loads((tmp_path / "bench_part_scores.json").read_text())["rows"]
    assert row["inf_equal"] and row["state_equal"] and row["max_abs_diff"] < 1e-5 and row["lists_diff"] == 0
    assert row["ms_ref"] > 0 and row["ms_kernel"] > 0 and row["ms_rest"] > 0
    assert row["sel_bits_diff"] == 0 and row["sel_lists_diff"] == 0
    assert all(row[key] > 0 for key in ("ms_sel_ref", "ms_sel_mixed", "ms_sel_kernel", "ms_combine", "ms_select"))
