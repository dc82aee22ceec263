"""The fidelity harness: task generation and exact scoring, the attention metrics against brute force on fresh
random inputs, a tiny end-to-end run on a random Llama, and the ``eval`` command's one-line errors."""

from __future__ import annotations

import itertools
import json
import math
import re
from typing import Any

import pytest
import torch
from helpers import random_state, tiny_hf_config

from raysparse.attention import DenseAttention, dense_attention
from raysparse.config import ModelConfig
from raysparse.eval.config import EvalConfig
from raysparse.eval.decode_ppl import decode_nll, scored_span
from raysparse.eval.harness import Harness, run_eval
from raysparse.eval.metrics import (
    FidelityTracer,
    dense_rows_output,
    group_probs,
    pool,
    retained_mass,
    sample_rows,
    selection_fidelity,
)
from raysparse.eval.report import method_columns, plot, summary_line, table, write_json
from raysparse.eval.settings import Setting, param_combinations, parse_method_params, parse_value, plan_settings
from raysparse.eval.tasks import TASK_NAMES, EvalTask, build_task, perplexity_windows
from raysparse.kv_cache import KVCache
from raysparse.loader import model_from_state
from raysparse.methods.base import MethodConfig, SparseMethod
from raysparse.methods.budget import row_budget
from raysparse.methods.registry import create_backend
from raysparse.methods.selection import BlockSelection, TokenSelection, indices_from_mask, topk_mask
from raysparse.methods.sparse_attention import block_sparse_attention
from raysparse.methods.views import SeqContext
from raysparse.specattn.method import SpecAttn, SpecAttnConfig
from raysparse.workload import load_haystack_text, synthetic_haystack


class CharTokenizer:
    """Printable ASCII and newline, one id each, plus an end-of-sequence id: 97 ids, the tiny Llama's vocab."""

    chars = "\n" + "".join(chr(c) for c in range(32, 127))
    eos_token_id = len(chars)

    def _encode(self, text: str) -> list[int]:
        return [self.chars.find(c) if c in self.chars else self.chars.index("?") for c in text]

    def __call__(self, text: str | list[str], add_special_tokens: bool = False) -> dict[str, Any]:
        return {"input_ids": [self._encode(t) for t in text] if isinstance(text, list) else self._encode(text)}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.chars[i] for i in ids if i < len(self.chars))

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            tokenize: bool = False) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from raysparse.loader import ModelNotFoundError, load_tokenizer, materialize, resolve_source

    try:  # the converted copy loads in a second; parsing the GGUF file takes far longer
        return load_tokenizer(materialize(resolve_source(None)))
    except ModelNotFoundError as e:
        pytest.skip(f"default model not installed: {e}")


@pytest.fixture(scope="module")
def haystack() -> tuple[str, str]:
    return load_haystack_text(None)


# ---- tasks ---------------------------------------------------------------------------------------------

def _whole(word: str, text: str) -> int:
    return len(re.findall(rf"(?<![A-Za-z0-9]){re.escape(word)}(?![A-Za-z0-9])", text))


@pytest.mark.parametrize("name", TASK_NAMES)
def test_tasks_fit_the_context_and_hide_each_answer_once(tokenizer, haystack, name):
    for seed in range(3):
        task = build_task(name, tokenizer, *haystack, context_tokens=1024, seed=seed)
        assert 0.9 * 1024 <= len(task.prompt_ids) <= 1024
        text = tokenizer.decode(task.prompt_ids)
        assert text.rstrip().endswith("<|im_start|>assistant")
        for needle in task.needles:  # every needle is in the prompt, as its own paragraph, before the question
            assert text.count(f"\n\n{needle}\n\n") == 1
            assert text.index(needle) < text.rindex(task.question)
        if name == "variable_tracking":  # each name is assigned exactly once
            assert all(len(re.findall(rf"VAR {v} = ", text)) == 1 for v in task.expected)
        else:
            assert all(_whole(v, text) == 1 for v in task.expected)
        assert task.score(text[text.rindex(task.question):]) == 0.0  # the question gives nothing away


