"""``raysparse eval`` and ``raysparse specattn-map`` on the engine's shard actors (Ray, gloo, CPU): the default
run gives the one-process harness's report, ``--tp 2`` the same outputs and numbers up to float rounding,
``--replicas 2`` exactly the same rows; bad flag combinations are one clear line. The TP=2 / two-replica run
is in the default run; the other Ray runs are ``slow`` (``python -m pytest -m slow
tests/test_eval_distributed.py``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from raysparse.cli import build_parser, main
from raysparse.cli.specattn_map import main as map_main
from raysparse.eval.config import EvalConfig
from raysparse.eval.harness import run_eval
from raysparse.eval.items import ItemResult, combine_shards, item_order, merge_items
from raysparse.eval.settings import Setting

METHODS = ("sketch_walk", "specattn", "cis")
# 0.8 of the whole model: 0.6 at each of the 2 sparse layers of 4, which 384-token prompts' sink and diagonal
# blocks (64 tokens each) leave room in
CFG = EvalConfig(methods=METHODS, densities=(0.8,), tasks=("single_needle",), samples=2, context_tokens=384,
                 max_new_tokens=2, rows=8, decode_ppl_tokens=6)  # what FLAGS say
FLAGS = ["--methods", ",".join(METHODS), "--densities", "0.8", "--tasks", "single_needle", "--samples", "2",
         "--context-tokens", "384", "--max-new-tokens", "2", "--rows", "8", "--decode-ppl-tokens", "6",
         "--threads", "1"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A random 4-layer Llama with 2 KV heads and a character tokenizer with a chat template."""
    from raysparse.loader import load_tokenizer, resolve_source
    from raysparse.serving.tiny import write_tiny_model

    d = write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=int(torch.randint(0, 1000, ())), layers=4)
    tok = load_tokenizer(resolve_source(str(d)))
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    from raysparse.workload import synthetic_haystack

    path = tmp_path_factory.mktemp("text") / "haystack.txt"
    path.write_text(synthetic_haystack(400, seed=int(torch.randint(0, 1000, ()))))
    return path


@pytest.fixture(scope="module")
def ray_instance():
    import ray

    from raysparse.orchestration.ray_env import start_ray

    owns = start_ray(None, num_cpus=4)
    yield
    if owns:
        ray.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_dir, text_file) -> dict[str, Any]:
    """The one-process harness on the same model, text and settings (what `raysparse eval` gave before Ray)."""
    from raysparse.loader import load_model, load_tokenizer, resolve_source
    from raysparse.workload import load_haystack_text

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = resolve_source(str(tiny_dir))
        text, source = load_haystack_text(str(text_file))
        report = run_eval(load_model(src, torch.float32, "cpu"), load_tokenizer(src), CFG, text, source,
                          model_name=src.name, model_dir=str(tiny_dir))
    finally:
        torch.set_num_threads(threads)
    assert all(r["status"] == "ok" for r in report["runs"]), [r["error"] for r in report["runs"]]
    return json.loads(json.dumps(report))  # as eval.json holds it


def _eval_cli(tiny_dir: Path, text_file: Path, out: Path, *extra: str) -> dict[str, Any]:
    assert main(["eval", "--model", str(tiny_dir), "--text", str(text_file), "--out", str(out), *FLAGS, *extra]) == 0
    return json.loads((out / "eval.json").read_text())


def _rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in report["runs"]]


def _close(a: Any, b: Any, path: str = "") -> None:
    """Equal structure and non-float values; floats to float32 rounding (shards reduce in another order)."""
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _close(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6), (path, a, b)
    else:
        assert a == b, (path, a, b)


@pytest.mark.slow  # Ray and shard actors: ~30 s each on two busy cores
def test_default_run_on_ray_gives_the_one_process_report(ray_instance, tiny_dir, text_file, reference, tmp_path):
    got = _eval_cli(tiny_dir, text_file, tmp_path)
    assert _rows(got) == _rows(reference)
    assert got["cluster"]["tp"] == 1 and got["cluster"]["replicas"] == 1
    for key in ("model", "config", "prompt_tokens", "haystack", "device"):
        assert got[key] == reference[key], key


@pytest.fixture(scope="module")
def engine_2x2(ray_instance, tiny_dir):
    """Two replicas of two shards each: TP=2 and the spreading over replicas on one set of actors."""
    from raysparse.eval.distributed import ClusterOptions, running_engine

    with running_engine(str(tiny_dir), "float32", ClusterOptions(tp=2, replicas=2, threads=1)) as engine:
        yield engine


def _first_replica(engine: Any) -> Any:
    """The same engine seen with its first replica only (M = 1 on the same shards)."""
    from types import SimpleNamespace

    return SimpleNamespace(tokenizer=engine.tokenizer, model_cfg=engine.model_cfg, runners=engine.runners[:1],
                           model_info=engine.model_info)


