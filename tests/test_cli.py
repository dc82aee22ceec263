"""The command line: bad input gives one clear line and a non-zero exit; the main job answers."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
       "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "COLUMNS": "200"}


def raysparse(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "raysparse.cli", *args], capture_output=True, text=True,
                          env=ENV, timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess[str], needle: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0] and "error" in lines[0]


@pytest.mark.parametrize("args, needle", [
    (["run", "--text", "/nonexistent/haystack.txt"], "no such file"),
    (["--model", "/nonexistent/model.gguf"], "no such file"),
    (["run", "--method", "nosuchmethod"], "unknown attention method 'nosuchmethod'"),
    (["run", "--context-tokens", "abc"], "positive integer"),
    (["run", "--context-tokens", "-5"], "positive integer"),
    (["run", "--depth", "1.5"], "[0, 1]"),
    (["run", "--no-such-flag"], "unrecognized arguments"),
    (["run", "--tp", "0"], "positive integer"),
    (["run", "--replicas", "two"], "positive integer"),
    (["run", "--cpus-per-shard", "0"], "cpus_per_shard must be > 0"),
    (["run", "--runtime", "fused_ops=fast"], "runtime.fused_ops must be one of"),
    (["run", "--runtime", "no_such_switch=1"], "unknown key 'no_such_switch'"),
    (["serve", "--runtime", "fused_allreduce=maybe"], "fused_allreduce takes true or false"),
    (["serve", "--runtime", "walk_select=true"], "unknown key 'walk_select'; choose from fused_ops, allreduce, "
                                                  "fused_allreduce, compiled_graph"),  # a Sketch&Walk parameter
    (["serve", "--runtime", "allreduce"], "expected KEY=VALUE"),
    (["bench", "--runtime", "compiled_graph=sometimes"], "runtime.compiled_graph must be one of"),
])
def test_bad_input_exits_with_one_clear_line(args, needle):
    assert_one_line_error(raysparse(*args, timeout=60), needle)


def test_help_lists_the_flags():
    out = raysparse("run", "--help", timeout=60)
    assert out.returncode == 0
    for flag in ("--method", "--text", "--context-tokens", "--model"):
        assert flag in out.stdout


def test_empty_text_file_is_a_clear_error(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert_one_line_error(raysparse("run", "--text", str(empty), "--context-tokens", "512"), "empty")


def test_context_longer_than_the_model_is_a_clear_error():
    assert_one_line_error(raysparse("run", "--context-tokens", "9000"), "exceeds the model's 8192 positions")


def test_main_job_answers_the_default_retrieval_question():
    proc = raysparse("run", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["correct"], result
    assert 3800 <= result["prompt_tokens"] <= 4400
    assert result["method"] == "dense" and result["density"] == 1.0 and result["density_prefill"] == 1.0
    assert result["ttft_s"] > 0 and result["decode_tokens_per_s"] > 0
    (load,) = result["load"]  # the one shard read the whole converted checkpoint, slice by slice
    assert load["source"] == "safetensors" and load["bytes_read"] == load["checkpoint_bytes"] > 0


def test_runtime_flag_reaches_the_engine_config():
    """``--runtime KEY=VALUE`` (repeatable, the last of a key wins) becomes the engine's RuntimeConfig,
    for every command built on the shared engine flags (serve, bench, the JSONL job)."""
    from raysparse.cli import build_parser
    from raysparse.cli.engine_flags import engine_config
    from raysparse.jobs.longcontext import build_parser as job_parser
    from raysparse.runtime_config import RuntimeConfig

    want = RuntimeConfig(fused_ops="torch", compiled_graph="off", fused_allreduce=False, allreduce="nccl")
    flags = ["--runtime", "fused_ops=torch", "--runtime", "compiled-graph=off", "--runtime", "fused_allreduce=off",
             "--runtime", "allreduce=symm_mem", "--runtime", "allreduce=nccl"]
    for argv in (["serve", *flags], ["bench", *flags]):
        assert engine_config(build_parser().parse_args(argv)).runtime == want
    job = job_parser().parse_args(["--input", "in.jsonl", "--output", "out.jsonl", *flags])
    assert engine_config(job).runtime == want
    assert engine_config(build_parser().parse_args(["serve"])).runtime == RuntimeConfig()
    assert build_parser().parse_args(["run", *flags]).runtime == flags[1::2]


def test_kv_offload_flags_reach_the_engine_config():
    """``--kv-offload`` with its pool and row cache sizes becomes ``EngineConfig.kv_offload``; a size without the
    tier, or a negative one, is refused in one line."""
    from raysparse.cli import build_parser
    from raysparse.cli.engine_flags import engine_config
    from raysparse.kv_tiers import KVOffloadConfig

    parse = build_parser().parse_args
    assert engine_config(parse(["serve"])).kv_offload is None
    assert engine_config(parse(["serve", "--kv-offload"])).kv_offload == KVOffloadConfig()
    got = engine_config(parse(["serve", "--kv-offload", "--kv-device-tokens", "8192", "--kv-row-tokens", "0"]))
    assert got.kv_offload == KVOffloadConfig(device_tokens=8192, row_tokens=0)
    assert got.kv_offload.row_cache_tokens == 0
    got = engine_config(parse(["bench", "--kv-offload", "--kv-row-tokens", "2048"])).kv_offload
    assert got.row_cache_tokens == 2048 and got.device_tokens == KVOffloadConfig().device_tokens
    assert KVOffloadConfig(device_tokens=1024).row_cache_tokens == 1024  # the default: the pool's size
    assert engine_config(parse(["serve", "--kv-offload", "--kv-fetch", "rows"])).kv_offload == \
        KVOffloadConfig(fetch="rows")
    for argv in (["serve", "--kv-row-tokens", "64"], ["serve", "--kv-device-tokens", "64"],
                 ["serve", "--kv-fetch", "rows"]):
        with pytest.raises(ValueError, match="give --kv-offload too") as e:
            engine_config(parse(argv))
        assert "\n" not in str(e.value)
    with pytest.raises(SystemExit):
        parse(["serve", "--kv-offload", "--kv-row-tokens", "-1"])


@pytest.mark.parametrize("args, needle", [
    (["run", "--context-tokens", "9000"], "exceeds the model's 8192 positions"),
    (["run", "--context-tokens", "8180"], "plus 24 new tokens exceeds the model's 8192 positions"),
    (["run", "--context-tokens", "100"], "at least 256"),
    (["run", "--text", "/nonexistent/haystack"], "no such file"),
    (["run", "--text", "{empty_dir}"], "holds no .txt files"),
])
def test_inputs_are_refused_before_the_model_loads(tmp_path, args, needle):
    """Loading the model takes 20-odd seconds; what can be checked without it is refused at once, before
    anything is printed on stdout (the first line there is the loaded model's)."""
    import time

    args = [a.format(empty_dir=tmp_path) for a in args]
    t0 = time.monotonic()
    proc = raysparse(*args, timeout=120)
    assert_one_line_error(proc, needle)
    assert proc.stdout == ""
    assert time.monotonic() - t0 < 15


def test_bench_refuses_prompts_longer_than_the_model_before_loading(capsys):
    from raysparse.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "--prompt-lens", "256,8190", "--output-len", "8"])
    assert e.value.code == 2
    assert "--prompt-lens 8190 plus --output-len 8 exceeds the model's 8192 positions" in capsys.readouterr().err


