"""Sketch&Walk's walk across layers: the transition weights W^k from a layer's A_hat rows
(row-softmax(A_hat) ** s, or the rollout's residual step), the renormalised rows R^k = R^{k-1} W^k a sequence
carries from one sparse layer to the next (``walk_rows``, the per-sequence path's), and the token counts
that turn block sums into means (``block_counts``). The batched decodes (``sketch_walk_rows``,
``sketch_walk_parts``) build their W rows from the same ``walk_weights`` / ``rollout_step``.
"""

from __future__ import annotations

import torch

from raysparse.methods.sketch_walk_method import SketchWalkMethod
from raysparse.methods.views import SeqContext


def block_counts(n: int, num_blocks: int, block_size: int, device: torch.device) -> torch.Tensor:
    """Tokens in each of the first ``num_blocks`` blocks of an n-token sequence (the last may be partial)."""
    return (n - torch.arange(num_blocks, device=device) * block_size).clamp(max=block_size).float()


def walk_weights(a_hat: torch.Tensor, exponent: float, stochastic: bool = False) -> torch.Tensor:
    """W = row-softmax(A_hat over causal blocks) ** s, fp32 [..., b, b], zero above the block diagonal.
    ``stochastic``: rows rescaled to sum 1, i.e. W = row-softmax(s * A_hat) (same ranking in each row)."""
    b = a_hat.shape[-1]
    causal = torch.ones(b, b, dtype=torch.bool, device=a_hat.device).tril()
    logits = a_hat.float().masked_fill(~causal, float("-inf"))
    if stochastic:
        return torch.softmax(exponent * logits, dim=-1)
    return torch.exp(exponent * torch.log_softmax(logits, dim=-1))


def rollout_step(a_hat: torch.Tensor, exponent: float, residual: float) -> torch.Tensor:
    """One rollout transition: alpha I + (1 - alpha) row-softmax(s * A_hat), fp32 [..., b, b], rows sum to 1."""
    w = walk_weights(a_hat, exponent, stochastic=True) * (1.0 - residual)
    return w + residual * torch.eye(w.shape[-1], device=w.device)


def renormalise(rows: torch.Tensor) -> torch.Tensor:
    """Rows scaled to sum 1 (ranking unchanged); keeps the product of many W's out of underflow."""
    return rows / rows.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)


def walk_rows(method: SketchWalkMethod, ctx: SeqContext, qb0: int, nb: int, token_row: torch.Tensor | None = None
              ) -> torch.Tensor:
    """Rows qb0..nb-1 of R^k for this layer (fp32 [H, nb - qb0, nb]), carried in ``ctx.seq_state``.
    ``token_row`` replaces the last row of A_hat for this call only: the state keeps the block mean's row,
    which the rows of later query blocks walk through."""
    cfg = method.config
    a_hat = ctx.state["a_hat"].view(-1, nb, nb)
    if token_row is not None:
        a_hat = torch.cat((a_hat[:, : nb - 1], token_row), 1)
    if cfg.walk == "rollout":
        w = rollout_step(a_hat, cfg.exponent, cfg.residual)
    else:
        w = walk_weights(a_hat, cfg.exponent)
    step = (ctx.q_start, ctx.n)
    if ctx.layer == method.first_sparse or cfg.walk == "one-hop":
        rows = w[:, qb0:nb]
    else:
        prev = ctx.seq_state.get("walk")
        if prev is None or prev[0] != step:
            raise RuntimeError(f"sketch_walk: layer {ctx.layer} found no walk state from an earlier sparse "
                               f"layer of this step; layers must run in order from layer {method.first_sparse}")
        rows = prev[1].view(w.shape[0], nb - qb0, nb) @ w
    rows = renormalise(rows)
    ctx.seq_state["walk"] = (step, rows if cfg.heads == "kv" else rows[0])
    return rows