# In the default run (the issue's --tp / --replicas for eval); the other Ray tests here are slow-marked.
def test_tp2_same_outputs_and_numbers_and_replicas_same_rows(engine_2x2, tiny_dir, text_file, reference):
    from raysparse.eval.distributed import ClusterOptions, run_eval_on_engine
    from raysparse.specattn.map_store import MAP_FILE
    from raysparse.workload import load_haystack_text

    (tiny_dir / MAP_FILE).unlink(missing_ok=True)  # SpecAttn's map is measured again, over both shards' heads
    text, source = load_haystack_text(str(text_file))
    opts = ClusterOptions(tp=2, replicas=2, threads=1)
    two = run_eval_on_engine(engine_2x2, CFG, text, source, str(tiny_dir), opts)
    one = run_eval_on_engine(_first_replica(engine_2x2), CFG, text, source, str(tiny_dir), opts)
    assert _rows(two) == _rows(one)  # the same rows whatever the number of replicas
    assert two["cluster"]["tp"] == 2 and two["cluster"]["replicas"] == 2
    for a, b in zip(_rows(json.loads(json.dumps(two))), _rows(reference), strict=True):
        assert a["status"] == "ok", a["error"]
        assert [s["output"] for s in a["samples"]] == [s["output"] for s in b["samples"]], a["label"]
        assert a["accuracy_per_task"] == b["accuracy_per_task"]
        _close(a, b, a["label"])  # perplexity, density, fidelity summed over both shards' KV heads, extras


@pytest.mark.slow  # Ray and shard actors: ~30 s each on two busy cores
def test_specattn_map_over_shards_and_replicas_matches_the_one_process_map(engine_2x2, tiny_dir, text_file):
    from raysparse.loader import load_model, load_tokenizer, resolve_source
    from raysparse.specattn.draft import default_draft_layers
    from raysparse.specattn.map_engine import measure_on_engine
    from raysparse.specattn.map_measure import compute_layer_map, map_from_sums, text_windows

    src = resolve_source(str(tiny_dir))
    windows = text_windows(load_tokenizer(src), text_file.read_text(), 3, 96)
    want = compute_layer_map(load_model(src, torch.float32, "cpu"), windows, steps=4, source="x")
    draft = default_draft_layers(4)
    got = map_from_sums(measure_on_engine(engine_2x2, windows, draft, 4, threads=1), 4, draft, 4, "x",
                        [len(w) for w in windows])
    one = map_from_sums(measure_on_engine(_first_replica(engine_2x2), windows, draft, 4, threads=1), 4, draft, 4,
                        "x", [len(w) for w in windows])
    assert got.similarity == one.similarity and got.mapping == want.mapping
    torch.testing.assert_close(torch.tensor(got.similarity), torch.tensor(want.similarity), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, tiny_dir) -> Path:
    """A separate SpecAttn draft: 2 layers of 1 KV head (group 3), with the verifier's tokenizer."""
    from raysparse.loader import load_tokenizer, resolve_source
    from raysparse.serving.tiny import write_tiny_model

    d = write_tiny_model(tmp_path_factory.mktemp("draft") / "draft", seed=int(torch.randint(0, 1000, ())), layers=2,
                         kv_heads=1, group=3)
    load_tokenizer(resolve_source(str(tiny_dir))).save_pretrained(d)
    return d


@pytest.mark.slow  # Ray and shard actors: ~30 s each on two busy cores
def test_draft_model_over_shards_matches_the_one_process_harness(engine_2x2, tiny_dir, draft_dir, text_file):
    """``--draft-model`` on TP=2 shards and two replicas: every shard loads the draft whole and cuts its rows
    to its own KV heads, so the rows are the one-process harness's; the map measured over the shards is the
    one-process map across the two models."""
    from dataclasses import replace

    from raysparse.eval.distributed import ClusterOptions, run_eval_on_engine
    from raysparse.loader import load_model, load_tokenizer, resolve_source
    from raysparse.specattn.draft_model import draft_key
    from raysparse.specattn.map_engine import measure_on_engine
    from raysparse.specattn.map_measure import compute_cross_layer_map, cross_map_from_sums, text_windows
    from raysparse.workload import load_haystack_text

    cfg = replace(CFG, methods=("specattn",), draft_model=str(draft_dir))
    text, source = load_haystack_text(str(text_file))
    src = resolve_source(str(tiny_dir))
    verifier, tok = load_model(src, torch.float32, "cpu"), load_tokenizer(src)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # first: measures the map across the models and saves it under the draft's key, where shards find it
        ref = json.loads(json.dumps(run_eval(verifier, tok, cfg, text, source, model_dir=str(tiny_dir))))
    finally:
        torch.set_num_threads(threads)
    got = run_eval_on_engine(engine_2x2, cfg, text, source, str(tiny_dir), ClusterOptions(tp=2, replicas=2, threads=1))
    key = draft_key(draft_dir)
    for a, b in zip(_rows(json.loads(json.dumps(got))), _rows(ref), strict=True):
        assert a["status"] == b["status"] == "ok", (a["error"], b["error"])
        assert [s["output"] for s in a["samples"]] == [s["output"] for s in b["samples"]], a["label"]
        _close(a, b, a["label"])
    spec = got["runs"][1]["extras"]["specattn"]
    assert spec["draft"] == key and spec["generation"]["rounds"] > 0

    windows = text_windows(tok, text_file.read_text(), 3, 96)
    want = compute_cross_layer_map(verifier, load_model(resolve_source(str(draft_dir)), torch.float32, "cpu"),
                                   windows, key, steps=4, source="x")
    lm = cross_map_from_sums(measure_on_engine(engine_2x2, windows, str(draft_dir.resolve()), 4, threads=1), 4, 2,
                             key, 4, "x", [len(w) for w in windows])
    assert lm.mapping == want.mapping and lm.draft == key
    torch.testing.assert_close(torch.tensor(lm.similarity), torch.tensor(want.similarity), rtol=1e-5, atol=1e-5)


