"""The comparison baselines: streaming, Quest and oracle top-k (docs/methods/baselines.md).

Shared conventions. Prefill selects key blocks of ``block_size`` per query block and KV head; decode
selects tokens (streaming, oracle) or pages (Quest). Query heads of a GQA group share their KV head's
selection. ``density`` is a sparse layer's (the registry turns ``--density``, the whole model's, into it:
``methods.registry.budgeted_config``). Budgets: in prefill ``prefill_block_budget`` (blocks per query block, the
diagonal's causal half counted, the first rows' forced excess paid back by later rows, so a prefill attends its
budget), in decode ``row_budget(density, causal units of the row)`` (tokens or pages); forced units (sinks,
diagonal, current page) count inside the budget; a request whose forced units alone exceed it attends them
and reports the density it had (``SparseMethod.check_request`` says so, for the eval).

Prefix caching (``prefix_state = "pages"``): streaming and oracle keep nothing but K/V; the batched Quest keeps
its page bounds per physical page (``page_pool``), so a prompt starting from cached pages finds them there.
``query_blocks``, ``scalar_budget`` and ``page_bounds`` / ``page_upper_bound`` (re-exported from the kernels'
references) are shared with Quest.

``streaming`` (StreamingLLM): the first ``sink_tokens`` keys plus a sliding window. Prefill keeps the
sink blocks (ceil(sink_tokens / B)) and the last local blocks up to the diagonal; decode keeps the sink
tokens and the last ``window`` tokens (the new one included). With ``density`` unset the window is
``window`` tokens (ceil(window / B) blocks in prefill): Delta's published base, sinks 64 + window 2048. With
``density`` set (``--density``) it replaces ``window``: window = max(budget - causal sink units, 1).
Sink default 64 tokens = one default block, so prefill and decode keep the same sinks.

``quest`` (Quest, page min/max bounds) lives in ``quest.py``.

``oracle`` (measurement only; quadratic): prefill scores block (i, j) by the exact attention mass, i.e.
the SUM of the exact softmax probabilities over the query rows of block i, the g query heads of the
group and the keys of block j. Like streaming and Quest it keeps the sink block 0 and the diagonal block
i (forced, inside the budget, kept even where they alone exceed it), plus the top other causal blocks
by that mass up to row_budget(density, i + 1). Pure top-k by mass wrecks the model (docs/methods/baselines.md):
rows 1-6 have a budget of one block, and
the diagonal (half causally masked, so undercounted) or the sink (every row's dump of excess mass) was
then dropped; the diagonal is the only block holding each query's own key and a query without the sink
has no place to put its excess attention. Decode keeps the newest token plus the top
row_budget(density, n) - 1 tokens by the probabilities summed over the group's query heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raysparse.kernels.formats import PackedBlockSelection
from raysparse.kernels.scorer_reference import page_bounds, page_upper_bound  # noqa: F401 - re-exported
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.methods.base import MethodConfig, SparseMethod
from raysparse.methods.budget import host_row_budget, prefill_block_budget, row_budget
from raysparse.methods.registry import method_spec, register
from raysparse.methods.selection import SENTINEL, BlockSelection, TokenSelection, indices_from_mask, topk_mask
from raysparse.methods.views import DecodeView, PrefillView, SeqContext

_CHUNK_ELEMS = 1 << 24  # scores materialised per chunk in the quadratic oracle


def scalar_budget(density: float, units: int) -> int:
    """``row_budget`` for one row given as a Python int, without tensors: the host-side density meter calls it
    per row and layer after every decode step."""
    return host_row_budget(density, units)


def query_blocks(q: torch.Tensor, ctx: SeqContext, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries padded to whole blocks [nqb, B, h, d] (fp32), row validity [nqb, B] and absolute query
    block ids [nqb] (query block r is block q_start // B + r of the sequence)."""
    b, n_q = block_size, q.shape[0]
    qb0, nqb = ctx.q_start // b, (ctx.n - 1) // b - ctx.q_start // b + 1
    lead = ctx.q_start - qb0 * b
    qf = F.pad(q.float(), (0, 0, 0, 0, lead, nqb * b - lead - n_q)).view(nqb, b, *q.shape[1:])
    pos = qb0 * b + torch.arange(nqb * b, device=q.device).view(nqb, b)
    return qf, (pos >= ctx.q_start) & (pos < ctx.n), torch.arange(qb0, qb0 + nqb, device=q.device)


def per_head(indices: torch.Tensor, h_kv: int) -> torch.Tensor:
    return indices.unsqueeze(0).expand(h_kv, *indices.shape).contiguous()


