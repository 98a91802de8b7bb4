"""The CUDA fused kernels of the layers -- ``kernels.rows_triton`` (RMSNorm both flavours, gated RMSNorm,
l2norm, SwiGLU, the GDN gates) and ``kernels.conv_triton`` (causal conv with state) -- run on CPU under the Triton
interpreter and checked against their plain-PyTorch references (``kernels.rows``, ``kernels.conv``); and the fp32 head's
backward kernel (``kernels.lm_head_triton``) against ``lm_head.head_grad_reference``, the head's log-softmax
statistics in torch's summation order (``kernels.log_softmax_triton``) against their torch emulation, and the MoE
grouped GEMM
(``kernels.grouped_gemm_triton``) against ``grouped_gemm.grouped_mm_reference``.

What must hold exactly (``torch.equal``): a row's / token's bits do not depend on which other rows or
sequences share the launch (batch invariance), on a strided view vs a contiguous copy of the input, or on a
prefill being split across steps with the conv state carried; final conv states are copies of inputs.
What holds to a tolerance: the values against the references. fp32: 1e-5 relative (a different reduction
order and fused multiply-adds). 16-bit outputs: three bf16 ulps, because the interpreter's fp32 -> bf16 cast
truncates instead of rounding, and the gated norm rounds three times (x_hat, w * x_hat, the gated product),
as its torch reference does.

Runs in a subprocess with ``TRITON_INTERPRET=1`` (it must be set before a kernel is defined and must not
leak into other tests). Skipped where triton is missing.
"""

from __future__ import annotations

import importlib.util

import pytest

from triton_interp import run_checks, run_checks_under_interpreter


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_fused_kernels_under_interpreter() -> None:
    run_checks_under_interpreter(__file__)


# ------------------------------------------------------------------------------------------------
# the checks, run in the subprocess


def _close(got, ref, rounded_to=None) -> None:  # type: ignore[no-untyped-def]
    """``rounded_to``: the narrowest dtype the computation rounds through (default: the output's)."""
    import torch

    assert got.dtype == ref.dtype and got.shape == ref.shape, (got.dtype, ref.dtype, got.shape, ref.shape)
    if (rounded_to or got.dtype) == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(got.float(), ref.float(), rtol=3 * 2.0**-7, atol=1e-3)


def _grads_near_float64(got, reference, ins, dys, label: str = "") -> None:  # type: ignore[no-untyped-def]
    """Gradients ``got`` (one per input) against the float64 gradient of ``reference`` at ``ins`` with output
    gradients ``dys``: fp32 within 1e-5 of the largest entry; 16-bit no further than ``reference``'s own gradient
    in that dtype plus two ulps of the largest entry (as ``_check_row_backward`` bounds it)."""
    import torch

    leaves = [t.detach().double().requires_grad_(True) for t in ins]
    want64 = torch.autograd.grad(reference(*leaves), leaves, tuple(d.double() for d in dys))
    leaves = [t.detach().requires_grad_(True) for t in ins]
    before = torch.autograd.grad(reference(*leaves), leaves, dys)
    for i, (a, b64, r) in enumerate(zip(got, want64, before)):
        big = b64.abs().max().item()
        err = (a.double() - b64).abs().max().item()
        if a.dtype == torch.float32:
            assert err <= 1e-5 * big, (label, i, err, big)
        else:
            err_ref = (r.double() - b64).abs().max().item()
            assert err <= err_ref + 2 * 2.0**-7 * big, (label, i, err, err_ref, big)


def _check_norms() -> None:
    import torch

    from titan_rl_ext.kernels import rows
    from titan_rl_ext.kernels import rows_triton as rt

    g = torch.Generator().manual_seed(0)
    for D in (128, 256, 1000, 4096):  # GDN head, attention head, a non-power-of-two, the hidden size
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(37, D, generator=g) * 2).to(dtype)
            w = (torch.randn(D, generator=g) * 0.1).to(dtype)
            z = torch.randn(37, D, generator=g).to(dtype)
            cases = {  # (kernel, reference), each on (x, gate)
                "zero-centred": (lambda x, z: rt.norm_rows(x, w, 1e-6, 1),
                                 lambda x, z: rows.rms_norm_torch(x, w, 1e-6, True)),
                "plain": (lambda x, z: rt.norm_rows(x, w, 1e-6, 0),
                          lambda x, z: rows.rms_norm_torch(x, w, 1e-6, False)),
                "gated": (lambda x, z: rt.norm_rows(x, w, 1e-6, 2, gate=z),
                          lambda x, z: rows.gated_rms_norm_torch(x, z, w, 1e-6)),
                "l2norm": (lambda x, z: rt.norm_rows(x, None, 1e-6, 3, out_dtype=torch.float32),
                           lambda x, z: rows.l2norm_torch(x, 1e-6)),
            }
            for name, (kern, ref) in cases.items():
                y = kern(x, z)
                _close(y, ref(x, z))
                for a, n in ((0, 1), (36, 1), (3, 5)):  # rows alone or in other groupings: same bits
                    assert torch.equal(kern(x[a : a + n], z[a : a + n]), y[a : a + n]), (name, D, dtype, a, n)
    # a weight wider than the rows (Qwen3's bf16 rows under an fp32 weight): torch promotes, so does the kernel
    x = torch.randn(5, 128, generator=g).bfloat16()
    w32 = torch.randn(128, generator=g)
    _close(rt.norm_rows(x, w32, 1e-6, 0, out_dtype=torch.float32), rows.rms_norm_torch(x, w32, 1e-6, False),
           rounded_to=torch.bfloat16)  # x_hat is rounded to the rows' dtype first
    # head views of a wider buffer ([T, H, K] cut from [T, C]) are read in place: same bits as a copy
    buf = torch.randn(9, 3 * 4 * 64, generator=g).bfloat16()
    view = buf[:, 4 * 64 : 8 * 64].reshape(9, 4, 64)
    assert view.stride() == (3 * 4 * 64, 64, 1)
    y = rt.norm_rows(view, None, 1e-6, 3, out_dtype=torch.float32)
    assert y.shape == (9, 4, 64) and torch.equal(y, rt.norm_rows(view.contiguous(), None, 1e-6, 3, out_dtype=torch.float32))
    _close(y, rows.l2norm_torch(view, 1e-6))


