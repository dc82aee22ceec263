"""A sequence's K/V at a range of positions copied out of one paged cache and into another.

SpecAttn's draft actor keeps a full-depth cache of its own. Where it shares one device with the verifier
shards (a CPU machine), every forward it runs to fill that cache takes the device from the verifier: the
prompt's prefill (as long as the verifier's own) and, each round, the tokens verified since the last one. The
verifier's cache holds both already, so the draft copies them (``orchestration/spec_step.py``): the prompt's
K/V are the ones its own dense prefill would compute, and the verified tokens' are the verifier's, which is
what the in-process self-speculative draft reads from the cache it shares with the verifier.

- ``export_tokens``: positions [start, end) of a sequence, every layer, this cache's KV heads, as ``(k, v)``
  each ``[layers, end - start, h_kv, d]`` on the CPU.
- ``import_tokens``: the parts of every tensor-parallel shard (their KV heads in rank order) written at a
  sequence's next positions in another cache with the same layers and head dim, and the sequence advanced
  past them.
- ``to_arrays`` / ``from_arrays``: the K/V as numpy arrays between the actors. Ray moves numpy arrays through
  its object store without a copy on either side, while a torch tensor is pickled through ``torch.save``: for
  a 4096-token prompt of the default model (189 MB) the adopted prefill took 1.3-1.8 s in all that way.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from raysparse.kv_cache import KVCache


def export_tokens(cache: KVCache, seq_id: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not 0 <= start <= end <= cache.seq_len(seq_id):
        raise ValueError(f"sequence {seq_id} holds {cache.seq_len(seq_id)} tokens; cannot export [{start}, {end})")
    pos = torch.arange(start, end, device=cache.device)
    pages = cache.page_table(seq_id)[pos // cache.page_size]
    offs = pos % cache.page_size
    k = torch.stack([layer[pages, :, offs] for layer in cache.k])
    v = torch.stack([layer[pages, :, offs] for layer in cache.v])
    return k.cpu(), v.cpu()


def import_tokens(cache: KVCache, seq_id: int, start: int, parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    if cache.seq_len(seq_id) != start:
        raise ValueError(f"sequence {seq_id} holds {cache.seq_len(seq_id)} tokens, not the {start} to import after")
    if not parts:
        raise ValueError("no shard's K/V to import")
    k = torch.cat([p[0] for p in parts], dim=2)
    v = torch.cat([p[1] for p in parts], dim=2)
    want = (len(cache.k), k.shape[1], cache.num_kv_heads, cache.cfg.head_dim)
    if tuple(k.shape) != want or tuple(v.shape) != want:
        raise ValueError(f"sequence {seq_id}: K/V of shape {tuple(k.shape)} and {tuple(v.shape)}, this cache "
                         f"holds {want[0]} layers of {want[2]} KV heads of dim {want[3]}")
    batch = cache.prepare([seq_id], [want[1]], True)  # advances the sequence (within its reservation)
    for layer in range(want[0]):
        cache.write(layer, k[layer].to(cache.device), v[layer].to(cache.device), batch)


def to_arrays(k: torch.Tensor, v: torch.Tensor) -> tuple[np.ndarray, np.ndarray, str]:
    """``(k, v)`` as numpy arrays and the dtype's name (bf16, which numpy lacks, travels as its int16 bits)."""
    name = str(k.dtype).removeprefix("torch.")
    if k.dtype == torch.bfloat16:
        k, v = k.view(torch.int16), v.view(torch.int16)
    return k.contiguous().numpy(), v.contiguous().numpy(), name


def from_arrays(k: np.ndarray, v: np.ndarray, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``to_arrays``' inverse. The arrays may be read-only views of the object store: only read from them."""
    with warnings.catch_warnings():  # torch warns on wrapping a read-only array; nothing writes to these
        warnings.simplefilter("ignore", UserWarning)
        kt, vt = torch.from_numpy(k), torch.from_numpy(v)
    dtype = getattr(torch, name)
    return (kt.view(dtype), vt.view(dtype)) if kt.dtype != dtype else (kt, vt)
