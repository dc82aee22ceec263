"""Small helpers shared by tests: run our model the way the generator does, without sampling."""

from __future__ import annotations

import torch

from raysparse.attention import DenseAttention
from raysparse.kv_cache import KVCache
from raysparse.model import LlamaForCausalLM


def fresh_cache(model: LlamaForCausalLM, tokens: int = 2048, page_size: int = 16) -> KVCache:
    pages = -(-tokens // page_size)
    return KVCache(model.cfg, num_pages=pages, page_size=page_size, dtype=model.lm_head.weight.dtype,
                   num_kv_heads=model.num_kv_heads)


def measure_density(model: LlamaForCausalLM, backend, n: int, steps: int, g: torch.Generator, page: int = 16
                    ) -> tuple[float, float, float]:
    """One random prompt of n tokens prefilled, then ``steps`` decode steps on a fresh paged cache (page = block:
    the batched seams run, as in serving): the backend meter's (overall, prefill, decode) density."""
    from raysparse.attention import ShardContext

    cache = fresh_cache(model, n + steps + 2 * page, page_size=page)
    backend.bind(ShardContext(cache=cache, max_batch=2))
    cache.allocate(0, n + steps)
    model(torch.randint(0, 97, (n,), generator=g), cache.prepare([0], [n], True), cache, backend)
    for _ in range(steps):
        model(torch.randint(0, 97, (1,), generator=g), cache.prepare([0], [1], False), cache, backend)
    m = backend.meter
    return m.overall(), m.prefill_overall(), m.decode_overall()


def full_logits(model: LlamaForCausalLM, ids: list[int], backend=None) -> torch.Tensor:
    """Logits of every position of one sequence from one prefill."""
    cache = fresh_cache(model, len(ids) + 8)
    cache.allocate(0, len(ids))
    batch = cache.prepare([0], [len(ids)], True)
    backend = backend or DenseAttention(model.cfg.num_layers)
    return model(torch.tensor(ids), batch, cache, backend, all_logits=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tp_worker(rank: int, world: int, port: int, hf_config, state, ids: list[list[int]], out_path: str,
              reduce_norm: bool = False, fused_ops: str = "auto") -> None:
    """One gloo rank: shard the model, run a packed ragged prefill, rank 0 saves every token's logits.
    ``reduce_norm``: the layers take the fused all-reduce + add + norm seam (emulated here in PyTorch, as the
    group's kernel would compute it), so the MLP outputs stay partial sums until the next norm. ``fused_ops``:
    the model's fused elementwise kernels (``RuntimeConfig.fused_ops``)."""
    import torch.distributed as dist

    from raysparse.loader import model_from_state
    from raysparse.tensor_parallel import apply_tensor_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        from raysparse.all_reduce import collective_all_reduce

        calls = []

        def emulated(x, h, norm):
            calls.append(x.shape[0])
            return norm.add_forward(collective_all_reduce(None)(x.clone()), h)

        model = apply_tensor_parallel(model_from_state(hf_config, state), rank, world,
                                      reduce_norm=emulated if reduce_norm else None)
        model.set_fused_ops(fused_ops)
        cache = fresh_cache(model, 2048)
        for i, seq in enumerate(ids):
            cache.allocate(i, len(seq))
        batch = cache.prepare(list(range(len(ids))), [len(s) for s in ids], True)
        flat = torch.tensor([t for s in ids for t in s])
        logits = model(flat, batch, cache, DenseAttention(model.cfg.num_layers), all_logits=True)
        if rank == 0:
            torch.save({"logits": logits, "kv_heads": model.num_kv_heads, "reduce_norm_calls": len(calls)}, out_path)
        # The ranks tear the group down together: rank 0 hosts the group's store, and one CI run had a rank
        # abort in gloo at the end ("terminate called without an active exception", SIGABRT) after the other
        # had finished its own part; a rank that leaves early can meet the other's teardown half done.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_tp(world: int, hf_config, state, ids: list[list[int]], tmp_path, reduce_norm: bool = False,
           fused_ops: str = "auto") -> dict:
    import torch.multiprocessing as mp

    out = str(tmp_path / f"tp{world}.pt")
    mp.spawn(tp_worker, args=(world, free_port(), hf_config, state, ids, out, reduce_norm, fused_ops), nprocs=world,
             join=True)
    return torch.load(out)


def tiny_hf_config(num_kv_heads: int = 3, group: int = 2, layers: int = 3, rope_parameters: dict | None = None):
    from transformers import LlamaConfig

    heads = num_kv_heads * group
    return LlamaConfig(
        vocab_size=97, hidden_size=heads * 16, intermediate_size=80, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=num_kv_heads, head_dim=16,
        max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
    )


def random_state(hf_config, seed: int = 0) -> dict[str, torch.Tensor]:
    """A transformers LlamaForCausalLM with seeded random weights: our oracle and our weights source."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():
        for p in model.parameters():  # non-trivial norms too, so their handling is tested
            p.add_(torch.randn_like(p) * 0.02)
    return model


# Graph-decode tests run on the CPU (the padded path, eagerly) and, on a GPU, with real captures and replays.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def tiny_model(device: str, num_kv_heads: int, group: int, layers: int, seed: int | None = None) -> LlamaForCausalLM:
    """Our model over a seeded random transformers Llama, on ``device``: weights from ``seed`` (None: a fresh
    seed per call), so a test that prints its seed can be replayed with the same weights."""
    from raysparse.loader import model_from_state

    cfg = tiny_hf_config(num_kv_heads=num_kv_heads, group=group, layers=layers)
    seed = int(torch.randint(0, 2**31 - 1, ())) if seed is None else seed
    return model_from_state(cfg, random_state(cfg, seed=seed).state_dict()).to(device)


def prefill_then_decode(model, cache, backend, graphs, lens: list[int], steps: int, g: torch.Generator,
                        graph: bool, after_prefill=None) -> torch.Tensor:
    """Each random prompt (ids from ``g``) prefilled alone, the meter reset (then ``after_prefill()``), then
    ``steps`` decode steps of the whole batch through ``graphs`` or the plain model; the stacked logits."""
    dev = cache.device
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in lens]
    for sid, p in enumerate(prompts):
        cache.allocate(sid, len(p) + steps + 1)
        model(torch.tensor(p, device=dev), cache.prepare([sid], [len(p)], True), cache, backend)
    backend.meter.reset()
    if after_prefill is not None:
        after_prefill()
    sids = list(range(len(lens)))
    logits = []
    for _ in range(steps):
        ids = torch.randint(0, 97, (len(sids),), generator=g).tolist()
        if graph:
            logits.append(graphs.decode("k", backend, sids, ids).clone())
        else:
            batch = cache.prepare(sids, [1] * len(sids), False)
            logits.append(model(torch.tensor(ids, device=dev), batch, cache, backend))
    return torch.stack(logits)


def whole_model_density(layer_density: float, num_layers: int, dense_layers: int = 0) -> float:
    """The whole-model ``--density`` whose sparse layers each get ``layer_density`` (``methods.budget.layer_density``'s
    inverse): tests that exercise a selection at a given per-layer budget ask for it through the registry. The
    registry's default has no dense layer (``dense_layers=0``); pass the count a test gives the method."""
    return (dense_layers + layer_density * (num_layers - dense_layers)) / num_layers


def prefill_block_budgets(density: float, rows: int, forced: int, block_size: int) -> list[int]:
    """The definition of a sparse layer's prefill row budgets, written out independently of the method code:
    row by row, the block count (within [the row's forced blocks, its causal blocks]) whose attended causal pairs
    bring the running total nearest to ``density`` of the running causal pairs (a diagonal block holds
    B (B + 1) / 2 of them, any other B^2); ties to the fewer blocks."""
    b = block_size
    out, attended, causal = [], 0, 0
    for i in range(rows):
        causal += i * b * b + b * (b + 1) // 2
        target = density * causal
        options = range(min(i + 1, forced), i + 2)
        k = min(options, key=lambda c: (abs(attended + (c - 1) * b * b + b * (b + 1) // 2 - target), c))
        attended += (k - 1) * b * b + b * (b + 1) // 2
        out.append(k)
    return out


def ray_session_in(procs) -> str | None:
    """The Ray session directory named on the command line of one of ``procs`` (psutil processes: a command's
    Ray daemons), or None."""
    import re

    import psutil

    for p in procs:
        try:
            m = re.search(r"(/\S*?/session_\d{4}-[\d_-]+)", " ".join(p.cmdline()))
        except psutil.Error:
            continue
        if m:
            return m.group(1)
    return None