def test_variable_chain_is_consistent(tokenizer, haystack):
    for seed in range(4):
        task = build_task("variable_tracking", tokenizer, *haystack, context_tokens=1024, seed=seed)
        text = tokenizer.decode(task.prompt_ids)
        env: dict[str, str] = {}
        for lhs, rhs in re.findall(r"^VAR ([A-Z]{5}) = ([A-Z]{5}|\d+)\.$", text, re.M):
            assert lhs not in env
            env[lhs] = env[rhs] if rhs.isalpha() else rhs  # a copy resolves: its source came earlier
        asked = re.search(r"assigned the value (\d+)", task.question).group(1)
        assert len(env) == 8 and sorted(set(env.values()))
        assert {v for v, val in env.items() if val == asked} == set(task.expected)
        assert len(set(env.values())) == 2  # the distractor chain has its own value


def test_seeds_vary_values_and_repeat_exactly(tokenizer, haystack):
    for name in TASK_NAMES:
        tasks = [build_task(name, tokenizer, *haystack, context_tokens=512, seed=s) for s in range(4)]
        assert len({t.expected for t in tasks}) == 4
        assert len({t.prompt_ids for t in tasks}) == 4
        assert build_task(name, tokenizer, *haystack, context_tokens=512, seed=2) == tasks[2]


def test_scoring_is_exact_fraction_of_whole_answers():
    task = EvalTask("multi_value", 0, (1,), "q", ("1234567", "7654321"), (), 256, "s", 15)
    assert task.score("1234567 and 7654321") == 1.0
    assert task.score("The numbers are 1234567.") == 0.5
    assert task.score("12345678, 76543210") == 0.0  # inside a longer number does not count
    vt = EvalTask("variable_tracking", 0, (1,), "q", ("ABCDE", "FGHIJ"), (), 256, "s", 5)
    assert vt.score("ABCDE FGHIJ") == 1.0 and vt.score("XABCDE FGHIJK") == 0.0


def test_synthetic_haystack_and_a_char_tokenizer_work_too():
    tok = CharTokenizer()
    for name in TASK_NAMES:
        task = build_task(name, tok, synthetic_haystack(400), "synthetic", context_tokens=1024, seed=1)
        assert 0.9 * 1024 <= len(task.prompt_ids) <= 1024
        assert task.score(tok.decode(task.prompt_ids)) == 1.0


def test_perplexity_windows_are_exact_and_seeded(tokenizer, haystack):
    a = perplexity_windows(tokenizer, haystack[0], 300, 2, seed=0)
    assert [len(w) for w in a] == [300, 300] and a[0] != a[1]
    assert perplexity_windows(tokenizer, haystack[0], 300, 2, seed=0) == a


# ---- metrics against brute force -----------------------------------------------------------------------

def _inputs(h_kv: int = 2, g: int = 3, n: int = 150, d: int = 16, seed: int | None = None):
    gen = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 1 << 30, ())))
    q = torch.randn(n, h_kv * g, d, generator=gen) * 2
    k = torch.randn(h_kv, n, d, generator=gen) * 2
    v = torch.randn(h_kv, n, d, generator=gen)
    return q, k, v


def test_group_probs_and_dense_rows_match_a_loop():
    q, k, v = _inputs()
    h_kv, n, d = k.shape
    g = q.shape[1] // h_kv
    pos = torch.tensor([0, 17, 99, n - 1])
    probs = group_probs(q[pos], k, pos)
    for r, p in enumerate(pos.tolist()):
        for kv in range(h_kv):
            ref = torch.stack([torch.softmax(k[kv, : p + 1] @ q[p, kv * g + j] / math.sqrt(d), 0)
                               for j in range(g)]).mean(0)
            assert torch.allclose(probs[kv, r, : p + 1], ref, atol=1e-6)
            assert probs[kv, r, p + 1:].abs().max().item() == 0 if p + 1 < n else True
    out = dense_rows_output(q[pos], k, v, pos)
    assert torch.allclose(out, dense_attention(q, k, v)[pos], atol=1e-5)


