"""The method interface: a frozen config plus a backend that selects, then attends over the selection.

A method subclasses ``SparseMethod`` and implements ``select_prefill`` and/or ``select_decode`` for one
sequence of one layer; this class runs the dense layers, gathers each sequence's K/V from the cache,
attends over the selection with the reference path (the Triton kernels replace it on GPUs), and meters
the density really used. Per-sequence, per-layer state lives in ``SeqContext.state``, which is the KV
cache's metadata slot for that layer and sequence, so it is freed with the sequence. What a method reads
(``SeqContext``, the batched seams' ``DecodeView`` and ``PrefillView``) lives in ``methods.views``, the
density budget's arithmetic in ``methods.budget``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from raysparse.attention import AttentionBackend, causal_pairs, dense_attention
from raysparse.config import ModelConfig

# Triton on CUDA tensors, the PyTorch reference otherwise (same signatures, same results within tolerance).
from raysparse.kernels.dispatch import (
    block_sparse_attention,
    block_sparse_attention_varlen,
    paged_decode_attention,
    sparse_decode_attention,
)
from raysparse.kernels.formats import PackedBlockSelection
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.methods.budget import host_row_budget, prefill_floor
from raysparse.methods.selection import BlockSelection, TokenSelection, block_pairs, packed_block_pairs
from raysparse.methods.views import DecodeView, PrefillStep, PrefillView, SeqContext


@dataclass(frozen=True)
class MethodConfig:
    """Fields every method shares. ``density``: each sparse layer's budget as a fraction of its causal pairs, forced
    units (sinks, local window, diagonal block) inside it. Users give the whole model's (``--density``), which the
    registry's factory turns into this one (``budgeted_config``), spread over every layer (the paper's two dense
    layers, ``dense_layers``, are this class's default only), keeping it as ``target_density``. Prefill and decode
    each meet it."""

    density: float = 0.2
    dense_layers: tuple[int, ...] = (0, 1)
    block_size: int = 64
    # The whole-model ``--density`` the factory turned into ``density`` (None if given per layer); not a parameter.
    target_density: float | None = None

    def __post_init__(self) -> None:
        self.check_shared(self.density)

    def check_shared(self, density: float | None) -> None:
        """Validates the shared fields at ``density`` (None, where a config's density is optional: at 1.0)."""
        if not 0.0 < (density := 1.0 if density is None else density) <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {density}")
        if self.target_density is not None and not 0.0 < self.target_density <= 1.0:
            raise ValueError(f"target_density must be in (0, 1], got {self.target_density}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if isinstance(self.dense_layers, (str, bytes)) or not hasattr(self.dense_layers, "__iter__"):
            raise ValueError(f"dense_layers must be a list of layer indices, got {self.dense_layers!r}")
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))  # a list from the CLI stays hashable
        if any(isinstance(layer, bool) or not isinstance(layer, int) or layer < 0 for layer in self.dense_layers):
            raise ValueError(f"dense_layers must be non-negative layer indices, got {self.dense_layers}")


