"""``raysparse eval`` with SpecAttn's separate draft model (``--draft-model``): a tiny random verifier and a
tiny random draft of another depth and head count.

Oracles: dense's own greedy output and decode perplexity (p = 1 verification is exact, whatever the draft);
the window's true tokens, which the draft's cache must have read exactly once and in order when the teacher-
forced decode perplexity ends; the draft's key, under which the layer map must be saved and reported.
The command-line checks: a draft no method uses, a missing path, a vocabulary or tokenizer that differs from
the verifier's are one clear line on ``eval`` and ``specattn-map``, before anything loads.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import random_state, tiny_hf_config
from test_eval import CharTokenizer

from raysparse.eval.config import EvalConfig
from raysparse.eval.decode_ppl import decode_nll, scored_span
from raysparse.eval.harness import Harness, run_eval
from raysparse.eval.report import method_columns, table
from raysparse.eval.settings import parse_method_params
from raysparse.kv_cache import KVCache
from raysparse.loader import model_from_state
from raysparse.specattn import SpecAttn, SpecAttnConfig
from raysparse.specattn.draft_model import SeparateDraft
from raysparse.specattn.map_store import map_file_name
from raysparse.workload import synthetic_haystack


def _model(kv_heads: int, group: int, layers: int):
    cfg = tiny_hf_config(num_kv_heads=kv_heads, group=group, layers=layers)
    cfg.max_position_embeddings = 2048
    return model_from_state(cfg, random_state(cfg, seed=int(torch.randint(0, 2**31 - 1, ()))).state_dict())


@pytest.fixture(scope="module")
def pair():
    """A 4-layer verifier (2 KV heads, group 2) and a 2-layer draft (1 KV head, group 3)."""
    print(f"torch seed {torch.seed()}")
    torch.set_num_threads(1)
    return _model(2, 2, 4), _model(1, 3, 2)


def test_eval_runs_specattn_with_the_draft_and_reports_its_rows(pair, tmp_path):
    verifier, draft_model = pair
    draft = SeparateDraft(draft_model, verifier.cfg, "tiny-draft", 2048)
    cfg = EvalConfig(methods=("specattn",), tasks=("single_needle", "multi_key"), samples=1, context_tokens=576,
                     max_new_tokens=3, rows=8, decode_ppl_tokens=14,
                     method_params=parse_method_params(["specattn:top_p=0.3,1.0", "specattn:gamma=3",
                                                                      "specattn:chunk_size=1"]))
    # No end-of-sequence id: a random verifier that drew it first would end a sample before any draft round
    # (a seed did, for both samples: no round, no acceptance to check).
    tok = CharTokenizer()
    tok.eos_token_id = None
    report = run_eval(verifier, tok, cfg, synthetic_haystack(300, seed=int(torch.randint(0, 99, ()))),
                      "synthetic", model_name="tiny", model_dir=str(tmp_path), draft=draft)
    runs = report["runs"]
    assert [r["label"] for r in runs] == ["dense", "specattn (top_p=0.3, gamma=3, chunk_size=1)",
                                           "specattn (top_p=1, gamma=3, chunk_size=1)"]
    assert all(r["status"] == "ok" for r in runs), [r["error"] for r in runs]
    dense, sparse, full = runs
    # p = 1: exact verification, so dense's greedy tokens and its decode perplexity, whatever the draft proposes
    assert [s["output"] for s in full["samples"]] == [s["output"] for s in dense["samples"]]
    assert full["decode_perplexity"] == pytest.approx(dense["decode_perplexity"], rel=1e-4)
    assert method_columns(full)["KV red"] == 0.0
    # the draft's rows picked the chunks through the map saved next to the verifier under the draft's key
    saved = json.loads((tmp_path / map_file_name("tiny-draft")).read_text())
    for run in (sparse, full):
        spec = run["extras"]["specattn"]
        assert spec["draft"] == saved["draft"] == "tiny-draft" and spec["layer_map"] == saved["map"]
        assert len(spec["layer_map"]) == 4 and set(spec["layer_map"]) <= {0, 1}
    cols = method_columns(sparse)
    assert 0 <= cols["accept"] <= 1 and 1 <= cols["tok/step"] <= 4 and 0 < cols["KV red"] < 1
    gen = sparse["extras"]["specattn"]["generation"]
    assert gen["rounds"] > 0 and 0 < gen["draft_kv_read_fraction"] < 1  # 2 layers of 1 KV head: fewer reads
    assert math.isfinite(sparse["decode_perplexity"]) and sparse["density_decode"] < 1
    assert table(report).row_count == 3
    assert draft.cache.free_pages == draft.cache.num_pages  # every sequence of the draft was released


def test_teacher_forced_decode_keeps_the_drafts_cache_on_the_true_tokens(pair):
    """Every round the draft reads the true tokens the verifier verifies, once each and in order, and its rows
    (one per drafted position) are what the backend plans from."""
    verifier, draft_model = pair
    gamma = int(torch.randint(2, 5, ()))
    draft = SeparateDraft(draft_model, verifier.cfg, "tiny-draft", 1024)
    backend = SpecAttn(verifier.cfg, SpecAttnConfig(top_p=0.1, gamma=gamma, chunk_size=1))
    from raysparse.specattn.layer_map import proportional_map

    backend.set_layer_map(proportional_map(4, 2, "tiny-draft"))
    # token chunks and a small p: a random draft's diffuse rows, united over a round, cannot cover the context
    # (16-token chunks around its scattered top tokens would)
    ids = torch.randint(0, 97, (600,)).tolist()
    m = int(torch.randint(5, 40, ()))
    p, _ = scored_span(len(ids), m)
    read: list[int] = []
    planned: list[int] = []
    teacher, feed, plan = draft.teacher_rows, draft.feed, backend.plan

    def teacher_rows(sid, tokens, needed):
        read.extend(tokens)
        rows = teacher(sid, tokens, needed)
        assert all(len(r) == len(tokens) and r[0].shape == (2, draft.cache.seq_len(sid) - len(tokens) + 1)
                   for r in rows.values())
        return rows

    def fed(sid, tokens):
        read.extend(tokens)
        feed(sid, tokens)

    def planning(sid, ctx_len, n_new, rows):
        assert draft.cache.seq_len(sid) == ctx_len + n_new  # the draft holds what the verifier will
        planned.append(n_new)
        return plan(sid, ctx_len, n_new, rows)

    draft.teacher_rows, draft.feed, backend.plan = teacher_rows, fed, planning  # type: ignore[method-assign]
    cache = KVCache(verifier.cfg, 40, 16, torch.float32, "cpu", verifier.num_kv_heads)
    nll, count = decode_nll(verifier, cache, backend, ids, m, 5, draft)
    assert count == m and math.isfinite(nll)
    assert read == ids[p:len(ids) - 1] and sum(planned) == m and max(planned) <= gamma + 1
    assert 0 < backend.stats.kv_read_fraction < 1 and backend.stats.rounds == 0  # no speculation: no acceptance
    assert draft.cache.free_pages == draft.cache.num_pages and cache.free_pages == cache.num_pages


def test_harness_loads_the_draft_cfg_names_and_refuses_one_no_method_uses(tmp_path):
    from raysparse.serving.tiny import write_tiny_model

    verifier_dir = write_tiny_model(tmp_path / "verifier", seed=1, layers=3, max_positions=2048)
    draft_dir = write_tiny_model(tmp_path / "draft", seed=2, layers=2, max_positions=2048, kv_heads=1, group=3)
    with pytest.raises(ValueError, match="--draft-model is for methods with a draft"):
        EvalConfig(methods=("streaming",), draft_model=str(draft_dir))
    from raysparse.loader import load_model, load_tokenizer, resolve_source

    src = resolve_source(str(verifier_dir))
    h = Harness(load_model(src, torch.float32, "cpu"), load_tokenizer(src),
                EvalConfig(methods=("specattn",), context_tokens=256, decode_ppl_tokens=16, draft_model=str(draft_dir)))
    assert h.draft.key.startswith("draft-") and h.draft.num_layers == 2 and h.draft.head_range == (0, 2)


# ---- the command line ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    """A verifier, a draft of another depth and head count, one of another vocabulary, one whose tokenizer
    differs (same size, one token renamed)."""
    from raysparse.serving.tiny import write_tiny_model

    root = tmp_path_factory.mktemp("draft-cli")
    out = {"verifier": write_tiny_model(root / "verifier", seed=1, layers=3),
           "draft": write_tiny_model(root / "draft", seed=2, layers=2, kv_heads=1, group=3),
           "vocab": write_tiny_model(root / "vocab", seed=3, layers=2),
           "tokenizer": write_tiny_model(root / "tokenizer", seed=4, layers=2)}
    cfg = json.loads((out["vocab"] / "config.json").read_text())
    cfg["vocab_size"] = 50
    (out["vocab"] / "config.json").write_text(json.dumps(cfg))
    tok_path = out["tokenizer"] / "tokenizer.json"
    tok = json.loads(tok_path.read_text())
    vocab = tok["model"]["vocab"]
    vocab["~~"] = vocab.pop("~")
    tok_path.write_text(json.dumps(tok))
    return out


def _bad(name: str, dirs: dict[str, Path]) -> tuple[list[str], str]:
    draft = {"missing": str(dirs["verifier"].parent / "no-such-draft")}.get(name) or str(dirs[name])
    needle = {"missing": "no such file or directory", "vocab": "vocabulary of 50 tokens",
              "tokenizer": "tokenizer's vocabulary differs"}[name]
    return ["--model", str(dirs["verifier"]), "--draft-model", draft], needle


@pytest.mark.parametrize("name", ["missing", "vocab", "tokenizer"])
def test_eval_bad_draft_model_is_one_line(dirs, capsys, name):
    from raysparse.cli import main

    args, needle = _bad(name, dirs)
    with pytest.raises(SystemExit) as e:
        main(["eval", "--methods", "specattn", *args])
    assert e.value.code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and needle in err[0] and err[0].startswith("raysparse: error:"), err


def test_eval_refuses_a_draft_no_method_uses(dirs, capsys):
    from raysparse.cli import main

    with pytest.raises(SystemExit) as e:
        main(["eval", "--methods", "streaming,cis", "--model", str(dirs["verifier"]), "--draft-model",
              str(dirs["draft"])])
    assert e.value.code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "is for methods with a draft (specattn), not streaming, cis" in err[0], err


@pytest.mark.parametrize("name", ["missing", "vocab", "tokenizer"])
def test_specattn_map_bad_draft_model_is_one_line(dirs, capsys, name):
    from raysparse.cli.specattn_map import main

    args, needle = _bad(name, dirs)
    assert main(args) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and needle in err[0] and err[0].startswith("raysparse specattn-map: error:"), err


def test_specattn_map_refuses_draft_layers_with_a_draft_model(dirs, capsys):
    from raysparse.cli.specattn_map import main

    assert main(["--model", str(dirs["verifier"]), "--draft-model", str(dirs["draft"]), "--draft-layers", "0,2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--draft-layers picks the self-speculative draft's layers" in err[0], err


def test_engine_commands_share_the_draft_flag_and_check_it(dirs):
    from raysparse.cli import build_parser
    from raysparse.cli.engine_flags import engine_config
    from raysparse.jobs.longcontext import build_parser as job_parser

    parser = build_parser()
    base = ["--model", str(dirs["verifier"]), "--draft-model", str(dirs["draft"])]
    for argv in (["serve", *base], ["bench", *base]):
        assert engine_config(parser.parse_args(argv)).draft_model == str(dirs["draft"])
    assert engine_config(job_parser().parse_args(["--input", "x", "--output", "y", *base])).draft_model
    with pytest.raises(ValueError, match="vocabulary of 50 tokens"):
        engine_config(parser.parse_args(["serve", "--model", str(dirs["verifier"]), "--draft-model",
                                         str(dirs["vocab"])]))
    with pytest.raises(ValueError, match="not dense"):
        engine_config(parser.parse_args(["bench", *base]), ["dense"])
    from raysparse.serving.app import AppConfig

    app = AppConfig.from_args({"model": str(dirs["verifier"]), "draft": "true", "draft_model": str(dirs["draft"])})
    assert app.engine_config("cpu").draft_model == str(dirs["draft"])
    helps = [a.help for p in (parser._subparsers._group_actions[0].choices[c] for c in ("run", "serve", "bench",
                                                                                          "eval"))
             for a in p._actions if a.dest == "draft_model"]
    assert len(helps) == 4 and len(set(helps)) == 1
