"""The Triton kernels against the PyTorch reference, on fresh random inputs.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is
imported); with one they run compiled. Shapes stay small: the interpreter pays per program. Every case
fills the outputs with NaN first, so an element the kernel forgot to write fails the comparison.
"""

from __future__ import annotations

import math

import pytest
import torch
from triton_env import DEV  # before raysparse.kernels: without a GPU it picks the interpreter

from raysparse.kernels import dispatch
from raysparse.kernels import sparse_decode as decode_mod
from raysparse.kernels.block_sparse_prefill import (
    CONFIGS,
    PrefillConfig,
    block_sparse_prefill,
    block_sparse_prefill_config,
    configs_for,
)
from raysparse.kernels.formats import PackedKV, PagedKV, pack_block_selections, pack_token_selections
from raysparse.kernels.reference import strided_dense_attention as strided_ref
from raysparse.kernels.sparse_decode import num_splits_for, sparse_decode
from raysparse.kernels.strided_dense import strided_dense, strided_rows
from raysparse.methods import sparse_attention as ref
from raysparse.methods.selection import BlockSelection, TokenSelection, indices_from_mask

B = 64
H_KV = 2
# (n keys, n_q new queries): a full prefill ending mid-block, a chunk starting mid-block, one query, one
# exact block.
PREFILL_LENS = [(200, 200), (300, 70), (129, 1), (64, 64)]
DECODE_LENS = [300, 1000, 70, 5]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    if dtype == torch.float32 and DEV.type == "cuda":  # fp32 dots use TF32 on the GPU
        return dict(atol=1e-2, rtol=1e-2)
    return dict(atol=2e-3, rtol=2e-3) if dtype == torch.float16 else dict(atol=1e-4, rtol=1e-4)


def _seqs(lens: list[tuple[int, int]], g: int, d: int, dtype: torch.dtype, gen: torch.Generator):
    return [(torch.randn(nq, H_KV * g, d, generator=gen).to(DEV, dtype),
             torch.randn(H_KV, n, d, generator=gen).to(DEV, dtype),
             torch.randn(H_KV, n, d, generator=gen).to(DEV, dtype)) for n, nq in lens]