def _check_norm_rotary() -> None:
    """The attention's q/k norm with its rotary embedding in one kernel (``norm_rows(..., cos=, sin=)``) against
    ``rows.rms_norm_rotary_torch`` (the norm, then HF's rotate-half form), on head views of the merged projection
    ([T, heads, D] with two-level strides), both Qwen norm flavours, a partial rotary (R < D) and a full one.
    fp32: 1e-5 (the same roundings, in fp32). bf16: within four bf16 ulps of the two rotary terms' magnitudes
    (``|n * cos| + |n' * sin|``: the kernel rounds the norm's output -- twice in Qwen3's form --, each term and
    their sum as torch does, but the interpreter's casts truncate, up to an ulp each, and where the terms cancel
    the sum keeps their absolute error); the pass-through dims within the norm's two ulps. Exact: the pass-through dims
    equal the plain norm's bits, a token's rows do not depend on the other tokens of the launch, and a copy of
    the view gives the view's bits. The gradient (the rotary's transpose, then the norm's backward kernel) against
    the float64 gradient of the reference, as ``_check_row_backward`` bounds it."""
    import torch

    from titan_rl_ext.kernels import rows
    from titan_rl_ext.kernels import rows_triton as rt

    g = torch.Generator().manual_seed(4)
    T, N, D = 7, 3, 40
    for R in (12, D):
        for dtype in (torch.float32, torch.bfloat16):
            wide = (torch.randn(T, N, 2 * D + 8, generator=g) * 2).to(dtype)
            x = wide[..., D + 8 :]  # the q part of a per-head [gate; q] layout: rows strided in two levels
            angle = torch.rand(T, R, generator=g) * 100
            cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
            for zc in (True, False):
                mode = 1 if zc else 0
                w = (torch.randn(D, generator=g) * 0.3 + (0.0 if zc else 1.0)).to(dtype)
                y = rt.norm_rows(x, w, 1e-6, mode, cos=cos, sin=sin)
                ref = rows.rms_norm_rotary_torch(x, w, cos, sin, 1e-6, zc)
                assert y.dtype == ref.dtype and y.shape == ref.shape
                if dtype == torch.float32:
                    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
                else:
                    n = rows.rms_norm_torch(x, w, 1e-6, zc).float()
                    half = R // 2
                    n_p = torch.cat([n[..., half:R], n[..., :half]], dim=-1)
                    terms = (n[..., :R] * cos.float()[:, None]).abs() + (n_p * sin.float()[:, None]).abs()
                    # the norm's output up to two ulps off (Qwen3's form rounds twice), then two products and
                    # the sum, each truncated
                    bound = torch.cat([4 * 2.0**-7 * terms, 2 * 2.0**-7 * n[..., R:].abs()], dim=-1) + 1e-6
                    assert ((y.float() - ref.float()).abs() <= bound).all(), (y.float() - ref.float()).abs().max()
                assert torch.equal(y[..., R:], rt.norm_rows(x, w, 1e-6, mode)[..., R:])
                assert torch.equal(rt.norm_rows(x[2:5], w, 1e-6, mode, cos=cos[2:5], sin=sin[2:5]), y[2:5])
                assert torch.equal(rt.norm_rows(x.contiguous(), w, 1e-6, mode, cos=cos, sin=sin), y)
    # the gradient, through the dispatcher's backward (forced onto the kernels: the dispatch asks for CUDA)
    for dtype in (torch.float32, torch.bfloat16):
        wide = (torch.randn(T, N, 2 * D, generator=g) * 2).to(dtype)
        x = wide[..., :D]
        w = (torch.randn(D, generator=g) * 0.3).to(dtype)
        angle = torch.rand(T, 12, generator=g) * 100
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
        dy = torch.randn(T, N, D, generator=g).to(dtype)
        forced = rows.fused_available
        rows.fused_available = lambda *ts: True
        try:
            xg, wg = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
            got = torch.autograd.grad(rows.rms_norm_rotary(xg, wg, cos, sin, 1e-6, True), (xg, wg), dy)
        finally:
            rows.fused_available = forced
        _grads_near_float64(got, lambda x, w: rows.rms_norm_rotary_torch(x, w, cos.to(x.dtype), sin.to(x.dtype), 1e-6, True),
                            (x, w), (dy,))


