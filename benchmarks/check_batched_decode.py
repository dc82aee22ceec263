"""Batched decode against the per-sequence reference on a real model: one long real-text prompt, then
teacher-forced decode steps, for each method in three modes (the reference path, forced by a no-op tracer;
the batched seam; the batched seam with the PyTorch paged attend in place of the kernel). Prints each mode's
NLL of the decoded tokens and its largest logit difference from the reference, so a fast path that selects
or attends differently shows at once (on a GPU, where the kernels run; the CPU runs the PyTorch forms).

    python benchmarks/check_batched_decode.py --model SmolLM2-135M-Instruct.Q4_1.gguf --text emma.txt \\
        --device cuda --methods socket,cis
"""

from __future__ import annotations

import argparse

import torch
from bench_common import method_spec

import raysparse.methods.base as base
from raysparse.kernels.paged_torch import paged_decode_torch
from raysparse.kv_cache import KVCache
from raysparse.loader import load_hf_config, load_state_dict, load_tokenizer, model_from_state, resolve_source
from raysparse.methods.registry import create_backend

MODES = ("reference", "batched", "batched, PyTorch attend")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file or model directory (default: the embedded model)")
    ap.add_argument("--text", required=True, help="a text file for the prompt")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--methods", default="socket,cis",
                    help="comma-separated NAME or NAME:key=value:... (values as JSON where they parse)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"a subset of: {', '.join(MODES)}")
    ap.add_argument("--density", type=float, default=0.15)
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    n, steps, dev = args.prompt_tokens, args.steps, args.device
    src = resolve_source(args.model)
    model = model_from_state(load_hf_config(src), load_state_dict(src, torch.float32), torch.float32, dev)
    tok = load_tokenizer(src)
    text = open(args.text, encoding="utf-8").read()
    ids = torch.tensor(tok(text[len(text) // 4:])["input_ids"][: n + steps], device=dev)
    if ids.numel() < n + steps:
        raise SystemExit(f"the text holds fewer than {n + steps} tokens past its first quarter")
    attend = base.paged_decode_attention

    modes = [m.strip() for m in args.modes.split(",")]
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"--modes takes a subset of: {', '.join(MODES)}")

    def run(entry: str, mode: str) -> torch.Tensor:
        # The attend is a module-level name of the seam: swapped here, restored for the next mode.
        base.paged_decode_attention = paged_decode_torch if mode == MODES[2] else attend
        method, params = method_spec(entry, args.density)
        backend = create_backend(method, model.cfg, **params)
        if mode == MODES[0]:
            backend.tracer = lambda *a: None  # any tracer forces the per-sequence reference path
        cache = KVCache(model.cfg, (n + steps) // 64 + 4, 64, torch.float32, dev)
        cache.allocate(0, n + steps)
        with torch.inference_mode():
            model(ids[:n], cache.prepare([0], [n], True), cache, backend)
            out = [model(ids[j:j + 1], cache.prepare([0], [1], False), cache, backend)
                   for j in range(n, n + steps - 1)]
        return torch.cat(out).float()

    print(f"{'method':36s} {'mode':26s} {'nll':>8s} {'max |dlogit|':>13s} {'argmax agree':>13s}  (against {modes[0]})")
    for method in args.methods.split(","):
        res = {mode: run(method, mode) for mode in modes}
        base.paged_decode_attention = attend
        tgt = ids[n + 1: n + steps]
        for mode, lg in res.items():
            nll = torch.nn.functional.cross_entropy(lg, tgt).item()
            diff = (lg - res[modes[0]]).abs().max().item()
            agree = (lg.argmax(-1) == res[modes[0]].argmax(-1)).float().mean().item()
            print(f"{method:36s} {mode:26s} {nll:8.4f} {diff:13.4f} {agree:13.3f}")


if __name__ == "__main__":
    main()
