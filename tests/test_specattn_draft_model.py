"""SpecAttn with a separate draft model of another depth and head count, and the speculative-sampling rule.

Oracles: plain greedy decoding of the verifier (p = 1 must reproduce it token for token); the verifier's
exact next-token distributions, computed by full prefills, against which a chi-square test checks the
tokens that speculative sampling emits; transformers' eager attention weights, from which the layer map
across the two models is recomputed independently.
"""

from __future__ import annotations

import pytest
import torch
from helpers import fresh_cache, random_state, tiny_hf_config

from raysparse.attention import DenseAttention
from raysparse.config import ModelConfig
from raysparse.generate import FinishEvent, GenerationRequest, Generator, TokenEvent
from raysparse.loader import model_from_state
from raysparse.methods.registry import create_backend, method_capabilities
from raysparse.sampling import SamplingParams
from raysparse.specattn import SpecAttn, SpecAttnConfig, SpecAttnGenerator
from raysparse.specattn.acceptance import greedy_accept, sampling_accept
from raysparse.specattn.draft_model import DraftModelError, SeparateDraft, check_draft_compatible
from raysparse.specattn.dtw import kl_similarity, monotone_dtw
from raysparse.specattn.layer_map import proportional_map
from raysparse.specattn.map_measure import compute_cross_layer_map
from raysparse.specattn.map_store import load_layer_map, map_file_name, resolve_draft_layer_map, save_layer_map

P_MIN = 1e-4  # chi-square p-value below which a distribution is rejected


@pytest.fixture(autouse=True)
def fresh_seed():
    print(f"torch seed {torch.seed()}")


def _model(kv_heads: int, group: int, layers: int, vocab: int = 97, head_scale: float = 1.0):
    hf = tiny_hf_config(num_kv_heads=kv_heads, group=group, layers=layers)
    hf.vocab_size = vocab
    state = random_state(hf, seed=int(torch.randint(0, 2**31 - 1, ()))).state_dict()
    state["lm_head.weight"] = state["lm_head.weight"] * head_scale  # sharper, more distinct distributions
    return model_from_state(hf, state)


@pytest.fixture(scope="module")
def pair():
    """A 5-layer verifier (2 KV heads, group 2) and a 2-layer draft (1 KV head, group 3): other depth, other
    head count, other width."""
    torch.set_num_threads(1)
    return _model(2, 2, 5), _model(1, 3, 2)


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed ``counts`` against ``probs``; cells expecting fewer than 5 draws are pooled."""
    n = float(counts.sum())
    exp = probs.double() * n
    small = exp < 5
    obs_c, exp_c = counts.double()[~small], exp[~small]
    if small.any():
        obs_c = torch.cat([obs_c, counts.double()[small].sum()[None]])
        exp_c = torch.cat([exp_c, exp[small].sum()[None]])
    stat = float(((obs_c - exp_c) ** 2 / exp_c.clamp(min=1e-12)).sum())
    df = obs_c.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def _run(gen, requests):
    done, streamed = {}, {}
    for ev in gen.generate(requests):
        if isinstance(ev, TokenEvent):
            streamed.setdefault(ev.request_id, []).append(ev.token_id)
        elif isinstance(ev, FinishEvent):
            assert ev.finish_reason == "length", ev.error
            done[ev.request_id] = ev.token_ids
    return done, streamed


def _draft(verifier, draft_model, tokens: int = 1024) -> SeparateDraft:
    return SeparateDraft(draft_model, verifier.cfg, "tiny-draft", tokens)


# ---- the acceptance rules ---------------------------------------------------------------------------
def test_greedy_accept_is_the_longest_matching_prefix():
    assert greedy_accept([5, 6, 7, 8], [5, 6, 1]) == (2, 7)
    assert greedy_accept([5, 6, 7, 8], [5, 6, 7]) == (3, 8)
    assert greedy_accept([4, 6], [5]) == (0, 4)
    with pytest.raises(ValueError, match="verifier positions"):
        greedy_accept([1, 2], [1, 2])


def _wrong_rule(p, q, drafts, generator):
    """A plausible mistake: rejections resample from p instead of the residual max(0, p - q)."""
    for i, d in enumerate(drafts):
        if float(torch.rand((), generator=generator, dtype=torch.float64)) * float(q[i, d]) < float(p[i, d]):
            continue
        return i, int(torch.multinomial(p[i].double(), 1, generator=generator))
    return len(drafts), int(torch.multinomial(p[-1].double(), 1, generator=generator))


@pytest.mark.parametrize("rule", [sampling_accept, _wrong_rule])
def test_sampling_rule_emits_the_verifier_distribution(rule):
    """Context-free p and q (each position's distributions fixed): the k-th emitted token of a round must be
    distributed as p[k]. The same test rejects a wrong residual, so it can fail."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    print(f"sampling-rule seed {seed}")
    g = torch.Generator().manual_seed(seed)
    V, gamma, draws = 6, 2, 12000
    p = torch.softmax(torch.randn(gamma + 1, V, generator=g, dtype=torch.float64) * 1.5, -1)
    q = torch.softmax(torch.randn(gamma, V, generator=g, dtype=torch.float64) * 1.5, -1)
    firsts, seconds = torch.zeros(V), torch.zeros(V)
    accepted = 0
    for _ in range(draws):
        drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(gamma)]
        n, nxt = rule(p, q, drafts, g)
        out = drafts[:n] + [nxt]
        accepted += n
        firsts[out[0]] += 1
        if len(out) > 1:
            seconds[out[1]] += 1
    p1, p2 = chi_square_p(firsts, p[0]), chi_square_p(seconds, p[1])
    print(f"acceptance {accepted / (draws * gamma):.3f}; p-values {p1:.3g} {p2:.3g}")
    if rule is sampling_accept:
        assert p1 > P_MIN and p2 > P_MIN
    else:
        assert min(p1, p2) < P_MIN