def _check_add_norm() -> None:
    """The residual stream's add fused with the next norm (``norm_rows(..., residual=)``, ``rows.add_rms_norm``):
    the sum is torch's ``x + h`` (fp32: ``torch.equal``; bf16: one ulp, the interpreter truncating where the GPU
    rounds) and the normalised rows are the plain norm of that sum (fp32 1e-5; bf16 bitwise equal to the kernel's
    own norm of the kernel's sum). Rows alone = in a batch. The gradient through ``rows.add_rms_norm`` (forced
    onto the kernels) against the float64 gradient of ``add_rms_norm_torch``, bounded as in ``_check_row_backward``,
    with the sum's own gradient reaching both addends."""
    import torch

    from titan_rl_ext.kernels import rows
    from titan_rl_ext.kernels import rows_triton as rt

    g = torch.Generator().manual_seed(6)
    for D in (96, 256):
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(13, D, generator=g) * 2).to(dtype)
            h = torch.randn(13, D, generator=g).to(dtype)
            for zc in (True, False):
                mode = 1 if zc else 0
                w = (torch.randn(D, generator=g) * 0.3 + (0.0 if zc else 1.0)).to(dtype)
                total, y = rt.norm_rows(x, w, 1e-6, mode, residual=h)
                s_ref, y_ref = rows.add_rms_norm_torch(x, h, w, 1e-6, zc)
                if dtype == torch.float32:
                    assert torch.equal(total, s_ref)
                else:
                    torch.testing.assert_close(total.float(), s_ref.float(), rtol=2.0**-7, atol=0)
                if dtype == torch.float32:
                    _close(y, rt.norm_rows(s_ref, w, 1e-6, mode))
                assert torch.equal(y, rt.norm_rows(total, w, 1e-6, mode))
                a, b = rt.norm_rows(x[4:7], w, 1e-6, mode, residual=h[4:7])
                assert torch.equal(a, total[4:7]) and torch.equal(b, y[4:7])
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(9, 128, generator=g) * 2).to(dtype)
        h = torch.randn(9, 128, generator=g).to(dtype)
        w = (torch.randn(128, generator=g) * 0.3).to(dtype)
        ds, dy = torch.randn(9, 128, generator=g).to(dtype), torch.randn(9, 128, generator=g).to(dtype)
        forced = rows.fused_available
        rows.fused_available = lambda *ts: True
        try:
            leaves = [t.detach().requires_grad_(True) for t in (x, h, w)]
            got = torch.autograd.grad(rows.add_rms_norm(*leaves, 1e-6, True), leaves, (ds, dy))
        finally:
            rows.fused_available = forced
        assert torch.equal(got[0], got[1])  # both addends get the sum's gradient
        _grads_near_float64(got, lambda x, h, w: rows.add_rms_norm_torch(x, h, w, 1e-6, True), (x, h, w), (ds, dy))


def _check_silu_mul() -> None:
    import torch

    from titan_rl_ext.kernels import rows
    from titan_rl_ext.kernels import rows_triton as rt

    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        merged = (torch.randn(11, 2 * 300, generator=g) * 3).to(dtype)
        gate, up = merged.split(300, dim=-1)  # views of one GEMM output, as FeedForward passes them
        y = rt.silu_mul(gate, up)
        _close(y, rows.silu_mul_torch(gate, up))
        assert torch.equal(rt.silu_mul(gate[4:6], up[4:6]), y[4:6])
        assert torch.equal(rt.silu_mul(gate.contiguous(), up.contiguous()), y)
        # the attention's output gate: sigmoid(gate) * o, the gate a head view of the merged q/gate projection
        T, N, Hd = 7, 3, 40
        qg = (torch.randn(T, N, 2 * Hd + 8, generator=g) * 3).to(dtype)  # per head [q; gate] and more columns
        gate_h = qg[..., Hd : 2 * Hd]
        o = torch.randn(T, N, Hd, generator=g).to(dtype)
        y = rt.sigmoid_mul(gate_h, o)
        assert y.shape == o.shape and y.is_contiguous()
        _close(y, rows.sigmoid_mul_torch(gate_h, o))
        assert torch.equal(rt.sigmoid_mul(gate_h[2:5], o[2:5]), y[2:5])
        assert torch.equal(rt.sigmoid_mul(gate_h.contiguous(), o), y)


def _check_gdn_gates() -> None:
    import torch

    from titan_rl_ext.kernels import rows
    from titan_rl_ext.kernels import rows_triton as rt

    g = torch.Generator().manual_seed(4)
    H = 32
    for dtype in (torch.float32, torch.bfloat16):
        proj = (torch.randn(45, 100 + 2 * H, generator=g) * 8).to(dtype)  # a and b: column slices, as in the layer
        a, b = proj[:, 100 : 100 + H], proj[:, 100 + H :]
        A_log = torch.empty(H).uniform_(0, 2.7, generator=g)
        dt_bias = torch.randn(H, generator=g).to(dtype)
        gk, bk = rt.gdn_gates(a, b, A_log, dt_bias)
        gr, br = rows.gdn_gates_torch(a, b, A_log, dt_bias)
        assert gk.dtype == torch.float32 and bk.dtype == dtype
        # softplus as log(1 + exp(x)) loses relative precision below x ~ -15, where g is ~1e-7 of A
        torch.testing.assert_close(gk, gr, rtol=1e-5, atol=1e-6)
        _close(bk, br)
        assert torch.equal(rt.gdn_gates(a[7:9], b[7:9], A_log, dt_bias)[0], gk[7:9])


