"""A separate draft model for SpecAttn (``--draft-model PATH``): a smaller Llama-family checkpoint that shares
the verifier's tokenizer, with its own KV cache.

Compatibility (``check_draft_compatible``): the two checkpoints must have the same vocabulary size and, where
both ship a tokenizer, the same token-to-id table and the same BOS/EOS ids; a draft with a tokenizer paired
with a verifier without one (or the reverse) is refused, because nothing shows their ids agree. Two
config-only checkpoints (token ids only, e.g. tests' random models) are compared by vocabulary size.

Attention rows for the verifier's plan: the draft records, per draft layer, its decode row averaged over each
KV group's query heads (``draft.AttentionProbe``), [h_kv_draft, n]. The verifier selects per KV head, so
``to_verifier_heads`` maps the rows onto the verifier's h_kv heads: kept per head when both models have
the same number of KV heads (a draft of the same family and width), otherwise averaged over the draft's
KV heads and shared by every verifier KV head (KV heads of two different models have no correspondence).
The layer map (``layer_map``) is measured on the same converted rows.

The draft's cache (``SeparateDraft``) is kept in step with the verifier's verified tokens without any
acceptance message, as the draft actor's self-speculative cache is: each round names the sequence's token
count and last tokens; the draft drops the K/V its own drafting wrote, runs the verified tokens it has not
seen (a few, through its full depth, dense) and drafts from the newest token.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from raysparse.attention import DenseAttention
from raysparse.config import ModelConfig
from raysparse.kv_cache import KVCache
from raysparse.model import LlamaForCausalLM
from raysparse.sampling import SamplingParams
from raysparse.specattn.acceptance import draw, processed_probs
from raysparse.specattn.draft import AttentionProbe


class DraftModelError(ValueError):
    """A draft checkpoint that cannot serve this verifier (vocabulary or tokenizer mismatch, bad path)."""


def draft_key(path: str | Path) -> str:
    """The key a separate draft's layer map is saved under: its directory name and a hash of its path."""
    p = Path(path).expanduser().resolve()
    return f"{p.stem}-{hashlib.sha1(str(p).encode()).hexdigest()[:10]}"


def check_draft_compatible(verifier_cfg: ModelConfig, draft_cfg: ModelConfig, verifier_tok: Any | None,
                           draft_tok: Any | None, draft_name: str = "the draft") -> None:
    """Raises DraftModelError unless the draft can propose tokens the verifier reads as the same text."""
    if draft_cfg.vocab_size != verifier_cfg.vocab_size:
        raise DraftModelError(f"--draft-model {draft_name}: vocabulary of {draft_cfg.vocab_size} tokens, the verifier "
                              f"has {verifier_cfg.vocab_size}; the draft must share the verifier's tokenizer")
    if (verifier_tok is None) != (draft_tok is None):
        which = "the verifier" if verifier_tok is None else "the draft"
        raise DraftModelError(f"--draft-model {draft_name}: {which} has no tokenizer, so the two cannot be checked "
                              "to share one")
    if verifier_tok is None:
        return
    if verifier_tok.get_vocab() != draft_tok.get_vocab():
        raise DraftModelError(f"--draft-model {draft_name}: its tokenizer's vocabulary differs from the verifier's "
                              "(the draft must share the verifier's tokenizer)")
    for attr in ("bos_token_id", "eos_token_id"):
        if getattr(verifier_tok, attr, None) != getattr(draft_tok, attr, None):
            raise DraftModelError(f"--draft-model {draft_name}: {attr} {getattr(draft_tok, attr, None)} differs from "
                                  f"the verifier's {getattr(verifier_tok, attr, None)}")


def check_draft_paths(verifier: str | None, draft: str) -> None:
    """Loads both configs (and tokenizers where present) and checks them: what a command runs before any
    actor starts."""
    from raysparse.loader import ModelNotFoundError, load_hf_config, resolve_source

    try:
        vsrc, dsrc = resolve_source(verifier), resolve_source(draft)
    except ModelNotFoundError as e:
        raise DraftModelError(str(e)) from None
    try:
        dcfg = ModelConfig.from_hf(load_hf_config(dsrc))
    except (OSError, ValueError) as e:
        raise DraftModelError(f"--draft-model {draft!r}: not a Llama-family checkpoint ({e})".splitlines()[0]) from None
    vcfg = ModelConfig.from_hf(load_hf_config(vsrc))
    check_draft_compatible(vcfg, dcfg, _tokenizer_or_none(vsrc), _tokenizer_or_none(dsrc), repr(draft))


def _tokenizer_or_none(src: Any) -> Any | None:
    from raysparse.loader import load_tokenizer

    try:
        return load_tokenizer(src)
    except Exception:  # a config-only directory: token ids only
        return None


