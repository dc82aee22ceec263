"""Paged KV cache: capacity accounting, reservation at admission, writes and gathers against a dict."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_hf_config

from raysparse.config import ModelConfig
from raysparse.kv_cache import CapacityError, KVCache


def _cfg() -> ModelConfig:
    return ModelConfig.from_hf(tiny_hf_config(num_kv_heads=2, group=2, layers=2))


def test_bytes_per_token_known_before_admission():
    cfg = _cfg()
    assert KVCache.bytes_per_token(cfg, torch.float32) == 2 * 2 * 2 * 16 * 4
    assert KVCache.bytes_per_token(cfg, torch.bfloat16, metadata_bytes_per_token=10) == 2 * 2 * 2 * 16 * 2 + 10
    assert KVCache.bytes_per_token(cfg, torch.float32, num_kv_heads=1) == 2 * 2 * 1 * 16 * 4
    pages = KVCache.pages_for_bytes(cfg, 1 << 20, 16, torch.float32)
    assert pages == (1 << 20) // (512 * 16)


def test_admission_refuses_what_cannot_fit_and_frees_pages():
    cache = KVCache(_cfg(), num_pages=4, page_size=16)
    cache.allocate(1, 40)  # 3 pages
    assert not cache.can_admit(17) and cache.can_admit(16)
    with pytest.raises(CapacityError, match="only 1 of 4 pages"):
        cache.allocate(2, 20)
    cache.prepare([1], [40], True)
    with pytest.raises(CapacityError, match="reservation"):
        cache.prepare([1], [1], False)
    cache.free(1)
    assert cache.free_pages == 4 and cache.usage() == 0.0


def test_ragged_writes_and_gathers_match_a_reference_store():
    cfg = _cfg()
    cache = KVCache(cfg, num_pages=32, page_size=8)
    ref: dict[int, list[torch.Tensor]] = {}
    lens = {0: 13, 1: 1, 2: 30}
    for sid, n in lens.items():
        cache.allocate(sid, n + 5)
    for step_lens, prefill in ((lens, True), ({0: 1, 1: 1, 2: 1}, False), ({0: 1, 2: 1}, False)):
        batch = cache.prepare(list(step_lens), list(step_lens.values()), prefill)
        t = sum(step_lens.values())
        k, v = torch.randn(t, 2, 16), torch.randn(t, 2, 16)
        cache.write(1, k, v, batch)
        for i, sid in enumerate(batch.seq_ids):
            ref.setdefault(sid, []).append(k[batch.cu_q[i]:batch.cu_q[i + 1]])
        for i, sid in enumerate(batch.seq_ids):
            kk, _ = cache.gather(1, batch, i)
            assert torch.equal(kk.transpose(0, 1), torch.cat(ref[sid]))
    cache.metadata[1][2] = {"sketch": torch.ones(3)}
    cache.free(2)
    assert 2 not in cache.metadata[1]



def test_density_meter_counts_decode_on_its_own():
    from raysparse.attention import DensityMeter

    m = DensityMeter(2)
    assert m.decode_overall() is None and m.overall() == 1.0
    m.add(0, 100.0, 100.0)  # a dense prefill
    m.add(1, 3.0, 10.0, decode=True)
    m.add(0, 2.0, 10.0, decode=True)
    assert m.decode_overall() == 5.0 / 20.0
    assert m.overall() == 105.0 / 120.0
    assert m.per_layer() == [102.0 / 110.0, 0.3]
    m.reset()
    assert m.decode_overall() is None


def test_paged_view_gives_dense_decode_through_the_kernel_entry_point():
    """``KVCache.paged`` (the GPU dense-decode path) attends exactly the keys ``gather`` returns."""
    from raysparse.attention import dense_attention
    from raysparse.config import ModelConfig
    from raysparse.kernels.dispatch import sparse_decode_attention_varlen

    cfg = ModelConfig(vocab_size=10, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=8,
                      num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    cache = KVCache(cfg, 40, 64, torch.float32)
    lens = [int(x) for x in torch.randint(1, 400, (3,))]
    for i, n in enumerate(lens):
        cache.allocate(i, n + 5)
    b = cache.prepare([0, 1, 2], lens, True)
    cache.write(0, torch.randn(sum(lens), 2, 64), torch.randn(sum(lens), 2, 64), b)
    step = cache.prepare([0, 1, 2], [1, 1, 1], False)
    cache.write(0, torch.randn(3, 2, 64), torch.randn(3, 2, 64), step)
    q = torch.randn(3, 8, 64)
    kv, blocks = cache.paged(0, step)
    out, _ = sparse_decode_attention_varlen(q, kv, blocks, unit=64)
    for i in range(3):
        k, v = cache.gather(0, step, i)
        torch.testing.assert_close(out[i], dense_attention(q[i: i + 1], k, v)[0], rtol=1e-5, atol=1e-5)


def test_tokens_exported_per_shard_and_imported_reproduce_the_cache_and_its_next_step():
    """What SpecAttn's draft actor does on CPUs (``kv_transfer``): the verifier's K/V, exported by each shard
    (here: the KV heads split as two shards would hold them), imported into a cache whose pages lie elsewhere
    in two ranges (a prompt, then tokens verified later), equal the source's bit for bit, and the next decode
    step's logits equal too."""
    from helpers import fresh_cache, tiny_model

    from raysparse.attention import DenseAttention
    from raysparse.kv_transfer import export_tokens, import_tokens

    seed = int(torch.randint(0, 2**31 - 1, ()))
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    model = tiny_model("cpu", num_kv_heads=2, group=2, layers=3, seed=seed)
    dense = DenseAttention(model.cfg.num_layers)
    n, m = int(torch.randint(20, 100, (), generator=g)), int(torch.randint(1, 6, (), generator=g))
    ids = torch.randint(0, model.cfg.vocab_size, (n + m + 1,), generator=g)
    src, dst = fresh_cache(model, 512), fresh_cache(model, 512)
    src.allocate(7, n + m + 4)
    dst.allocate(99, 50)  # the imported sequence's pages are not the source's
    dst.allocate(7, n + m + 4)
    model(ids[:n], src.prepare([7], [n], True), src, dense)
    model(ids[n:n + m], src.prepare([7], [m], True), src, dense)

    def halves(start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        k, v = export_tokens(src, 7, start, end)
        assert k.shape == (3, end - start, 2, model.cfg.head_dim)
        return [(k[:, :, :1], v[:, :, :1]), (k[:, :, 1:], v[:, :, 1:])]

    with pytest.raises(ValueError, match="KV heads"):
        import_tokens(dst, 7, 0, halves(0, n)[:1])  # one shard's heads only
    import_tokens(dst, 7, 0, halves(0, n))
    assert dst.seq_len(7) == n
    with pytest.raises(ValueError, match="not the 0 to import after"):
        import_tokens(dst, 7, 0, halves(0, n))
    with pytest.raises(ValueError, match="cannot export"):
        export_tokens(src, 7, 0, n + m + 1)
    import_tokens(dst, 7, n, halves(n, n + m))
    a, b = src.prepare([7], [1], False), dst.prepare([7], [1], False)
    for layer in range(model.cfg.num_layers):
        for x, y in zip(src.gather(layer, a, 0), dst.gather(layer, b, 0), strict=True):
            assert torch.equal(x[:, :n + m], y[:, :n + m])
    tok = ids[-1:]
    assert torch.equal(model(tok, a, src, dense), model(tok, b, dst, dense))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_travels_as_arrays_bit_for_bit(dtype):
    """Between the actors the K/V go as numpy arrays (Ray's object store moves them without a copy); bf16, which
    numpy lacks, as its int16 bits. The round trip is exact, the arrays read-only as the object store's are."""
    from raysparse.kv_transfer import from_arrays, to_arrays

    seed = int(torch.randint(0, 2**31 - 1, ()))
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(3, 17, 2, 16, generator=g).to(dtype) for _ in range(2))
    ka, va, name = to_arrays(k, v)
    ka.flags.writeable = va.flags.writeable = False
    k2, v2 = from_arrays(ka, va, name)
    assert k2.dtype == v2.dtype == dtype and torch.equal(k2, k) and torch.equal(v2, v)