def test_sampling_rule_checks_shapes():
    with pytest.raises(ValueError, match="need p"):
        sampling_accept(torch.ones(2, 4) / 4, torch.ones(2, 4) / 4, [1, 2])


# ---- compatibility -------------------------------------------------------------------------------
class _Tok:
    def __init__(self, vocab: dict[str, int], eos: int = 0) -> None:
        self.vocab, self.eos_token_id, self.bos_token_id = vocab, eos, None

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


def test_draft_compatibility_is_checked(pair):
    verifier, draft = pair
    check_draft_compatible(verifier.cfg, draft.cfg, None, None)
    other = ModelConfig(**{**verifier.cfg.__dict__, "vocab_size": 50})
    with pytest.raises(DraftModelError, match="vocabulary of 50 tokens"):
        check_draft_compatible(verifier.cfg, other, None, None)
    with pytest.raises(DraftModelError, match="no tokenizer"):
        check_draft_compatible(verifier.cfg, draft.cfg, _Tok({"a": 0}), None)
    with pytest.raises(DraftModelError, match="vocabulary differs"):
        check_draft_compatible(verifier.cfg, draft.cfg, _Tok({"a": 0, "b": 1}), _Tok({"a": 1, "b": 0}))
    with pytest.raises(DraftModelError, match="eos_token_id"):
        check_draft_compatible(verifier.cfg, draft.cfg, _Tok({"a": 0}, eos=0), _Tok({"a": 0}, eos=1))
    with pytest.raises(DraftModelError):
        SeparateDraft(_model(1, 2, 2, vocab=50), verifier.cfg, "x", 64)


# ---- greedy end to end -------------------------------------------------------------------------------
def _requests(max_new: int, lens=(37, 70, 9), params: SamplingParams | None = None):
    params = params or SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    return [GenerationRequest(tuple(torch.randint(0, 97, (n,)).tolist()), params, str(i))
            for i, n in enumerate(lens)]


def test_separate_draft_with_p1_decodes_exactly_greedy(pair):
    verifier, draft = pair
    reqs = _requests(21)
    want, _ = _run(Generator(verifier, fresh_cache(verifier, 512), DenseAttention(verifier.cfg.num_layers)), reqs)
    cache = fresh_cache(verifier, 512)
    backend = SpecAttn(verifier.cfg, SpecAttnConfig(top_p=1.0, gamma=3))
    sep = _draft(verifier, draft)
    got, streamed = _run(SpecAttnGenerator(verifier, cache, backend, draft=sep), reqs)
    assert got == want and {k: tuple(v) for k, v in streamed.items()} == want
    s = backend.stats.to_dict()
    assert s["rounds"] > 0 and 0 <= s["accepted"] <= s["drafted"] and s["tokens_per_round"] >= 1
    assert backend.layer_map.draft == "tiny-draft" and len(backend.layer_map.mapping) == verifier.cfg.num_layers
    assert cache.free_pages == cache.num_pages and sep.cache.free_pages == sep.cache.num_pages