def to_verifier_heads(rows: torch.Tensor, verifier_kv_heads: int) -> torch.Tensor:
    """Draft rows [h_kv_draft, n] -> [verifier_kv_heads, n] (per head when the counts match, else the mean
    over the draft's KV heads, shared)."""
    if rows.shape[0] == verifier_kv_heads:
        return rows
    return rows.mean(0, keepdim=True).expand(verifier_kv_heads, -1)


@dataclass
class Proposal:
    """One round's drafts: per sequence its tokens, its rows per draft layer (one [h_kv_verifier, n] per
    step) and, for sampled requests, the distribution [V] each token was drawn from."""

    tokens: list[list[int]]
    rows: list[dict[int, list[torch.Tensor]]]
    q: list[list[torch.Tensor]] = field(default_factory=list)


def pick_tokens(logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None]) -> tuple[list[int], list[torch.Tensor | None]]:
    """The draft's token per row of ``logits`` [B, V]: argmax for greedy requests, a draw from the processed
    distribution (returned too) for sampled ones."""
    greedy = logits.argmax(-1).tolist()
    toks: list[int] = []
    qs: list[torch.Tensor | None] = []
    for r, (p, g) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            toks.append(greedy[r])
            qs.append(None)
        else:
            q = processed_probs(logits[r], p)
            toks.append(draw(q, g))
            qs.append(q)
    return toks, qs


