"""raysparse bench: the vLLM metric math against hand-computed values, arrivals, prompts, and end to end."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest

from raysparse.bench.loadgen import PromptSampler, arrival_offsets
from raysparse.bench.metrics import RequestRecord, compute_metrics, parse_slos


def _records() -> list[RequestRecord]:
    return [
        # 4 tokens in 3 chunks (the last carries two): TTFT 100 ms, E2EL 400 ms, TPOT 300/3 = 100 ms, ITL 200, 50
        RequestRecord(prompt_len=10, t_send=0.0, chunk_times=[0.1, 0.3, 0.35], output_len=4, t_end=0.4, success=True),
        # one token: TTFT 500 ms, no TPOT and no ITL
        RequestRecord(prompt_len=20, t_send=1.0, chunk_times=[1.5], output_len=1, t_end=1.5, success=True),
        RequestRecord(prompt_len=30, t_send=1.0, t_end=1.2, success=False, error="UNAVAILABLE"),
    ]


def test_metrics_match_hand_computed_values():
    m = compute_metrics(_records(), duration_s=2.0)
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (2, 1, 30, 5)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(2.5)
    assert m["total_token_throughput"] == pytest.approx(17.5)
    expect = {
        "ttft": (300.0, 300.0, 200.0, 100 + 0.99 * 400),  # mean, median, std (population), p99 (linear)
        "tpot": (100.0, 100.0, 0.0, 100.0),
        "itl": (125.0, 125.0, 75.0, 50 + 0.99 * 150),
        "e2el": (450.0, 450.0, 50.0, 400 + 0.99 * 100),
    }
    for name, (mean, median, std, p99) in expect.items():
        got = (m[f"mean_{name}_ms"], m[f"median_{name}_ms"], m[f"std_{name}_ms"], m[f"p99_{name}_ms"])
        assert got == pytest.approx((mean, median, std, p99)), name
    assert m["request_goodput"] is None


def test_goodput_counts_requests_meeting_every_slo():
    recs = _records()
    assert compute_metrics(recs, 2.0, {"ttft": 200})["request_goodput"] == pytest.approx(0.5)  # the first only
    # the second has one token, so its TPOT counts as 0 and only its TTFT (500 ms) matters
    assert compute_metrics(recs, 2.0, {"ttft": 600, "tpot": 50})["request_goodput"] == pytest.approx(0.5)
    assert compute_metrics(recs, 2.0, {"ttft": 600, "tpot": 150, "e2el": 500})["request_goodput"] == 1.0
    assert compute_metrics(recs, 2.0, {"e2el": 399})["request_goodput"] == 0.0
    with pytest.raises(ValueError):
        compute_metrics(recs, 2.0, {"latency": 1})
    with pytest.raises(ValueError):
        compute_metrics(recs, 0.0)


def _percentile(xs: list[float], p: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * p / 100
    lo = math.floor(k)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)


def test_metrics_match_a_plain_python_reference_on_random_records():
    rng = random.Random()
    recs = []
    for _ in range(rng.randint(5, 40)):
        t0 = rng.uniform(0, 5)
        times = sorted(t0 + rng.uniform(0.01, 3) for _ in range(rng.randint(1, 12)))
        n = len(times) + rng.randint(0, 3)
        recs.append(RequestRecord(rng.randint(1, 4096), t0, times, n, times[-1] + rng.uniform(0, 0.1),
                                  success=rng.random() > 0.1))
    recs.append(RequestRecord(7, 0.0, [0.5, 0.9], 2, 1.0, success=True))
    dur = rng.uniform(5, 10)
    m = compute_metrics(recs, dur, percentiles=(50, 90, 99))
    ok = [r for r in recs if r.success]
    ttft = [(r.chunk_times[0] - r.t_send) * 1000 for r in ok]
    tpot = [((r.t_end - r.t_send) - (r.chunk_times[0] - r.t_send)) / (r.output_len - 1) * 1000
            for r in ok if r.output_len > 1]
    itl = [(b - a) * 1000 for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    e2el = [(r.t_end - r.t_send) * 1000 for r in ok]
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl or [0.0]), ("e2el", e2el)):
        assert m[f"mean_{name}_ms"] == pytest.approx(statistics.fmean(xs))
        assert m[f"median_{name}_ms"] == pytest.approx(statistics.median(xs))
        assert m[f"std_{name}_ms"] == pytest.approx(statistics.pstdev(xs))
        for p in (50, 90, 99):
            assert m[f"p{p}_{name}_ms"] == pytest.approx(_percentile(xs, p))
    assert m["output_throughput"] == pytest.approx(sum(r.output_len for r in ok) / dur)


def test_arrivals_are_poisson_at_the_requested_rate():
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    seed = random.randrange(1 << 30)
    for burstiness, cv in ((1.0, 1.0), (4.0, 0.5)):
        t = arrival_offsets(20000, 8.0, burstiness, seed)
        gaps = [b - a for a, b in zip(t, t[1:], strict=False)]
        assert t[0] == 0.0 and all(g >= 0 for g in gaps)
        assert statistics.fmean(gaps) == pytest.approx(1 / 8.0, rel=0.05)
        assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(cv, rel=0.06)
    assert arrival_offsets(10, 3.0, seed=seed) == arrival_offsets(10, 3.0, seed=seed)


def test_prompts_have_exact_lengths_and_come_from_the_text(real_text):
    ids = {c: i for i, c in enumerate(sorted(set(real_text)))}
    sampler = PromptSampler(real_text, lambda s: [ids[c] for c in s], seed=random.randrange(1000))
    inverse = {i: c for c, i in ids.items()}
    for n in (1, 17, 300, 2048):
        p = sampler.sample(n)
        assert len(p) == n and "".join(inverse[i] for i in p) in real_text
    with pytest.raises(ValueError):
        PromptSampler("short", list)


def test_parse_slos():
    assert parse_slos(["ttft:500", "tpot:50.5", "e2el:2000"]) == {"ttft": 500.0, "tpot": 50.5, "e2el": 2000.0}
    for bad in ("ttft", "itl:5", "ttft:x", "tpot:0", "tpot:-3"):
        with pytest.raises(ValueError):
            parse_slos([bad])


def test_bench_command_end_to_end(tmp_path):
    from raysparse.cli import main
    from raysparse.serving.tiny import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    out = tmp_path / "bench"
    lens, n, output_len = (24, 96), 6, 5
    rc = main(["bench", "--model", str(model), "--num-cpus", "2", "--cpus-per-shard", "0.5", "--no-draft",
               "--kv-cache-tokens", "2048", "--num-prompts", str(n), "--prompt-lens", ",".join(map(str, lens)),
               "--output-len", str(output_len), "--request-rate", "50", "--max-concurrency", "4",
               "--slo", "ttft:60000", "--num-warmups", "2", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["schema"] == "raysparse.bench/1" and [r["prompt_len"] for r in report["sweep"]] == list(lens)
    for row in report["sweep"]:  # the warm-ups ran, and are not in the timed figures
        assert row["warmups_completed"] == 2
        assert row["completed"] == n and row["failed"] == 0 and not row["errors"]
        assert row["total_input_tokens"] == n * row["prompt_len"] and row["total_output_tokens"] == n * output_len
        assert row["request_goodput"] == pytest.approx(row["request_throughput"])
        assert 0 < row["mean_ttft_ms"] <= row["mean_e2el_ms"] and row["mean_tpot_ms"] > 0
    assert (out / "bench_sweep.png").stat().st_size > 10_000


def test_bench_openai_backend_end_to_end(tmp_path):
    """--backend openai: the bench starts a server with the HTTP API and loads /v1/completions (token-id
    prompts of exact lengths, the method in the raysparse extension field)."""
    from raysparse.cli import main
    from raysparse.serving.tiny import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    out = tmp_path / "bench"
    n, output_len = 5, 6
    rc = main(["bench", "--backend", "openai", "--model", str(model), "--num-cpus", "2", "--cpus-per-shard", "0.5",
               "--no-draft", "--kv-cache-tokens", "2048", "--num-prompts", str(n), "--prompt-lens", "160",
               "--output-len", str(output_len), "--max-concurrency", "3", "--method", "streaming",
               "--density", "0.5", "--param", "block_size=16", "--param", "sink_tokens=16",
               "--param", "dense_layers=[]", "--out", str(out), "--no-plot"])
    assert rc == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["load"]["backend"] == "openai" and report["model"] == "tiny"
    (row,) = report["sweep"]
    assert row["completed"] == n and row["failed"] == 0 and not row["errors"], row["errors"]
    assert row["total_input_tokens"] == n * 160 and row["total_output_tokens"] == n * output_len
    # the density asked for is what each request attended, prefill and decode apart
    assert row["mean_density_prefill"] == pytest.approx(0.5, abs=0.01)
    assert row["mean_density_decode"] == pytest.approx(0.5, abs=0.01)
    assert 0 < row["mean_ttft_ms"] <= row["mean_e2el_ms"] and row["mean_tpot_ms"] > 0


def test_bench_usage_errors(capsys):
    from raysparse.cli import main

    for argv in (["bench", "--slo", "itl:3", "--target", "127.0.0.1:1"], ["bench", "--local-nodes", "2"],
                 ["bench", "--request-rate", "0"], ["bench", "--prompt-lens", "0,5"],
                 ["bench", "--backend", "openai", "--target", "ftp://127.0.0.1:1"],
                 ["bench", "--backend", "openai", "--scaling", "1,2"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert "error" in capsys.readouterr().err


@pytest.mark.slow
def test_scaling_mode_spreads_replicas_over_a_local_cluster(tmp_path):
    from raysparse.cli import main
    from raysparse.serving.tiny import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    out = tmp_path / "scaling"
    rc = main(["bench", "--model", str(model), "--cpus-per-shard", "0.5", "--no-draft", "--kv-cache-tokens", "2048",
               "--num-prompts", "8", "--prompt-lens", "48", "--output-len", "4", "--max-concurrency", "4",
               "--scaling", "1,2", "--local-nodes", "2", "--out", str(out)])
    assert rc == 0
    rows = json.loads((out / "bench.json").read_text())["scaling"]
    assert [(r["replicas"], r["nodes"]) for r in rows] == [(1, 1), (2, 2)]  # one replica per node
    assert all(r["completed"] == 8 and r["failed"] == 0 for r in rows)
    assert rows[0]["scaling_efficiency"] == 1.0
    assert rows[1]["scaling_efficiency"] == pytest.approx(rows[1]["output_throughput"]
                                                          / (2 * rows[0]["output_throughput"]))
    assert (out / "bench_scaling.png").is_file()


def test_sweep_plot_names_tokens_units_model_and_method(tmp_path):
    """The plot says what it shows: real prompt lengths on the axis (1,024, not 2^10), units on every axis,
    and the model and method in the title."""
    from raysparse.bench.report import bench_title, scaling_figure, sweep_figure, write_report

    def row(n: int) -> dict:
        return {"prompt_len": n, "output_throughput": 10.0, "total_token_throughput": 10.0 + n,
                **{f"{s}_{m}_ms": float(n) for s in ("mean", "p99") for m in ("ttft", "tpot", "itl", "e2el")}}

    report = {"model": "SmolLM2-135M-Instruct", "load": {"method": "psaw", "method_params": (("density", 0.1),)},
              "sweep": [row(n) for n in (128, 1024, 4096)]}
    title = bench_title(report)
    assert title == "raysparse bench: SmolLM2-135M-Instruct, psaw (density=0.1)"
    fig = sweep_figure(report["sweep"], title)
    fig.canvas.draw()
    assert "SmolLM2-135M-Instruct" in fig._suptitle.get_text() and "psaw" in fig._suptitle.get_text()
    for ax in fig.axes:
        assert ax.get_xlabel() == "prompt length (tokens)"
        assert [t.get_text() for t in ax.get_xticklabels()] == ["128", "1,024", "4,096"]
        assert not ax.xaxis.get_minorticklabels() or all(not t.get_text() for t in ax.xaxis.get_minorticklabels())
    assert [ax.get_ylabel() for ax in fig.axes] == ["request latency (ms)", "per-token latency (ms)",
                                                    "throughput (tokens/s)"]
    scaling = scaling_figure([{**row(256), "replicas": r} for r in (1, 2, 4)], title)
    scaling.canvas.draw()
    assert "psaw" in scaling._suptitle.get_text()
    assert [t.get_text() for t in scaling.axes[0].get_xticklabels()] == ["1", "2", "4"]
    assert all("(" in ax.get_ylabel() for ax in scaling.axes)
    assert (tmp_path / "bench_sweep.png") in write_report(tmp_path, report)
