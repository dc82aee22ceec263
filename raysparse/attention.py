"""The attention seam: the one interface the model calls for prefill and for decode.

The model projects Q/K/V, applies RoPE, writes the new K/V into the cache and then hands the layer
index, the new queries and the batch metadata to an ``AttentionBackend``. Everything a sparse method
needs (the cached K/V, its per-layer metadata, the sequences' lengths) is reachable from there, so
methods plug in without touching the model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from raysparse.kernels import cpu_prefill
from raysparse.kernels.dispatch import paged_dense_decode
from raysparse.kernels.formats import PagedKV
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.runtime_config import RuntimeConfig


@dataclass
class DensityMeter:
    """Counts attended and causal (query, key) pairs per layer, so every method reports real density.

    Decode steps are also counted on their own: a decode-only method runs a dense prefill, and its
    whole-run density would otherwise be dominated by the prompt.
    """

    num_layers: int
    attended: list[float] = field(default_factory=list)
    causal: list[float] = field(default_factory=list)
    decode_attended: float = 0.0
    decode_causal: float = 0.0

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.attended = [0.0] * self.num_layers
        self.causal = [0.0] * self.num_layers
        self.decode_attended = self.decode_causal = 0.0

    def add(self, layer: int, attended: float, causal: float, decode: bool = False) -> None:
        self.attended[layer] += attended
        self.causal[layer] += causal
        if decode:
            self.decode_attended += attended
            self.decode_causal += causal

    def per_layer(self) -> list[float]:
        return [a / c if c else 1.0 for a, c in zip(self.attended, self.causal, strict=True)]

    def overall(self) -> float:
        c = sum(self.causal)
        return sum(self.attended) / c if c else 1.0

    def prefill_overall(self) -> float | None:
        """Density of the prefill calls alone (None when there were none)."""
        c = sum(self.causal) - self.decode_causal
        return (sum(self.attended) - self.decode_attended) / c if c > 0 else None

    def decode_overall(self) -> float | None:
        """Density of the decode steps alone (None when there were none)."""
        return self.decode_attended / self.decode_causal if self.decode_causal else None


def causal_pairs(q_len: int, ctx_len: int) -> int:
    """Number of causal (query, key) pairs for q_len new queries ending at ctx_len."""
    start = ctx_len - q_len
    return q_len * start + q_len * (q_len + 1) // 2


@dataclass(frozen=True)
class ShardContext:
    """What a shard offers the backends it creates (``AttentionBackend.bind``), so a method takes what it
    needs without the shard knowing which method it is.

    - ``cache``: the shard's KV cache (None where backends are built outside a shard, e.g. the distributed
      eval's per-sequence generators).
    - ``max_batch``: the largest batch the shard's CUDA-graph runner captures; None when it replays no graphs.
    - ``runtime``: the engine's runtime switches (``EngineConfig.runtime``).
    - ``all_reduce``: the tensor-parallel group's SUM all-reduce (in place, returns its input); None on a
      single shard. Whatever a method must agree on across shards goes through it.
    """

    cache: KVCache | None = None
    max_batch: int | None = None
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass(frozen=True)
class StepCollectives:
    """What a method's decode step all-reduces across the tensor-parallel group beyond the model's own
    reductions: ``count`` SUM all-reduces of an fp32 tensor of ``shape``, each through ``ShardContext.all_reduce``."""

    shape: tuple[int, ...]
    count: int


class AttentionBackend(ABC):
    """One layer's attention for a packed batch. Outputs are [T, num_heads, head_dim].

    Generic code (the model, the shard executor, the graph runner, the eval) reaches a backend only through
    what this class declares: ``prefill`` and ``decode``, and optional hooks whose defaults are right for a
    method that has no use for them; a method overrides the hooks it needs.
    """

    name: str = "abstract"
    # Decode steps are draft-then-verify rounds (SpecAttn): generators drive the backend with
    # ``specattn.SpecAttnGenerator`` and the eval verifies in chunks, instead of one decode step per token; the
    # shards verify an engine's rounds through ``verify_round``.
    speculative: bool = False
    # Decode reads lengths and pages from device tensors only, so ``raysparse.decode_graphs`` may capture and
    # replay its steps; such a backend prepares each replay (``graph_prepare``) and accounts its density
    # (``account_graph_decode``).
    graph_decode: bool = False

    def __init__(self, num_layers: int) -> None:
        self.meter = DensityMeter(num_layers)

    @abstractmethod
    def prefill(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta) -> torch.Tensor:
        """q: [T, num_heads, head_dim] for the new tokens; their K/V are already in ``cache``."""

    @abstractmethod
    def decode(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta) -> torch.Tensor:
        """q: [num_seqs, num_heads, head_dim], one new token per sequence."""

    # ---- the layers' plan -----------------------------------------------------------------------
    # As FlashInfer's wrappers plan before they run: what every layer of one step shares (budgets, row lists,
    # masks built from the batch's lengths) is built once, before the model's layers, by ``plan_layers``; each
    # layer's ``prefill`` / ``decode`` reads it (``layer_plan``) instead of building it at the step's first
    # layer and caching it there.
    def plan_layers(self, cache: KVCache, batch: BatchMeta) -> Any:
        """This backend's state for the step ``batch``, shared by every layer of it; None (the default) where
        it needs none. Called once per step before the layers (``begin_step``); inside a captured decode step
        it is captured with the step, so it reads the batch's device tensors, not its host lists."""
        return None

    def begin_step(self, cache: KVCache, batch: BatchMeta) -> None:
        """Plans the step for this backend and every backend it wraps; the model's forward calls it once per
        step, before its first layer."""
        for b in (self, *self.wrapped_backends()):
            batch.extras[("plan", id(b))] = b.plan_layers(cache, batch)

    def layer_plan(self, cache: KVCache, batch: BatchMeta) -> Any:
        """The plan ``begin_step`` built for this step (``plan_layers``'s). A layer driven on its own, outside a
        model's forward (a test of one layer), plans the step here first."""
        key = ("plan", id(self))
        if key not in batch.extras:
            batch.extras[key] = self.plan_layers(cache, batch)
        return batch.extras[key]

    def planned(self, batch: BatchMeta) -> tuple[bool, Any]:
        """(Whether this step was planned for this backend, by ``begin_step`` or ``layer_plan``; the plan): a hook
        without the cache (``frozen_rows``) reads the plan this way, and a layer driven on its own, unplanned,
        does the plan's work itself."""
        key = ("plan", id(self))
        return key in batch.extras, batch.extras.get(key)

    def release(self, seq_id: int) -> None:  # noqa: B027 - an optional hook, not abstract
        """Drops any per-sequence state the backend keeps outside the cache."""

    def bind(self, shard: ShardContext) -> None:  # noqa: B027 - an optional hook, not abstract
        """Called once by the shard that created this backend, before its first step: a method takes from
        ``shard`` what it needs (a graph decode path over the cache, the group's all-reduce). Most need
        nothing."""

    def check_request(self, prompt_len: int, total_len: int) -> None:  # noqa: B027 - an optional hook
        """Raises ValueError where this backend cannot serve a request of ``prompt_len`` prompt tokens decoded up
        to ``total_len`` keys as configured (a density its forced units exceed); most accept every length."""

    def stats_dict(self) -> dict[str, Any] | None:
        """The method's own statistics beyond density (e.g. speculative acceptance), reported by the shard
        per method key; None when it keeps none."""
        return None

    def wrapped_backends(self) -> tuple[AttentionBackend, ...]:
        """The backends this one wraps and calls from its own calls (Delta wraps its base): the shard binds them
        too. None by default."""
        return ()

    def frozen_rows(self, layer: int, batch: BatchMeta) -> torch.Tensor | None:
        """Early token freezing: bool [T] of the rows whose hidden state is carried unchanged through ``layer``
        (their K/V are still projected and cached; the backend decides what they attend, usually nothing), or
        None where every row runs the layer (the default)."""
        return None

    def decode_collectives(self, batch: int) -> StepCollectives | None:
        """What a decode step of ``batch`` rows all-reduces across the shards for the method's own selection
        (its cost is measured apart from the step's); None, the default, where the shards select alike without
        collectives of their own."""
        return None

    def graph_prepare(self, rows: list[int], cache: KVCache) -> None:  # noqa: B027 - an optional hook
        """Host side, before each replayed decode step: places the backend's per-row state for ``rows`` (the
        sequence of each row of the padded batch, -1 for padding) where the captured step reads it. Backends
        whose decode reads the cache's pages alone need nothing."""

    def account_graph_decode(self, ctx_lens: list[int], num_kv_heads: int) -> None:
        """Meters a replayed decode step over rows of ``ctx_lens`` keys (a replay runs no host code of the
        backend's own); only backends with ``graph_decode`` are replayed."""
        raise NotImplementedError(f"{type(self).__name__} does not decode from CUDA graphs")

    def takes_density(self) -> bool:
        """Whether ``--density`` sets this backend's budget (the eval sweeps densities for these alone); a
        method whose budget is a schedule or a top-p says False."""
        return True

    def set_tracer(self, tracer: Callable[..., None] | None) -> bool:
        """Installs ``tracer``, called as tracer(ctx, q, k, v, selection, out) after each sparse attention, so
        the eval's fidelity metrics see what the method attended (None removes it). Returns False, installing
        nothing, where the backend makes no selection to trace (the default)."""
        return False

    def verify_round(self, model: Any, cache: KVCache, seq_ids: list[int], tokens: list[list[int]],
                     message: bytes, record_stats: bool) -> list[list[int]]:
        """One draft-then-verify round on this shard (``ShardExecutor.verify``), for a backend with
        ``speculative``: ``message`` is what the engine's draft actor proposed for ``seq_ids``; returns each
        sequence's accepted tokens plus the verifier's own next one, ``record_stats`` on one rank of a group
        only. A backend without verification rounds (the default) refuses."""
        raise TypeError(f"method {self.name!r} has no verification rounds")

    def reset_stats(self) -> None:  # noqa: B027 - an optional hook, not abstract
        """Zeroes the method's own run-wide statistics (the eval does before each item)."""

    def item_sums(self) -> dict[str, Any]:
        """The method's own statistics since ``reset_stats`` as sums additive over an eval's items and a group's
        shards, by kind: ``spec`` (SpecAttn's rounds and KV reads), ``cis`` (CIS's retrievals and head steps per
        layer), ``delta`` (Delta's fitted correction, ``fit_sums``). Empty by default."""
        return {}


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal attention of q [n_q, h, d] over k, v [h_kv, n_k, d]; queries are the last n_q positions.

    GQA is native: SDPA's ``enable_gqa`` broadcasts KV heads instead of materialising repeats.
    """
    n_q, n_k = q.shape[0], k.shape[1]
    if n_q == 1 and q.is_cuda:
        return _decode_attention(q, k, v, scale)
    if n_q > 1 and not q.is_cuda:
        k, v = k.to(q.dtype), v.to(q.dtype)
        if cpu_prefill.supported(q, k, v):
            return cpu_prefill.causal_attention_cpu(q, k, v, scale)
        if n_q < n_k:
            return _chunk_attention_cpu(q, k, v, scale)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, h, n_q, d]
    kh, vh = k.unsqueeze(0), v.unsqueeze(0)
    if n_q == 1:
        mask, causal = None, False
    elif n_q == n_k:
        mask, causal = None, True
    else:
        rows = torch.arange(n_k - n_q, n_k, device=q.device)[:, None]
        mask, causal = rows >= torch.arange(n_k, device=q.device)[None, :], False
    out = F.scaled_dot_product_attention(
        qh, kh.to(q.dtype), vh.to(q.dtype), attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def _chunk_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """A prompt chunk's n_q queries (the last of n_k positions) on the CPU: the earlier keys attended with no
    mask (each KV head's query heads as one block of rows over its keys, no repeat), the chunk's own keys
    causally, by two calls of the fused CPU flash attention merged by their log-sum-exp. One call with a
    boolean mask over every key costs that kernel a third more, and the mask itself is n_q x n_k."""
    n_q, h, d = q.shape
    h_kv, n_k = k.shape[0], k.shape[1]
    g, p = h // h_kv, n_k - n_q
    k, v = k.to(q.dtype), v.to(q.dtype)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    heads = q.view(n_q, h_kv, g, d).permute(1, 2, 0, 3)  # [h_kv, g, n_q, d]
    o1, l1 = op(heads.reshape(1, h_kv, g * n_q, d), k[None, :, :p], v[None, :, :p], scale=scale)
    own_k = k[:, p:, None].expand(h_kv, n_q, g, d).transpose(1, 2).reshape(1, h, n_q, d)
    own_v = v[:, p:, None].expand(h_kv, n_q, g, d).transpose(1, 2).reshape(1, h, n_q, d)
    o2, l2 = op(heads.reshape(1, h, n_q, d), own_k, own_v, is_causal=True, scale=scale)
    l1, l2 = l1.reshape(h, n_q, 1).float(), l2.reshape(h, n_q, 1).float()
    top = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - top), torch.exp(l2 - top)
    out = (o1.reshape(h, n_q, d).float() * w1 + o2.reshape(h, n_q, d).float() * w2) / (w1 + w2)
    return out.to(q.dtype).transpose(0, 1)


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """One query row per head over every key, the KV group's heads batched against one K/V read.

    On GPUs SDPA picks cuDNN for a single query, which re-plans for every new key length (about 7 ms of
    host time per call, measured on an H200), or repeats K/V per query head; three GEMV-like kernels read
    K and V once each instead."""
    h, d = q.shape[1], q.shape[2]
    h_kv = k.shape[0]
    qg = q[0].view(h_kv, h // h_kv, d)
    s = torch.bmm(qg, k.to(q.dtype).transpose(1, 2)).float() * (scale if scale is not None else d ** -0.5)
    p = torch.softmax(s, dim=-1).to(q.dtype)
    return torch.bmm(p, v.to(q.dtype)).view(1, h, d)


class DenseAttention(AttentionBackend):
    """Exact causal attention (SDPA) over each sequence's cached K/V."""

    name = "dense"
    graph_decode = True  # decode reads lengths and pages from device tensors only (raysparse.decode_graphs)

    def account_graph_decode(self, ctx_lens: list[int], num_kv_heads: int) -> None:
        keys = float(sum(ctx_lens) * num_kv_heads)
        for layer in range(self.meter.num_layers):
            self.meter.add(layer, keys, keys, decode=True)

    def prefill(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta) -> torch.Tensor:
        out = torch.empty_like(q)
        ones = [i for i, n in enumerate(batch.q_lens) if n == 1]
        if len(ones) > 1 or (ones and batch.ctx_lens[ones[0]] > 1):
            # One-token rows (a mixed step's decode rows) are decode rows: the paged decode over their pages in
            # place, all at once, instead of a gather of each one's whole K/V for a one-row attend.
            kv, blocks = cache.paged(layer, batch)
            rows = torch.tensor(ones, device=q.device)
            sub = PagedKV(kv.k, kv.v, kv.page_table[rows], kv.seqlens[rows],
                          None if kv.host_rows is None else tuple(kv.host_rows[i] for i in ones))
            out[[batch.cu_q[i] for i in ones]] = paged_dense_decode(q[[batch.cu_q[i] for i in ones]], sub,
                                                                    blocks[rows])
        else:
            ones = []
        for i in range(batch.num_seqs):
            if not ones or batch.q_lens[i] != 1:
                k, v = cache.gather(layer, batch, i)
                lo, hi = batch.cu_q[i], batch.cu_q[i + 1]
                out[lo:hi] = dense_attention(q[lo:hi], k, v)
            pairs = causal_pairs(batch.q_lens[i], batch.ctx_lens[i]) * cache.num_kv_heads
            self.meter.add(layer, pairs, pairs, decode=not batch.is_prefill)
        return out

    def decode(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta) -> torch.Tensor:
        # Every sequence's whole block list over its pages, read in place: one split-K kernel on GPUs (a decode
        # step's host time is what bounds it), each sequence's runs of consecutive pages as views on CPUs.
        kv, blocks = cache.paged(layer, batch)
        out = paged_dense_decode(q, kv, blocks)
        for n in batch.ctx_lens:
            self.meter.add(layer, n * cache.num_kv_heads, n * cache.num_kv_heads, decode=True)
        return out
