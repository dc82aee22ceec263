"""The CPU's C selection kernels against the PyTorch forms they stand in for: the list selection (``cpu_topk``),
Quest's bounds update and decode lists (``cpu_quest``), Sketch&Walk's sketches, part scores with the heads'
combine, and part lists (``cpu_parts``); then each method's batched decode with them against the same decode
with the PyTorch forms.

Fresh random inputs each run (the seed is in every failure's message). Where the kernels' arithmetic is the
PyTorch form's (the lists, the bounds, the sketches, the state) every element is compared exactly. Where a dot
product is summed in another order (Quest's page bounds, the part scores) the inputs are drawn twice: integer
valued, where fp32 sums are exact in any order, so scores and lists must agree bit for bit, ties included; and
Gaussian, where the scores must agree to fp32 rounding and the lists must be the PyTorch list of the kernel's own
scores, bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import prefill_then_decode, tiny_model, whole_model_density

from raysparse.kernels import cpu_parts, cpu_quest, cpu_topk, dispatch, scorer_dispatch
from raysparse.kernels.paged_quest import paged_quest_scores_torch
from raysparse.kernels.part_scores import part_scores_reference
from raysparse.kernels.row_select import select_list_torch
from raysparse.kv_cache import KVCache
from raysparse.methods.hadamard import SRHT
from raysparse.methods.registry import create_backend
from raysparse.methods.sketch_walk_config import SketchWalkConfig
from raysparse.methods.sketch_walk_parts import PartsDecode

pytestmark = pytest.mark.skipif(cpu_topk.library() is None, reason="no C compiler: the PyTorch forms serve")


def _gen() -> tuple[torch.Generator, int]:
    seed = int(torch.randint(0, 2**31 - 1, ()))
    return torch.Generator().manual_seed(seed), seed


# ---- the list selection ---------------------------------------------------------------------------------------

def test_select_list_matches_the_pytorch_form():
    """Rows with heavy ties (small integers), -0.0 beside 0.0, forced (+inf) and excluded (-inf) entries, empty
    rows, kk below zero and above the candidates, k_max and widths cutting the list."""
    g, seed = _gen()
    for trial in range(200):
        rows, n = int(torch.randint(1, 6, (), generator=g)), int(torch.randint(0, 300, (), generator=g))
        s = torch.randint(-4, 5, (rows, n), generator=g).float() if trial % 2 else torch.randn(rows, n, generator=g)
        u = torch.rand(rows, n, generator=g)
        s[u < 0.05] = math.inf
        s[(u > 0.05) & (u < 0.12)] = -math.inf
        s[(u > 0.12) & (u < 0.15)] = -0.0
        kk = torch.randint(-2, n + 3, (rows,), generator=g)
        k_max, width = (int(torch.randint(0, n + 3, (), generator=g)) for _ in range(2))
        got = cpu_topk.select_list(s, kk, k_max, width)
        assert torch.equal(got, select_list_torch(s, kk, k_max, width)), f"seed {seed} trial {trial}"


# ---- Quest --------------------------------------------------------------------------------------------------

def _quest_draw(g: torch.Generator, exact: bool, b: int = 4, h_kv: int = 2, group: int = 3, d: int = 64,
                page: int = 64, qp: int = 16):
    """A ragged batch over shuffled pages: rows of one token, a partial Quest page, a whole cache page and many
    pages; the table's entries past a row's pages point anywhere."""
    pages = 12
    sub = page // qp
    lens = torch.tensor([1, 37, 64, int(torch.randint(page * 4, page * (pages - 2), (), generator=g))][:b])
    width = -(-int(lens.max()) // page)
    table = torch.stack([torch.randperm(pages, generator=g)[:width] for _ in range(b)]).to(torch.int32)
    if exact:  # small integers: every fp32 product and sum exact, many equal scores
        q = torch.randint(-3, 4, (b, h_kv * group, d), generator=g).float()
        lo = torch.randint(-3, 2, (pages + 1, h_kv, sub, d), generator=g).float()
        hi = lo + torch.randint(0, 3, lo.shape, generator=g).float()
    else:
        q = torch.randn(b, h_kv * group, d, generator=g)
        lo = torch.randn(pages + 1, h_kv, sub, d, generator=g)
        hi = lo + torch.rand(lo.shape, generator=g)
    return q, lo, hi, table, lens.to(torch.int32), qp


@pytest.mark.parametrize("exact", [True, False], ids=["integers", "gaussian"])
@pytest.mark.parametrize("group,d", [(3, 64), (1, 16), (5, 24)])
def test_quest_decode_lists_match_the_pytorch_form(exact, group, d):
    """``cpu_quest.decode_lists`` against ``paged_quest_scores_torch`` + ``select_list_torch``: the scores (+inf
    forced, -inf past the row) to fp32 rounding, exactly where they are exact; the lists bit for bit on the
    kernel's own scores, and on the PyTorch form's where those are exact."""
    g, seed = _gen()
    q, lo, hi, table, lens, qp = _quest_draw(g, exact, group=group, d=d)
    b, h_kv = q.shape[0], lo.shape[1]
    cols = table.shape[1] * lo.shape[2]
    want_s = paged_quest_scores_torch(q, lo, hi, table, lens, qp)
    for _ in range(4):
        kk = torch.randint(-1, cols + 2, (b * h_kv,), generator=g)
        k_max = int(torch.randint(0, cols + 2, (), generator=g))
        width = int(torch.randint(1, cols + 3, (), generator=g))
        got_s = torch.full((b, h_kv, cols), math.nan)
        got = cpu_quest.decode_lists(q, lo, hi, table, lens, qp, kk, k_max, width, scores=got_s)
        assert not got_s.isnan().any(), f"seed {seed}"
        if exact:
            assert torch.equal(got_s, want_s), f"seed {seed}"
        else:
            assert torch.equal(got_s.isinf(), want_s.isinf()), f"seed {seed}"
            torch.testing.assert_close(got_s, want_s, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
        mine = select_list_torch(got_s.flatten(0, 1), kk, k_max, width).view(b, h_kv, width)
        assert torch.equal(got, mine), f"seed {seed}"
        if exact:
            want = select_list_torch(want_s.flatten(0, 1), kk, k_max, width).view(b, h_kv, width)
            assert torch.equal(got, want), f"seed {seed}"


def test_quest_bounds_update_matches_the_pytorch_form(monkeypatch):
    """The C bounds update against dispatch's PyTorch form (the kernels switched off) on the same tokens: every
    bound element, touched or not, bit for bit; a page listed twice ends as its last listing leaves it."""
    g, seed = _gen()
    pages, h_kv, size, d, qp = 5, 3, 64, 32, 16
    k = torch.randn(pages, h_kv, size, d, generator=g)
    lo = torch.randn(pages + 1, h_kv, size // qp, d, generator=g)
    hi = lo + 1
    tok_pages = torch.randint(0, pages, (7,), generator=g)
    tok_slots = torch.randint(0, size, (7,), generator=g)
    tok_pages[-1], tok_slots[-1] = tok_pages[0], tok_slots[0] // qp * qp + (tok_slots[0] + 5) % qp  # page again
    want_lo, want_hi = lo.clone(), hi.clone()
    with monkeypatch.context() as mp:
        mp.setattr(cpu_quest, "library", lambda: None)
        dispatch.update_quest_bounds(k, want_lo, want_hi, tok_pages, tok_slots, qp)
    calls = []
    real = cpu_quest.update_bounds
    monkeypatch.setattr(cpu_quest, "update_bounds", lambda *a: calls.append(1) or real(*a))
    dispatch.update_quest_bounds(k, lo, hi, tok_pages, tok_slots, qp)
    assert calls and torch.equal(lo, want_lo) and torch.equal(hi, want_hi), f"seed {seed}"


def test_quest_falls_back_without_a_compiler(monkeypatch):
    """No library: ``quest_decode_lists`` is the PyTorch scores and list."""
    g, _ = _gen()
    q, lo, hi, table, lens, qp = _quest_draw(g, True)
    kk = torch.full((q.shape[0] * lo.shape[1],), 3)
    want = select_list_torch(paged_quest_scores_torch(q, lo, hi, table, lens, qp).flatten(0, 1), kk, 3, 5)
    monkeypatch.setattr(cpu_quest, "library", lambda: None)
    assert not cpu_quest.supported(q, lo, hi)
    assert torch.equal(dispatch.quest_decode_lists(q, lo, hi, table, lens, qp, kk, 3, 5).flatten(0, 1), want)


# ---- Sketch&Walk's sketches, scores and lists ------------------------------------------------------------------

@pytest.mark.parametrize("group,d,sketch_dim", [(3, 64, 64), (4, 128, 32), (1, 48, 16), (2, 24, 64)])
def test_decode_sketches_are_the_pytorch_forms_bits(monkeypatch, group, d, sketch_dim):
    g, seed = _gen()
    s = SRHT(d, sketch_dim, seed=seed)
    bsz, h_kv, pages, page = 5, 3, 7, 16
    q = torch.randn(bsz, group * h_kv, d, generator=g)
    k_pages = torch.randn(pages, h_kv, page, d, generator=g)
    slot_pages, slot_offsets = torch.randint(0, pages, (bsz,), generator=g), torch.randint(0, page, (bsz,), generator=g)
    monkeypatch.setenv(dispatch.ENV, "torch")
    want = scorer_dispatch.decode_sketches(q, k_pages, slot_pages, slot_offsets, s)
    got = dispatch.decode_sketches(q, k_pages, slot_pages, slot_offsets, s)
    assert got.shape == want.shape and torch.equal(got, want), f"seed {seed}"


def _parts_draw(g: torch.Generator, exact: bool, h_kv: int, r: int, parts: int, block: int, group: int = 1):
    """Page-indexed part sums of a ragged batch on distinct shuffled pages: a one-token row, a row whose new token
    starts a part (stored over stale sums), a partial part, a full block, a long row."""
    size = block // parts
    lens = torch.tensor([1, size + 1, 2 * size + 3, block, 5 * block + 2 * size - 1])
    width = -(-int(lens.max()) // block)
    pages = len(lens) * width + 1  # real rows hold distinct pages
    table = torch.randperm(pages, generator=g)[: len(lens) * width].view(len(lens), width).to(torch.int32)
    rows = (pages + 1) * parts
    if exact:  # multiples of 840: a sum over any part count (1..8) divides exactly; products stay below 2^24
        ks = 840.0 * torch.randint(-3, 4, (rows, h_kv, r), generator=g).float()
        q = torch.randint(-2, 3, (len(lens), h_kv * group, r), generator=g).float()
        k = 840.0 * torch.randint(-3, 4, (len(lens), h_kv, r), generator=g).float()
    else:
        ks = torch.randn(rows, h_kv, r, generator=g)
        q = torch.randn(len(lens), h_kv * group, r, generator=g)
        k = torch.randn(len(lens), h_kv, r, generator=g)
    return ks, table, lens.long(), q, k, size


@pytest.mark.parametrize("exact", [True, False], ids=["integers", "gaussian"])
@pytest.mark.parametrize("heads", ["pair", "pair-lse"])
@pytest.mark.parametrize("h_kv,r,parts,group", [(3, 64, 8, 1), (2, 16, 4, 3), (1, 24, 2, 1)])
def test_part_combine_matches_the_pytorch_form(exact, heads, h_kv, r, parts, group):
    """The state update bit for bit, and the partial combine against ``part_scores_reference`` then
    ``head_partial``: on integer sums the same fp32 scores (exactly, or to the fp64 exp's last bit), to fp32
    rounding on Gaussian ones (its zeros and -infs exactly)."""
    g, seed = _gen()
    block = 32
    ks, table, n, q, k, size = _parts_draw(g, exact, h_kv, r, parts, block, group)
    want_state, got_state = ks.clone(), ks.clone()
    s = part_scores_reference(want_state, table, n, q, k, size, parts)  # [h_kv * G, bsz, w * P]
    x = s.double()
    want = (x.exp() if heads == "pair-lse" else x).sum(0)
    got = cpu_parts.part_combine(got_state, table, n, q, k, size, parts, heads)
    assert torch.equal(got_state, want_state), f"seed {seed}"
    assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got == 0, want == 0), f"seed {seed}"
    if exact and heads == "pair":
        assert torch.equal(got, want), f"seed {seed}"
    elif exact:  # the same fp32 scores; libm's fp64 exp and PyTorch's may differ in a last bit
        torch.testing.assert_close(got, want, rtol=4 * torch.finfo(torch.float64).eps, atol=0, msg=f"seed {seed}")
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"seed {seed}")


def _path(parts: int, density: float, local: int, heads: str, block: int) -> PartsDecode:
    """A paired path holding only what ``paired_constants``, ``part_widths`` and ``_choose_parts`` read."""
    path = PartsDecode.__new__(PartsDecode)
    path.cfg = SketchWalkConfig(block_size=block, density=density, local_blocks=local, sub_blocks=parts,
                                heads=heads)
    path.parts = parts
    return path


def _finish(heads: str, x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``SketchWalk._finish_heads`` after ``_head_part`` on a reduced partial: what ``_choose_parts`` ranks."""
    if heads == "pair-lse":
        return x.clamp(min=torch.finfo(torch.float64).tiny).log().float()
    return (x / num_heads).float()


@pytest.mark.parametrize("heads", ["pair", "pair-lse"])
@pytest.mark.parametrize("ties", [True, False])
@pytest.mark.parametrize("parts,local,density", [(8, 1, 0.1), (4, 2, 0.3), (2, 1, 0.5), (1, 1, 0.25)])
def test_part_select_matches_choose_parts(heads, ties, parts, local, density):
    """``cpu_parts.part_select`` against ``_combine_heads``' finalisation + ``_choose_parts`` on the same reduced
    partial, bit for bit: ragged rows from one token to the whole width, heavy ties, infinite and empty parts."""
    g, seed = _gen()
    block, w = 16, 9
    path = _path(parts, density, local, heads, block)
    n = torch.tensor([1, 2, block - 1, block, block + 1, 3 * block + 5, w * block - 3, w * block])
    wp = w * parts
    held = (n + block // parts - 1) // (block // parts)
    if ties:  # a few values only: many equal scores within a row
        x = torch.randint(1, 4, (len(n), wp), generator=g).double() * (0.5 if heads == "pair" else 1.0)
    else:
        x = torch.rand(len(n), wp, generator=g, dtype=torch.float64) * 5 + 1e-3
    x[torch.rand(x.shape, generator=g) < 0.05] = math.inf
    filled = torch.arange(wp) < held[:, None]
    x = torch.where(filled, x, 0.0 if heads == "pair-lse" else -math.inf)  # empty parts as part_combine leaves them
    st = path.paired_constants(n, w)
    num_heads = 3
    want = path._choose_parts(_finish(heads, x, num_heads), st)
    got = cpu_parts.part_select(x, n, heads, num_heads, block, parts, local, density, st["p_k"], st["p_width"])
    assert (st["p_k"], st["p_width"]) == path.part_widths(w)
    assert torch.equal(got, want), f"seed {seed}"


# ---- the methods' batched decode with and without the kernels --------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return tiny_model("cpu", 2, 3, 4)


def _decode(model, name: str, params: dict, lens: list[int], steps: int, seed: int, spy_on, block: int = 16):
    """Each prompt prefilled, then ``steps`` batched decode steps; every decode selection (``spy_on``'s) and the
    logits."""
    cache = KVCache(model.cfg, 64, block)
    backend = create_backend(name, model.cfg, **params)
    if name == "sketch_walk":
        assert backend.build_batched(cache, max_batch=None)
    picks = []
    owner, attr = spy_on(backend)
    real = getattr(owner, attr)

    def spy(*args):
        out = real(*args)
        picks.append((out[0] if isinstance(out, tuple) else out).clone())
        return out

    setattr(owner, attr, spy)
    logits = prefill_then_decode(model, cache, backend, None, lens, steps, torch.Generator().manual_seed(seed), False)
    return picks, logits, backend


def test_quest_decode_with_the_kernels_is_the_pytorch_forms(model, monkeypatch):
    """Quest's batched decode (bounds update and lists) through the C kernels against the same decode with them
    off: the same lists at every layer and step, and the same logits."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    params = {"density": whole_model_density(0.3, 4), "block_size": 64}  # four Quest pages a cache page
    lens, steps = [70, 16, 133], 4
    calls = []
    real = cpu_quest.decode_lists
    monkeypatch.setattr(cpu_quest, "decode_lists", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got, got_logits, backend = _decode(model, "quest", params, lens, steps, seed, lambda b: (b, "decode_select"), 64)
    assert calls
    monkeypatch.setattr(cpu_quest, "library", lambda: None)
    want, want_logits, _ = _decode(model, "quest", params, lens, steps, seed, lambda b: (b, "decode_select"), 64)
    assert len(got) == len(want) == steps * len(backend.sparse_layers())
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"seed {seed} call {i}"
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4, msg=f"seed {seed}")


@pytest.mark.parametrize("scoring", [{}, {"heads": "pair", "sub_blocks": 4}, {"part_scores": False},
                                     {"decode_query": "heads"}],
                         ids=["default", "pair-P4", "torch-scores", "query-heads"])
def test_sketch_walk_decode_with_the_kernels_is_the_pytorch_forms(model, monkeypatch, scoring):
    """Sketch&Walk's paired decode (``decode_unit="part"``) through the C kernels against the same decode with the
    PyTorch forms (``native`` off, the sketches' kernel off): the same part lists at every layer and step, the
    same logits."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    params = {"density": whole_model_density(0.3, 4), "block_size": 16, **scoring}
    lens, steps = [70, 16, 133], 5

    def on(backend):
        return backend.batch_decoder, "_selection"

    calls = []
    real = cpu_parts.part_select
    monkeypatch.setattr(cpu_parts, "part_select", lambda *a: calls.append(1) or real(*a))
    got, got_logits, _ = _decode(model, "sketch_walk", params, lens, steps, seed, on)
    assert calls
    monkeypatch.setattr(PartsDecode, "native", False)
    monkeypatch.setattr(cpu_parts, "supported", lambda *t: False)
    calls.clear()
    want, want_logits, _ = _decode(model, "sketch_walk", params, lens, steps, seed, on)
    assert not calls and len(got) == len(want) > 0
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"seed {seed} call {i}"
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4, msg=f"seed {seed}")