def _check_reference_grad() -> None:
    """Forward from the kernel, gradient = autograd of the reference at the same inputs (exactly)."""
    import functools

    import torch

    from titan_rl_ext.kernels import rows
    from titan_rl_ext.kernels import rows_triton as rt

    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 64, generator=g, requires_grad=True)
    w = torch.randn(64, generator=g, requires_grad=True)
    gy = torch.randn(6, 64, generator=g)
    ref = functools.partial(rows.rms_norm_torch, eps=1e-6, zero_centered=True)
    y = rows.kernel_with_reference_grad(lambda x, w: rt.norm_rows(x, w, 1e-6, 1), ref, x, w)
    assert torch.equal(y.detach(), rt.norm_rows(x.detach(), w.detach(), 1e-6, 1))
    y.backward(gy)
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    ref(x, w).backward(gy)
    assert torch.equal(gx, x.grad) and torch.equal(gw, w.grad)
    # only the inputs that require grad get one; a None input passes through
    x2 = torch.randn(6, 64, generator=g, requires_grad=True)
    out = rows.kernel_with_reference_grad(lambda a, b: rt.silu_mul(a, a), lambda a, b: rows.silu_mul_torch(a, a), x2, None)
    out.sum().backward()
    assert x2.grad is not None and x2.grad.shape == x2.shape


def _check_row_backward() -> None:
    """The backward kernels of the norms (all four modes), SwiGLU and the output gate against the float64 gradient of their torch
    references: fp32 as close as the fp32 reference's own gradient (1e-5 relative to the largest entry); bf16 no
    further from float64 than the bf16 reference's gradient (what ran before) plus two bf16 ulps of the largest
    entry (the kernels round up to twice on the way, e.g. the activation and then the product, and the interpreter
    truncates each of those casts where the GPU rounds). Rows as the layers hand them over: head views of wider buffers.
    Through ``kernel_with_reference_grad(..., backward=)``: the kernel's gradients, in ``rows.reference_backward``
    the reference's."""
    import functools

    import torch

    from row_grad_cases import row_grad_cases

    from titan_rl_ext.kernels import rows
    from titan_rl_ext.kernels import rows_triton as rt

    g = torch.Generator().manual_seed(12)
    T, H, D = 9, 3, 96  # D not a power of two: masked lanes

    for dtype in (torch.float32, torch.bfloat16):
        wide = (torch.randn(T, H * D + 16, generator=g) * 2).to(dtype)
        x = wide[:, 16:].view(T, H, D)  # a head view: rows strided in two levels
        z = torch.randn(T, H, D, generator=g).to(dtype)
        w = (torch.randn(D, generator=g) * 0.3 + 1).to(dtype)
        cases = row_grad_cases(x, z, w)
        for name, (ref, ins, bwd) in cases.items():
            out_dtype = torch.float32 if name == "l2" else dtype
            dy = torch.randn(T, H, D, generator=g).to(out_dtype)
            got = bwd(*ins, dy)
            for i, a in enumerate(got):
                assert a.dtype == ins[i].dtype and a.shape == ins[i].shape, (name, i)
            _grads_near_float64(got, ref, ins, (dy,), label=name)
    # the dispatch wrapper: the backward kernel's gradients, or in reference_backward the reference's
    xg = torch.randn(5, 64, generator=g, requires_grad=True)
    wg = torch.randn(64, generator=g, requires_grad=True)
    dy = torch.randn(5, 64, generator=g)
    ref = functools.partial(rows.rms_norm_torch, eps=1e-6, zero_centered=True)
    kern = lambda x, w: rt.norm_rows(x, w, 1e-6, 1)  # noqa: E731
    bwd = lambda x, w, dy: rt.norm_rows_backward(x, w, 1e-6, 1, dy)[:2]  # noqa: E731
    fused = torch.autograd.grad(rows.kernel_with_reference_grad(kern, ref, xg, wg, backward=bwd), (xg, wg), dy)
    assert all(torch.equal(a, b) for a, b in zip(fused, bwd(xg.detach(), wg.detach(), dy)))
    with rows.reference_backward():
        off = torch.autograd.grad(rows.kernel_with_reference_grad(kern, ref, xg, wg, backward=bwd), (xg, wg), dy)
    assert rows.fused_backward_on()
    assert all(torch.equal(a, b) for a, b in zip(off, torch.autograd.grad(ref(xg, wg), (xg, wg), dy)))


