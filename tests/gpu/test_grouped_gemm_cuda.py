"""The MoE grouped GEMM on CUDA (``kernels.grouped_gemm``) at the Qwen3.5-35B-A3B expert shapes (256
experts, hidden 2048, expert width 512, top-8): batch invariance of the Triton kernel (a row's bits alone =
in any routing of any batch), both paths against the expert-by-expert fp32 reference, the MoE layer's
output rows independent of the batch under BI, and a decode-sized dispatch inside a CUDA graph = eager.
Skips without CUDA.

Tolerance against the reference: two bf16 ulps of the output (fp32 accumulation in another order).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

E, D, I, TOPK = 256, 2048, 512, 8


def _routing(T: int, g: torch.Generator) -> torch.Tensor:
    return torch.rand(T, E, device="cuda", generator=g).topk(TOPK, dim=-1).indices


def _sorted_rows(x_TD: torch.Tensor, top_i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    flat = top_i.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int64, device="cuda").scatter_add_(0, flat, torch.ones_like(flat))
    return x_TD[order // TOPK], counts, order


def test_bi_grouped_gemm_rows_do_not_depend_on_the_batch() -> None:
    from titan_rl_ext.kernels import grouped_gemm as gg
    from titan_rl_ext.kernels.batch_invariant import batch_invariant

    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(E, I, D, device="cuda", generator=g) * 0.02).bfloat16()
    x = torch.randn(1024, D, device="cuda", generator=g).bfloat16()
    top_i = _routing(1024, g)
    with batch_invariant(True):
        xs, counts, order = _sorted_rows(x, top_i)
        y = gg.grouped_mm(xs, w, counts)
        ref = gg.grouped_mm_reference(xs.float(), w.float(), counts).bfloat16()
        torch.testing.assert_close(y.float(), ref.float(), rtol=2 * 2.0**-7, atol=1e-3)
        y_pairs = torch.empty_like(y).index_copy(0, order, y)  # (token, slot) order
        for T in (1, 3, 16, 255):  # decode-sized and prefill-sized batches of the same tokens
            xs_t, counts_t, order_t = _sorted_rows(x[:T], top_i[:T])
            yt = torch.empty_like(xs_t[:, :I]).index_copy(0, order_t, gg.grouped_mm(xs_t, w, counts_t))
            assert torch.equal(yt, y_pairs[: T * TOPK]), T


def test_non_bi_path_matches_the_reference() -> None:
    from titan_rl_ext.kernels import grouped_gemm as gg

    g = torch.Generator(device="cuda").manual_seed(1)
    w = (torch.randn(E, D, I, device="cuda", generator=g) * 0.02).bfloat16()
    h = torch.randn(512 * TOPK, I, device="cuda", generator=g).bfloat16()
    _, counts, _ = _sorted_rows(torch.zeros(512, 1, device="cuda"), _routing(512, g))
    y = gg.grouped_mm(h, w, counts)
    ref = gg.grouped_mm_reference(h.float(), w.float(), counts).bfloat16()
    torch.testing.assert_close(y.float(), ref.float(), rtol=2 * 2.0**-7, atol=1e-3)


def test_moe_layer_batch_invariant_and_graph_capturable() -> None:
    from titan_rl_ext.kernels.batch_invariant import batch_invariant
    from titan_rl_ext.models.common.moe import MoE, MoEConfig

    torch.manual_seed(2)
    moe = MoE(D, MoEConfig(num_experts=E, top_k=TOPK, expert_ffn_dim=I, shared_ffn_dim=I)).cuda()
    moe.experts.reset_parameters()
    for p in moe.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    moe = moe.bfloat16()
    x = torch.randn(300, D, device="cuda").bfloat16()
    with torch.no_grad(), batch_invariant(True):
        full = moe(x)
        for T in (1, 7, 64):
            assert torch.equal(moe(x[:T]), full[:T]), T
        static = x[:8].clone()
        moe(static)  # warm-up (Triton compiles outside the capture)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(static)
        static.copy_(x[8:16])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, moe(x[8:16]))
