"""Fast Walsh-Hadamard transform and the subsampled randomized Hadamard transform (SRHT).

``fwht`` is the orthonormal Walsh-Hadamard transform (Sylvester order) over the last dimension, done in
log2(d) vectorised butterfly stages. ``SRHT`` is the d x r sketch ``H_d = D W S sqrt(d'/r)``: random
signs ``D``, the orthonormal transform ``W`` (after zero-padding d to the next power of two d'), and ``r``
coordinates sampled without replacement, scaled so that E[<x H_d, y H_d>] = <x, y> over the draw.
``SRHT.apply`` goes through ``raysparse.kernels.dispatch`` (a fused Triton kernel on CUDA tensors);
``fwht`` and ``srht_reference``, the plain PyTorch path and the kernel's oracle, live in
``raysparse.kernels.scorer_reference`` (the CPU fallback of the dispatch) and are re-exported here.
"""

from __future__ import annotations

import math

import torch

from raysparse.kernels import dispatch
from raysparse.kernels.scorer_reference import fwht, srht_reference  # noqa: F401 - re-exported


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class SRHT:
    """A fixed draw of the subsampled randomized Hadamard transform from R^dim to R^r.

    ``r`` is ``min(sketch_dim, d')``: past d' coordinates there is nothing left to sample, and with r = d'
    the sketch is an exact rotation (inner products preserved exactly, not only in expectation).
    """

    def __init__(self, dim: int, sketch_dim: int, seed: int) -> None:
        if dim <= 0 or sketch_dim <= 0:
            raise ValueError(f"dim and sketch_dim must be positive, got {dim}, {sketch_dim}")
        self.dim = dim
        self.padded = next_pow2(dim)
        self.sketch_dim = min(sketch_dim, self.padded)
        # Drawn on the CPU from a private generator, so the draw is the same on every device and shard.
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.signs = torch.randint(0, 2, (self.padded,), generator=gen).float() * 2 - 1
        self.coords = torch.randperm(self.padded, generator=gen)[: self.sketch_dim].sort().values
        self.scale = math.sqrt(self.padded / self.sketch_dim)
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def device_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(signs, coords, slots) on ``device``; ``slots[c]`` is the output column of transform column c
        (-1 if not drawn), the kernel's form of ``coords``."""
        if device not in self._on:
            slots = torch.full((self.padded,), -1, dtype=torch.int32)
            slots[self.coords] = torch.arange(self.sketch_dim, dtype=torch.int32)
            self._on[device] = (self.signs.to(device), self.coords.to(device), slots.to(device))
        return self._on[device]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim] -> [..., r] in fp32, through the fast transform (O(d log d) per row)."""
        return dispatch.srht_apply(x, *self.device_tensors(x.device), self.scale)

    def matrix(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The explicit d x r matrix H_d (x @ H_d == apply(x))."""
        return self.apply(torch.eye(self.dim, device=device))


def derive_seed(seed: int, dim: int) -> int:
    """One fixed SRHT seed per (config seed, head dim): models of different head dims get independent
    draws, and every call (and every shard) of one model reuses the same one."""
    return (seed * 0x9E3779B97F4A7C15 + dim * 0xBF58476D1CE4E5B9) % (2**63)