def _check_conv() -> None:
    import torch

    from titan_rl_ext.kernels.conv import causal_conv1d_reference, causal_conv1d_torch
    from titan_rl_ext.kernels.conv_triton import causal_conv1d_triton

    g = torch.Generator().manual_seed(3)
    C, W = 192, 4  # C not a multiple of the 128-channel block: a tail
    lengths = [5, 0, 1, 40, 2, 1, 33]  # an empty sequence, decode-like singles, ones longer than BLOCK_T
    cu = torch.tensor([0] + lengths).cumsum(0)
    T, N = int(cu[-1]), len(lengths)
    for dtype in (torch.float32, torch.bfloat16):
        wide = torch.randn(T, C + 64, generator=g).to(dtype)
        x = wide[:, 32 : 32 + C]  # a column slice (rows strided), as the GDN projection hands it over
        w = (torch.randn(C, W, generator=g) * 0.5).to(dtype)
        bias = torch.randn(C, generator=g).to(dtype)
        st = torch.randn(N, W - 1, C, generator=g).to(dtype)
        for state in (None, st):
            for b in (None, bias):
                y, fin = causal_conv1d_triton(x, w, cu, b, state, "silu")
                y_ref, fin_ref = causal_conv1d_torch(x, w, cu, b, state, "silu")
                _close(y, y_ref)
                assert torch.equal(fin, fin_ref), "final states are copies of inputs"
                assert torch.equal(causal_conv1d_triton(x.contiguous(), w, cu, b, state, "silu")[0], y)
        y_lin, _ = causal_conv1d_triton(x, w, cu, None, st, None)
        _close(y_lin, causal_conv1d_reference(x, w, cu, None, st, None)[0])
        y, fin = causal_conv1d_triton(x, w, cu, None, st)
        # one sequence alone gives the bits it had packed with the others
        n = 3
        s, e = int(cu[n]), int(cu[n + 1])
        y1, f1 = causal_conv1d_triton(x[s:e], w, torch.tensor([0, e - s]), None, st[n : n + 1])
        assert torch.equal(y1, y[s:e]) and torch.equal(f1, fin[n : n + 1])
        # a prefill split in two steps, state carried, equals the unsplit one; then a decode step
        seq = x[s:e]
        cut = 17
        ya, fa = causal_conv1d_triton(seq[:cut], w, torch.tensor([0, cut]), None, st[n : n + 1])
        yb, fb = causal_conv1d_triton(seq[cut:], w, torch.tensor([0, e - s - cut]), None, fa)
        assert torch.equal(torch.cat([ya, yb]), y1) and torch.equal(fb, f1)
        tok = torch.randn(1, C, generator=g).to(dtype)
        yd, fd = causal_conv1d_triton(tok, w, torch.tensor([0, 1]), None, fb)
        yfull, ffull = causal_conv1d_triton(torch.cat([seq, tok]), w, torch.tensor([0, e - s + 1]), None, st[n : n + 1])
        assert torch.equal(yd, yfull[-1:]) and torch.equal(fd, ffull)
        # written in two parts (q/k and v apart): the same values, each part contiguous
        (ya, yb), fs = causal_conv1d_triton(x, w, cu, None, st, split=64)
        assert ya.is_contiguous() and yb.is_contiguous() and torch.equal(fs, fin)
        assert torch.equal(ya, y[:, :64]) and torch.equal(yb, y[:, 64:])