def test_merge_is_the_same_for_any_split_of_shards_and_items():
    """Head-additive sums add over shards; acceptance counts and outputs come from rank 0; the first failure
    ends the row with the fields filled before it."""
    def item(kind: str, index: int, scale: float, error: str | None = None) -> ItemResult:
        r = torch.rand(6).tolist()
        return ItemResult(kind, index, error, {"task": "t", "score": 1.0} if kind == "task" else None,
                          nll=r[0] * 10, count=5, meter=([r[1] * scale, 2.0], [4.0 * scale, 2.0], r[2], 4.0),
                          tracer={("prefill", 1): (r[3], r[4], 2, r[5], 1.0)},
                          spec={"rounds": 3, "drafted": 6, "accepted": 2, "kv_read": [r[1], 1.0],
                                "kv_held": [4.0, 4.0], "draft_kv_read": r[2], "draft_kv_full": 8.0,
                                "sparse_layers": (1,)})

    a, b = item("ppl", 0, 1.0), item("ppl", 0, 1.0)
    both = combine_shards([a, b])
    assert both.meter[0][0] == a.meter[0][0] + b.meter[0][0] and both.spec["rounds"] == 3
    assert both.spec["kv_read"][0] == a.spec["kv_read"][0] + b.spec["kv_read"][0] and both.nll == a.nll
    assert both.tracer[("prefill", 1)][0] == a.tracer[("prefill", 1)][0] + b.tracer[("prefill", 1)][0]
    order = item_order(2, 1, True)
    assert order == [("task", 0), ("task", 1), ("ppl", 0), ("decode", 0)]
    items = [item(k, i, 1.0) for k, i in order]
    ok = merge_items(Setting("x", 0.3), items, 2, 8)
    assert ok.status == "ok" and ok.accuracy == 1.0 and ok.nll == pytest.approx(items[2].nll / 5)
    assert ok.extras["specattn"]["generation"]["drafted"] == 12 and ok.extras["specattn"]["total"]["drafted"] == 24
    items[3].error = "ValueError: boom"
    bad = merge_items(Setting("x", 0.3), items, 2, 8)
    assert bad.status == "error" and bad.error == "ValueError: boom" and bad.accuracy == 1.0
    assert bad.nll is not None and bad.decode_nll is None and bad.density is None


@pytest.mark.parametrize("args, needle, code", [
    (["--tp", "0"], "positive integer", 2),
    (["--replicas", "x"], "positive integer", 2),
    (["--device", "cuda:1"], "not a torch device the shards take", 2),
    (["--cpus-per-shard", "0"], "--cpus-per-shard must be > 0", 2),
])
def test_eval_cluster_flags_are_validated_in_one_line(capsys, args, needle, code):
    with pytest.raises(SystemExit) as e:
        main(["eval", "--methods", "streaming", *args])
    assert e.value.code == code
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and needle in err[0], err


def test_tp_beyond_the_kv_heads_is_one_clear_line_before_ray_starts(tiny_dir, capsys):
    import ray

    started = ray.is_initialized()
    code = main(["eval", "--model", str(tiny_dir), "--methods", "streaming", "--tp", "3"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err == "raysparse: error: --tp 3 exceeds the model's 2 KV heads (shards split whole KV heads)"
    assert map_main(["--model", str(tiny_dir), "--tp", "3"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("raysparse specattn-map: error: --tp 3 exceeds") and "\n" not in err
    assert ray.is_initialized() == started  # refused before any Ray instance or actor


def test_both_commands_parse_and_document_the_cluster_flags(capsys):
    args = build_parser().parse_args(["eval", "--tp", "2", "--replicas", "3", "--address", "10.0.0.1:6379"])
    assert (args.tp, args.replicas, args.address, args.cpus_per_shard) == (2, 3, "10.0.0.1:6379", 1.0)
    defaults = build_parser().parse_args(["eval"])
    assert (defaults.tp, defaults.replicas, defaults.address, defaults.device) == (1, 1, None, "cpu")
    for argv in (["eval", "--help"], ["specattn-map", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        out = capsys.readouterr().out
        for flag in ("--tp", "--replicas", "--address", "--cpus-per-shard", "--threads", "--device"):
            assert flag in out, (argv, flag)
