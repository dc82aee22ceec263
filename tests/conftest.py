"""Shared fixtures: a tiny random Llama and the real default model (loaded once per session)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

TEXT_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "text"


def tiny_hf_config(num_kv_heads: int = 3, group: int = 2, layers: int = 3, rope_parameters: dict | None = None):
    from transformers import LlamaConfig

    heads = num_kv_heads * group
    return LlamaConfig(
        vocab_size=97, hidden_size=heads * 16, intermediate_size=80, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=num_kv_heads, head_dim=16,
        max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
    )


def random_state(hf_config, seed: int = 0) -> dict[str, torch.Tensor]:
    """A transformers LlamaForCausalLM with seeded random weights: our oracle and our weights source."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():
        for p in model.parameters():  # non-trivial norms too, so their handling is tested
            p.add_(torch.randn_like(p) * 0.02)
    return model


@pytest.fixture(scope="session")
def real_text() -> str:
    if not TEXT_DIR.is_dir():
        pytest.skip("../shared/data/text is not present")
    return (TEXT_DIR / "emma.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def smollm():
    """(transformers model, our fp32 model, tokenizer) for the default SmolLM2 weights."""
    from transformers import AutoModelForCausalLM

    from raysparse.loader import load_tokenizer, model_from_state, resolve_source

    try:
        src = resolve_source(None)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    hf = AutoModelForCausalLM.from_pretrained(src.directory, dtype=torch.float32, **src.hf_kwargs()).eval()
    ours = model_from_state(hf.config, hf.state_dict())
    return hf, ours, load_tokenizer(src)
