"""The self-speculative draft: the verifier itself run through a subset of its layers.

There is no separate draft model for the default model (SmolLM2-135M; models of other families do not
share its tokenizer), so the draft is the verifier's embedding, a subset D of its decoder layers, its final
norm and its LM head. Default D (``default_draft_layers``): every layer except a contiguous middle third,
[max(2, L // 3), max(2, L // 3) + L // 3), never the last layer; for SmolLM2-135M (30 layers) that skips layers
10..19 and keeps 20. Why this subset: skipping a middle block accepted more drafted tokens on the default model
than every other shape tried at the same size (the measurements: docs/methods/specattn.md). Early and late layers
are the ones a model cannot do without (they read the embedding and write the logits); the middle ones refine the
residual stream least, so the draft's residual stream, and hence its attention rows, stay closest to the
verifier's. The first two layers are always kept (the verifier runs them dense; the draft's copy is then exact)
and so is the last (the head reads it). With this small a model the self-speculative draft does not make decoding
faster (about 1.8 tokens per round for 4 draft steps of 2/3 of the depth); it is there to provide attention rows
and a faithful protocol.

KV cache: shared with the verifier (no second cache). Draft layer i reads and writes verifier layer i's
pages. For the verified context the draft attends the verifier's own keys and values (as in Draft & Verify
self-speculation), so its attention rows differ from the verifier's only through its queries; its writes for
the speculative positions land in the slots the verifier overwrites when it verifies those positions
(the generator truncates the sequence back before verifying). This costs no memory, needs no draft
prefill, and the draft's context is always exactly the verified one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from raysparse.attention import AttentionBackend, causal_pairs, dense_attention
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.model import LlamaForCausalLM


def default_draft_layers(num_layers: int) -> tuple[int, ...]:
    """Every layer but a contiguous middle third: [max(2, L // 3), max(2, L // 3) + L // 3), last layer kept."""
    lo = max(2, num_layers // 3)
    skip = set(range(lo, min(lo + num_layers // 3, num_layers - 1)))
    return tuple(i for i in range(num_layers) if i not in skip)


def validate_draft_layers(layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    out = tuple(int(x) for x in layers)
    if not out:
        raise ValueError("the draft needs at least one layer")
    if any(b <= a for a, b in zip(out, out[1:], strict=False)):
        raise ValueError(f"draft layers must be strictly increasing, got {list(out)}")
    if out[0] != 0 or out[-1] >= num_layers:
        raise ValueError(f"draft layers must start at 0 and stay below {num_layers}, got {list(out)}")
    return out


class AttentionProbe(AttentionBackend):
    """Dense attention that keeps, for the ``record`` layers, each decoding sequence's attention row
    averaged over every KV group's query heads: ``take(layer, seq_id)`` -> [h_kv, n] fp32.

    Decode materialises the softmax (one query row per sequence, so [h, n] is small); prefill is plain
    SDPA and records nothing.
    """

    name = "specattn-probe"

    def __init__(self, num_layers: int, record: Iterable[int] = ()) -> None:
        super().__init__(num_layers)
        self.record = frozenset(record)
        self._rows: dict[tuple[int, int], torch.Tensor] = {}

    def take(self, layer: int, seq_id: int) -> torch.Tensor:
        return self._rows.pop((layer, seq_id))

    def clear(self) -> None:
        self._rows.clear()

    def prefill(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta) -> torch.Tensor:
        out = torch.empty_like(q)
        for i in range(batch.num_seqs):
            k, v = cache.gather(layer, batch, i)
            lo, hi = batch.cu_q[i], batch.cu_q[i + 1]
            out[lo:hi] = dense_attention(q[lo:hi], k, v)
            pairs = causal_pairs(hi - lo, batch.ctx_lens[i]) * cache.num_kv_heads
            self.meter.add(layer, pairs, pairs)
        return out

    def decode(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta) -> torch.Tensor:
        out = torch.empty_like(q)
        h, d = q.shape[1], q.shape[2]
        for i, sid in enumerate(batch.seq_ids):
            k, v = cache.gather(layer, batch, i)
            h_kv, n = k.shape[0], k.shape[1]
            scores = torch.einsum("kgd,knd->kgn", q[i].float().view(h_kv, h // h_kv, d), k.float()) / math.sqrt(d)
            probs = scores.softmax(-1)
            out[i] = torch.einsum("kgn,knd->kgd", probs, v.float()).reshape(h, d).to(q.dtype)
            if layer in self.record:
                self._rows[(layer, sid)] = probs.mean(1)
            self.meter.add(layer, n * h_kv, n * h_kv)
        return out


@torch.inference_mode()
def draft_forward(model: LlamaForCausalLM, layers: Sequence[int], input_ids: torch.Tensor, batch: BatchMeta,
                  cache: KVCache, backend: AttentionBackend) -> torch.Tensor:
    """The draft's forward: the verifier's embedding, its ``layers`` in order, its final norm and head.
    Returns the logits of each sequence's last token [num_seqs, V] (fp32)."""
    h = model.model.embed_tokens(input_ids)
    cos, sin = model.rotary(batch.positions, h.dtype)
    backend.begin_step(cache, batch)  # as the model's forward: the step planned before its layers
    for i in layers:
        h = model.model.layers[i](h, cos, sin, cache, batch, backend)
    h = h[batch.last_token_rows()]
    logits = model.lm_head(model.model.norm(h))
    gather = getattr(model, "gather_logits", None)
    if gather is not None:  # a vocab-parallel head (tensor parallelism): each rank holds a slice of the vocabulary
        logits = gather(logits)
    return logits.float()