def _kv(ks: list[torch.Tensor], vs: list[torch.Tensor], layout: str, gen: torch.Generator):
    lens = [k.shape[1] for k in ks]
    if layout == "packed":
        cu = torch.tensor([0, *lens]).cumsum(0).to(DEV, torch.int32)
        return PackedKV(torch.cat([k.transpose(0, 1) for k in ks]), torch.cat([v.transpose(0, 1) for v in vs]), cu)
    need = [-(-n // B) for n in lens]
    perm = torch.randperm(sum(need) + 3, generator=gen)  # shuffled pages, a few never used
    d, dtype = ks[0].shape[-1], ks[0].dtype
    # NaN everywhere no sequence wrote: a kernel reading past a sequence's end poisons its output.
    kc = torch.full((perm.numel(), H_KV, B, d), float("nan"), dtype=dtype, device=DEV)
    vc = kc.clone()
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    at = 0
    for i, (k, v) in enumerate(zip(ks, vs, strict=True)):
        pages = perm[at: at + need[i]]
        table[i, : need[i]] = pages.int()
        at += need[i]
        for j, p in enumerate(pages.tolist()):
            kc[p, :, : k[:, j * B:(j + 1) * B].shape[1]] = k[:, j * B:(j + 1) * B]
            vc[p, :, : v[:, j * B:(j + 1) * B].shape[1]] = v[:, j * B:(j + 1) * B]
    return PagedKV(kc, vc, table.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV))


def _block_sel(n: int, n_q: int, gen: torch.Generator) -> BlockSelection:
    """Random causal selection with sink + diagonal, one empty row, one stray future block, extra padding."""
    q_start = n - n_q
    qb0, nkb = q_start // B, -(-n // B)
    nqb = -(-(q_start % B + n_q) // B)
    qb = qb0 + torch.arange(nqb)
    kb = torch.arange(nkb)
    mask = (torch.rand(H_KV, nqb, nkb, generator=gen) < 0.5) & (kb <= qb[:, None])
    mask |= (kb == 0) | (kb == qb[:, None])
    if nqb > 1:
        mask[0, 0] = False  # a query block with nothing selected: zeros and lse = -inf
        mask[1, 0, qb0 + 1] = True  # above the diagonal: fully masked, must not change the result
    return BlockSelection(indices_from_mask(mask, width=nkb + 2).to(DEV), B)


PREFILL_CASES = [  # (g, d, dtype, layout, block_qt)
    (1, 64, torch.float16, "packed", None),
    (4, 128, torch.float32, "paged", None),
    (8, 64, torch.float16, "paged", None),
    (4, 64, torch.float16, "packed", 16),  # several tiles per query block
    (3, 64, torch.float32, "packed", None),  # a group size that is not a power of two
]


def _check_prefill(g: int, d: int, dtype: torch.dtype, layout: str, launch, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    seqs = _seqs(PREFILL_LENS, g, d, dtype, gen)
    sels = [_block_sel(n, nq, gen) for n, nq in PREFILL_LENS]
    q = torch.cat([s[0] for s in seqs])
    kv = _kv([s[1] for s in seqs], [s[2] for s in seqs], layout, gen)
    cu_q = torch.tensor([0] + [nq for _, nq in PREFILL_LENS]).cumsum(0).to(DEV, torch.int32)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=DEV)
    launch(q, kv, pack_block_selections(sels), cu_q, out=out, lse=lse)
    refs = [ref.block_sparse_attention(qi.float(), ki.float(), vi.float(), s)
            for (qi, ki, vi), s in zip(seqs, sels, strict=True)]
    torch.testing.assert_close(out.float(), torch.cat([r[0] for r in refs]), **_tol(dtype))
    torch.testing.assert_close(lse, torch.cat([r[1] for r in refs]), **_tol(dtype))
    assert torch.isneginf(lse).any()  # the empty row was exercised


@pytest.mark.parametrize("g,d,dtype,layout,block_qt", PREFILL_CASES)
def test_block_sparse_prefill(g: int, d: int, dtype: torch.dtype, layout: str, block_qt: int | None) -> None:
    _check_prefill(g, d, dtype, layout, lambda *a, **kw: block_sparse_prefill(*a, block_qt=block_qt, **kw),
                   g * 1000 + d)


@pytest.mark.parametrize("layout,dtype,bounds,config", [
    ("paged", torch.float32, "any", None), ("packed", torch.float16, "any", None),
    ("paged", torch.float32, "sliding", PrefillConfig(64, 2, 4, 2)),  # key blocks in pairs past the band
    ("packed", torch.float16, "sliding", None)])
def test_block_sparse_prefill_with_a_row_window(layout: str, dtype: torch.dtype, bounds: str,
                                                config: PrefillConfig | None) -> None:
    """PSAW's per-row window inside the listed blocks (``window_lo``, ``sink``): the kernel and the CPU path
    against masked attention over every key, on random block lists and a stray block, with any bound per row
    (most blocks under the window's mask) or PSAW's sliding ones (lo = floor(f (p + 1)) - 1: a band of masked
    blocks, the blocks above it unmasked)."""
    from dataclasses import replace

    from raysparse.kernels.paged_torch import block_sparse_prefill_torch

    seed = int(torch.randint(0, 2**31 - 1, ()))
    gen = torch.Generator().manual_seed(seed)
    g, d = 2, 64
    seqs = _seqs(PREFILL_LENS, g, d, dtype, gen)
    sels = [_block_sel(n, nq, gen) for n, nq in PREFILL_LENS]
    sink = int(torch.randint(0, 80, (), generator=gen))
    frac = float(torch.rand((), generator=gen)) * 0.6
    los = []
    for n, nq in PREFILL_LENS:
        pos = torch.arange(n - nq, n)
        if bounds == "any":
            los.append((torch.rand(nq, generator=gen) * (pos + 1)).long())  # any bound in [0, p]
        else:
            los.append(((frac * (pos + 1).double()).floor().long() - 1).clamp(min=0))
    q = torch.cat([s[0] for s in seqs])
    kv = _kv([s[1] for s in seqs], [s[2] for s in seqs], layout, gen)
    cu_q = torch.tensor([0] + [nq for _, nq in PREFILL_LENS]).cumsum(0).to(DEV, torch.int32)
    sel = replace(pack_block_selections(sels), window_lo=torch.cat(los).to(DEV, torch.int32), sink=sink)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=DEV)
    if config is None:
        block_sparse_prefill(q, kv, sel, cu_q, out=out, lse=lse)
    else:
        block_sparse_prefill_config(q, kv, sel, cu_q, config, out=out, lse=lse)
    want_o, want_l, cpu_o, cpu_l = [], [], [], []
    for (qi, ki, vi), one, lo, (n, nq) in zip(seqs, sels, los, PREFILL_LENS, strict=True):
        pos = torch.arange(n - nq, n, device=DEV)[:, None]
        keys = torch.arange(n, device=DEV)[None, :]
        listed = torch.zeros(H_KV, nq, n, dtype=torch.bool, device=DEV)
        for h in range(H_KV):
            for r in range(nq):
                blocks = one.indices[h, (n - nq + r) // B - (n - nq) // B]
                for b in blocks[blocks >= 0].tolist():
                    listed[h, r, b * B: (b + 1) * B] = True
        ok = listed & (keys <= pos) & ((keys < sink) | (keys >= lo.to(DEV)[:, None]))  # [h_kv, nq, n]
        s_ = torch.einsum("qkgd,knd->kgqn", qi.float().view(nq, H_KV, g, d), ki.float()) / math.sqrt(d)
        s_ = s_.masked_fill(~ok[:, None], float("-inf"))
        l_ = torch.logsumexp(s_, -1)
        p_ = torch.exp(s_ - torch.where(torch.isfinite(l_), l_, 0.0)[..., None])
        want_o.append(torch.einsum("kgqn,knd->qkgd", p_, vi.float()).reshape(nq, -1, d))
        want_l.append(l_.permute(2, 0, 1).reshape(nq, -1))
        o, l_cpu = block_sparse_prefill_torch(qi.cpu().float(), ki.cpu().float(), vi.cpu().float(),
                                              one.indices.cpu(), B, None, lo, sink)
        cpu_o.append(o)
        cpu_l.append(l_cpu)
    msg = f"seed {seed}"
    torch.testing.assert_close(out.float(), torch.cat(want_o), **_tol(dtype), msg=lambda m: f"{msg}: {m}")
    torch.testing.assert_close(lse, torch.cat(want_l), **_tol(dtype), msg=lambda m: f"{msg}: {m}")
    torch.testing.assert_close(torch.cat(cpu_o), torch.cat(want_o).cpu(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat(cpu_l), torch.cat(want_l).cpu(), atol=1e-4, rtol=1e-4)


PREFILL_CONFIG_CASES = [  # (g, d, dtype, layout, config): two key blocks per step, odd and even counts
    (4, 128, torch.float16, "paged", PrefillConfig(256, 2, 16, 2)),
    (8, 64, torch.float32, "packed", PrefillConfig(256, 2, 16, 2)),  # two tiles per query block
]


@pytest.mark.parametrize("g,d,dtype,layout,config", PREFILL_CONFIG_CASES)
def test_block_sparse_prefill_two_block_steps(g: int, d: int, dtype: torch.dtype, layout: str,
                                              config: PrefillConfig) -> None:
    _check_prefill(g, d, dtype, layout, lambda *a, **kw: block_sparse_prefill_config(*a, config=config, **kw),
                   g * 100 + d)


def test_prefill_configs_fit_every_group() -> None:
    """Every autotune config gives whole tiles per query block; each group size tunes over the configs whose
    row count it reaches, and the autotuner gets them without duplicates."""
    for g_pad in (1, 2, 4, 8, 16, 128):
        fit = configs_for(g_pad, B)
        assert fit
        for c in fit:
            qt = c.block_qt(g_pad, B)
            assert 1 <= qt <= B and B % qt == 0, (c, g_pad)
            assert qt * g_pad == c.rows or len(fit) == len(CONFIGS), (c, g_pad)
    assert {c.rows for c in configs_for(1, B)} == {64}
    assert len(configs_for(4, B)) == len(CONFIGS)
    with pytest.raises(ValueError):
        PrefillConfig(96, 1, 4, 3)


DECODE_CASES = [  # (g, d, unit, layout, dtype, num_splits)
    (1, 128, 1, "packed", torch.float32, None),
    (4, 64, 64, "paged", torch.float16, 3),
    (8, 128, 64, "paged", torch.float16, None),
    (4, 64, 1, "paged", torch.float16, 5),  # token gathers through the page table; some splits empty
    (3, 64, 16, "packed", torch.float32, None),  # blocks smaller than pages, odd group size
    (4, 128, 16, "paged", torch.float16, 1),  # one split: the single-launch kernel writes the output itself
]


def _decode_case(g: int, d: int, unit: int, layout: str, dtype: torch.dtype, gen: torch.Generator):
    seqs = _seqs([(n, 1) for n in DECODE_LENS], g, d, dtype, gen)
    sels = []
    for i, n in enumerate(DECODE_LENS):
        units = -(-n // unit)
        mask = torch.rand(H_KV, units, generator=gen) < 0.3
        mask[:, 0] = True
        if i == 2:
            mask[0] = False  # a KV head with an empty selection
        sels.append(TokenSelection(indices_from_mask(mask, width=units + i).to(DEV), unit))
    q = torch.stack([s[0][0] for s in seqs])
    kv = _kv([s[1] for s in seqs], [s[2] for s in seqs], layout, gen)
    refs = [ref.sparse_decode_attention(qi[0].float(), ki.float(), vi.float(), s)
            for (qi, ki, vi), s in zip(seqs, sels, strict=True)]
    return q, kv, pack_token_selections(sels), torch.stack([r[0] for r in refs]), torch.stack([r[1] for r in refs])


def _nan_outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full_like(q, float("nan")), torch.full(q.shape[:2], float("nan"), device=DEV)


@pytest.mark.parametrize("g,d,unit,layout,dtype,num_splits", DECODE_CASES)
def test_sparse_decode(g: int, d: int, unit: int, layout: str, dtype: torch.dtype, num_splits: int | None) -> None:
    q, kv, idx, ref_o, ref_l = _decode_case(g, d, unit, layout, dtype, torch.Generator().manual_seed(7 * g + d + unit))
    out, lse = _nan_outputs(q)
    sparse_decode(q, kv, idx, unit, num_splits=num_splits, out=out, lse=lse)
    torch.testing.assert_close(out.float(), ref_o, **_tol(dtype))
    torch.testing.assert_close(lse, ref_l, **_tol(dtype))
    assert torch.isneginf(lse[2, :g]).all()


def test_single_launch_decode_repeats_on_one_workspace() -> None:
    """The counters are reset by the kernel: a second call on the same workspace (a graph replay) gives
    bit-identical results and the workspace is left zeroed. Many splits, so
    several programs race for the last-arrival role."""
    q, kv, idx, ref_o, ref_l = _decode_case(4, 128, 1, "paged", torch.float16, torch.Generator().manual_seed(21))
    runs = []
    for _ in range(2):
        out, lse = _nan_outputs(q)
        sparse_decode(q, kv, idx, 1, num_splits=7, out=out, lse=lse)
        runs.append((out, lse))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert not bool(decode_mod._workspace(q.device, q.shape[0] * H_KV).any())
    torch.testing.assert_close(runs[0][0].float(), ref_o, **_tol(torch.float16))
    torch.testing.assert_close(runs[0][1], ref_l, **_tol(torch.float16))


def test_split_heuristic_fills_the_gpu() -> None:
    """Every split has work and the splits cover the selection; on an H100-sized GPU (132 SMs, 2 programs
    each) batch 1 spreads its few selected tokens over many programs (as many as whole 128-key inner steps allow)
    and big batches keep fewer, longer ones, but no token list goes past ~512 keys a program."""
    for batch, h_kv, max_sel, unit in [(1, 8, 32, 64), (1, 8, 2048, 1), (8, 8, 128, 64), (64, 8, 8192, 1),
                                       (1, 2, 5, 1), (3, 1, 1, 64)]:
        splits, per = num_splits_for(batch, h_kv, max_sel, unit, torch.device("cpu"))
        assert 1 <= splits <= 128 and (splits - 1) * per < max_sel <= splits * per
    slots = 132 * 2
    one, per_one = decode_mod._best_split(8, 2048, 1, slots)
    many, per_many = decode_mod._best_split(64, 2048, 1, slots)
    assert one == 2048 // 128 and one * 8 <= slots and per_one % 128 == 0
    assert 2048 // 512 <= many < one and per_many % 128 == 0
    # the floor: the model alone keeps 4 splits a row at batch 8 x 13107 tokens, the floor 26 of 512
    assert decode_mod._best_split(64, 13107, 1, slots) == (26, 512)
    # pages keep the model's choice: a batch of long page lists stays in few programs
    assert decode_mod._best_split(64, 204, 64, slots)[0] <= 4


STRIDED_CASES = [  # (g, d, gamma, layout, dtype, block_qt)
    (1, 64, 16, "packed", torch.float16, None),
    (4, 128, 64, "paged", torch.float32, None),
    (8, 64, 32, "paged", torch.float16, 2),  # several row tiles per sequence
]


@pytest.mark.parametrize("g,d,gamma,layout,dtype,block_qt", STRIDED_CASES)
def test_strided_dense(g: int, d: int, gamma: int, layout: str, dtype: torch.dtype, block_qt: int | None) -> None:
    gen = torch.Generator().manual_seed(g + d + gamma)
    lens = [(300, 300), (500, 77), (130, 1), (40, 3)]
    seqs = _seqs(lens, g, d, dtype, gen)
    q = torch.cat([s[0] for s in seqs])
    kv = _kv([s[1] for s in seqs], [s[2] for s in seqs], layout, gen)
    cu_q = torch.tensor([0] + [nq for _, nq in lens]).cumsum(0).to(DEV, torch.int32)
    q_lens, k_lens = [nq for _, nq in lens], [n for n, _ in lens]
    rows = sum(strided_rows(q_lens, k_lens, gamma))
    out = torch.full((rows, *q.shape[1:]), float("nan"), dtype=dtype, device=DEV)
    lse = torch.full((rows, q.shape[1]), float("nan"), device=DEV)
    strided_dense(q, kv, cu_q, gamma, q_lens, k_lens, block_qt=block_qt, out=out, lse=lse)
    refs = [strided_ref(qi.float(), ki.float(), vi.float(), gamma, n - nq)
            for (qi, ki, vi), (n, nq) in zip(seqs, lens, strict=True)]
    torch.testing.assert_close(out.float(), torch.cat([r[0] for r in refs]), **_tol(dtype))
    torch.testing.assert_close(lse, torch.cat([r[1] for r in refs]), **_tol(dtype))


def test_dispatch_single_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference signatures: Triton when forced, the reference itself when told so or unsupported."""
    gen = torch.Generator().manual_seed(3)
    (q, k, v), = _seqs([(150, 90)], 4, 64, torch.float32, gen)
    sel = _block_sel(150, 90, gen)
    tsel = TokenSelection(indices_from_mask(torch.rand(H_KV, 3, generator=gen) < 0.7, width=4).to(DEV), B)
    calls = {
        "prefill": (lambda m: m.block_sparse_attention(q, k, v, sel)),
        "decode": (lambda m: m.sparse_decode_attention(q[-1], k, v, tsel)),
        "strided": (lambda m: m.strided_dense_attention(q, k, v, 16, 60) if m is dispatch
                    else strided_ref(q, k, v, 16, 60)),
    }
    for name, call in calls.items():
        expect = call(ref)
        monkeypatch.setenv(dispatch.ENV, "torch")
        for a, b in zip(call(dispatch), expect, strict=True):
            if name == "prefill":  # the CPU's fused flash-attention path, held to the reference's values
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
            else:  # the reference itself
                assert torch.equal(a, b), name
        monkeypatch.setenv(dispatch.ENV, "triton")
        for a, b in zip(call(dispatch), expect, strict=True):
            torch.testing.assert_close(a, b, **_tol(torch.float32), msg=name)
    assert not dispatch.use_triton(q, head_dim=48)  # unsupported head dim: reference even when forced
    monkeypatch.setenv(dispatch.ENV, "auto")
    assert dispatch.use_triton(q, head_dim=64) == (DEV.type == "cuda")


def test_dispatch_varlen_fallback_matches_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ragged entry points give the same answer through the reference loop and through Triton."""
    gen = torch.Generator().manual_seed(5)
    lens = [(130, 130), (200, 10)]
    seqs = _seqs(lens, 2, 64, torch.float32, gen)
    q = torch.cat([s[0] for s in seqs])
    kv = _kv([s[1] for s in seqs], [s[2] for s in seqs], "paged", gen)
    cu_q = torch.tensor([0] + [nq for _, nq in lens]).cumsum(0).to(DEV, torch.int32)
    psel = pack_block_selections([_block_sel(n, nq, gen) for n, nq in lens])
    idx = torch.stack([indices_from_mask(torch.rand(H_KV, 4, generator=gen) < 0.5, width=5) for _ in lens]).to(DEV)
    q1 = torch.stack([s[0][-1] for s in seqs])
    runs = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv(dispatch.ENV, mode)
        runs[mode] = (dispatch.block_sparse_attention_varlen(q, kv, psel, cu_q),
                      dispatch.sparse_decode_attention_varlen(q1, kv, idx, B),
                      dispatch.strided_dense_attention_varlen(q, kv, cu_q, 32, [130, 10], [130, 200]))
    for a, b in zip(runs["torch"], runs["triton"], strict=True):
        torch.testing.assert_close(a[0], b[0], **_tol(torch.float32))
        torch.testing.assert_close(a[1], b[1], **_tol(torch.float32))


def test_combine_of_splits_equals_whole() -> None:
    """Two decode calls over disjoint halves of a selection, combined, equal one call over all of it."""
    gen = torch.Generator().manual_seed(11)
    (q, k, v), = _seqs([(400, 1)], 4, 64, torch.float32, gen)
    mask = (torch.rand(H_KV, 400, generator=gen) < 0.4).to(DEV)
    first = torch.arange(400, device=DEV) < 200
    idx, lo, hi = (indices_from_mask(m, width=400) for m in (mask, mask & first, mask & ~first))
    kv = PackedKV.single(k, v)
    whole = sparse_decode(q[-1:], kv, idx[None])
    a = sparse_decode(q[-1:], kv, lo[None])
    b = sparse_decode(q[-1:], kv, hi[None])
    out, lse = dispatch.combine(a[0], a[1], b[0], b[1])
    torch.testing.assert_close(out, whole[0], **_tol(torch.float32))
    torch.testing.assert_close(lse, whole[1], **_tol(torch.float32))
    assert math.isfinite(float(lse.min()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_dispatch_linear_matches_torch_linear(dtype: torch.dtype, bias: bool):
    """The model's projections' ``linear`` (oneDNN's GEMM on CPUs) against ``F.linear``, every element, for the
    shapes a prefill chunk, a decode step and a packed 3-D input give it; under autograd it is PyTorch's."""
    from raysparse.kernels.dispatch import linear

    seed = int(torch.randint(0, 2**31 - 1, ()))
    g = torch.Generator().manual_seed(seed)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for shape in ((1, 96), (5, 96), (300, 96), (2, 7, 96)):
        x = torch.randn(*shape, generator=g).to(dtype)
        w = torch.randn(40, 96, generator=g).to(dtype)
        b = torch.randn(40, generator=g).to(dtype) if bias else None
        want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        got = linear(x, w, b)
        assert got.shape == want.shape and got.dtype == dtype, f"seed {seed}"
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol, msg=lambda m: f"seed {seed}: {m}")
    w = torch.randn(4, 8, generator=g, requires_grad=True)
    linear(torch.randn(3, 8, generator=g), w).sum().backward()
    assert w.grad is not None and w.grad.shape == w.shape, f"seed {seed}"