def _brute_best(mass: list[float], allowed: list[int], c: int) -> float:
    return max(sum(mass[i] for i in sub) for sub in itertools.combinations(allowed, c))


def test_retained_mass_matches_the_best_subset_by_brute_force():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    for _ in range(40):
        u = 9
        mass = torch.rand(u, generator=gen) ** 3
        causal = torch.arange(u) < int(torch.randint(1, u + 1, (), generator=gen))
        mass = mass * causal / (mass * causal).sum()
        selected = torch.rand(u, generator=gen) < 0.4
        retained, got = retained_mass(mass, selected, causal)
        sel = [i for i in range(u) if selected[i] and causal[i]]
        allowed = [i for i in range(u) if causal[i]]
        assert got.item() == pytest.approx(sum(mass[i].item() for i in sel), abs=1e-6)
        if sel:
            assert retained.item() == pytest.approx(got.item() / _brute_best(mass.tolist(), allowed, len(sel)),
                                                    rel=1e-5)
            assert retained.item() <= 1 + 1e-6
        else:
            assert retained.item() == 0.0  # an empty selection retains nothing
        # The oracle's own choice of the same size retains everything.
        c = max(1, len(sel))
        oracle = topk_mask(mass, c, causal)
        assert retained_mass(mass, oracle, causal)[0].item() == pytest.approx(1.0, abs=1e-6)


