"""Sketch&Walk: block selection from sketched block scores, for prefill and decode (docs/methods/sketch_walk.md).
By default it does not walk across layers: each layer selects by its own scores (``walk="one-hop"``), which kept
the retrieval tasks on the default model where every walk lost them; the published walk (``walk="product"``) and a
rollout (``walk="rollout"``) are options.
``SketchWalk`` holds the method's seams and its batched state; the per-sequence path, the plain PyTorch reference
(sketches, scores, selection), is ``sketch_walk_reference``'s ``ReferenceSelection``, and the walk across layers
``sketch_walk_walk``'s.

Per sparse layer k and sequence: Q_avg / K_avg (head means) are reduced to block means, sketched with a
fixed SRHT H_d (d x r), A_hat = Q~ K~^T / sqrt(r) under the block-causal mask, W^k = row-softmax(A_hat)**s,
R^k = R^{k-1} W^k (R^0 = W at the first sparse layer), and each query block attends the top key blocks
of its row of R^k plus the sink and diagonal blocks, on the original per-head Q, K, V.

Defaults (each measured: docs/methods/sketch_walk.md): walk one-hop, token_query last, heads pair-lse, sub_blocks
8, decode_unit part, decode_query group (every query head's own scoring, ``decode_query="heads"``, is an option:
more accurate, and it costs the decode's saving); the published form is walk="product", token_query="never" with
``GRAPH_DECODE`` (heads="mean", sub_blocks=1, decode_unit="block").
The batched decode seam (``decode_select``, captured in CUDA graphs): its state and selection are in
``sketch_walk_rows`` for ``GRAPH_DECODE``'s scoring and ``sketch_walk_parts`` for the paired modes
(the parameter ``graph_paired`` False decodes them per sequence).

The batched prefill seam (``prefill_select``): for one-hop with per-KV-head sketches (the default; heads
pair-lse, pair or kv) ``sketch_walk_batch`` selects the whole step in launches that do not grow with the
batch, from block sums kept per page (a sequence's metadata then holds only ``n``; per-sequence readers
rebuild the dict layout from its pages, ``sketch_walk_prefix.adopt_prefix``). The walks that chain layers
(rollout, product) and the published head mean select per sequence (``prefill_select_per_sequence``, also the
batched path's test oracle).

Where the method departs from the published one, with the measurements behind each, and the state layout of
every mode are in docs/methods/sketch_walk.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from raysparse.attention import ShardContext, StepCollectives
from raysparse.config import ModelConfig
from raysparse.kernels.formats import PackedBlockSelection
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.methods.base import SparseMethod
from raysparse.methods.hadamard import SRHT, derive_seed
from raysparse.methods.registry import method_spec, register
from raysparse.methods.sketch_walk_batch import StepRows, batched_mode, prefill_select_batched, step_rows
from raysparse.methods.sketch_walk_config import SketchWalkConfig
from raysparse.methods.sketch_walk_parts import PartsDecode
from raysparse.methods.sketch_walk_reference import ReferenceSelection
from raysparse.methods.sketch_walk_rows import RowsDecode
from raysparse.methods.views import DecodeView, PrefillView

log = logging.getLogger(__name__)


class SketchWalk(ReferenceSelection, SparseMethod):
    name = "sketch_walk"
    config_cls = SketchWalkConfig
    config: SketchWalkConfig

    def __init__(self, model_cfg: ModelConfig, config: SketchWalkConfig | None = None) -> None:
        super().__init__(model_cfg, config)
        cfg = self.config
        self.srht = SRHT(model_cfg.head_dim, cfg.sketch_dim, derive_seed(cfg.seed, model_cfg.head_dim))
        sparse = [layer for layer in range(model_cfg.num_layers) if not self.is_dense_layer(layer)]
        self.first_sparse: int | None = sparse[0] if sparse else None
        # Tensor parallelism: a SUM all-reduce over the shards (docs/methods/sketch_walk.md); None on one device.
        self.head_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def bind(self, shard: ShardContext) -> None:
        """Under tensor parallelism the walk coordinator: the block sums are SUM-all-reduced every layer, so
        every shard holds identical sketches, walk state and selections. With the shard's cache, the batched
        decode's fixed-shape state (``build_batched``)."""
        if shard.all_reduce is not None:
            self.head_reduce = shard.all_reduce
        if shard.cache is not None:
            self._cache = shard.cache  # the reference prefill keeps its per-page sums there too (prefix cache)
            self.build_batched(shard.cache, shard.max_batch,
                               max_positions=self.model_cfg.max_position_embeddings)

    # ---- the batched seam -----------------------------------------------------------------------
    # Two state layouts (docs/methods/sketch_walk.md): the paired scorings keep key part sums per KV page
    # (``sketch_walk_parts``, shared by every instance with the same sketch); the head-mean scoring keeps a slot of
    # sums and walk rows per running sequence (``sketch_walk_rows``: row state, placed by ``graph_prepare``).
    batch_decoder: Any = None
    _cache: KVCache | None = None

    def build_batched(self, cache: KVCache, max_batch: int | None,
                      state_budget_bytes: int = 8 << 30, max_positions: int | None = None) -> bool:
        """Allocates the batched decode's state over ``cache``; returns whether this instance now decodes on the
        batched seam. It does not where its state would exceed ``state_budget_bytes`` or the device has no room
        left (the log says so; the per-sequence decode then runs, much slower), where a page is not a block,
        and for a head-mean instance without a graph runner (``max_batch`` None: its slots are sized by it)."""
        self.batch_decoder = None
        if cache.page_size != self.config.block_size:
            return False
        if self.config.heads != "mean":
            if not self.config.graph_paired or not PartsDecode.supports(self.config):
                return False
            shared = PartsDecode.state_key(self) in cache.shared_state  # no new allocation
            need = 0 if shared else PartsDecode.state_bytes(self, cache.num_pages, cache.num_kv_heads)
            return self._build(lambda: PartsDecode(self, cache), need, state_budget_bytes)
        if max_batch is None or self.config.sub_blocks > 1:  # the head-mean rows score whole blocks
            return False
        limit = cache.num_pages if max_positions is None else min(cache.num_pages, -(-max_positions // cache.page_size))
        need = (max_batch + 1) * RowsDecode.state_bytes(self, limit)
        return self._build(lambda: RowsDecode(self, cache, max_batch, limit), need, state_budget_bytes)

    def _build(self, make: Callable[[], Any], need: int, budget: int) -> bool:
        # The state is allocated when a method is first used, after the KV cache took its memory: where the
        # device has no room left, the method decodes per sequence rather than failing the request that asked.
        if need > budget:
            log.warning("sketch_walk: the batched decode's state (%.2f GB) exceeds its budget (%.2f GB): decoding "
                        "per sequence, much slower", need / 2**30, budget / 2**30)
            return False
        try:
            self.batch_decoder = make()
        except torch.OutOfMemoryError:
            log.warning("sketch_walk: no device memory left for the batched decode's state (%.2f GB): decoding per "
                        "sequence, much slower; a smaller KV cache (--kv-cache-tokens) leaves room for it",
                        need / 2**30)
            return False
        return True

    @property
    def batched_decode(self) -> bool:  # type: ignore[override]
        return self.batch_decoder is not None

    @property
    def row_state(self) -> bool:  # type: ignore[override]
        return self.config.heads == "mean"

    def decode_collectives(self, batch: int) -> StepCollectives | None:
        # The walk coordinator: a batched step all-reduces [2, batch, r] sketch sums at every sparse layer.
        if not self.batched_decode:
            return None
        return StepCollectives((2, batch, self.srht.sketch_dim), len(self.sparse_layers()))

    @property
    def decode_unit(self) -> int:  # type: ignore[override]
        cfg = self.config
        return cfg.block_size // cfg.sub_blocks if cfg.decode_unit == "part" else cfg.block_size

    def graph_prepare(self, rows: list[int], cache: KVCache) -> None:
        """A sequence's prefill state moves into the batched decode's (its pages' part sums, or a slot) on its
        first decode step; the per-sequence state is dropped then."""
        if self.batch_decoder is not None:
            self.batch_decoder.prepare(rows, cache)

    def decode_select(self, layer: int, q: torch.Tensor, view: DecodeView) -> torch.Tensor:
        """One list per row, the same for every KV head (the heads are combined or averaged before the top-k);
        the step's new key enters the sums inside this call, in the scoring launch, so ``update_state`` has
        nothing to do."""
        idx, unit = self.batch_decoder.layer_select(layer, q, view.cache, view.batch, view.kv.page_table,
                                              view.kv.seqlens)
        assert unit == self.decode_unit
        return idx[:, None, :].expand(-1, view.cache.num_kv_heads, -1)  # the kernel reads the heads' stride 0

    def decode_keys(self, layer: int, n: int) -> int:
        return self.batch_decoder.row_keys(n)

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        if self.batch_decoder is not None:
            self.batch_decoder.release(seq_id)

    # ---- SparseMethod ---------------------------------------------------------------------------
    @property
    def prefill_forced_blocks(self) -> int:  # type: ignore[override]
        return self.config.local_blocks + 1  # the sink block and the local ones (the diagonal included)

    def decode_forced_keys(self, n: int) -> int:
        B = self.config.block_size
        nb = -(-n // B)
        return sum(min(B, n - j * B) for j in {0, *range(max(0, nb - self.config.local_blocks), nb)})

    # Tests set it to run the per-sequence reference where the batched selection would serve.
    prefill_reference = False

    def plan_layers(self, cache: KVCache, batch: BatchMeta) -> StepRows | None:
        """A batched prefill step's layout (``sketch_walk_batch.StepRows``: row and part indices, counts,
        budgets, masks), from the lengths alone: built once, before the layers. None off that path."""
        cfg = self.config
        if (not batch.is_prefill or not batched_mode(cfg) or self.prefill_reference or self.tracer is not None
                or cache.page_size != cfg.block_size or not self.sparse_layers()):
            return None
        return step_rows(self, cache, batch)

    def prefill_select(self, layer: int, q: torch.Tensor, view: PrefillView) -> PackedBlockSelection:
        """The batch's selection: ``sketch_walk_batch`` (launches that do not grow with the batch) for the modes
        it serves (one-hop, per-KV-head sketches: the default), else per sequence."""
        if batched_mode(self.config) and not self.prefill_reference:
            return prefill_select_batched(self, layer, q, view)
        return self.prefill_select_per_sequence(layer, q, view)

    # Prefix caching: rebuilt, from per-page sums every prefill keeps (``sketch_walk_prefix``).
    prefix_state = "rebuilt"

    def state_bytes(self, n: int) -> dict[str, int]:
        """Bytes of Sketch&Walk state per sequence of n tokens (all sparse layers), for capacity planning."""
        b = -(-n // self.config.block_size)
        layers = len(self.sparse_layers())
        h_kv, cfg = self.model_cfg.num_kv_heads, self.config
        hs = h_kv if cfg.heads == "kv" else 1  # score heads: walks and A_hat
        sums = (1 + cfg.sub_blocks) * (1 if cfg.heads == "mean" else h_kv)  # qs rows + ks rows per block
        return {"a_hat": 2 * b * b * layers * hs, "sketch_sums": 4 * self.srht.sketch_dim * b * layers * sums,
                "decode_walk_row": 4 * b * hs}


register(method_spec(SketchWalk, "Sketch&Walk: SRHT-sketched block scores walked across layers (prefill + decode)"))
