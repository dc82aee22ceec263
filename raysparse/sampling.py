"""Per-request sampling parameters and the sampler (greedy, seeded temperature / top-p)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Smallest accepted temperature and top_p. Below them the sampler's float32 arithmetic breaks down:
# logits / temperature overflows to inf (softmax then gives NaN), and a top_p that rounds to 0 in float32
# keeps no token at all. Such values are refused up front so a request never fails during generation.
MIN_TEMPERATURE = 1e-4
MIN_TOP_P = 1e-6
MAX_LOGPROBS = 20  # most alternatives per token (vLLM's default limit)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 means greedy; otherwise >= MIN_TEMPERATURE
    top_p: float = 1.0  # in [MIN_TOP_P, 1]
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Log-probabilities, of the model's own distribution (its logits' log-softmax, before temperature, top_p and
    # penalties): ``logprobs`` for each generated token, with its ``logprobs`` most likely alternatives (0: the
    # token's own alone); ``prompt_logprobs`` for every prompt token after the first, likewise. None: none.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # OpenAI's penalties over the tokens generated so far: a token's logit less ``presence_penalty`` once it
    # appeared, and ``frequency_penalty`` times the number of times it appeared.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_p < MIN_TOP_P:
            raise ValueError(f"top_p must be >= {MIN_TOP_P}, got {self.top_p!r}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be a non-negative 64-bit integer, got {self.seed!r}")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing to do on the host but the argmax: no log-probabilities, no penalties (a decode
        step may then pick its token on the device)."""
        return self.greedy and self.logprobs is None and not self.penalized


Logprob = tuple[int, float, tuple[tuple[int, float], ...]]  # token id, its log-probability, the top alternatives


def logprob_rows(logits: torch.Tensor, chosen: list[int], k: int) -> list[Logprob]:
    """For each row of ``logits`` [n, V] (the model's, fp32): the log-softmax of ``chosen[row]`` and the row's
    ``k`` most likely tokens with theirs (ties in id order)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(-1, torch.tensor(chosen, device=logp.device).view(-1, 1)).view(-1).tolist()
    if k > 0:
        top_v, top_i = logp.topk(k, dim=-1)
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(top_i.tolist(), top_v.tolist(), strict=True)]
    else:
        tops = [()] * len(chosen)
    return [(t, lp, top) for t, lp, top in zip(chosen, picked, tops, strict=True)]


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zeroes all but the smallest set of most likely tokens whose mass reaches top_p; renormalises."""
    if top_p >= 1.0:
        return probs
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    # Keep a token if the mass strictly before it is below top_p (so the first token is always kept).
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, idx, keep_sorted)
    filtered = probs * keep
    return filtered / filtered.sum(-1, keepdim=True)


class Sampler:
    """Holds one torch.Generator per request so seeded requests are reproducible in any batch."""

    def __init__(self) -> None:
        self._gens: dict[int, torch.Generator] = {}
        self._counts: dict[int, dict[int, int]] = {}  # a penalized sequence's generated tokens, counted

    def add(self, seq_id: int, params: SamplingParams) -> None:
        if params.penalized:
            self._counts[seq_id] = {}
        if params.greedy:
            return
        g = torch.Generator(device="cpu")
        if params.seed is None:
            g.seed()
        else:
            g.manual_seed(params.seed)
        self._gens[seq_id] = g

    def generator(self, seq_id: int) -> torch.Generator | None:
        """The request's own generator (None for a greedy request): speculative acceptance draws from it too."""
        return self._gens.get(seq_id)

    def remove(self, seq_id: int) -> None:
        self._gens.pop(seq_id, None)
        self._counts.pop(seq_id, None)

    def _penalize(self, logits: torch.Tensor, seq_ids: list[int], params: list[SamplingParams]) -> torch.Tensor:
        rows = [i for i, p in enumerate(params) if p.penalized and self._counts.get(seq_ids[i])]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            p, counts = params[i], self._counts[seq_ids[i]]
            ids = torch.tensor(list(counts), device=logits.device)
            n = torch.tensor(list(counts.values()), dtype=logits.dtype, device=logits.device)
            logits[i, ids] -= p.presence_penalty + p.frequency_penalty * n
        return logits

    def sample(self, logits: torch.Tensor, seq_ids: list[int], params: list[SamplingParams]) -> list[int]:
        """logits: [num_seqs, V] fp32. Returns one token id per sequence."""
        out = self._draw(self._penalize(logits, seq_ids, params), seq_ids, params)
        for sid, t in zip(seq_ids, out, strict=True):
            counts = self._counts.get(sid)
            if counts is not None:
                counts[t] = counts.get(t, 0) + 1
        return out

    def _draw(self, logits: torch.Tensor, seq_ids: list[int], params: list[SamplingParams]) -> list[int]:
        greedy_ids = logits.argmax(-1).tolist()
        out = []
        for row, (sid, p) in enumerate(zip(seq_ids, params, strict=True)):
            if p.greedy:
                out.append(greedy_ids[row])
                continue
            probs = torch.softmax(logits[row].float().cpu() / p.temperature, dim=-1)
            probs = top_p_filter(probs, p.top_p)
            out.append(int(torch.multinomial(probs, 1, generator=self._gens[sid]).item()))
        return out
