"""torch's CUDA log-softmax order, in plain PyTorch: the reference of ``log_softmax_triton``.

vLLM's sampler takes a sampled token's logprob from ``logits.log_softmax(-1)`` on fp32 logits; for rows of
``MIN_V`` or more columns torch's CUDA kernel (``cunn_SoftMaxForward`` in ``aten/src/ATen/native/cuda/SoftMax.cu``)
runs one block of ``THREADS`` threads per row: thread ``t`` accumulates ``exp(x - max)`` in fp32, in order, over its
float4 groups ``4 (t + THREADS k) + j`` (k ascending, j = 0..3) for the first ``V - V % (4 THREADS)`` columns, then
over the columns ``V - V % (4 THREADS) + t + THREADS m``; the partial sums are reduced by a warp-shuffle tree (lane
``i`` adds lane ``i + 16``, then ``i + 8``, ..., in each warp, then the same over the warp sums); the output is
``(x - max) - log(sum)``. That order holds for rows that start 16-byte aligned (``replicates``).
``log_softmax_stats_reference`` computes each row's ``max`` and ``logsum`` in it, with the elementwise ``exp``/``log``
it is given.
"""

from __future__ import annotations

from typing import Callable

import torch

THREADS, ILP, WARP = 1024, 4, 32  # torch's block for rows of >= 1024 fp32, its float4 loads, the warp
MIN_V = 16384  # below ~12 k fp32 columns torch caches the row in shared memory (another summation order)


def replicates(x_TV: torch.Tensor) -> bool:
    """Whether ``log_softmax_stats`` follows torch's order for these logits: fp32 rows of ``MIN_V``+ columns,
    unit stride, every row starting 16-byte aligned (torch takes another order for a misaligned row start)."""
    return (x_TV.dim() == 2 and x_TV.dtype == torch.float32 and x_TV.shape[1] >= MIN_V and x_TV.stride(1) == 1
            and x_TV.data_ptr() % 16 == 0 and (x_TV.stride(0) * 4) % 16 == 0)


def log_softmax_stats_reference(x_TV: torch.Tensor, exp: Callable[[torch.Tensor], torch.Tensor] = torch.exp,
                                log: Callable[[torch.Tensor], torch.Tensor] = torch.log
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max [T], logsum [T])`` in torch's CUDA summation order (module docstring), in plain PyTorch.
    ``exp`` / ``log``: the elementwise functions (the interpreter's, to compare with the kernel on CPU)."""
    T, V = x_TV.shape
    x = x_TV.float()
    m = x.max(dim=1).values
    last = V % (THREADS * ILP)
    main = x[:, : V - last].reshape(T, -1, THREADS, ILP)
    acc = torch.zeros(T, THREADS, dtype=torch.float32, device=x.device)
    for k in range(main.shape[1]):
        for j in range(ILP):
            acc = acc + exp(main[:, k, :, j] - m[:, None])
    for j0 in range(V - last, V, THREADS):
        n = min(THREADS, V - j0)
        acc[:, :n] = acc[:, :n] + exp(x[:, j0: j0 + n] - m[:, None])

    def tree(v: torch.Tensor) -> torch.Tensor:  # [..., 32] -> [...], shuffle-down order
        while v.shape[-1] > 1:
            h = v.shape[-1] // 2
            v = v[..., :h] + v[..., h:]
        return v[..., 0]

    return m, log(tree(tree(acc.reshape(T, WARP, WARP))))