def test_help_shows_every_default(monkeypatch):
    from raysparse.cli import build_parser
    from raysparse.jobs.longcontext import build_parser as job_parser

    monkeypatch.setenv("COLUMNS", "300")  # argparse wraps help at COLUMNS; keep each flag on one line
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    want = {"run": ["haystack size in tokens (default: 4096)",
                    "(default: 24)", "(default: float32)", "(default: 0.5)"],
            "serve": ["(default: 50051)", "(default: 9400)", "(default: 5.0)", "(default: 16384)"],
            "generate": ["(default: 64)", "(default: 127.0.0.1:50051)", "(default: 0.0)"],
            "bench": ["(default: 256,1024)", "(default: 32)", "(default: inf)", "(default: results/bench)"],
            "eval": ["(default: 2048)", "(default: results/eval)", "(default: 16)"]}
    for name, needles in want.items():
        text = sub.choices[name].format_help()
        for needle in needles:
            assert needle in text, (name, needle)
        assert "(default: None)" not in text and "(default: False)" not in text
    job = job_parser().format_help()
    assert "(default: 3600.0)" in job and "(default: 64)" in job and "(default: 1.0)" in job
    from raysparse.cli.specattn_map import build_map_parser

    parsers = {**sub.choices, "job": job_parser(), "specattn-map": build_map_parser()}
    smap = parsers["specattn-map"].format_help()
    for needle in ("(default: 4)", "(default: 1024)", "(default: 8)", "(default: float32)", "(default: cpu)",
                   "(default: SmolLM2-135M-Instruct", "(default: 1)"):
        assert needle in smap, needle
    # Every flag that has a value when it is not given says what it is; the rest are switches, repeatable
    # (empty when not given) or required.
    for name, p in parsers.items():
        fmt = p._get_formatter()
        for a in p._actions:
            if (not a.option_strings or a.required or a.default is argparse.SUPPRESS or a.default == []
                    or isinstance(a, (argparse._HelpAction, argparse._StoreTrueAction))):
                continue
            if name == "generate" and a.dest == "token_ids" or name == "bench" and a.dest in ("scaling",
                                                                                              "local_nodes"):
                continue  # the alternative to another input, or a mode that is off unless given
            assert "default" in (fmt._get_help_string(a) or ""), (name, a.option_strings)


