"""The paged-KV attention kernel installed into each titan full-attention layer.

The titan ``Attention`` layer keeps its projections, q/k norms, rotary and output gate; this module
fills its ``kernel`` slot with vLLM's own ``Attention`` layer, so keys/values go to vLLM's paged KV
cache and the attention backend of the platform runs (CPU_ATTN on CPU, FlashAttention/Triton on GPU).

In batch-invariant mode the backend is bypassed: the kernel writes this step's keys/values into
vLLM's paged cache at vLLM's slots and runs the trainer's batch-invariant attention over them: on CUDA
the Triton kernel of ``titan_rl_ext.kernels.attention_triton`` in one launch, reading keys through the
block table (the trainer runs it over packed keys: same bits); on CPU ``attention_bi`` per sequence
over keys gathered through the block table. vLLM still owns the cache memory, the block tables and
prefix caching.

Steps with a prefill take that kernel with BI off too, where vLLM's backend is its Triton one
(``TRITON_ATTN``): at the 9B's heads (16 q / 4 kv of 256) it runs a prefill well above the throughput of
vLLM's unified Triton kernel (the timings: docs/gpu_runs.md §16, the row "prefill steps on the project's
attention kernel"). Decode-only steps keep vLLM's kernel
(the one the decode graphs capture), reading the keys the prefills wrote: both address the cache through the
same views (``tests/gpu/test_paged_kv_cuda.py``). ``TITAN_PREFILL_ATTENTION=vllm`` keeps vLLM's kernel for every
step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from titan_rl_ext import settings
from titan_rl_ext.kernels import batch_invariant as bi
from titan_rl_ext.kernels.attention import attention_bi
from titan_rl_ext.models.common.attention import KVState
from titan_rl_ext.models.common.batch import SeqBatch
from vllm_titan_plugin import checks, compat

# "titan" (default): steps with a prefill run the project's attention kernel where vLLM's backend is TRITON_ATTN;
# "vllm": vLLM's backend runs every non-BI step (checked at start-up: checks.prefill_attention_problem)
PREFILL_ENV = settings.PREFILL_ATTENTION.name


class VllmAttentionKernel(nn.Module):
    """``kernel(q_TNH, k_TKH, v_TKH, batch, state) -> (o_TNH, state)`` backed by vLLM's ``Attention``.

    vLLM keeps the cache and reads per-layer metadata from its forward context, keyed by the wrapped
    layer's ``prefix``; the titan ``SeqBatch`` and ``KVState`` are not needed and pass through.
    """

    def __init__(
        self,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        scale: float,
        *,
        cache_config: object,
        prefix: str,
    ) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.scale = n_heads, head_dim, scale
        self.layer_name = f"{prefix}.attn"
        # prefix must be this module's path in the vLLM model: it keys the KV cache and metadata
        self.attn = compat.Attention(
            num_heads=n_heads,
            head_size=head_dim,
            scale=scale,
            num_kv_heads=n_kv_heads,
            cache_config=cache_config,
            prefix=f"{prefix}.attn",
        )
        problem = checks.attention_head_size_problem(getattr(self.attn, "attn_backend", None), head_dim)
        if problem is not None:
            raise ValueError(problem)

    def forward(
        self,
        q_TNH: torch.Tensor,
        k_TKH: torch.Tensor,
        v_TKH: torch.Tensor,
        batch: SeqBatch,
        state: KVState | None,
    ) -> tuple[torch.Tensor, KVState | None]:
        T = q_TNH.shape[0]
        md = compat.layer_metadata(self.layer_name)
        if md is not None and (bi.is_batch_invariant() or self.prefill_on_own_kernel(q_TNH, md)):
            return self._forward_batch_invariant(q_TNH, k_TKH, v_TKH, md), state
        o_TF = self.attn(q_TNH.reshape(T, -1), k_TKH.reshape(T, -1), v_TKH.reshape(T, -1))
        return o_TF.view(T, self.n_heads, self.head_dim), state

    def prefill_on_own_kernel(self, q_TNH: torch.Tensor, md: Any) -> bool:
        """Whether a non-BI step runs the project's attention kernel instead of vLLM's backend: a step with a
        prefill (``max_query_len > 1``, a host-side value of the metadata), on CUDA with triton, where the
        backend is vLLM's Triton kernel and the cache holds the activations' dtype; not with
        ``TITAN_PREFILL_ATTENTION=vllm``."""
        if settings.PREFILL_ATTENTION.get() == "vllm" or not q_TNH.is_cuda or bi._triton() is None:
            return False
        backend = getattr(self.attn, "attn_backend", None)
        name = backend.get_name() if hasattr(backend, "get_name") else ""
        if name != "TRITON_ATTN" or int(getattr(md, "max_query_len", 1)) <= 1:
            return False
        return compat.paged_kv_views(self.attn, self.head_dim)[0].dtype == q_TNH.dtype

    def _forward_batch_invariant(
        self, q_TNH: torch.Tensor, k_TKH: torch.Tensor, v_TKH: torch.Tensor, md: object
    ) -> torch.Tensor:
        """The project's attention over vLLM's paged cache (BI mode, and non-BI prefills where
        ``prefill_on_own_kernel`` says so): write this step's keys/values at vLLM's slots, then attend."""
        k_cache, v_cache = compat.paged_kv_views(self.attn, self.head_dim)  # [NB, bs, K, D]
        block_size = k_cache.shape[1]
        n = md.num_actual_tokens
        # Padded tokens (CUDA graph batches) have slot -1, which vLLM's own cache writers skip; an index
        # of -1 would land in the last block, so they go to slot 0 of block 0, vLLM's null block, which
        # no request reads. A where, not a mask: no data-dependent shape, no host sync.
        slots = md.slot_mapping[:n].long().clamp_min(0)
        blk, off = slots // block_size, slots % block_size
        k_cache[blk, off] = k_TKH[:n].to(k_cache.dtype)
        v_cache[blk, off] = v_TKH[:n].to(v_cache.dtype)
        if q_TNH.is_cuda and bi._triton() is not None:
            return self._paged_bi_kernel(q_TNH, k_cache, v_cache, md)
        o_TNH = torch.zeros_like(q_TNH)
        qsl = md.query_start_loc.tolist()
        seq_lens = md.seq_lens.tolist()
        for i, L in enumerate(seq_lens):
            qs, qe = qsl[i], qsl[i + 1]
            if qe == qs:
                continue
            n_blocks = -(-L // block_size)
            ids = md.block_table[i, :n_blocks].long()
            k_seq = k_cache[ids].reshape(-1, *k_cache.shape[2:])[:L]
            v_seq = v_cache[ids].reshape(-1, *v_cache.shape[2:])[:L]
            o_TNH[qs:qe] = attention_bi(q_TNH[qs:qe], k_seq.to(q_TNH.dtype), v_seq.to(q_TNH.dtype), L - (qe - qs), self.scale)
        return o_TNH

    def _paged_bi_kernel(
        self, q_TNH: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: object
    ) -> torch.Tensor:
        """The trainer's batch-invariant Triton kernel, reading keys/values through the block table:
        one launch for every sequence of the step (prefill chunks and decodes alike)."""
        from titan_rl_ext.kernels.attention_triton import bi_attention_fwd

        n_seqs = md.seq_lens.shape[0]
        qsl = md.query_start_loc[: n_seqs + 1].to(torch.int32)
        max_q = getattr(md, "max_query_len", None)
        if max_q is None:  # a host read, only where the backend's metadata lacks the bound
            max_q = int((qsl[1:] - qsl[:-1]).max())
        n = md.num_actual_tokens
        o_TNH = torch.zeros_like(q_TNH)
        if k_cache.dtype != q_TNH.dtype:
            raise TypeError(f"batch-invariant attention reads the KV cache as {q_TNH.dtype}; the cache is "
                            f"{k_cache.dtype} (serve with --kv-cache-dtype auto)")
        o_TNH[:n] = bi_attention_fwd(
            q_TNH[:n].contiguous(), k_cache, v_cache, qsl, md.seq_lens.to(torch.int32), int(max_q), self.scale,
            block_table=md.block_table[:n_seqs].to(torch.int32),
        )
        return o_TNH
