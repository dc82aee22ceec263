"""Fast Walsh-Hadamard transform and the subsampled randomized Hadamard transform (SRHT).

``fwht`` is the orthonormal Walsh-Hadamard transform (Sylvester order) over the last dimension, done in
log2(d) vectorised butterfly stages. ``SRHT`` is the d x r sketch ``H_d = D W S sqrt(d'/r)``: random
signs ``D``, the orthonormal transform ``W`` (after zero-padding d to the next power of two d'), and ``r``
coordinates sampled without replacement, scaled so that E[<x H_d, y H_d>] = <x, y> over the draw.
``SRHT.apply`` goes through ``raysparse.kernels.dispatch`` (a fused Triton kernel on CUDA tensors);
``srht_reference`` is the plain PyTorch path and the kernel's oracle.
"""

from __future__ import annotations

import math

import torch

from raysparse.kernels import dispatch


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform over the last dim (a power of two): x @ H / sqrt(d), where
    H is the symmetric Sylvester matrix H_2d = [[H_d, H_d], [H_d, -H_d]]."""
    d = x.shape[-1]
    if d <= 0 or d & (d - 1):
        raise ValueError(f"fwht needs a power-of-two last dimension, got {d}")
    lead = x.shape[:-1]
    y = x.reshape(-1, d)
    h = 1
    while h < d:
        # Butterfly stage: entries j and j + h of every 2h-long segment become (a + b, a - b).
        pairs = y.view(-1, d // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).view(-1, d)
        h *= 2
    return y.view(*lead, d) / math.sqrt(d)


def srht_reference(x: torch.Tensor, signs: torch.Tensor, coords: torch.Tensor, scale: float) -> torch.Tensor:
    """x: [..., dim] -> fp32 [..., r]: pad to len(signs), flip signs, fast transform, keep ``coords``, scale."""
    xp = torch.nn.functional.pad(x.float(), (0, signs.numel() - x.shape[-1])) * signs
    return fwht(xp).index_select(-1, coords) * scale


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
