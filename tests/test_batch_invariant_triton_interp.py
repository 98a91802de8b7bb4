"""The CUDA batch-invariant Triton kernels (``titan_rl_ext.kernels.batch_invariant_triton``: GEMM, row
reductions), run on CPU under the Triton interpreter and checked against float64 and the torch references.

``TRITON_INTERPRET=1`` must be set before a kernel is defined, and must not leak into other tests, so
the checks run in a subprocess (this file executed as a script). Skipped where triton is missing.

Interpreter caveats (not properties of the GPU kernels): its numpy ``dot`` mishandles bf16, and numpy's
BLAS (OpenBLAS AVX2) rounds a row differently at different positions in a tile, so on CPU tensors the GEMM
takes a float64 dot per K block, rounded once to the fp32 accumulator; and
its fp32 -> bf16 cast truncates instead of rounding to nearest, so bf16 outputs are checked to one
bf16 ulp rather than half an ulp.
"""

from __future__ import annotations

import importlib.util

import pytest

from triton_interp import run_checks, run_checks_under_interpreter


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_triton_kernels_under_interpreter() -> None:
    run_checks_under_interpreter(__file__)


# ------------------------------------------------------------------------------------------------
# the checks, run in the subprocess


def _gemm_bound(x, w_KN, y64):  # type: ignore[no-untyped-def]
    """Allowed |y - y64|: output rounding (1 ulp of the output dtype) + fp32 accumulation over K."""
    import torch

    ulp = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[x.dtype]
    K = x.shape[1]
    mag = x.double().abs() @ w_KN.double().abs()
    return ulp * y64.abs() + K * 2.0**-24 * mag + 1e-30