def _check_conv_cache_slots() -> None:
    """The conv on an engine's cache by slot (``state_slots``): the kernel reads each sequence's state from its slot
    (zeros where ``state_keep`` is false) and writes the final state back in place -- the same bits as gathering
    the states, running the kernel and scattering, and no other cache byte moves; a slot stride wider than a state
    (vLLM's shared mamba pages) is read through. The dispatcher's fallback (gather, kernel, scatter) where the
    kernel cannot work in place (a cache dtype other than the activations') gives those bits too."""
    import torch

    from titan_rl_ext.kernels import conv as cv
    from titan_rl_ext.kernels.conv_triton import causal_conv1d_triton

    g = torch.Generator().manual_seed(5)
    C, W, S = 192, 4, 11
    lengths = [5, 0, 1, 40, 2, 1, 33]  # an empty sequence keeps (or zeroes) its state
    cu = torch.tensor([0] + lengths).cumsum(0)
    T, N = int(cu[-1]), len(lengths)
    slots = torch.tensor([7, 2, 9, 0, 4, 10, 5])
    keep = torch.tensor([True, True, False, True, True, False, True])
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(T, C + 64, generator=g).to(dtype)[:, 32 : 32 + C]
        w = (torch.randn(C, W, generator=g) * 0.5).to(dtype)
        pages = torch.randn(S, W + 1, C, generator=g).to(dtype)  # a slot's page: its W-1 rows and two more
        cache = pages[:, 1:W]
        before = pages.clone()
        st = torch.where(keep[:, None, None], cache[slots], torch.zeros(N, W - 1, C, dtype=dtype))
        for k in (keep, None):
            pages.copy_(before)
            y_ref, fin_ref = causal_conv1d_triton(x, w, cu, None, st if k is not None else cache[slots])
            y, fin = causal_conv1d_triton(x, w, cu, None, cache, state_slots=slots, state_keep=k)
            assert fin is cache and torch.equal(y, y_ref) and torch.equal(cache[slots], fin_ref)
            moved = torch.zeros(S, dtype=torch.bool)
            moved[slots] = True
            assert torch.equal(pages[~moved], before[~moved])
            assert torch.equal(pages[:, 0], before[:, 0]) and torch.equal(pages[:, W:], before[:, W:])
            pages.copy_(before)
            (ya, yb), fin = causal_conv1d_triton(x, w, cu, None, cache, state_slots=slots, state_keep=k, split=130)
            assert fin is cache and torch.equal(torch.cat([ya, yb], dim=1), y_ref) and torch.equal(cache[slots], fin_ref)
        # the dispatcher, the kernel forced on (it asks for CUDA): in place, and through its fallback for a cache
        # in another dtype, the kernel's bits both ways
        forced = cv._on_kernel
        cv._on_kernel = lambda x: True
        try:
            pages.copy_(before)
            y1, _ = cv.causal_conv1d(x, w, cu, None, cache, "silu", state_slots=slots, state_keep=keep)
            want = cache[slots].clone()
            wide_cache = before[:, 1:W].double()
            y2, c2 = cv.causal_conv1d(x, w, cu, None, wide_cache, "silu", state_slots=slots, state_keep=keep)
            # a bias that alone wants a gradient takes the differentiable path, not the in-place kernel
            bias = torch.randn(C, generator=g).to(dtype).requires_grad_(True)
            pages.copy_(before)
            with torch.enable_grad():
                yb, _ = cv.causal_conv1d(x, w, cu, bias, cache, "silu", state_slots=slots, state_keep=keep)
                yb.float().square().sum().backward()
        finally:
            cv._on_kernel = forced
        assert bias.grad is not None and bias.grad.shape == (C,)
        ref_b = bias.detach().clone().requires_grad_(True)
        with torch.enable_grad():
            yr, _ = cv.causal_conv1d_torch(x, w, cu, ref_b, st, "silu")
            yr.float().square().sum().backward()
        _close(bias.grad, ref_b.grad)
        y_k, _ = causal_conv1d_triton(x, w, cu, None, st)
        assert c2 is wide_cache and torch.equal(y1, y_k) and torch.equal(y2, y_k)
        assert torch.equal(c2[slots].to(dtype), want)
        # on CPU the dispatcher gathers for the torch conv: values to the kernel's tolerance, states exact
        pages.copy_(before)
        y3, c3 = cv.causal_conv1d(x, w, cu, None, cache, "silu", state_slots=slots, state_keep=keep)
        _close(y3, y_k)
        assert c3 is cache and torch.equal(cache[slots], want)
    for bad in (dict(state_slots=slots[:3]), dict(state_slots=slots, state_keep=keep[:2])):
        try:
            causal_conv1d_triton(x, w, cu, None, cache, **bad)
        except ValueError as e:
            assert "[N=7]" in str(e), e
        else:
            raise AssertionError(f"accepted {bad}")
    try:
        causal_conv1d_triton(x, w, cu, None, cache.float(), state_slots=slots)
    except ValueError as e:
        assert "conv cache" in str(e), e
    else:
        raise AssertionError("accepted a cache in another dtype for the in-place kernel")


def _check_conv_backward() -> None:
    """The conv's backward kernel (training: no state, no bias) against the gradient of ``causal_conv1d_torch``:
    fp32 to 1e-5 relative; bf16 dx within two bf16 ulps of the float64 gradient (one fp32 sum rounded once --
    truncated by the interpreter -- where the reference rounds each tap's share to bf16 before adding), dw
    (fp32 sums of exact products) to 1e-5 of the float64 one, in bf16 to the one cast's ulp. A gradient reaching the final states takes the
    reference's path, same values as the reference."""
    import torch

    from titan_rl_ext.kernels import conv
    from titan_rl_ext.kernels.conv_triton import causal_conv1d_backward_triton

    g = torch.Generator().manual_seed(9)
    C, W = 160, 4
    lengths = [5, 0, 1, 40, 2, 37]  # an empty sequence, a single token, sequences past BLOCK_T
    cu = torch.tensor([0] + lengths).cumsum(0)
    T = int(cu[-1])
    for dtype in (torch.float32, torch.bfloat16):
        wide = torch.randn(T, C + 32, generator=g).to(dtype)
        x = wide[:, 16 : 16 + C]
        w = (torch.randn(C, W, generator=g) * 0.5).to(dtype)
        dy = torch.randn(T, C, generator=g).to(dtype)
        for act in ("silu", None):
            dx, dw = causal_conv1d_backward_triton(x, w, cu, dy, act)
            assert dx.dtype == dtype and dw.dtype == dtype and dw.shape == (C, W)
            x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
            y64, _ = conv.causal_conv1d_torch(x64, w64, cu, None, None, act)
            dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
            rtol = 1e-5 if dtype == torch.float32 else 2.0**-7  # bf16 dw: the fp32 sum's one (truncating) cast
            torch.testing.assert_close(dw.double(), dw64, rtol=rtol, atol=1e-5 * dw64.abs().max().item())
            if dtype == torch.float32:
                torch.testing.assert_close(dx.double(), dx64, rtol=1e-5, atol=1e-6)
            else:
                err = (dx.double() - dx64).abs()
                assert (err <= 2 * 2.0**-8 * dx64.abs() + 1e-6).all(), err.max().item()
            # the two-pass variant gives the fused kernel's bits; a smaller dw tile changes only dw's partials
            dx2, dw2 = causal_conv1d_backward_triton(x, w, cu, dy, act, variant="two_pass")
            assert torch.equal(dx2, dx) and torch.equal(dw2, dw)
            dx3, dw3 = causal_conv1d_backward_triton(x, w, cu, dy, act, variant="two_pass", block_t=16, block_c=64)
            assert torch.equal(dx3, dx)
            torch.testing.assert_close(dw3.double(), dw64, rtol=rtol, atol=1e-5 * dw64.abs().max().item())
    # the autograd function: forward = the kernel, backward = the backward kernel; with a gradient on the
    # final states, the reference's gradient
    x = torch.randn(T, C, generator=g).requires_grad_(True)
    w = (torch.randn(C, W, generator=g) * 0.5).requires_grad_(True)
    dy = torch.randn(T, C, generator=g)
    y, fin = conv._ConvKernelForwardBackward.apply(x, w, cu, "silu")
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    dx, dw = causal_conv1d_backward_triton(x.detach(), w.detach(), cu, dy, "silu")
    assert torch.equal(gx, dx) and torch.equal(gw, dw)
    y, fin = conv._ConvKernelForwardBackward.apply(x, w, cu, "silu")
    d_fin = torch.randn(fin.shape, generator=g)
    gx, gw = torch.autograd.grad((y, fin), (x, w), (dy, d_fin))
    y_r, fin_r = conv.causal_conv1d_torch(x, w, cu, None, None, "silu")
    rx, rw = torch.autograd.grad((y_r, fin_r), (x, w), (dy, d_fin))
    assert torch.equal(gx, rx) and torch.equal(gw, rw)