class SeparateDraft:
    """A separate draft model with its own paged KV cache (``cache_tokens`` tokens) on ``model``'s device."""

    def __init__(self, model: LlamaForCausalLM, verifier_cfg: ModelConfig, key: str, cache_tokens: int,
                 page_size: int = 16, tokenizer: Any | None = None,
                 head_range: tuple[int, int] | None = None) -> None:
        check_draft_compatible(verifier_cfg, model.cfg, None, None, key)
        self.model, self.key, self.tokenizer = model, key, tokenizer
        self.verifier_kv_heads = verifier_cfg.num_kv_heads
        # A verifier shard plans over its own KV heads only: the rows are cut to them (whole model: all).
        lo, hi = head_range if head_range is not None else (0, verifier_cfg.num_kv_heads)
        if not 0 <= lo < hi <= verifier_cfg.num_kv_heads:
            raise ValueError(f"head_range {head_range} is outside the verifier's {verifier_cfg.num_kv_heads} KV heads")
        self.head_range = (lo, hi)
        self.verifier_layers = verifier_cfg.num_layers
        self.layers = tuple(range(model.cfg.num_layers))
        dev, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
        self.cache = KVCache(model.cfg, -(-cache_tokens // page_size), page_size, dtype, dev, model.num_kv_heads)
        self.dense = DenseAttention(model.cfg.num_layers)
        self._verified: dict[int, int] = {}  # seq -> its tokens whose K/V the draft's cache holds as verified

    @property
    def num_layers(self) -> int:
        return self.model.cfg.num_layers

    @property
    def device(self) -> torch.device:
        return self.cache.device

    def free(self, seq_ids: Sequence[int]) -> None:
        for sid in seq_ids:
            if sid in self._verified:
                self.cache.free(sid)
                del self._verified[sid]

    @torch.inference_mode()
    def prefill(self, items: Sequence[tuple[int, int, Sequence[int]]]) -> None:
        """items: (seq id, tokens to reserve, prompt). A dense prefill of every prompt into the draft's cache."""
        for sid, reserve, _ in items:
            self.free([sid])
            self.cache.allocate(sid, reserve)
            self._verified[sid] = 0
        ids = torch.tensor([t for _, _, p in items for t in p], dtype=torch.long, device=self.device)
        batch = self.cache.prepare([s for s, _, _ in items], [len(p) for _, _, p in items], True)
        self.model(ids, batch, self.cache, self.dense)
        for sid, _, p in items:
            self._verified[sid] = len(p)

    def _pending(self, sid: int, total: int, tail: Sequence[int]) -> list[int]:
        """Rolls the cache back to its verified tokens; the verified tokens still to feed (newest last)."""
        start, first = self._verified[sid], total - len(tail)
        if start < first:
            raise RuntimeError(f"sequence {sid}: the draft is behind by more than the tail it was sent")
        self.cache.truncate(sid, start)
        return list(tail[start - first:])

    @torch.inference_mode()
    def propose(self, items: Sequence[tuple[int, int, Sequence[int], int]], needed: Sequence[int],
                params: Sequence[SamplingParams] | None = None,
                generators: Sequence[torch.Generator | None] | None = None) -> Proposal:
        """items: (seq id, tokens in the sequence, its last tokens (at least those since the last round),
        lookahead). Drafts every sequence's lookahead, recording the rows of the draft layers ``needed``."""
        n = len(items)
        params = list(params) if params is not None else [SamplingParams()] * n
        gens = list(generators) if generators is not None else [None] * n
        sids = [it[0] for it in items]
        pending = [self._pending(sid, total, tail) for sid, total, tail, _ in items]
        if any(not p for p in pending):
            raise RuntimeError("every sequence needs its newest token to draft from")
        catch = [i for i, p in enumerate(pending) if len(p) > 1]
        if catch:  # the tokens verified since the last round, dense through the full draft
            ids = torch.tensor([t for i in catch for t in pending[i][:-1]], dtype=torch.long, device=self.device)
            self.model(ids, self.cache.prepare([sids[i] for i in catch], [len(pending[i]) - 1 for i in catch], True),
                       self.cache, self.dense)
        for sid in sids:
            self._verified[sid] = self.cache.seq_len(sid)
        gam = [it[3] for it in items]
        probe = AttentionProbe(self.num_layers, needed)
        out = Proposal([[] for _ in items], [{d: [] for d in needed} for _ in items], [[] for _ in items])
        cur = [p[-1] for p in pending]
        active = list(range(n))
        for s in range(max(gam, default=0)):
            active = [i for i in active if gam[i] > s]
            batch = self.cache.prepare([sids[i] for i in active], [1] * len(active), False)
            ids = torch.tensor([cur[i] for i in active], dtype=torch.long, device=self.device)
            logits = self.model(ids, batch, self.cache, probe).float()
            toks, qs = pick_tokens(logits, [params[i] for i in active], [gens[i] for i in active])
            for pos, i in enumerate(active):
                out.tokens[i].append(toks[pos])
                if qs[pos] is not None:
                    out.q[i].append(qs[pos])
                cur[i] = toks[pos]
                for d in needed:
                    out.rows[i][d].append(self._verifier_rows(probe.take(d, sids[i])))
        return out

    def _verifier_rows(self, rows: torch.Tensor) -> torch.Tensor:
        lo, hi = self.head_range
        return to_verifier_heads(rows, self.verifier_kv_heads)[lo:hi]

    @torch.inference_mode()
    def teacher_rows(self, seq_id: int, tokens: Sequence[int], needed: Sequence[int]) -> dict[int, list[torch.Tensor]]:
        """Feeds ``tokens`` one decode step each (teacher-forced: the true tokens, not the draft's own) after
        the sequence's cached tokens, recording the rows of the draft layers ``needed``; the tokens stay in
        the cache as verified. What the eval's decode perplexity plans its verification chunks from."""
        probe = AttentionProbe(self.num_layers, needed)
        rows: dict[int, list[torch.Tensor]] = {d: [] for d in needed}
        for t in tokens:
            ids = torch.tensor([t], dtype=torch.long, device=self.device)
            self.model(ids, self.cache.prepare([seq_id], [1], False), self.cache, probe)
            for d in needed:
                rows[d].append(self._verifier_rows(probe.take(d, seq_id)))
        self._verified[seq_id] = self.cache.seq_len(seq_id)
        return rows

    @torch.inference_mode()
    def feed(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Runs verified ``tokens`` after the sequence's cached ones (dense, through the full draft)."""
        if tokens:
            ids = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
            self.model(ids, self.cache.prepare([seq_id], [len(tokens)], True), self.cache, self.dense)
        self._verified[seq_id] = self.cache.seq_len(seq_id)

    def kv_reads(self, ctx_len: int) -> float:
        """Keys one draft step reads over a context of ``ctx_len`` (x KV heads, every draft layer). A draft
        beside a verifier shard runs whole on every shard of the group: each counts the share of its verifier
        KV heads, so the sum over the shards is one draft's reads."""
        lo, hi = self.head_range
        return float(ctx_len) * self.model.num_kv_heads * self.num_layers * (hi - lo) / self.verifier_kv_heads


def load_separate_draft(path: str, verifier_cfg: ModelConfig, verifier_tokenizer: Any | None, cache_tokens: int,
                        dtype: torch.dtype, device: str | torch.device, page_size: int = 16,
                        head_range: tuple[int, int] | None = None) -> SeparateDraft:
    """Loads the checkpoint at ``path`` as a draft for the verifier, checking its vocabulary and tokenizer
    (``head_range``: the verifier KV heads its rows are cut to, a tensor-parallel shard's own)."""
    from raysparse.loader import ModelNotFoundError, load_hf_config, load_model, resolve_source

    try:
        src = resolve_source(path)
    except ModelNotFoundError as e:
        raise DraftModelError(f"--draft-model: {e}") from None
    hf = load_hf_config(src)
    tok = _tokenizer_or_none(src)
    check_draft_compatible(verifier_cfg, ModelConfig.from_hf(hf), verifier_tokenizer, tok, repr(path))
    model = load_model(src, dtype=dtype, device=device, hf_config=hf)
    return SeparateDraft(model, verifier_cfg, draft_key(path), cache_tokens, page_size, tok, head_range)
