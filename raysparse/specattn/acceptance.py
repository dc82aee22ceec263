"""SpecAttn's acceptance rules: greedy, and standard speculative sampling for sampled requests.

Greedy (temperature 0): the longest prefix of the draft equal to the verifier's argmax, then the verifier's
own next token.

Sampling (temperature > 0; standard speculative sampling): the draft samples d_i from its
distribution q_i, the verifier gives p_i at each of the gamma + 1 positions. Draft token i is accepted with
probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token emitted instead is drawn from
the normalised residual max(0, p_i - q_i); when every draft token is accepted the verifier's extra position
gives one more token drawn from p_gamma. Every emitted token is then distributed exactly as plain sampling
from the verifier would give it. p and q are the distributions the plain sampler draws from (softmax of
logits / temperature, then the request's top-p filter: ``processed_probs``), so a request's output
distribution is that of ``raysparse.sampling.Sampler`` on the verifier alone.

All the draws of a sequence use that request's own seeded ``torch.Generator`` (the sampler's), on the CPU,
so a seeded request is reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from raysparse.sampling import SamplingParams, top_p_filter


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the plain sampler draws from for ``params`` (temperature > 0): [..., V] fp32, CPU."""
    if params.greedy:
        raise ValueError("a greedy request has no sampling distribution")
    probs = torch.softmax(logits.float().cpu() / params.temperature, dim=-1)
    return top_p_filter(probs, params.top_p)


def greedy_accept(verifier_argmax: Sequence[int], drafts: Sequence[int]) -> tuple[int, int]:
    """(accepted draft tokens, the verifier's next token): ``verifier_argmax`` has len(drafts) + 1 entries."""
    if len(verifier_argmax) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} draft tokens need {len(drafts) + 1} verifier positions, "
                         f"got {len(verifier_argmax)}")
    n = 0
    while n < len(drafts) and drafts[n] == verifier_argmax[n]:
        n += 1
    return n, int(verifier_argmax[n])


def sampling_accept(p: torch.Tensor, q: torch.Tensor, drafts: Sequence[int],
                    generator: torch.Generator | None = None) -> tuple[int, int]:
    """The speculative-sampling rule. ``p`` [gamma + 1, V] the verifier's distributions, ``q`` [gamma, V]
    the draft's (each draft token was drawn from its row), ``drafts`` the gamma draft tokens. Returns
    (accepted draft tokens, the next token: a residual draw at the first rejection, else a draw from p[gamma])."""
    g = len(drafts)
    if p.shape[0] != g + 1 or q.shape[0] != g or (g and p.shape[1] != q.shape[1]):
        raise ValueError(f"{g} draft tokens need p [{g + 1}, V] and q [{g}, V], got {list(p.shape)} and "
                         f"{list(q.shape)}")
    p, q = p.double().cpu(), q.double().cpu()
    for i, d in enumerate(drafts):
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        # u < p/q, written without the division: q[i, d] > 0 because d was drawn from q[i].
        if u * float(q[i, d]) < float(p[i, d]):
            continue
        residual = (p[i] - q[i]).clamp(min=0.0)
        total = float(residual.sum())
        # A residual of zero mass means p == q up to rounding, where a rejection has probability ~0: p itself.
        dist = residual / total if total > 0 else p[i]
        return i, int(torch.multinomial(dist, 1, generator=generator))
    return g, int(torch.multinomial(p[g], 1, generator=generator))


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token drawn from ``probs`` [V]."""
    return int(torch.multinomial(probs.double(), 1, generator=generator))