def test_piped_output_is_not_wrapped(monkeypatch, capsys):
    """Into a pipe, report lines stay whole (rich would cut them at 80 columns); on a terminal, rich follows
    the terminal's width."""
    import io

    from raysparse import cli
    from raysparse.cli import common as cli_common
    from raysparse.orchestration import local_job

    def fake_run(opts: local_job.RunOptions, console) -> dict:
        result = {"answer": "1234567", "expected": "1234567", "correct": True, "prompt_tokens": opts.context_tokens,
                  "ttft_s": 1.5, "decode_tokens_per_s": 42.0, "new_tokens": 8, "method": opts.method,
                  "density": 1.0, "density_prefill": 1.0, "density_decode": 1.0}
        local_job._report(result, console)
        return result

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(local_job, "run_retrieval", fake_run)
    assert cli.main(["run", "--context-tokens", "512"]) == 0
    lines = capsys.readouterr().out.splitlines()
    report = [ln for ln in lines if ln.startswith("prompt tokens 512")]
    tail = "method dense, density 1.000 (prefill 1.000, decode 1.000)"
    assert len(report) == 1 and len(report[0]) > 80 and report[0].endswith(tail), lines

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdout", Terminal())
    console = cli_common.output_console()
    assert not console.soft_wrap and console.width < cli_common.PIPE_WIDTH


@pytest.mark.parametrize("argv", [
    ["run", "--method", "dense", "--density", "0.2"],
    ["run", "--method", "specattn", "--density", "0.2"],  # its budget is top_p
    ["generate", "--token-ids", "1,2", "--method", "dense", "--density", "0.3"],
    ["generate", "--token-ids", "1,2", "--method", "psaw", "--param", "bogus=1"],
    ["bench", "--method", "dense", "--density", "0.1"],
    ["bench", "--method", "quest", "--param", "top_p=0.9"],
    ["eval", "--methods", "psaw", "--method-params", "psaw:bogus=1,2"],
    ["job", "--method", "dense", "--density", "0.2"],
    ["job", "--method", "cis", "--param", "nonsense=3"],
])
def test_flags_a_method_does_not_take_are_errors_on_every_command(argv, capsys, tmp_path):
    """One line naming the flag and the method, exit 2, before any model or Ray starts."""
    import time

    from raysparse import cli
    from raysparse.jobs import longcontext

    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e:
        if argv[0] == "job":
            (tmp_path / "in.jsonl").write_text('{"prompt_ids": [1]}\n')
            longcontext.main(["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
                              *argv[1:]])
        else:
            cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "has no parameter" in lines[0], err
    flag = "--density" if "--density" in argv else "--param" if "--param" in argv else "--method-params"
    method = argv[argv.index("--method") + 1] if "--method" in argv else argv[argv.index("--methods") + 1]
    assert flag in lines[0] and f"method {method!r}" in lines[0]
    assert time.monotonic() - t0 < 10
    assert not (tmp_path / "out.jsonl").exists()