def test_a_separate_copy_of_the_verifier_is_always_accepted(pair):
    """The draft's own cache is kept in step: a draft with the verifier's weights proposes its greedy tokens."""
    verifier, _ = pair
    reqs = _requests(17, lens=(40, 12))
    backend = SpecAttn(verifier.cfg, SpecAttnConfig(top_p=1.0, gamma=4))
    got, _ = _run(SpecAttnGenerator(verifier, fresh_cache(verifier, 512), backend,
                                    draft=_draft(verifier, verifier)), reqs)
    want, _ = _run(Generator(verifier, fresh_cache(verifier, 512), DenseAttention(verifier.cfg.num_layers)), reqs)
    assert got == want
    s = backend.stats
    print(f"acceptance {s.acceptance_rate:.3f}")
    assert s.acceptance_rate > 0.95 and s.tokens_per_round > 4


def test_separate_draft_plans_sparse_verification(pair):
    verifier, draft = pair
    # contexts of up to 26 chunks and a small p: the union of a round's draft rows (every step and KV head)
    # cannot cover them all, as it could at ~10 chunks where a random draft's attention is diffuse
    reqs = _requests(10, lens=(400, 9, 300))
    cache = fresh_cache(verifier, 1024)
    backend = SpecAttn(verifier.cfg, SpecAttnConfig(top_p=0.1, gamma=3))
    got, _ = _run(SpecAttnGenerator(verifier, cache, backend, draft=_draft(verifier, draft)), reqs)
    assert {k: len(v) for k, v in got.items()} == {"0": 10, "1": 10, "2": 10}
    s = backend.stats.to_dict()
    assert 0 < s["kv_reduction"] < 1 and s["kv_read_fraction_per_layer"][:2] == [1.0, 1.0]
    assert 0 < s["draft_kv_read_fraction"] < 1  # a 2-layer draft of 1 KV head reads less than the verifier


# ---- sampling end to end ---------------------------------------------------------------------------------
def test_speculative_sampling_keeps_the_verifiers_distribution():
    """Many seeded requests of one prompt, sampled at temperature 1 through SpecAttn with a separate draft:
    the second and third tokens (both emitted by speculative rounds) follow the verifier's exact marginals."""
    torch.set_num_threads(1)
    V = 8
    verifier, draft = _model(2, 2, 3, vocab=V, head_scale=5.0), _model(1, 2, 2, vocab=V, head_scale=5.0)
    seed = int(torch.randint(0, 2**31 - 1, ()))
    print(f"request seeds from {seed}")
    prompt = tuple(torch.randint(0, V, (6,)).tolist())
    n_req = 1500
    params = [SamplingParams(max_new_tokens=3, temperature=1.0, seed=seed + i, ignore_eos=True) for i in range(n_req)]
    reqs = [GenerationRequest(prompt, p, str(i)) for i, p in enumerate(params)]
    backend = SpecAttn(verifier.cfg, SpecAttnConfig(top_p=1.0, gamma=2))
    gen = SpecAttnGenerator(verifier, fresh_cache(verifier, 16 * n_req + 64), backend,
                            draft=SeparateDraft(draft, verifier.cfg, "tiny-draft", 16 * n_req + 64))
    done, _ = _run(gen, reqs)
    outs = torch.tensor([done[str(i)] for i in range(n_req)])

    # The verifier's exact distributions: P(t1), P(t2 | t1), P(t3 | t1, t2) by full prefills.
    def dist(prefix: tuple[int, ...]) -> torch.Tensor:
        from helpers import full_logits

        return torch.softmax(full_logits(verifier, list(prefix))[-1].double(), -1)

    p1 = dist(prompt)
    p2 = torch.stack([dist(prompt + (a,)) for a in range(V)])  # [t1, t2]
    m2 = (p1[:, None] * p2).sum(0)
    m3 = torch.zeros(V, dtype=torch.float64)
    for a in range(V):
        for b in range(V):
            m3 += p1[a] * p2[a, b] * dist(prompt + (a, b))
    s = backend.stats
    pv = [chi_square_p(torch.bincount(outs[:, k], minlength=V), m) for k, m in ((0, p1), (1, m2), (2, m3))]
    print(f"acceptance {s.acceptance_rate:.3f}; p-values {pv}")
    assert 0.05 < s.acceptance_rate < 0.95  # both acceptance and the residual path were exercised
    assert min(pv) > P_MIN


