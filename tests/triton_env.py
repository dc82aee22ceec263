"""Imported by the kernel tests before anything that imports triton: without a GPU the kernels must run in
Triton's CPU interpreter, which has to be chosen (TRITON_INTERPRET=1) before triton is first imported."""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        # Triton's own library functions were built for compiled mode: the interpreter cannot run them.
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set: run this file alone or "
                    "export TRITON_INTERPRET=1", allow_module_level=True)
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
