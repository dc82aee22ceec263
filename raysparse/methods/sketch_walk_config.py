"""Sketch&Walk's configuration: the frozen, validated parameters of ``raysparse.methods.sketch_walk`` and the
names of its modes. What each mode does and why the defaults are what they are: that module's docstring and
docs/methods/sketch_walk.md."""

from __future__ import annotations

import math
from dataclasses import dataclass

from raysparse.methods.base import MethodConfig

WALKS = ("rollout", "product", "one-hop")
TOKEN_QUERIES = ("decode", "last", "never")
HEADS = ("mean", "kv", "pair", "pair-lse")
DECODE_UNITS = ("block", "part")
DECODE_QUERIES = ("group", "heads")
# The paper's scoring (head-averaged sketches, whole blocks), the one the head-mean batched graph decode
# (sketch_walk_rows) implements.
GRAPH_DECODE = {"heads": "mean", "sub_blocks": 1, "decode_unit": "block"}


@dataclass(frozen=True)
class SketchWalkConfig(MethodConfig):
    sketch_dim: int = 64  # r
    exponent: float = 8.0  # s, the sparsity exponent of W = P ** s
    seed: int = 0  # the SRHT draw (combined with head_dim)
    walk: str = "one-hop"  # one-hop (W^k alone; default: measured best), rollout, product (the paper's walk)
    residual: float = 0.5  # rollout: weight alpha of the identity (the residual stream) in each step
    local_blocks: int = 1  # trailing blocks always kept, the diagonal included (besides the sink block)
    # Whose query scores the last query block's selection row: "decode": in decode the new token's alone
    # (the paper's decode); "last" (default): also at the end of a prefill, its last token's; "never": the block mean.
    token_query: str = "last"
    # mean: the paper's head-averaged sketches; kv: sketches, walk and selection per KV head; pair / pair-lse
    # (default): per-KV-head scores (group query . that head's keys) combined by their mean / log-sum-exp,
    # one selection per layer
    heads: str = "pair-lse"
    sub_blocks: int = 8  # key sketches per 1/sub_blocks of a block; a key block scores as its best part (paper: 1)
    decode_unit: str = "part"  # part (default; one-hop only): decode attends the top parts of B / sub_blocks tokens
    # Whose query scores a decode step's key parts (decode_unit="part", heads pair / pair-lse): "group": each KV
    # head's query group averaged, one query per KV head; "heads": every query head on its own, the scores
    # combined by ``heads`` over every query head (a needle one head of a group attends is not averaged away).
    decode_query: str = "group"
    # Which implementation the batched decode runs; each pair of paths selects the same keys, and the defaults are
    # the measured fastest. graph_paired: the paired scorings (heads pair / pair-lse) decode on the batched seam,
    # from CUDA graphs on GPUs (sketch_walk_parts); off, per sequence. part_scores / part_select: that path's
    # Triton part scores and its combine + part selection (kernels/part_scores.py, kernels/part_select.py) on CUDA
    # tensors, their C kernels (kernels/cpu_parts.py) on fp32 CPU tensors with decode_unit="part"; off, their
    # PyTorch forms. walk_select: one-hop's Triton selection (kernels/walk_select.py) on the head-mean graph path;
    # off, its PyTorch form.
    graph_paired: bool = True
    part_scores: bool = True
    part_select: bool = True
    walk_select: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("graph_paired", "part_scores", "part_select", "walk_select"):
            # a string such as "off" is truthy: take booleans only, so it cannot silently mean on
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if isinstance(self.sketch_dim, bool) or not isinstance(self.sketch_dim, int) or self.sketch_dim <= 0:
            raise ValueError(f"sketch_dim must be a positive integer, got {self.sketch_dim!r}")
        if not (isinstance(self.exponent, int | float) and math.isfinite(self.exponent) and self.exponent > 0):
            raise ValueError(f"exponent must be a finite number > 0, got {self.exponent!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be a non-negative 64-bit integer, got {self.seed!r}")
        if self.walk not in WALKS:
            raise ValueError(f"walk must be one of {WALKS}, got {self.walk!r}")
        if not (isinstance(self.residual, int | float) and 0.0 <= self.residual < 1.0):
            raise ValueError(f"residual must be in [0, 1), got {self.residual!r}")
        if isinstance(self.local_blocks, bool) or not isinstance(self.local_blocks, int) or self.local_blocks < 1:
            raise ValueError(f"local_blocks must be an integer >= 1, got {self.local_blocks!r}")
        if self.token_query not in TOKEN_QUERIES:
            raise ValueError(f"token_query must be one of {TOKEN_QUERIES}, got {self.token_query!r}")
        if self.heads not in HEADS:
            raise ValueError(f"heads must be one of {HEADS}, got {self.heads!r}")
        if self.decode_unit not in DECODE_UNITS:
            raise ValueError(f"decode_unit must be one of {DECODE_UNITS}, got {self.decode_unit!r}")
        if self.decode_unit == "part" and self.walk != "one-hop":
            raise ValueError("decode_unit='part' ranks parts by this layer's scores: it needs walk='one-hop' "
                             "(with another walk, pass decode_unit='block')")
        if self.decode_query not in DECODE_QUERIES:
            raise ValueError(f"decode_query must be one of {DECODE_QUERIES}, got {self.decode_query!r}")
        if self.decode_query == "heads" and (self.decode_unit != "part" or self.heads not in ("pair", "pair-lse")):
            raise ValueError("decode_query='heads' combines every query head's part scores: it needs "
                             "decode_unit='part' and heads 'pair' or 'pair-lse'")
        if (isinstance(self.sub_blocks, bool) or not isinstance(self.sub_blocks, int) or self.sub_blocks < 1
                or self.block_size % self.sub_blocks):
            raise ValueError(f"sub_blocks must be a positive divisor of block_size, got {self.sub_blocks!r}")
