"""Which path serves a kernel call: Triton or the PyTorch reference.

``RAYSPARSE_KERNELS`` picks it: ``auto`` (default: Triton when the tensors are on CUDA and Triton is
installed), ``triton`` (always Triton; with ``TRITON_INTERPRET=1`` the kernels run on the CPU) or ``torch``
(always the reference). Both dispatch modules (``dispatch`` and ``scorer_dispatch``) decide here, so the
choice is made in one place; importing this module does not import Triton.
"""

from __future__ import annotations

import importlib.util
import os

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None

ENV = "RAYSPARSE_KERNELS"


def pow2_at_least_16(x: int) -> bool:
    return x >= 16 and not x & (x - 1)


def triton_wanted(*tensors: torch.Tensor) -> bool:
    """The ``RAYSPARSE_KERNELS`` decision before any shape check: Triton installed and forced, or all
    tensors on CUDA under ``auto``."""
    mode = os.environ.get(ENV, "auto").lower()
    if mode not in ("auto", "triton", "torch"):
        raise ValueError(f"{ENV} must be auto, triton or torch, got {mode!r}")
    if mode == "torch" or not HAS_TRITON:
        return False
    return mode == "triton" or all(t.is_cuda for t in tensors)


def use_triton(*tensors: torch.Tensor, head_dim: int, block: int = 16) -> bool:
    return pow2_at_least_16(head_dim) and pow2_at_least_16(block) and triton_wanted(*tensors)
