"""Delta attention (SPEC section 2): a prefill correction on top of any registered sparse prefill.

For one sequence: O_sparse = the base method's ``prefill_seq`` output; the rows R = {i : i mod gamma == 0}
(absolute positions) are computed densely by ``strided_dense_attention`` (query-sparse, key-dense);
Delta[j] = O_dense[j gamma] - O_sparse[j gamma] and O[i] = O_sparse[i] + Delta[floor(i / gamma)], rows in
R being written as O_dense exactly; finally the last ``n mod gamma + max(tail, gamma)`` queries of the
prompt are computed densely and overwrite the result. ``mode="recompute"`` only swaps in the rows of R
(and the dense tail); ``mode="sparse-only"`` returns O_sparse. Decode is the base method's decode.

Choices where SPEC is silent:
- ``density``: unset by default, so the base keeps its own default (streaming: sinks 64 + window 2048);
  when set it is forwarded to the base as the base's budget (the whole model's, which the base turns into its
  sparse layers' and checks requests against). Decode is the base's, so it meets the density; the prefill's
  dense rows (below) come on top of the base's, so Delta's prefill attends more than the density asked: the
  reported density is the real one, base plus dense rows, so compare methods at the reported density.
  ``dense_layers`` and ``block_size`` are forwarded too; ``base_params`` (dict or pairs) override all three.
- Density accounting counts the union: attended = base pairs + sum over the dense rows D of
  (causal keys of the row - keys the base already attended in that row), the latter read from the base's
  BlockSelection (captured through the tracer hook). A base that reports no BlockSelection falls back
  to min(base pairs + dense pairs, causal pairs), an upper bound.
- ``tail=0`` disables the dense tail (an ablation).
- Chunked prefill (q_start > 0): the tail is the last rows of the chunk (the chunk does not know whether
  it is the prompt's last), and rows before the chunk's first anchor use the Delta of their anchor from
  the previous chunk, kept in ``ctx.state``; without it they stay uncorrected.
- The tracer sees a ``DeltaSelection``: the base's BlockSelection plus which rows were computed densely.
- Prefix caching: none. The dense tail sits at the end of the prompt that computed a page, so a cached
  prefix's K/V depend on where that prompt ended; a prompt is always prefilled whole.

Measured on the default model (benchmarks/probe_delta.py --diagnose): Delta rests on the true correction
D(i) = O_dense(i) - O_sparse(i) of a row being close to its anchor's; on SmolLM2-135M at 2K tokens their
cosine is ~0.4 and reusing D(anchor) raises the output error of most layers (error after / before: 1.16
over a token-level sliding window as in the paper, 2.3 over the block-level streaming base, whose anchor
row i = 64 j is the first row of its query block and so has the smallest window of the block). The
correction therefore raises perplexity there; this is the formula as specified, not a defect of the code.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from raysparse.attention import causal_pairs, dense_attention
from raysparse.config import ModelConfig
from raysparse.kernels import dispatch
from raysparse.kernels.reference import strided_dense_attention  # noqa: F401 - re-exported
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.methods import baselines  # noqa: F401  - registers the default base, streaming
from raysparse.methods.base import DecodeView, MethodConfig, SeqContext, SparseMethod, method_spec
from raysparse.methods.registry import create_backend, register
from raysparse.methods.selection import SENTINEL, BlockSelection

MODES = ("delta", "recompute", "sparse-only")


@dataclass(frozen=True)
class DeltaSelection(BlockSelection):
    """What the tracer sees: the base's selection, and the rows (of this call) computed densely."""

    dense_rows: torch.Tensor  # bool [n_q]
    gamma: int
    mode: str


