"""Batch-invariant primitives: a row's bits must not depend on the rows around it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from titan_rl_ext.kernels import batch_invariant as bi


def _embedded(row: torch.Tensor, before: int, after: int, gen: torch.Generator) -> torch.Tensor:
    return torch.cat([torch.randn(before, *row.shape[1:], generator=gen), row, torch.randn(after, *row.shape[1:], generator=gen)])


@pytest.mark.parametrize("K,N", [(64, 96), (40, 7), (256, 512)])
def test_mm_rows_bit_identical_whatever_the_batch(K: int, N: int) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=g)
    row = torch.randn(1, K, generator=g)
    ref = bi.linear(row, w)
    plain_differs = False
    for before in (0, 1, 5, 31, 33):
        for after in (0, 2, 17, 200):
            x = _embedded(row, before, after, g)
            assert torch.equal(bi.linear(x, w)[before], ref[0]), (before, after)
            plain_differs |= not torch.equal(F.linear(x, w)[before], F.linear(row, w)[0])
    # the value is the same as the plain GEMM's up to rounding
    torch.testing.assert_close(ref, F.linear(row, w), atol=1e-4, rtol=1e-5)
    if K == 64:  # witnessed on this CPU: the stock GEMM is not batch invariant at these shapes
        assert plain_differs


def test_elementwise_and_log_softmax_invariant() -> None:
    g = torch.Generator().manual_seed(1)
    a = torch.randn(1000, generator=g)
    full = bi.elementwise(F.silu, a)
    for s in range(0, 40, 3):
        for n in (1, 3, 17, 100):
            assert torch.equal(bi.elementwise(F.silu, a[s : s + n]), full[s : s + n])
    logits = torch.randn(9, 333, generator=g)
    ls = bi.log_softmax(logits)
    torch.testing.assert_close(ls, torch.log_softmax(logits, -1), atol=1e-6, rtol=0)
    for i in range(9):
        assert torch.equal(bi.log_softmax(logits[i : i + 1])[0], ls[i])


def test_bi_ops_against_float64_reference() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(77, 96, generator=g)
    w = torch.randn(130, 96, generator=g)
    b = torch.randn(130, generator=g)
    ref = (x.double() @ w.double().t() + b.double())
    # fp32 GEMM over K=96 with values ~N(0,1): rounding ~1e-6 relative to |y| ~ 10
    torch.testing.assert_close(bi.linear(x, w, b).double(), ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(bi.elementwise(torch.exp, x).double(), x.double().exp(), atol=0, rtol=1e-6)
    torch.testing.assert_close(bi.log_softmax(x).double(), torch.log_softmax(x.double(), -1), atol=1e-5, rtol=0)


def test_bi_rows_invariant_for_many_batch_sizes() -> None:
    """Every row of an M-row product equals that row computed alone, for M = 1..200."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=g)
    x = torch.randn(200, 64, generator=g)
    alone = torch.cat([bi.linear(x[i : i + 1], w) for i in range(200)])
    for M in range(1, 201):
        assert torch.equal(bi.linear(x[:M], w), alone[:M]), M


# The backward passes of the BI GEMM and row reductions: on CPU always (the torch path), on CUDA too (the
# Triton kernels' custom backward) where there is a device.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dev", DEVICES)
def test_bi_gemm_backward(dev: str) -> None:
    g = torch.Generator(device=dev).manual_seed(4)
    x = torch.randn(100, 512, device=dev, generator=g, requires_grad=True)
    w = (torch.randn(256, 512, device=dev, generator=g) * 0.05).requires_grad_(True)
    gy = torch.randn(100, 256, device=dev, generator=g)
    bi.linear(x, w).backward(gy)
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    F.linear(x, w).backward(gy)
    # fp32, two summation orders over K = 512 (gx) or 100 (gw): ~K * 2^-24 relative, far below 1e-4
    torch.testing.assert_close(gx, x.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gw, w.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dev", DEVICES)
def test_row_reductions_backward(dev: str) -> None:
    g = torch.Generator(device=dev).manual_seed(7)
    for fn, ref in ((bi.row_sum_sq, lambda t: (t * t).sum(-1)), (bi.row_mean_sq, lambda t: t.pow(2).mean(-1))):
        x = torch.randn(33, 4, 256, device=dev, generator=g, requires_grad=True)
        gy = torch.randn(33, 4, device=dev, generator=g)
        fn(x).backward(gy)
        got = x.grad.clone()
        x.grad = None
        ref(x).backward(gy)
        # the gradient 2 x gy (/ D) is elementwise: equal up to one rounding of the scale
        torch.testing.assert_close(got, x.grad, rtol=1e-6, atol=1e-7)


def test_gemm_tile_table_is_read_per_gpu(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """A GPU's measured M-bucket table (``bi_gemm_tables.json``) decides the bf16 tiles on that GPU only; another
    GPU, another dtype or no table keeps the built-in configurations."""
    import json

    tri = pytest.importorskip("titan_rl_ext.kernels.batch_invariant_triton")
    table = {"GPU A": [{"max_m": 16, "config": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "num_stages": 8}},
                       {"max_m": 256, "max_n": 4096, "config": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128}},
                       {"max_m": 1 << 30, "config": {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "tma": True,
                                                     "persistent": False}}]}
    path = tmp_path / "tables.json"
    path.write_text(json.dumps(table))
    monkeypatch.setattr(tri, "TABLES_FILE", path)
    tri.device_table.cache_clear()
    try:
        cuda = torch.device("cuda")
        monkeypatch.setattr(tri, "_gpu_name", lambda device: "GPU A")
        assert tri.mm_config(1, torch.bfloat16, cuda) == tri.MMConfig(16, 32, 64, num_stages=8)
        big = tri.mm_config(8192, torch.bfloat16, cuda)
        assert (big.BLOCK_N, big.tma, big.persistent) == (256, True, False)
        # a row with max_n serves only outputs that narrow, and only where N is known
        assert tri.mm_config(200, torch.bfloat16, cuda, N=4096) == tri.MMConfig(64, 64, 128)
        assert tri.mm_config(200, torch.bfloat16, cuda, N=4097).BLOCK_N == 256
        assert tri.mm_config(200, torch.bfloat16, cuda).BLOCK_N == 256
        assert tri.mm_config(300, torch.bfloat16, cuda, N=4096).BLOCK_N == 256
        assert tri.mm_config(8192, torch.float32, cuda) == tri._MM_CONFIGS[torch.float32]  # bf16 only
        monkeypatch.setattr(tri, "_gpu_name", lambda device: "GPU B")
        assert tri.mm_config(1, torch.bfloat16, cuda) == tri._SMALL_M_CONFIGS[torch.bfloat16][0][1]
        assert tri.mm_config(1, torch.bfloat16) == tri._SMALL_M_CONFIGS[torch.bfloat16][0][1]  # no device
        # a GPU without an entry takes the one measured on a GPU of its die (an H100 the H200's)
        path.write_text(json.dumps({**table, "NVIDIA H200": table["GPU A"][:1]}))
        tri.device_table.cache_clear()
        monkeypatch.setattr(tri, "_gpu_name", lambda device: "NVIDIA H100 80GB HBM3")
        assert tri.mm_config(1, torch.bfloat16, cuda) == tri.MMConfig(16, 32, 64, num_stages=8)
    finally:
        tri.device_table.cache_clear()