def _check_head_grad() -> None:
    """The fp32 head's backward pass over the kept log-softmax (``lm_head_triton.head_grad``) against its
    torch reference: fp32 out to fp32 rounding (``exp``'s last ulp), bf16 out to ``_close``'s bf16 bound."""
    import torch

    from titan_rl_ext.kernels.lm_head import head_grad_reference
    from titan_rl_ext.kernels.lm_head_triton import BLOCK_V, head_grad

    g = torch.Generator().manual_seed(4)
    T, V = 5, BLOCK_V + 301  # a full vocabulary tile and a ragged one
    lp = (torch.randn(T, V + 7, generator=g) * 3).log_softmax(-1)[:, :V]  # rows strided, as a chunk view is
    gt = torch.randn(T, generator=g)
    tgt = torch.randint(0, V, (T,), generator=g)
    tgt[1] = V - 1  # the target in the ragged tile
    for dtype in (torch.float32, torch.bfloat16):
        got = head_grad(lp, gt, tgt, dtype)
        _close(got, head_grad_reference(lp.clone(), gt, tgt, dtype))
        # into rows of a larger buffer, as the backward writes the whole [T, V] gradient chunk by chunk
        buf = torch.full((T + 3, V), float("nan"), dtype=dtype)
        assert head_grad(lp, gt, tgt, dtype, out=buf[2:2 + T]).data_ptr() == buf[2].data_ptr()
        assert torch.equal(buf[2:2 + T], got) and bool(buf[:2].isnan().all()) and bool(buf[2 + T:].isnan().all())
    try:
        head_grad(lp, gt, tgt, torch.bfloat16, out=torch.empty(T, V, dtype=torch.float32))
    except ValueError as e:
        assert "out must be" in str(e)
    else:
        raise AssertionError("an out of another dtype must be refused")
    try:
        head_grad(lp.double(), gt, tgt, torch.float32)
    except ValueError as e:
        assert "fp32" in str(e)
    else:
        raise AssertionError("a float64 lp must be refused")