def _check_gemm() -> None:
    import torch

    from titan_rl_ext.kernels import batch_invariant as bi
    from titan_rl_ext.kernels import batch_invariant_triton as tri

    g = torch.Generator().manual_seed(0)
    # K tails (K % BLOCK_K != 0), N tails, several M tiles; 300 x 260 -> 9 tiles > 4 programs (persistent loop)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for M, K, N in ((300, 100, 260), (5, 64, 16), (1, 33, 7)):
            x = torch.randn(M, K, generator=g).to(dtype)
            w = torch.randn(N, K, generator=g).to(dtype)
            y = tri.bi_matmul(x, w.t())  # transposed weight read in place, as bi.linear does
            assert y.dtype == dtype and y.shape == (M, N)
            y64 = x.double() @ w.double().t()
            err = (y.double() - y64).abs()
            assert (err <= _gemm_bound(x, w.t(), y64)).all(), (dtype, M, K, N, err.max().item())
            # against the plain-PyTorch BI reference (mm_torch); bf16/fp16: both round to the output dtype
            ref = bi.mm_torch(x.float(), w.float().t())
            tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
            torch.testing.assert_close(y.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)
            # contiguous b gives the same bits as the strided one
            assert torch.equal(tri.bi_matmul(x, w.t().contiguous()), y)
            # batch invariance: any row window, any offset
            for s, n in ((0, 1), (M - 1, 1), (M // 3, min(M, 7)), (1, min(M - 1, 129)), (0, M)):
                if n > 0 and s + n <= M:
                    assert torch.equal(tri.bi_matmul(x[s : s + n], w.t()), y[s : s + n]), (dtype, M, s, n)
    # mixed dtypes (fp32 activations, bf16 LM head): the kernel widens b per tile, bit for bit a cast first;
    # batch invariant like the rest
    for M, K, N in ((300, 100, 260), (1, 33, 7)):
        x = torch.randn(M, K, generator=g)
        w = torch.randn(N, K, generator=g).to(torch.bfloat16)
        y = tri.bi_matmul(x, w.t())
        assert y.dtype == torch.float32 and torch.equal(y, tri.bi_matmul(x, w.float().t())), (M, K, N)
        assert torch.equal(tri.bi_matmul(x[M // 2 :], w.t()), y[M // 2 :])
        assert torch.equal(bi.mm(x, w.t()), bi.mm(x, w.float().t()))  # the CPU dispatch promotes too
    # the dispatch: on CPU bi.mm is the torch path, untouched
    x = torch.randn(9, 40, generator=g)
    w = torch.randn(40, 24, generator=g)
    assert torch.equal(bi.mm(x, w), bi.mm_torch(x, w))
    # empty / degenerate shapes
    assert tri.bi_matmul(torch.zeros(0, 8), torch.zeros(8, 3)).shape == (0, 3)
    assert torch.equal(tri.bi_matmul(torch.ones(2, 0), torch.ones(0, 3)), torch.zeros(2, 3))


def _check_gemm_grad() -> None:
    import torch

    from titan_rl_ext.kernels import batch_invariant_triton as tri

    g = torch.Generator().manual_seed(1)
    x = torch.randn(20, 48, generator=g, requires_grad=True)
    w = torch.randn(30, 48, generator=g, requires_grad=True)
    gy = torch.randn(20, 30, generator=g)
    y = tri.bi_mm(x, w.t())
    with _CopyLog() as copies:
        y.backward(gy)
    # the weight's gradient comes out of the GEMM in the weight's layout: no transposing copy into .grad
    assert w.grad.is_contiguous() and not [c for c in copies.shapes if c == tuple(w.shape)], copies.shapes
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    (x @ w.t()).backward(gy)
    # fp32 products of randn over K = 48: both sides sum in fp32 in different orders (~K ulps of |x||w|)
    torch.testing.assert_close(gx, x.grad, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(gw, w.grad, atol=1e-4, rtol=1e-5)
    # a row-major b (not a transposed weight) keeps its row-major gradient
    b = torch.randn(48, 30, generator=g, requires_grad=True)
    tri.bi_mm(x.detach(), b).backward(gy)
    assert b.grad.is_contiguous()
    torch.testing.assert_close(b.grad, x.detach().t() @ gy, atol=1e-4, rtol=1e-5)


class _CopyLog:
    """The shapes of every copy/clone dispatched inside the block."""

    def __enter__(self):  # type: ignore[no-untyped-def]
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        shapes = self.shapes = []
        copy_ops = {torch.ops.aten.copy_.default, torch.ops.aten.clone.default}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if func in copy_ops:
                    shapes.append(tuple(args[0].shape))
                return func(*args, **(kwargs or {}))

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):  # type: ignore[no-untyped-def]
        return self._mode.__exit__(*exc)


def _check_rows() -> None:
    import torch

    from titan_rl_ext.kernels import batch_invariant_triton as tri

    g = torch.Generator().manual_seed(2)
    for D in (128, 300, 2500):  # one strip, a tail, and several strips of ROW_BLOCK_D_MAX
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(40, D, generator=g) * 3).to(dtype)
            s, m = tri.row_sum_sq(x), tri.row_mean_sq(x)
            assert s.dtype == m.dtype == torch.float32 and s.shape == (40,)
            s64 = (x.double() ** 2).sum(-1)
            # all terms >= 0: relative error <= (D / BLOCK + log2 BLOCK) * 2^-24 << 1e-5
            torch.testing.assert_close(s.double(), s64, rtol=1e-5, atol=0)
            torch.testing.assert_close(m.double(), s64 / D, rtol=1e-5, atol=0)
            for a, n in ((0, 1), (39, 1), (5, 3), (1, 38)):
                assert torch.equal(tri.row_sum_sq(x[a : a + n]), s[a : a + n])
                assert torch.equal(tri.row_mean_sq(x[a : a + n]), m[a : a + n])
    # leading dims and non-contiguous input ([T, H, K] slices, as l2norm sees them)
    x = torch.randn(6, 4, 2 * 64, generator=g)[..., :64]
    torch.testing.assert_close(tri.row_sum_sq(x), (x * x).sum(-1), rtol=1e-6, atol=0)
    assert tri.row_sum_sq(x).shape == (6, 4)
    # gradients == torch autograd of the same expressions
    for fn, ref in ((tri.row_sum_sq, lambda t: (t * t).sum(-1)), (tri.row_mean_sq, lambda t: t.pow(2).mean(-1))):
        x = torch.randn(7, 3, 50, generator=g, requires_grad=True)
        gy = torch.randn(7, 3, generator=g)
        fn(x).backward(gy)
        got = x.grad.clone()
        x.grad = None
        ref(x).backward(gy)
        torch.testing.assert_close(got, x.grad, rtol=1e-6, atol=1e-7)


def _check_gemm_fp32_out() -> None:
    """bf16 operands, fp32 accumulator stored as is (the fp32 LM head): exact products, fp32 sums."""
    import torch

    from titan_rl_ext.kernels import batch_invariant_triton as tri

    g = torch.Generator().manual_seed(3)
    for M, K, N in ((300, 100, 260), (1, 64, 33)):
        x = torch.randn(M, K, generator=g).bfloat16()
        w = torch.randn(N, K, generator=g).bfloat16()
        y = tri.bi_matmul(x, w.t(), out_dtype=torch.float32)
        assert y.dtype == torch.float32
        y64 = x.double() @ w.double().t()
        bound = K * 2.0**-24 * (x.double().abs() @ w.double().abs().t()) + 2.0**-24 * y64.abs() + 1e-30
        assert ((y.double() - y64).abs() <= bound).all(), (M, K, N)
        for s, n in ((0, 1), (M - 1, 1), (M // 3, min(M, 7))):
            assert torch.equal(tri.bi_matmul(x[s : s + n], w.t(), out_dtype=torch.float32), y[s : s + n])


def _check_gemm_configs() -> None:
    """Every launch shape of the GEMM gives the default's bits: output tiles, persistent grid or one program
    per tile, pointer loads or TMA descriptors (zero-filled out-of-bounds boxes in place of masks), K and N
    tails included; a weight TMA cannot read (a column-major copy) takes the pointer kernel, same bits."""
    import dataclasses

    import torch

    from titan_rl_ext.kernels import batch_invariant_triton as tri

    g = torch.Generator().manual_seed(5)
    for dtype, K in ((torch.bfloat16, 136), (torch.float32, 72)):  # K: a tail past the last BLOCK_K, rows 16B aligned
        x = torch.randn(70, K, generator=g).to(dtype)
        w = torch.randn(40, K, generator=g).to(dtype)
        base = tri.mm_config(70, dtype)
        y = tri.bi_matmul(x, w.t())
        for cfg in (dataclasses.replace(base, BLOCK_M=16, BLOCK_N=32), dataclasses.replace(base, persistent=False),
                    dataclasses.replace(base, tma=True), dataclasses.replace(base, BLOCK_M=32, BLOCK_N=16, tma=True,
                                                                             persistent=False)):
            assert torch.equal(tri.bi_matmul(x, w.t(), config=cfg), y), cfg
            assert torch.equal(tri.bi_matmul(x[3:4], w.t(), config=cfg), y[3:4]), cfg
        tma = dataclasses.replace(base, tma=True)
        assert tri._tma_weight(w.t().contiguous()) is None  # [K, N] row-major: not TMA-readable as [N, K]
        assert torch.equal(tri.bi_matmul(x, w.t().contiguous(), config=tma), y)
    # the fp32 head under TMA: bf16 operands, fp32 accumulator out
    x = torch.randn(33, 64, generator=g).bfloat16()
    w = torch.randn(50, 64, generator=g).bfloat16()
    y = tri.bi_matmul(x, w.t(), out_dtype=torch.float32)
    cfg = dataclasses.replace(tri.mm_config(33, torch.bfloat16), tma=True)
    assert torch.equal(tri.bi_matmul(x, w.t(), out_dtype=torch.float32, config=cfg), y)
    # mixed dtypes under TMA: fp32 activations, bf16 weight widened per tile
    xf = torch.randn(9, 64, generator=g)
    cfg = dataclasses.replace(tri.mm_config(9, torch.float32), tma=True)
    assert torch.equal(tri.bi_matmul(xf, w.t(), config=cfg), tri.bi_matmul(xf, w.float().t()))


def _main() -> None:
    run_checks((_check_gemm, _check_gemm_grad, _check_rows, _check_gemm_fp32_out, _check_gemm_configs))


if __name__ == "__main__":
    _main()
