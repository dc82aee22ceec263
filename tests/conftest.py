"""Shared fixtures: a tiny random Llama and the real default model (loaded once per session)."""

from __future__ import annotations

import os
from pathlib import Path

# Without a GPU the Triton kernels' tests run in Triton's CPU interpreter, which must be chosen before
# anything imports triton (tests/triton_env.py skips a kernel test file otherwise): set here, first.
if not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

TEXT_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "text"


@pytest.fixture(scope="session")
def real_text() -> str:
    if not TEXT_DIR.is_dir():
        pytest.skip("../shared/data/text is not present")
    return (TEXT_DIR / "emma.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def smollm():
    """(transformers model, our fp32 model, tokenizer) for the default SmolLM2 weights."""
    from transformers import AutoModelForCausalLM

    from raysparse.loader import load_tokenizer, materialize, model_from_state, resolve_source

    try:
        src = materialize(resolve_source(None))
    except FileNotFoundError as e:
        pytest.skip(str(e))
    hf = AutoModelForCausalLM.from_pretrained(src.directory, dtype=torch.float32, **src.hf_kwargs()).eval()
    ours = model_from_state(hf.config, hf.state_dict())
    return hf, ours, load_tokenizer(src)