def _check_log_softmax_stats() -> None:
    """``log_softmax_triton``: each row's max and log-sum-exp in torch's CUDA summation order, against the plain-
    PyTorch emulation of that order with the interpreter's own ``exp``/``log`` (numpy's), bit for bit, for rows
    with and without a tail past the last full 4096 columns; ``(x - max) - logsum`` at the target is the ``lp``
    written; logits torch sums otherwise are refused; the head's backward from the kept logits equals
    its backward from the log-softmax those logits give; and ``token_logprobs_fused`` through this path
    (forced here; on CUDA a probe against ``torch.log_softmax`` decides) matches torch's log-softmax to fp32
    rounding, forward and gradients (CPU torch sums in another order)."""
    import numpy as np
    import torch

    from titan_rl_ext.kernels import lm_head
    from titan_rl_ext.kernels.lm_head_triton import head_grad
    from titan_rl_ext.kernels.log_softmax import MIN_V, log_softmax_stats_reference
    from titan_rl_ext.kernels.log_softmax_triton import log_softmax_stats

    def np_exp(t: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.exp(t.numpy()))

    def np_log(t: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.log(t.numpy()))

    g = torch.Generator().manual_seed(6)
    for V in (MIN_V, MIN_V + 4, 4096 * 5 + 2564):  # no tail; a 4-column tail; a tail of 3 rounds, 2 of them partial
        x = torch.randn(3, V, generator=g) * 4
        x[1, 7] = 40.0  # one column dominates
        x[2, : V // 2] -= 95.0  # exp of half the row near or under fp32's normal range
        tgt = torch.randint(0, V, (3,), generator=g)
        lp, m, logsum = log_softmax_stats(x, tgt)
        m_ref, logsum_ref = log_softmax_stats_reference(x, np_exp, np_log)
        assert torch.equal(m, m_ref) and torch.equal(logsum, logsum_ref), (V, logsum - logsum_ref)
        assert torch.equal(lp, (x[torch.arange(3), tgt] - m) - logsum)
        assert log_softmax_stats(x)[0] is None
        # the backward from the logits = the backward from their log-softmax (same lp bits, same kernel)
        gt = torch.randn(3, generator=g)
        lp_rows = (x - m[:, None]) - logsum[:, None]
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(head_grad(x, gt, tgt, dtype, row_max=m, row_logsum=logsum),
                               head_grad(lp_rows, gt, tgt, dtype))
    try:  # logits torch sums in another order (here: rows it keeps in shared memory) are refused
        log_softmax_stats(torch.zeros(2, MIN_V - 4))
    except ValueError as e:
        assert "aligned unit-stride rows" in str(e)
    else:
        raise AssertionError("logits the kernel cannot replicate torch on must be refused")
    # the trainer's head through this path (the CUDA gate forced open), two chunks, one kept and one recomputed
    T, D, V = 6, 16, MIN_V + 4
    h = torch.randn(T, D, generator=g, requires_grad=True)
    w = (torch.randn(V, D, generator=g) * 0.5).requires_grad_(True)
    tgt = torch.randint(0, V, (T,), generator=g)
    gl = torch.randn(T, generator=g)
    saved = (lm_head._lse_variant, lm_head.CHUNK_BYTES, lm_head.SAVE_BYTES)
    lm_head._lse_variant = lambda logits: {"fp_fusion": True, "ftz": False}
    lm_head.CHUNK_BYTES, lm_head.SAVE_BYTES = 3 * V * 4, 3 * V * 4
    try:
        lp = lm_head.token_logprobs_fused(h, w, tgt)
        (lp * gl).sum().backward()
    finally:
        lm_head._lse_variant, lm_head.CHUNK_BYTES, lm_head.SAVE_BYTES = saved
    dh, dw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = (h @ w.t()).log_softmax(-1).gather(1, tgt[:, None]).squeeze(1)
    (ref * gl).sum().backward()
    _close(lp, ref)
    _close(dh, h.grad)
    _close(dw, w.grad)


def _check_grouped_mm() -> None:
    """The MoE grouped GEMM (``grouped_gemm_triton``) against the expert-by-expert reference; a row's bits
    do not depend on how many rows its expert or the others got (batch invariance); empty experts, ragged
    tiles; the backward of the autograd wrapper against the reference's."""
    import torch

    from titan_rl_ext.kernels import grouped_gemm as gg
    from titan_rl_ext.kernels.grouped_gemm_triton import grouped_mm

    g = torch.Generator().manual_seed(5)
    E, N, K = 37, 72, 80  # experts not a power of two; N and K not multiples of the 64 tiles
    counts = torch.zeros(E, dtype=torch.int64)
    counts[[0, 3, 4, 20, 36]] = torch.tensor([70, 1, 0, 130, 5])  # a tile and a bit, single rows, empties
    R = int(counts.sum())
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(R, K, generator=g).to(dtype)
        w = (torch.randn(E, N, K, generator=g) * 0.2).to(dtype)
        y = grouped_mm(x, w, counts)
        _close(y, gg.grouped_mm_reference(x.float(), w.float(), counts).to(dtype), rounded_to=dtype)
        # the 4th row of expert 20 alone, and expert 20's rows with another split of the others
        r0 = 70 + 1
        alone = torch.zeros(E, dtype=torch.int64)
        alone[20] = 1
        assert torch.equal(grouped_mm(x[r0 + 3 : r0 + 4], w, alone), y[r0 + 3 : r0 + 4])
        only20 = torch.zeros(E, dtype=torch.int64)
        only20[20] = 130
        assert torch.equal(grouped_mm(x[r0 : r0 + 130], w, only20), y[r0 : r0 + 130])
        wt = w.transpose(1, 2).contiguous().transpose(1, 2)  # another weight layout, the same values
        assert torch.equal(grouped_mm(x, wt, counts), y)
    # the autograd wrapper: forward = the kernel, gradients = the reference's (fp32, to rounding)
    x = torch.randn(R, K, generator=g, requires_grad=True)
    w = (torch.randn(E, N, K, generator=g) * 0.2).requires_grad_(True)
    gy = torch.randn(R, N, generator=g)
    gg._TritonGroupedMM.apply(x, w, counts).backward(gy)
    dx, dw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    gg.grouped_mm_reference(x, w, counts).backward(gy)
    _close(dx, x.grad)
    _close(dw, w.grad)


def _main() -> None:
    run_checks((_check_norms, _check_norm_rotary, _check_add_norm, _check_silu_mul, _check_gdn_gates, _check_reference_grad, _check_row_backward, _check_conv,
                _check_conv_cache_slots, _check_conv_backward, _check_head_grad, _check_log_softmax_stats, _check_grouped_mm))


if __name__ == "__main__":
    _main()