def test_specattn_capabilities_allow_sampling():
    caps = method_capabilities("specattn")
    assert caps.needs_draft and not caps.greedy_only


# ---- the layer map across models -------------------------------------------------------------------------
def _eager_rows(model_state_hf, ids: list[int], steps: int, kv_heads_out: int, kv_heads: int) -> torch.Tensor:
    """Reference rows from transformers' eager attention: [L, steps, kv_heads_out, n] over the last ``steps``
    query rows, averaged per KV group (and over every head when mapped to another head count)."""
    out = model_state_hf(torch.tensor([ids]), output_attentions=True)
    rows = []
    for a in out.attentions:  # [1, h, n, n]
        a = a[0, :, -steps:, :].double()  # [h, steps, n]
        per_kv = a.view(kv_heads, -1, steps, a.shape[-1]).mean(1)  # [h_kv, steps, n]
        if kv_heads != kv_heads_out:
            per_kv = per_kv.mean(0, keepdim=True).expand(kv_heads_out, -1, -1)
        rows.append(per_kv.permute(1, 0, 2))
    return torch.stack(rows)


def test_cross_layer_map_matches_eager_attention_and_is_saved_by_draft(tmp_path):
    torch.set_num_threads(1)
    hv, hd = tiny_hf_config(num_kv_heads=2, group=2, layers=5), tiny_hf_config(num_kv_heads=1, group=3, layers=3)
    sv, sd = (random_state(h, seed=int(torch.randint(0, 2**31 - 1, ()))) for h in (hv, hd))
    verifier, draft = model_from_state(hv, sv.state_dict()), model_from_state(hd, sd.state_dict())
    steps = 4
    windows = [torch.randint(0, 97, (n,)).tolist() for n in (40, 29)]
    lm = compute_cross_layer_map(verifier, draft, windows, "tiny-draft", steps)
    assert lm.draft == "tiny-draft" and lm.draft_layers == (0, 1, 2) and len(lm.mapping) == 5
    assert all(a <= b for a, b in zip(lm.mapping, lm.mapping[1:], strict=False))

    # Independent oracle: eager attention weights of both transformers models, KL averaged over rows.
    for m in (sv, sd):
        m.config._attn_implementation = "eager"
        m.model.config._attn_implementation = "eager"
    sims = []
    for w in windows:
        with torch.no_grad():
            rv = _eager_rows(sv, w, steps, 2, 2)
            rd = _eager_rows(sd, w, steps, 2, 1)
        sims.append((kl_similarity(rv, rd).double(), rv.shape[1] * rv.shape[2]))
    ref = sum(s * n for s, n in sims) / sum(n for _, n in sims)
    torch.testing.assert_close(torch.tensor(lm.similarity, dtype=torch.float64), ref, rtol=1e-3, atol=1e-4)
    assert list(lm.mapping) == monotone_dtw(ref)[0]

    # Saved next to the verifier under the draft's key; the self-speculative map is another file.
    path = save_layer_map(lm, model_dir=tmp_path)
    assert path.name == map_file_name("tiny-draft") != map_file_name("")
    assert load_layer_map(model_dir=tmp_path, num_layers=5, draft="tiny-draft") == lm
    assert load_layer_map(model_dir=tmp_path, num_layers=5) is None
    with pytest.raises(ValueError, match="was made for draft"):
        load_layer_map(path=path, num_layers=5, draft="another")
    sep = SeparateDraft(draft, verifier.cfg, "tiny-draft", 256)
    assert resolve_draft_layer_map(verifier, tmp_path, sep) == lm  # loaded, not measured again
    fallback = resolve_draft_layer_map(verifier, tmp_path / "none", sep, tokenizer=None)
    assert fallback == proportional_map(5, 3, "tiny-draft") and fallback.mapping == (0, 0, 1, 2, 2)
    backend = create_backend("specattn", verifier.cfg)
    backend.set_layer_map(lm)  # a separate draft's map is accepted whatever the self-draft's layers