class SparseMethod(AttentionBackend):
    name = "sparse"
    config_cls: type[MethodConfig] = MethodConfig

    def __init__(self, model_cfg: ModelConfig, config: MethodConfig | None = None) -> None:
        super().__init__(model_cfg.num_layers)
        self.model_cfg = model_cfg
        self.config = config if config is not None else self.config_cls()
        self._seq_state: dict[int, dict[str, Any]] = {}
        # Set by the fidelity harness: called as tracer(ctx, q, k, v, selection, out) after each sparse
        # attention, so metrics see exactly what the method attended.
        self.tracer: Callable[..., None] | None = None
        self._first_selecting_layer: int | None = None  # ``_first_selecting``, found on first use
        # The density each sparse layer's rows get (None: no density budget); the registry's factory sets the
        # config's from the whole-model one (``budgeted_config``).
        density = getattr(self.config, "density", None)
        self.layer_density: float | None = density if density is not None and self.has_density_budget() else None

    @property
    def batched_decode(self) -> bool:
        """The method selects a whole decode batch at once (``decode_select``): fixed shapes, per-page
        state, no host reads, so the step can be captured in a CUDA graph."""
        return type(self).decode_select is not SparseMethod.decode_select

    @property
    def graph_decode(self) -> bool:
        # A tracer needs the per-sequence reference path: it sees each sequence's gathered K/V.
        return self.batched_decode and self.tracer is None

    def graph_prepare(self, rows: list[int], cache: KVCache) -> None:  # noqa: B027 - an optional hook
        """Host side, before each batched decode step: places per-row state for ``rows`` (the sequence of each
        row of the padded batch, -1 for padding) where ``decode_select`` reads it. The graph runner calls it
        before a replay; an eager batched step calls it itself. Methods with per-page state alone need nothing."""

    def account_graph_decode(self, ctx_lens: list[int], num_kv_heads: int) -> None:
        # One count per class of layer (``decode_layer_class``), not per layer: at 64 rows and 30 layers the
        # per-layer sum was 1920 host calls a step, longer than a sparse step's device time.
        memo: dict[Hashable, int] = {}
        for layer in range(self.model_cfg.num_layers):
            self._meter_decode(layer, ctx_lens, num_kv_heads, memo)

    def set_tracer(self, tracer: Callable[..., None] | None) -> bool:
        self.tracer = tracer
        return True

    def _meter_decode(self, layer: int, ctx_lens: list[int], num_kv_heads: int,
                      memo: dict[Hashable, int] | None = None) -> None:
        """Host-side density accounting of a batched decode step (the selection's size is a function of
        the length alone, so nothing is read back from the device). ``memo``: the step's counts by
        ``decode_layer_class``, shared by the layers of one step."""
        memo = {} if memo is None else memo
        cls = self.decode_layer_class(layer)
        if cls not in memo:
            dense = self.dense_decode_layer(layer)
            memo[cls] = sum(n if dense else self.decode_keys(layer, n) for n in ctx_lens)
        keys = memo[cls]
        self.meter.add(layer, float(keys * num_kv_heads), float(sum(ctx_lens) * num_kv_heads), decode=True)

    # ---- the density budget's floor ---------------------------------------------------------------
    def has_density_budget(self) -> bool:
        """Whether the config's ``density`` sets this instance's budget (PSAW's and ETF's schedules, or an
        explicit top-k, replace it)."""
        return getattr(type(self), "density_budget", True)

    def takes_density(self) -> bool:
        # PSAW's and ETF's schedules are their budget (``density_budget = False``); a config without a density
        # field has none (SpecAttn's top-p).
        flag = getattr(self, "density_budget", None)
        return bool(flag) if flag is not None else hasattr(self.config, "density")

    # What a method keeps whatever its budget; ``check_request`` says when a request's forced units alone would
    # attend more than the budget (the eval's settings refuse it; the engine serves it and reports the density).
    prefill_forced_blocks: int | None = None  # forced blocks of a prefill row (the diagonal included), if budgeted

    def decode_forced_keys(self, n: int) -> int | None:
        """Keys per KV head a sparse layer's decode row of n keys keeps whatever its budget (None: the decode has
        no density budget)."""
        return None

    def check_request(self, prompt_len: int, total_len: int) -> None:
        """Raises ValueError when ``--density`` cannot be met by a request of ``prompt_len`` prompt tokens decoded
        up to ``total_len`` keys: the forced units alone exceed the budget of its prefill or of a decode step."""
        d = self.layer_density
        if d is None:
            return
        forced = self.prefill_forced_blocks
        if forced is not None:
            floor = prefill_floor(prompt_len, forced, self.config.block_size)
            if floor > d * (1 + 1e-6):
                raise ValueError(density_floor_error(self, "prefill", prompt_len, floor))
        for n in range(prompt_len + 1, total_len + 1):
            keys = self.decode_forced_keys(n)
            if keys is None:
                break
            if keys > host_row_budget(d, n):
                raise ValueError(density_floor_error(self, "decode", n, keys / n))

    # ---- to implement ------------------------------------------------------------------------
    def select_prefill(self, ctx: SeqContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> BlockSelection:
        raise NotImplementedError(f"{self.name} has no prefill selection")

    def select_decode(self, ctx: SeqContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> TokenSelection:
        raise NotImplementedError(f"{self.name} has no decode selection")

    # What a prompt that starts from cached pages (the engine's prefix cache) needs of this method:
    # "pages": its state lives in the pages (K/V, ``page_pool``) or starts at decode, so nothing else;
    # "rebuilt": per-sequence prefill state, rebuilt from per-page state by the method; "none": the prefix's
    # K/V depend on more than its own tokens (e.g. on the prompt's length), so the prompt is recomputed.
    prefix_state: str = "pages"

    # ---- the batched seam (implement for the fast path) ------------------------------------------
    decode_unit: int = 1  # what ``decode_select``'s entries count: tokens (1) or blocks of that many tokens
    # The batched decode keeps per-row state that ``graph_prepare`` places and meters on the device (CIS):
    # a wrapper that borrows only ``decode_select`` (Delta) cannot drive it and stays per sequence.
    row_state: bool = False

    def update_state(self, layer: int, cache: KVCache, batch: BatchMeta) -> None:
        """Brings this layer's per-page state (``KVCache.page_pool``) up to date with the step's new tokens,
        whose K/V are already in the cache. Runs in prefill and decode, inside a captured decode step, so
        it must read only device tensors (``batch.slot_pages``, ``batch.slot_offsets``, the cache)."""

    def decode_select(self, layer: int, q: torch.Tensor, view: DecodeView) -> torch.Tensor:
        """The batch's decode selection: int32 ``[B, h_kv, W]`` ascending entries (``decode_unit``),
        SENTINEL-padded, with W fixed by the method's parameters and the page-width bucket
        (``view.width_tokens``) alone. No host reads: this runs inside a captured CUDA graph."""
        raise NotImplementedError(f"{self.name} has no batched decode selection")

    def decode_keys(self, layer: int, n: int) -> int:
        """Keys per KV head the batched selection attends at a context of n keys (host-side meter)."""
        raise NotImplementedError(f"{self.name} has no batched decode selection")

    def dense_decode_layer(self, layer: int) -> bool:
        """Layers whose decode attends every key (the dense layers, and any a method leaves dense in decode)."""
        return self.is_dense_layer(layer)

    def decode_layer_class(self, layer: int) -> Hashable:
        """Layers of one class attend the same number of keys at every length (``decode_keys``), so the meter
        counts a step once per class. By default the dense layers are one class and the sparse ones another; a
        method whose budget changes with depth says so here."""
        return self.dense_decode_layer(layer)

    def _decode_batched(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta) -> torch.Tensor:
        kv, blocks = cache.paged(layer, batch)
        if not self.is_dense_layer(layer):
            self.update_state(layer, cache, batch)
        if self.dense_decode_layer(layer):
            idx, unit = blocks, cache.page_size
        else:
            idx, unit = self.decode_select(layer, q, DecodeView(kv, batch, cache)), self.decode_unit
        if cache.tiers is not None and cache.tiers.covers(layer) and not self.dense_decode_layer(layer):
            # The selection named its keys over the host tier (per-page state by host page); the pages it needs are
            # brought into the device pool and the attend reads them there (``KVTiers.decode_attention``). A dense
            # layer of a sparse method reads every page: it keeps its K/V on the device (``device_layers``).
            out = cache.tiers.decode_attention(layer, q, kv, idx, unit)
        else:
            out, _ = paged_decode_attention(q, kv, idx, unit)
        self._meter_decode(layer, batch.ctx_lens, cache.num_kv_heads)  # thrown away under a capture
        return out

    @property
    def decodes_through_tiers(self) -> bool:
        """Whether this method's decode can read K/V through the device pool (``--kv-offload``): a batched decode
        selection names the keys a step reads before it reads them. The per-sequence path gathers every key."""
        return self.batched_decode

    @property
    def selection_reads_keys(self) -> bool:
        """Whether ``decode_select`` reads cached keys beyond the step's new ones (CIS's retrieval scores read every
        key): with the K/V tiers in separate host memory (GPUs) those are not on the device."""
        return False

    # ---- the batched prefill seam (implement for the fast path) -----------------------------------
    @property
    def batched_prefill(self) -> bool:
        """The method selects a whole prefill batch at once (``prefill_select``), and the shared varlen
        kernel attends over the paged cache in place. It needs a page to be a block (the kernel reads key
        blocks through the page table); otherwise, and under a tracer, the per-sequence path runs."""
        return type(self).prefill_select is not SparseMethod.prefill_select

    def prefill_select(self, layer: int, q: torch.Tensor, view: PrefillView) -> PackedBlockSelection:
        """The batch's packed prefill selection: per KV head, each query block of every sequence (in batch
        order) to its ascending key blocks, SENTINEL-padded (``PackedBlockSelection``). It reads the step's
        new keys (``view.new_keys``) and the method's state, never a sequence's gathered K/V."""
        raise NotImplementedError(f"{self.name} has no batched prefill selection")

    def prefill_selects(self, layer: int, batch: BatchMeta) -> bool:
        """Whether this (non-dense) layer's prefill of this step goes through ``prefill_select``; a method whose
        prefill is dense at some layers or steps (PSAW below its start layer, ETF where it freezes no row of the
        step) keeps those on the dense path."""
        return True

    def prefill_pairs(self, view: PrefillView, sel: PackedBlockSelection) -> torch.Tensor:
        """Causal pairs each sequence's rows attend under ``sel``, summed over KV heads: [batch] int64."""
        rows = view.qblocks(sel.block_size)
        pairs = packed_block_pairs(sel.indices, rows.qblock, rows.q_start, rows.n, sel.block_size)
        per_seq = torch.zeros(len(view.batch.seq_ids), dtype=torch.int64, device=pairs.device)
        return per_seq.index_add_(0, sel.qblock_seq.long(), pairs)

    def _prefill_batched(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta) -> torch.Tensor:
        view = self.prefill_view(layer, batch, cache)
        sel = self.prefill_select(layer, q, view)
        out, _ = block_sparse_attention_varlen(q, view.kv, sel, view.cu_q_dev)
        h_kv = cache.num_kv_heads
        attended = self.prefill_pairs(view, sel).tolist()  # one sync
        for n_q, n, pairs in zip(batch.q_lens, batch.ctx_lens, attended, strict=True):
            self.meter.add(layer, float(pairs), float(causal_pairs(n_q, n) * h_kv), decode=False)
        return out

    # ---- overridable per-sequence attention ----------------------------------------------------
    def is_dense_layer(self, layer: int) -> bool:
        return layer in self.config.dense_layers

    def sparse_layers(self) -> tuple[int, ...]:
        """The layers this method selects in (every layer not kept dense), ascending."""
        return tuple(i for i in range(self.model_cfg.num_layers) if not self.is_dense_layer(i))

    def prefill_seq(self, ctx: SeqContext, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Returns the output [n_q, h, d] and the attended causal pairs summed over KV heads."""
        sel = self.select_prefill(ctx, q, k, v)
        out, _ = block_sparse_attention(q, k, v, sel)
        if self.tracer is not None:
            self.tracer(ctx, q, k, v, sel, out)
        return out, float(block_pairs(sel.indices, sel.block_size, ctx.q_start, ctx.n).sum())

    def decode_seq(self, ctx: SeqContext, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> tuple[torch.Tensor, float]:
        """q: [h, d]. Returns the output [h, d] and the attended keys summed over KV heads."""
        sel = self.select_decode(ctx, q, k, v)
        out, _ = sparse_decode_attention(q, k, v, sel)
        if self.tracer is not None:
            self.tracer(ctx, q, k, v, sel, out)
        return out, self.attended_keys(ctx, sel)

    def attended_keys(self, ctx: SeqContext, sel: TokenSelection) -> float:
        """Keys a decode selection attends, summed over KV heads (what the density meter counts)."""
        return float(sel.to_tokens(ctx.n).counts.sum())

    def dense_seq(self, ctx: SeqContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Hook for dense layers (Sketch&Walk records sketches there); plain SDPA by default."""
        return dense_attention(q, k, v)

    # ---- the AttentionBackend seam -------------------------------------------------------------
    def _run(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta, decode: bool) -> torch.Tensor:
        out = torch.empty_like(q)
        h_kv = cache.num_kv_heads
        for i, sid in enumerate(batch.seq_ids):
            lo, hi = batch.cu_q[i], batch.cu_q[i + 1]
            n = batch.ctx_lens[i]
            k, v = cache.gather(layer, batch, i)
            ctx = SeqContext(layer, sid, n - (hi - lo), n, cache.metadata[layer].setdefault(sid, {}),
                             self._seq_state.setdefault(sid, {}), batch.prompt_end(i))
            causal = causal_pairs(hi - lo, n) * h_kv
            if self.is_dense_layer(layer):
                out[lo:hi] = self.dense_seq(ctx, q[lo:hi], k, v)
                attended = float(causal)
            elif decode:
                o, attended = self.decode_seq(ctx, q[lo], k, v)
                out[lo] = o
            else:
                out[lo:hi], attended = self.prefill_seq(ctx, q[lo:hi], k, v)
            self.meter.add(layer, attended, causal, decode=decode)
        return out

    def prefill(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta) -> torch.Tensor:
        if self.batched_decode and not self.is_dense_layer(layer):
            self.update_state(layer, cache, batch)  # the decode steps read it
        if (self.batched_prefill and self.tracer is None and not self.is_dense_layer(layer)
                and cache.page_size == self.config.block_size and self.prefill_selects(layer, batch)):
            return self._prefill_batched(layer, q, cache, batch)
        return self._run(layer, q, cache, batch, decode=False)

    def begin_step(self, cache: KVCache, batch: BatchMeta) -> None:
        """The step's plans; for a batched prefill step the packed geometry its views share (``PrefillStep``);
        for an eager batched decode step (no graph runner placed the rows) the rows' per-row state placed
        (``graph_prepare``), all before the layers read them."""
        super().begin_step(cache, batch)
        if batch.is_prefill and self.batched_prefill and self.tracer is None:
            step = PrefillStep.of(batch, cache.device, (self.config.block_size,))
            batch.extras[("prefill-step", id(self))] = step
        if self._places_rows(batch):
            self.graph_prepare(list(batch.seq_ids), cache)

    def prefill_view(self, layer: int, batch: BatchMeta, cache: KVCache) -> PrefillView:
        """This layer's ``PrefillView`` over the step's geometry built by ``begin_step`` (a layer driven on its
        own builds its own)."""
        return PrefillView.of(layer, batch, cache, batch.extras.get(("prefill-step", id(self))))

    def _places_rows(self, batch: BatchMeta) -> bool:
        """An eager batched decode step with a selecting layer: its rows are placed before the layers."""
        return (not batch.is_prefill and self.batched_decode and self.tracer is None
                and not batch.extras.get("graph") and self._first_selecting() >= 0)

    def decode(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta) -> torch.Tensor:
        if self.batched_decode and self.tracer is None:
            if layer == self._first_selecting() and not self.planned(batch)[0] and self._places_rows(batch):
                self.graph_prepare(list(batch.seq_ids), cache)  # a layer driven on its own: no plan placed them
            if cache.tiers is not None:  # this class's own path, whose attend the tier serves (not a subclass's)
                return SparseMethod._decode_batched(self, layer, q, cache, batch)
            return self._decode_batched(layer, q, cache, batch)
        return self._run(layer, q, cache, batch, decode=True)

    def _first_selecting(self) -> int:
        """The first layer whose decode selects (the rows are placed before it); fixed by the config, so found
        once rather than at every layer of every step."""
        if self._first_selecting_layer is None:
            self._first_selecting_layer = next(
                (i for i in range(self.model_cfg.num_layers) if not self.dense_decode_layer(i)), -1)
        return self._first_selecting_layer

    def release(self, seq_id: int) -> None:
        self._seq_state.pop(seq_id, None)


def density_floor_error(method: SparseMethod, phase: str, n: int, floor: float) -> str:
    """The one-line refusal of a density its forced units exceed, with the least density that fits."""
    cfg = method.model_cfg
    dense = cfg.num_layers - len(method.sparse_layers())
    need = (dense + floor * (cfg.num_layers - dense)) / cfg.num_layers
    asked = method.config.target_density if method.config.target_density is not None else method.config.density
    return (f"density {asked} is below what {method.name}'s forced units alone attend in the "
            f"{phase} of {n} tokens (its sink, local and diagonal units, and {dense} dense layers): at least "
            f"{need:.4f}; raise the density or use a longer context")