# ---- streaming ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class StreamingConfig(MethodConfig):
    density: float | None = None  # None: fixed window; set: the window follows the budget
    sink_tokens: int = 64
    window: int = 2048

    def __post_init__(self) -> None:
        self.check_shared(self.density)
        if self.sink_tokens < 0 or self.window < 1:
            raise ValueError(f"need sink_tokens >= 0 and window >= 1, got {self.sink_tokens}, {self.window}")


class Streaming(SparseMethod):
    name = "streaming"
    config_cls = StreamingConfig
    config: StreamingConfig

    @property
    def prefill_forced_blocks(self) -> int:  # type: ignore[override]
        return -(-self.config.sink_tokens // self.config.block_size) + 1  # the sinks and the diagonal

    def decode_forced_keys(self, n: int) -> int:
        sinks = min(self.config.sink_tokens, n)
        return sinks + int(n > sinks)  # and the newest token

    def _local(self, units: torch.Tensor, sinks: int, unit: int) -> torch.Tensor:
        """Local (window) units of decode rows with ``units`` causal tokens each (``unit`` 1), or with
        ``--density`` unset of prefill rows."""
        if self.layer_density is None:
            return torch.full_like(units, -(-self.config.window // unit))
        return (row_budget(self.layer_density, units) - units.clamp(max=sinks)).clamp(min=1)

    def _local_blocks(self, qb: torch.Tensor, last_row: int, sinks: int) -> torch.Tensor:
        """Local blocks (the diagonal included) of prefill query blocks ``qb``."""
        if self.layer_density is None:
            return self._local(qb + 1, sinks, self.config.block_size)
        budget = prefill_block_budget(self.layer_density, qb, last_row, sinks + 1, self.config.block_size)
        return (budget - (qb + 1).clamp(max=sinks)).clamp(min=1)

    def select_prefill(self, ctx, q, k, v) -> BlockSelection:
        b = self.config.block_size
        sinks = -(-self.config.sink_tokens // b)
        _, _, qb = query_blocks(q, ctx, b)
        local = self._local_blocks(qb, (ctx.n - 1) // b, sinks)
        kb = torch.arange(-(-ctx.n // b), device=q.device)[None, :]
        mask = (kb <= qb[:, None]) & ((kb < sinks) | (kb > qb[:, None] - local[:, None]))
        return BlockSelection(per_head(indices_from_mask(mask), k.shape[0]), b)

    def prefill_select(self, layer: int, q: torch.Tensor, view: PrefillView) -> PackedBlockSelection:
        """``select_prefill``'s rows for every query block of the batch at once: a function of positions."""
        b = self.config.block_size
        sinks = -(-self.config.sink_tokens // b)
        qb = view.qblocks(b).qblock
        local = self._local_blocks(qb, (max(view.batch.ctx_lens) - 1) // b, sinks)
        kb = torch.arange(-(-max(view.batch.ctx_lens) // b), device=qb.device)[None, :]
        mask = (kb <= qb[:, None]) & ((kb < sinks) | (kb > qb[:, None] - local[:, None]))
        return view.packed(per_head(indices_from_mask(mask), view.cache.num_kv_heads), b)

    def select_decode(self, ctx, q, k, v) -> TokenSelection:
        n, sinks = ctx.n, min(self.config.sink_tokens, ctx.n)
        local = int(self._local(torch.tensor([n]), sinks, 1)[0])
        dev = k.device
        idx = torch.cat([torch.arange(sinks, device=dev), torch.arange(max(sinks, n - local), n, device=dev)])
        return TokenSelection(per_head(idx.to(torch.int32), k.shape[0]), 1)

    # ---- batched decode: sinks then the window, a function of each row's length alone ----------------
    def _window_max(self, width: int) -> int:
        """The widest window any row of a ``width``-token bucket gets (the budget grows with the length)."""
        sinks = min(self.config.sink_tokens, width)
        return int(self._local(torch.tensor([width]), sinks, 1)[0])

    def plan_layers(self, cache: KVCache, batch: BatchMeta) -> torch.Tensor | None:
        """A batched decode step's list, a function of the lengths alone and so the same at every sparse layer
        (one density for all): built once before the layers, instead of a dozen small launches at each."""
        if batch.is_prefill or self.tracer is not None or not self.sparse_layers():
            return None
        return self._step_list(DecodeView(cache.paged(0, batch)[0], batch, cache))

    def decode_select(self, layer: int, q: torch.Tensor, view: DecodeView) -> torch.Tensor:
        return self.layer_plan(view.cache, view.batch)

    def _step_list(self, view: DecodeView) -> torch.Tensor:
        width = view.width_tokens
        n = view.seqlens.long()[:, None]  # [B, 1]
        sinks = n.clamp(max=self.config.sink_tokens)
        local = self._local(n, sinks, 1)
        start = torch.maximum(sinks, n - local)
        s_cols = torch.arange(min(self.config.sink_tokens, width), device=n.device)
        w_cols = torch.arange(min(self._window_max(width), width), device=n.device)
        sink_part = torch.where(s_cols < sinks, s_cols, SENTINEL)
        win = start + w_cols
        # Valid entries stay a prefix: a row short of its sinks has an empty window.
        idx = torch.cat([sink_part, torch.where(win < n, win, SENTINEL)], 1)
        return idx.to(torch.int32)[:, None, :].expand(-1, view.kv.k.shape[1], -1)

    def decode_keys(self, layer: int, n: int) -> int:
        sinks = min(self.config.sink_tokens, n)
        density = self.layer_density  # the host form of ``_local`` (no tensors on the meter's path)
        local = self.config.window if density is None else max(host_row_budget(density, n) - sinks, 1)
        return sinks + n - max(sinks, n - local)


# ---- oracle top-k ------------------------------------------------------------------------------
@dataclass(frozen=True)
class OracleConfig(MethodConfig):
    """The shared fields (density is the budget, block_size the prefill block), and ``shared_list``: one prefill
    list for every KV head, by the mass summed over them, the best a method that selects once per layer (as
    Sketch&Walk's paired scorings do) can do. Default False: a list per KV head."""

    shared_list: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.shared_list, bool):
            raise ValueError(f"shared_list must be true or false, got {self.shared_list!r}")


class Oracle(SparseMethod):
    name = "oracle"
    config_cls = OracleConfig
    prefill_forced_blocks = 2  # the sink block and the diagonal

    def decode_forced_keys(self, n: int) -> int:
        return 1  # the newest token

    def block_mass(self, ctx: SeqContext, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Exact attention mass of each (query block, key block), summed over the group: [h_kv, nqb, nkb]."""
        b = self.config.block_size
        h_kv, n, d = k.shape
        qf, valid, qb = query_blocks(q, ctx, b)
        qf = qf.view(len(qb), b, h_kv, -1, d)
        kpos, nkb = torch.arange(n, device=q.device), -(-n // b)
        qpos = qb[:, None] * b + torch.arange(b, device=q.device)
        mass = torch.empty(h_kv, len(qb), nkb, device=q.device)
        step = max(1, _CHUNK_ELEMS // (q.shape[1] * b * n))
        for c0 in range(0, len(qb), step):
            c1 = min(len(qb), c0 + step)
            s = torch.einsum("cbhgd,hnd->hgcbn", qf[c0:c1], k.float()) / math.sqrt(d)
            ok = (kpos <= qpos[c0:c1, :, None]) & valid[c0:c1, :, None]
            prob = torch.softmax(s.masked_fill(~ok, -math.inf), -1).nan_to_num(0.0)
            prob = F.pad(prob, (0, nkb * b - n)).view(h_kv, -1, c1 - c0, b, nkb, b)
            mass[:, c0:c1] = prob.sum(dim=(1, 3, 5))
        return mass

    def select_prefill(self, ctx, q, k, v) -> BlockSelection:
        b = self.config.block_size
        mass = self.block_mass(ctx, q, k)
        h_kv = mass.shape[0]
        if self.config.shared_list:  # one top-k, its list expanded over the KV heads
            mass = mass.sum(0, keepdim=True)
        qb = ctx.q_start // b + torch.arange(mass.shape[1], device=q.device)
        kb = torch.arange(mass.shape[2], device=q.device)[None, :]
        causal, forced = kb <= qb[:, None], (kb == 0) | (kb == qb[:, None])
        budget = prefill_block_budget(self.layer_density, qb, (ctx.n - 1) // b, 2, b)
        top = (budget - torch.where(qb == 0, 1, 2)).clamp(min=0)
        mask = topk_mask(mass, top, causal.expand_as(mass), forced.expand_as(mass))
        return BlockSelection(indices_from_mask(mask).expand(h_kv, -1, -1), b)

    def select_decode(self, ctx, q, k, v) -> TokenSelection:
        h_kv, n, d = k.shape
        s = torch.einsum("hgd,hnd->hgn", q.float().view(h_kv, -1, d), k.float()) / math.sqrt(d)
        score = torch.softmax(s, -1).sum(1)  # [h_kv, n]
        top = scalar_budget(self.layer_density, n)
        newest = torch.arange(n, device=q.device) == n - 1
        mask = topk_mask(score, top - 1, torch.ones_like(score, dtype=torch.bool), newest.expand_as(score))
        return TokenSelection(indices_from_mask(mask, top), 1)


register(method_spec(Streaming, "StreamingLLM: sink tokens + sliding window (window = budget - sinks with --density)"))
register(method_spec(Oracle, "oracle top-k by exact attention mass (quadratic; for measurement)"))