@dataclass(frozen=True)
class DeltaConfig(MethodConfig):
    density: float | None = None  # None: the base's own budget; set: forwarded to the base
    gamma: int = 64
    mode: str = "delta"
    tail: int = 128  # dense tail = n mod gamma + max(tail, gamma) queries; 0 disables it
    base: str = "streaming"
    base_params: Any = ()  # dict or (key, value) pairs for the base

    def __post_init__(self) -> None:
        if self.density is None:
            replace(self, density=1.0)  # validates the shared fields
        else:
            super().__post_init__()
        if isinstance(self.base_params, dict):
            object.__setattr__(self, "base_params", tuple(sorted(self.base_params.items())))
        object.__setattr__(self, "base_params", tuple((str(a), b) for a, b in self.base_params))
        if self.gamma < 1 or self.tail < 0:
            raise ValueError(f"need gamma >= 1 and tail >= 0, got {self.gamma}, {self.tail}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.base == "delta":
            raise ValueError("Delta cannot wrap itself")

    def tail_rows(self, n: int) -> int:
        return n % self.gamma + max(self.tail, self.gamma) if self.tail else 0


class Delta(SparseMethod):
    name = "delta"
    config_cls = DeltaConfig
    config: DeltaConfig
    # The dense tail is the last rows of the prompt (or chunk) that computed a page, so a cached prefix's
    # K/V depend on where that prompt ended: never reused from the prefix cache.
    prefix_state = "none"

    def __init__(self, model_cfg: ModelConfig, config: DeltaConfig | None = None) -> None:
        super().__init__(model_cfg, config)
        cfg = self.config
        params: dict[str, Any] = {"dense_layers": cfg.dense_layers, "block_size": cfg.block_size}
        if cfg.density is not None:  # the base turns the whole-model density into its layers' itself
            params["density"] = cfg.target_density if cfg.target_density is not None else cfg.density
        params.update(dict(cfg.base_params))
        base = create_backend(cfg.base, model_cfg, **params)
        if not isinstance(base, SparseMethod):
            raise ValueError(f"Delta needs a sparse prefill method as its base, got {cfg.base!r}")
        self.base = base

    @contextmanager
    def _base_tracer(self, fn) -> Iterator[None]:
        saved, self.base.tracer = self.base.tracer, fn
        try:
            yield
        finally:
            self.base.tracer = saved

    def dense_seq(self, ctx, q, k, v) -> torch.Tensor:
        return self.base.dense_seq(ctx, q, k, v)

    def decode_seq(self, ctx, q, k, v) -> tuple[torch.Tensor, float]:
        with self._base_tracer(self.tracer):
            return self.base.decode_seq(ctx, q, k, v)

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self.base.release(seq_id)

    def check_request(self, prompt_len: int, total_len: int) -> None:
        self.base.check_request(prompt_len, total_len)

    # ---- batched decode: the base's (Delta corrects prefill only) ---------------------------------
    @property
    def batched_decode(self) -> bool:  # type: ignore[override]
        return self.base.batched_decode and not self.base.row_state

    @property
    def decode_unit(self) -> int:  # type: ignore[override]
        return self.base.decode_unit

    def dense_decode_layer(self, layer: int) -> bool:
        return self.base.dense_decode_layer(layer)

    def update_state(self, layer: int, cache: KVCache, batch: BatchMeta) -> None:
        self.base.update_state(layer, cache, batch)

    def graph_prepare(self, rows: list[int], cache: KVCache) -> None:
        self.base.graph_prepare(rows, cache)

    def decode_select(self, layer: int, q: torch.Tensor, view: DecodeView) -> torch.Tensor:
        return self.base.decode_select(layer, q, view)

    def decode_keys(self, layer: int, n: int) -> int:
        return self.base.decode_keys(layer, n)

    def prefill_seq(self, ctx: SeqContext, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> tuple[torch.Tensor, float]:
        cfg, gamma = self.config, self.config.gamma
        seen: list[Any] = []
        with self._base_tracer(lambda *args: seen.append(args[4])):
            o_sparse, attended = self.base.prefill_seq(ctx, q, k, v)
        base_sel = seen[-1] if seen and isinstance(seen[-1], BlockSelection) else None
        n_q, n = q.shape[0], ctx.n
        pos = ctx.q_start + torch.arange(n_q, device=q.device)
        tail_lo = max(n - cfg.tail_rows(n), ctx.q_start)
        dense = torch.zeros(n_q, dtype=torch.bool, device=q.device)
        out = o_sparse
        if cfg.mode != "sparse-only":
            first = (-ctx.q_start) % gamma
            o_rows, _ = dispatch.strided_dense_attention(q, k, v, gamma, ctx.q_start)
            out = o_sparse.float()
            if cfg.mode == "delta":
                out = out + self._deltas(ctx, o_rows.float() - out[first::gamma], pos, first)
            out[first::gamma] = o_rows.float()
            if tail_lo < n:
                out[tail_lo - ctx.q_start:] = dense_attention(q[tail_lo - ctx.q_start:], k, v).float()
            out = out.to(q.dtype)
            dense = (pos % gamma == 0) | (pos >= tail_lo)
            attended += self._extra_pairs(base_sel, pos[dense], k.shape[0], n, ctx.q_start, attended)
        if self.tracer is not None:
            sel = None if base_sel is None else DeltaSelection(base_sel.indices, base_sel.block_size, dense,
                                                               gamma, cfg.mode)
            self.tracer(ctx, q, k, v, sel, out)
        return out, attended

    def _deltas(self, ctx: SeqContext, delta: torch.Tensor, pos: torch.Tensor, first: int) -> torch.Tensor:
        """Delta[floor(i / gamma)] for every row i of the call: [n_q, h, d]. Row 0 of the table is the
        carried Delta of the anchor before this call's first one (zeros when there is none)."""
        gamma, st = self.config.gamma, ctx.state
        anchor0 = (ctx.q_start // gamma) * gamma  # anchor of the call's first row
        carry = st.get("delta_carry")
        shape = (1, *delta.shape[1:])
        use_carry = carry is not None and carry[0] == anchor0 and first
        prev = carry[1].to(delta).view(shape) if use_carry else delta.new_zeros(shape)
        table = torch.cat([prev, delta])
        if len(delta):
            st["delta_carry"] = (ctx.q_start + first + gamma * (len(delta) - 1), delta[-1])
        group = torch.div(pos - (ctx.q_start + first), gamma, rounding_mode="floor") + 1  # 0: before first anchor
        return table[group]

    def _extra_pairs(self, sel: BlockSelection | None, rows: torch.Tensor, h_kv: int, n: int,
                     q_start: int, base_pairs: float) -> float:
        """Causal pairs of the dense rows (absolute positions ``rows``) the base did not attend."""
        dense_pairs = float((rows + 1).sum()) * h_kv
        if sel is None:
            return max(0.0, min(dense_pairs, causal_pairs(n - q_start, n) * h_kv - base_pairs))
        b = sel.block_size
        kb = sel.indices[:, rows // b - q_start // b].long()  # [h_kv, |D|, S]
        lo = kb * b
        hi = torch.minimum(lo + b, rows[None, :, None] + 1)
        covered = ((hi - lo).clamp(min=0) * (kb != SENTINEL)).sum()
        return dense_pairs - float(covered)


register(method_spec(Delta, "Delta attention: dense every-gamma rows correct any sparse prefill (default streaming)"))