def test_block_selection_fidelity_against_per_row_brute_force():
    q, k, v = _inputs(n=150)
    b, h_kv, n = 16, k.shape[0], k.shape[1]
    nb = -(-n // b)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    qb = torch.arange(nb)[:, None]
    causal = torch.arange(nb)[None, :] <= qb
    mask = (torch.rand(h_kv, nb, nb, generator=gen) < 0.4) & causal
    mask |= torch.eye(nb, dtype=torch.bool)  # the diagonal block keeps every row non-empty
    sel = BlockSelection(indices_from_mask(mask), b)
    pos = sample_rows(0, n, 20, b)
    retained, got = selection_fidelity(sel, q[pos], k, pos, 0)
    probs = group_probs(q[pos], k, pos)
    for r, p in enumerate(pos.tolist()):
        for kv in range(h_kv):
            bm = [probs[kv, r, j * b:(j + 1) * b].sum().item() for j in range(nb)]
            chosen = [j for j in range(nb) if mask[kv, p // b, j] and j * b <= p]
            allowed = [j for j in range(nb) if j * b <= p]
            assert got[kv, r].item() == pytest.approx(sum(bm[j] for j in chosen), abs=1e-5)
            assert retained[kv, r].item() == pytest.approx(sum(bm[j] for j in chosen)
                                                           / _brute_best(bm, allowed, len(chosen)), rel=1e-4)
    # Attending the selection with the reference kernel and tracing it: a full selection is exact.
    full = BlockSelection(indices_from_mask(causal.expand(h_kv, nb, nb)), b)
    out, _ = block_sparse_attention(q, k, v, full)
    tracer = FidelityTracer(num_layers=1, rows=32)
    tracer(SeqContext(0, 0, 0, n, {}), q, k, v, full, out)
    s = tracer.summary()
    assert s["out_err"]["prefill"] < 1e-5 and s["attn_mass"]["prefill"] == pytest.approx(1.0, abs=1e-5)
    assert s["retained"]["prefill"] == pytest.approx(1.0, abs=1e-5) and s["retained"]["decode"] is None


def test_dense_rows_count_as_full_and_a_missing_selection_measures_error_only():
    from raysparse.methods.delta_config import DeltaSelection

    q, k, v = _inputs(n=128)
    b, h_kv, n = 16, k.shape[0], k.shape[1]
    nb = n // b
    diag = torch.eye(nb, dtype=torch.bool).expand(h_kv, nb, nb)
    dense_rows = torch.zeros(n, dtype=torch.bool)
    dense_rows[::8] = True
    sel = DeltaSelection(indices_from_mask(diag), b, dense_rows, gamma=8, mode="far-merge")
    pos = torch.arange(b, n)
    retained, got = selection_fidelity(sel, q[pos], k, pos, 0, dense_rows[pos])
    assert torch.allclose(got[:, dense_rows[pos]], torch.ones(1), atol=1e-5)
    assert (got[:, ~dense_rows[pos]] < 1 - 1e-4).all()
    tracer = FidelityTracer(num_layers=2, rows=n)
    out, _ = block_sparse_attention(q, k, v, BlockSelection(sel.indices, b))
    tracer(SeqContext(1, 0, 0, n, {}), q, k, v, sel, out)
    tracer(SeqContext(0, 0, 0, n, {}), q, k, v, None, out)
    s = tracer.summary()
    assert s["retained"]["prefill_per_layer"][0] is None and s["out_err"]["prefill_per_layer"][0] > 0
    assert 0 < s["attn_mass"]["prefill_per_layer"][1] < 1


def test_token_selection_fidelity_for_decode():
    q, k, v = _inputs(n=120)
    h_kv, n, d = k.shape
    g = q.shape[1] // h_kv
    pos = torch.tensor([n - 1])
    probs = group_probs(q[-1:], k, pos)[:, 0]  # [h_kv, n]
    oracle = TokenSelection(indices_from_mask(topk_mask(probs, 10, torch.ones_like(probs, dtype=torch.bool))))
    retained, got = selection_fidelity(oracle, q[-1:], k, pos, n - 1)
    assert torch.allclose(retained, torch.ones_like(retained), atol=1e-5)
    recent = TokenSelection(indices_from_mask(torch.arange(n).expand(h_kv, n) >= n - 10))
    retained, got = selection_fidelity(recent, q[-1:], k, pos, n - 1)
    assert (retained <= 1 + 1e-6).all()
    assert torch.allclose(got[:, 0], probs[:, -10:].sum(-1), atol=1e-6)
    # Block-granular decode selections are measured against the block oracle of the same size.
    blocks = TokenSelection(torch.tensor([[0, 7]] * h_kv, dtype=torch.int32), block_size=16)
    retained, got = selection_fidelity(blocks, q[-1:], k, pos, n - 1)
    bm = pool(probs, 16)
    best = bm.topk(2, -1).values.sum(-1)
    assert torch.allclose(got[:, 0], bm[:, 0] + bm[:, 7], atol=1e-6)
    assert torch.allclose(retained[:, 0], got[:, 0] / best, atol=1e-5)
    assert g * h_kv == q.shape[1] and d == k.shape[2]


# ---- the harness end to end on a tiny random Llama --------------------------------------------------------

class WindowMethod(SparseMethod):
    """Test-only: the sink block plus the most recent blocks, as many as the density allows."""

    name = "test_window"

    def select_prefill(self, ctx, q, k, v):
        b = self.config.block_size
        qb = torch.arange(ctx.q_start // b, (ctx.n - 1) // b + 1)[:, None]
        kb = torch.arange(-(-ctx.n // b))[None, :]
        keep = row_budget(self.config.density, qb + 1)
        mask = ((kb == 0) | ((kb <= qb) & (kb > qb - keep))).expand(k.shape[0], -1, -1)
        return BlockSelection(indices_from_mask(mask), b)

    def select_decode(self, ctx, q, k, v):
        keep = int(row_budget(self.config.density, torch.tensor(ctx.n)))
        mask = (torch.arange(ctx.n) >= ctx.n - keep) | (torch.arange(ctx.n) < 4)
        return TokenSelection(indices_from_mask(mask.expand(k.shape[0], -1)))


class BrokenMethod(WindowMethod):
    name = "test_broken"

    def select_prefill(self, ctx, q, k, v):
        raise NotImplementedError("test_broken has no prefill selection")


def _factory(name: str, cfg: ModelConfig, **params: Any):
    methods = {"test_window": WindowMethod, "test_broken": BrokenMethod}
    if name in methods:
        return methods[name](cfg, MethodConfig(**params))
    return create_backend(name, cfg, **params)


@pytest.fixture
def one_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a busy 2-core machine the threads' hand-offs
    cost several times the work itself."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_model():
    cfg = tiny_hf_config(num_kv_heads=2, group=2, layers=3)
    cfg.max_position_embeddings = 2048
    return model_from_state(cfg, random_state(cfg, seed=3).state_dict())


def test_tiny_end_to_end_report(tiny_model, tmp_path, one_thread):
    tok = CharTokenizer()
    cfg = EvalConfig(methods=("test_window", "test_broken"), densities=(0.3, 1.0), samples=1, context_tokens=768,
                     max_new_tokens=2, rows=16, decode_ppl_tokens=24)
    report = run_eval(tiny_model, tok, cfg, synthetic_haystack(400), "synthetic", backend_factory=_factory,
                      model_name="tiny")
    runs = report["runs"]
    assert [(r["method"], r["density_target"]) for r in runs] == [
        ("dense", None), ("test_window", 0.3), ("test_window", 1.0), ("test_broken", 0.3), ("test_broken", 1.0)]
    dense, w03, w10, broken = runs[0], runs[1], runs[2], runs[3]
    assert dense["status"] == "ok" and dense["density"] == 1.0
    assert dense["fidelity"]["retained"]["overall"] == 1.0 and dense["fidelity"]["out_err"]["overall"] == 0.0
    assert set(dense["accuracy_per_task"]) == set(TASK_NAMES) and len(dense["samples"]) == 4
    assert math.isfinite(dense["perplexity"]) and dense["perplexity"] > 1
    # Full density selects every causal block: exactly dense, so the same perplexity and zero output error.
    assert w10["density"] == pytest.approx(1.0)
    assert w10["perplexity"] == pytest.approx(dense["perplexity"], rel=1e-4)
    assert w10["decode_perplexity"] == pytest.approx(dense["decode_perplexity"], rel=1e-4)
    assert w03["decode_perplexity"] != pytest.approx(dense["decode_perplexity"], rel=1e-4)
    assert w03["density_decode"] < 0.9 and dense["density_decode"] == 1.0
    assert w10["fidelity"]["out_err"]["overall"] < 1e-4
    assert w10["fidelity"]["retained"]["prefill"] == pytest.approx(1.0, abs=1e-5)
    # A window keeps less: real density below 1, mass below 1, a measurable output error; dense layers 0, 1.
    f = w03["fidelity"]
    assert w03["status"] == "ok" and 0.2 < w03["density"] < 1.0
    assert w03["density_per_layer"][:2] == [1.0, 1.0] and w03["density_per_layer"][2] < 0.6
    assert f["retained"]["prefill_per_layer"][:2] == [None, None]
    assert 0 < f["retained"]["prefill_per_layer"][2] <= 1 + 1e-6 and 0 < f["attn_mass"]["overall"] < 1
    assert f["out_err"]["overall"] > 1e-4 and f["retained"]["decode"] is not None
    assert broken["status"] == "error" and "NotImplementedError" in broken["error"]
    # The report: JSON round trip, a PNG and a table with a row per setting.
    path = write_json(report, tmp_path)
    loaded = json.loads(path.read_text())
    for key in ("schema", "model", "haystack", "config", "perplexity_scored", "prompt_tokens", "elapsed_s", "runs"):
        assert key in loaded
    assert plot(report, tmp_path).read_bytes()[:4] == b"\x89PNG"
    assert table(report).row_count == 5
    assert "error: NotImplementedError" in summary_line(broken) and "accuracy" in summary_line(w03)


def test_untraced_eval_runs_the_fast_paths_with_the_same_numbers(tiny_model, one_thread, monkeypatch):
    """``rows=0``: no fidelity tracer, so Quest's batched seam runs (a traced run takes the per-sequence
    reference path); the density, accuracy and perplexities equal the traced run's, the fidelity is unknown."""
    from raysparse.methods.base import SparseMethod

    calls = {"batched": 0}
    seam = SparseMethod._prefill_batched

    def counted(self, *a, **k):
        calls["batched"] += 1
        return seam(self, *a, **k)

    monkeypatch.setattr(SparseMethod, "_prefill_batched", counted)
    tok = CharTokenizer()
    runs = {}
    for rows in (16, 0):
        cfg = EvalConfig(methods=("quest",), densities=(0.8,), samples=1, context_tokens=768, max_new_tokens=2,
                         rows=rows, decode_ppl_tokens=24, tasks=("single_needle",))
        before = calls["batched"]
        report = run_eval(tiny_model, tok, cfg, synthetic_haystack(400), "synthetic", model_name="tiny")
        runs[rows] = (report["runs"][1], calls["batched"] - before)
    (traced, traced_calls), (fast, fast_calls) = runs[16], runs[0]
    assert traced["status"] == fast["status"] == "ok"
    assert traced_calls == 0 and fast_calls > 0
    for key in ("retained", "attn_mass", "out_err"):  # measured when traced, unknown (None) when not
        assert traced["fidelity"][key]["overall"] is not None and fast["fidelity"][key]["overall"] is None
    assert fast["density"] == pytest.approx(traced["density"], rel=1e-6)
    assert fast["accuracy"] == traced["accuracy"]
    assert fast["perplexity"] == pytest.approx(traced["perplexity"], rel=1e-4)
    assert fast["decode_perplexity"] == pytest.approx(traced["decode_perplexity"], rel=1e-4)
    with pytest.raises(ValueError, match="rows must be >= 0"):
        EvalConfig(methods=("quest",), densities=(0.5,), rows=-1)


def test_decode_time_methods_report_their_own_columns(tiny_model, one_thread):
    """SpecAttn swept over top_p runs once per value (no density) through the speculative generator; CIS
    reports rho (1 when it never shares: threshold > 1); PSAW, whose budget is its schedule, runs once."""
    # 0.8 of the whole model: 0.4 at the one sparse layer of 3
    cfg = EvalConfig(methods=("specattn", "cis", "psaw"), densities=(0.8,), tasks=("single_needle",), samples=1,
                     context_tokens=512, max_new_tokens=2, rows=8, decode_ppl_tokens=12,
                     method_params=parse_method_params(["specattn:top_p=0.5,1.0", "specattn:chunk_size=1",
                                                        "cis:threshold=0.8,2"]))
    report = run_eval(tiny_model, CharTokenizer(), cfg, synthetic_haystack(300), "synthetic", model_name="tiny")
    runs = report["runs"]
    assert [(r["label"], r["density_target"]) for r in runs] == [
        ("dense", None), ("specattn (top_p=0.5, chunk_size=1)", None), ("specattn (top_p=1, chunk_size=1)", None),
        ("cis (threshold=0.8)", 0.8), ("cis (threshold=2)", 0.8), ("psaw", None)]
    assert all(r["status"] == "ok" for r in runs), [r["error"] for r in runs]
    dense, sparse_spec, full_spec, cis, cis_oracle, _ = runs
    # p = 1: exact verification, so dense's tokens and decode perplexity; p = 0.5 reads part of the context.
    assert full_spec["samples"][0]["output"] == dense["samples"][0]["output"]
    assert full_spec["decode_perplexity"] == pytest.approx(dense["decode_perplexity"], rel=1e-4)
    cols = method_columns(sparse_spec)
    assert 0 <= cols["accept"] <= 1 and 1 <= cols["tok/step"] <= 5 and 0 < cols["KV red"] < 1
    assert sparse_spec["fidelity"]["retained"]["decode"] is not None and sparse_spec["density_decode"] < 1
    assert method_columns(full_spec)["KV red"] == 0.0
    assert 0 < cis["extras"]["cis"]["retrieval_ratio"] <= 1 and cis_oracle["extras"]["cis"]["retrieval_ratio"] == 1
    assert method_columns(dense) == {"rho": None, "fallback": None, "accept": None, "tok/step": None, "KV red": None}
    assert table(report).row_count == len(runs)


def test_harness_rejects_a_context_past_the_model(tiny_model):
    with pytest.raises(ValueError, match="exceeds the model's 2048 positions"):
        Harness(tiny_model, CharTokenizer(), EvalConfig(context_tokens=2000))


def test_multi_row_decode_trace_equals_one_decode_row_at_a_time():
    """A verification step traced as decode (q [r, h, d]) sums exactly what r single-row decode calls over
    each row's own causal prefix would: retained, attention mass and output error."""
    h_kv, g, d, n, r = 2, 2, 8, int(torch.randint(40, 70, ())), 4
    q, k, v, out = torch.randn(r, h_kv * g, d), torch.randn(h_kv, n, d), torch.randn(h_kv, n, d), \
        torch.randn(r, h_kv * g, d)
    keep = torch.rand(h_kv, n) < 0.4
    keep[:, n - r:] = True  # the new rows themselves, as SpecAttn's plan
    sel = TokenSelection(indices_from_mask(keep))
    multi = FidelityTracer(1)
    multi(SeqContext(0, 1, n - r, n, {}), q, k, v, sel, out, phase="decode")
    single = FidelityTracer(1)
    for i in range(r):
        m = n - r + i + 1
        single(SeqContext(0, 1, m - 1, m, {}), q[i], k[:, :m], v[:, :m], sel, out[i])
    a, b = multi.sums[("decode", 0)], single.sums[("decode", 0)]
    assert a.pairs == b.pairs == r * h_kv
    for f in ("retained", "mass", "err_sq", "ref_sq"):
        assert getattr(a, f) == pytest.approx(getattr(b, f), rel=1e-5), f


# ---- settings and method parameters --------------------------------------------------------------------

def test_method_params_parse_and_sweep_every_combination():
    assert parse_value("0.97") == 0.97 and parse_value("2") == 2 and parse_value("False") is False
    assert parse_value("none") is None and parse_value("mean") == "mean"
    sweeps = parse_method_params(["specattn:top_p=0.95,0.97,0.99", "cis:threshold=0.8,2", "cis:radius=0,1"])
    assert sweeps[0] == ("specattn", "top_p", (0.95, 0.97, 0.99))
    assert param_combinations(sweeps, "cis") == [
        (("threshold", 0.8), ("radius", 0)), (("threshold", 0.8), ("radius", 1)),
        (("threshold", 2), ("radius", 0)), (("threshold", 2), ("radius", 1))]
    assert param_combinations(sweeps, "socket") == [()]
    # list values (a method's dense layers): commas inside brackets belong to the list
    assert parse_method_params(["socket:dense_layers=[],[0, 1]"]) == (("socket", "dense_layers", ((), (0, 1))),)
    with pytest.raises(ValueError, match="not a JSON list"):
        parse_value("[0,")
    plan = plan_settings(["socket", "specattn", "dense", "psaw"], [0.1, 0.2], sweeps, lambda m: m == "socket")
    assert plan == [Setting("dense"), Setting("socket", 0.1), Setting("socket", 0.2),
                    Setting("specattn", None, (("top_p", 0.95),)), Setting("specattn", None, (("top_p", 0.97),)),
                    Setting("specattn", None, (("top_p", 0.99),)), Setting("psaw")]
    assert plan[4].label == "specattn (top_p=0.97)" and plan[4].backend_params() == {"top_p": 0.97}
    assert Setting("cis", 0.2, (("threshold", 2),)).backend_params() == {"threshold": 2, "density": 0.2}
    for bad, needle in ((["cis"], "METHOD:KEY"), (["cis:threshold"], "METHOD:KEY"), (["cis:threshold="], "METHOD"),
                        (["cis:density=0.1"], "--densities"), (["cis:k=1", "cis:k=2"], "twice")):
        with pytest.raises(ValueError, match=needle):
            parse_method_params(bad)
    with pytest.raises(ValueError, match="not among the methods"):
        EvalConfig(methods=("socket",), method_params=parse_method_params(["cis:threshold=2"]))


# ---- teacher-forced decode perplexity ----------------------------------------------------------------------

def _window_nll_by_prefill(model, ids: list[int], p: int) -> float:
    """Independent reference: the model's prefill logits over the whole window, scored on ids[p + 1:]."""
    cache = KVCache(model.cfg, -(-len(ids) // 16), 16, torch.float32, "cpu", model.num_kv_heads)
    cache.allocate(0, len(ids))
    logits = model(torch.tensor(ids), cache.prepare([0], [len(ids)], True), cache, DenseAttention(model.cfg.num_layers),
                   all_logits=True)
    return float(torch.nn.functional.cross_entropy(logits[p:-1], torch.tensor(ids[p + 1:]), reduction="sum"))


def test_decode_perplexity_exact_backends_match_the_prefill_reference(tiny_model, one_thread):
    n, m = int(torch.randint(60, 90, ())), int(torch.randint(9, 20, ()))
    ids = torch.randint(0, 97, (n,)).tolist()
    p, count = scored_span(n, m)
    assert (p, count) == (n - 1 - m, m)
    want = _window_nll_by_prefill(tiny_model, ids, p)
    cache = KVCache(tiny_model.cfg, -(-n // 16) + 1, 16, torch.float32, "cpu", tiny_model.num_kv_heads)
    exact = {"dense": DenseAttention(tiny_model.cfg.num_layers),
             "window at density 1": WindowMethod(tiny_model.cfg, MethodConfig(density=1.0)),
             "specattn p=1": SpecAttn(tiny_model.cfg, SpecAttnConfig(top_p=1.0, gamma=int(torch.randint(2, 5, ()))))}
    for name, backend in exact.items():
        got, c = decode_nll(tiny_model, cache, backend, ids, m, 7)
        assert c == m and got == pytest.approx(want, rel=1e-4), name
        assert cache.free_pages == cache.num_pages, name  # the window's pages were released
    # A sparse decode changes the scored logits; its decode steps are metered as decode.
    sparse = WindowMethod(tiny_model.cfg, MethodConfig(density=0.2))
    got, _ = decode_nll(tiny_model, cache, sparse, ids, m, 8)
    assert abs(got - want) > 1e-3 and sparse.meter.decode_overall() < 0.8  # 2 of 3 layers are dense
    spec = SpecAttn(tiny_model.cfg, SpecAttnConfig(top_p=0.5, gamma=3, chunk_size=4))
    tracer = FidelityTracer(tiny_model.cfg.num_layers)
    spec.tracer = tracer
    got, _ = decode_nll(tiny_model, cache, spec, ids, m, 9)
    assert math.isfinite(got) and 0 < spec.stats.kv_read_fraction < 1 and spec.stats.rounds == 0
    assert tracer.summary()["retained"]["decode"] is not None and tracer.summary()["retained"]["prefill"] is None


# ---- the command line ------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, needle", [
    (["--methods", "nosuchmethod"], "unknown attention method 'nosuchmethod'"),
    (["--densities", "0"], "(0, 1]"),
    (["--densities", "0.1,abc"], "(0, 1]"),
    (["--densities", ","], "comma-separated list"),
    (["--tasks", "single_needle,nope"], "unknown task(s) nope"),
    (["--samples", "0"], "positive integer"),
    (["--context-tokens", "100"], "at least 256"),
    (["--text", "/nonexistent/haystack.txt"], "no such file"),
    (["--model", "/nonexistent/model.gguf"], "no such file"),
    (["--device", "nodevice"], "not a torch device"),
    (["--method-params", "cis"], "METHOD:KEY"),
    (["--method-params", "cis:threshold=2"], "not among the methods"),
    (["--decode-ppl-tokens", "-3"], "non-negative integer"),
    (["--no-such-flag"], "unrecognized arguments"),
])
def test_eval_bad_input_is_one_line_and_exit_2(capsys, args, needle):
    from raysparse.cli import main

    with pytest.raises(SystemExit) as e:
        main(["eval", "--methods", "dense", *args] if args[0] != "--methods" else ["eval", *args])
    assert e.value.code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and needle in err[0] and "error" in err[0], err


def test_eval_help_lists_the_flags(capsys):
    from raysparse.cli import main

    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    out = capsys.readouterr().out
    for flag in ("--methods", "--densities", "--samples", "--context-tokens", "--text", "--model", "--out",
                 "--method-params", "--decode-ppl-tokens", "--threads"):
        assert flag in out
