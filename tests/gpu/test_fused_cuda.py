"""The fused layer kernels on CUDA (``kernels.rows_triton``, ``kernels.conv_triton``) against their torch
references, their batch invariance, and the conv inside a CUDA graph. Skips without CUDA.

Tolerances: fp32 results 1e-5 relative (another reduction order, fused multiply-adds); 16-bit results two
ulps of the output dtype (the kernel and the reference round the same fp32 values, which may differ in the
last fp32 bit; two roundings in the gated norm).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(got.float(), ref.float(), rtol=2 * 2.0**-7, atol=1e-3)


@pytest.mark.parametrize("D", [128, 256, 4096])
def test_norms_match_reference_and_are_batch_invariant(D: int) -> None:
    from titan_rl_ext.kernels import rows

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4099, D, device="cuda", generator=g).bfloat16() * 3
    z = torch.randn(4099, D, device="cuda", generator=g).bfloat16()
    w = (torch.randn(D, device="cuda", generator=g) * 0.1).bfloat16()
    for name, fn, ref in (
        ("zc", lambda x, z: rows.rms_norm(x, w, 1e-6, True), lambda x, z: rows.rms_norm_torch(x, w, 1e-6, True)),
        ("plain", lambda x, z: rows.rms_norm(x, w, 1e-6, False), lambda x, z: rows.rms_norm_torch(x, w, 1e-6, False)),
        ("gated", lambda x, z: rows.gated_rms_norm(x, z, w, 1e-6), lambda x, z: rows.gated_rms_norm_torch(x, z, w, 1e-6)),
        ("l2", lambda x, z: rows.l2norm(x), lambda x, z: rows.l2norm_torch(x)),
    ):
        y = fn(x, z)
        _close(y, ref(x, z))
        same = (y == ref(x, z)).float().mean().item()
        print(f"{name} D={D}: {100 * same:.2f} % of elements bit-equal to the torch reference")
        for a, n in ((0, 1), (4098, 1), (17, 300), (1, 4096)):
            assert torch.equal(fn(x[a : a + n], z[a : a + n]), y[a : a + n]), (name, a, n)
    # the l2norm written in bf16 for FLA's kernels (which cast q/k to v's dtype): the same rounding of the same values
    with torch.no_grad():
        assert torch.equal(rows.l2norm(x, out_dtype=torch.bfloat16), rows.l2norm(x).to(torch.bfloat16))


def test_residual_add_fused_into_the_norm() -> None:
    """``rows.add_rms_norm`` at the hidden size: the sum is torch's ``x + h`` bit for bit (both compute in fp32 and
    round once), the normalised rows are the plain norm kernel's bits of that sum, rows alone = in the batch."""
    from titan_rl_ext.kernels import rows

    g = torch.Generator(device="cuda").manual_seed(6)
    x = (torch.randn(4099, 4096, device="cuda", generator=g) * 3).bfloat16()
    h = torch.randn(4099, 4096, device="cuda", generator=g).bfloat16()
    w = (torch.randn(4096, device="cuda", generator=g) * 0.1).bfloat16()
    for zc in (True, False):
        total, y = rows.add_rms_norm(x, h, w, 1e-6, zc)
        assert torch.equal(total, x + h)
        assert torch.equal(y, rows.rms_norm(x + h, w, 1e-6, zc))
        a, b = rows.add_rms_norm(x[17:317], h[17:317], w, 1e-6, zc)
        assert torch.equal(a, total[17:317]) and torch.equal(b, y[17:317])


def test_attention_norm_rotary_and_gate_match_reference() -> None:
    """The attention's fused q/k path (norm + partial rotary, the 9B's 16 q heads of 256 with 64 rotary dims, read
    as head views of the merged projection) and its output gate ``sigmoid(gate) * o`` against the torch
    references: two bf16 ulps of the rotary terms' magnitudes (each term and the sum rounded as torch rounds
    them; the fp32 values may differ in their last bit), and batch invariance (a token alone = in the batch)."""
    from titan_rl_ext.kernels import rows

    g = torch.Generator(device="cuda").manual_seed(5)
    T, N, D, R = 3000, 16, 256, 64
    qg = (torch.randn(T, N, 2 * D, device="cuda", generator=g) * 3).bfloat16()  # per head [q; gate]
    q, gate = qg[..., :D], qg[..., D:]
    w = (torch.randn(D, device="cuda", generator=g) * 0.1).bfloat16()
    angle = torch.rand(T, R, device="cuda", generator=g) * 1000
    cos, sin = angle.cos().bfloat16(), angle.sin().bfloat16()
    y = rows.rms_norm_rotary(q, w, cos, sin, 1e-6, True)
    ref = rows.rms_norm_rotary_torch(q, w, cos, sin, 1e-6, True)
    n = rows.rms_norm_torch(q, w, 1e-6, True).float()
    n_p = torch.cat([n[..., R // 2 : R], n[..., : R // 2]], dim=-1)
    terms = (n[..., :R] * cos.float()[:, None]).abs() + (n_p * sin.float()[:, None]).abs()
    bound = torch.cat([2 * 2.0**-7 * terms, 2.0**-7 * n[..., R:].abs()], dim=-1) + 1e-6
    assert ((y.float() - ref.float()).abs() <= bound).all()
    print(f"norm+rotary: {100 * (y == ref).float().mean().item():.2f} % of elements bit-equal to the torch reference")
    for a, k in ((0, 1), (T - 1, 1), (17, 300)):
        assert torch.equal(rows.rms_norm_rotary(q[a : a + k], w, cos[a : a + k], sin[a : a + k], 1e-6, True), y[a : a + k])
    o = torch.randn(T, N, D, device="cuda", generator=g).bfloat16()
    yo = rows.sigmoid_mul(gate, o)
    _close(yo, rows.sigmoid_mul_torch(gate, o))
    assert torch.equal(rows.sigmoid_mul(gate[5:6], o[5:6]), yo[5:6])


def test_conv_matches_reference_split_and_graph() -> None:
    from titan_rl_ext.kernels.conv import causal_conv1d, causal_conv1d_torch

    g = torch.Generator(device="cuda").manual_seed(1)
    C, W = 8192, 4
    lengths = [2048, 1, 0, 700, 33, 1]
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).int()
    T, N = int(cu[-1]), len(lengths)
    wide = torch.randn(T, C + 4160, device="cuda", generator=g).bfloat16()
    x = wide[:, :C]  # the GDN projection's column slice
    w = (torch.randn(C, W, device="cuda", generator=g) * 0.5).bfloat16()
    st = torch.randn(N, W - 1, C, device="cuda", generator=g).bfloat16()
    y, fin = causal_conv1d(x, w, cu, None, st)
    y_ref, fin_ref = causal_conv1d_torch(x, w, cu, None, st)
    _close(y, y_ref)
    assert torch.equal(fin, fin_ref)
    # q/k and v written apart (the layer's call): the same bits, v contiguous
    (y_qk, y_v), _ = causal_conv1d(x, w, cu, None, st, split=4096)
    assert y_v.is_contiguous() and torch.equal(y_qk, y[:, :4096]) and torch.equal(y_v, y[:, 4096:])
    # split prefill, state carried: same bits
    s, e = 0, 2048
    ya, fa = causal_conv1d(x[s:1000], w, torch.tensor([0, 1000], device="cuda"), None, st[:1])
    yb, fb = causal_conv1d(x[1000:e], w, torch.tensor([0, e - 1000], device="cuda"), None, fa)
    assert torch.equal(torch.cat([ya, yb]), y[s:e]) and torch.equal(fb, fin[:1])
    # a decode step captured in a CUDA graph replays the eager bits (no host sync inside)
    B = 64
    xd = torch.randn(B, C, device="cuda", generator=g).bfloat16()
    sd = torch.randn(B, W - 1, C, device="cuda", generator=g).bfloat16()
    cud = torch.arange(B + 1, device="cuda", dtype=torch.int32)
    y_eager, f_eager = causal_conv1d(xd, w, cud, None, sd)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        causal_conv1d(xd, w, cud, None, sd)  # warm-up (compile) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_g, f_g = causal_conv1d(xd, w, cud, None, sd)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_g, y_eager) and torch.equal(f_g, f_eager)


def test_gdn_gates_match_reference() -> None:
    from titan_rl_ext.kernels import rows

    g = torch.Generator(device="cuda").manual_seed(3)
    proj = torch.randn(3000, 4096 + 64, device="cuda", generator=g).bfloat16() * 8
    a, b = proj[:, 4096 : 4096 + 32], proj[:, 4096 + 32 :]
    A_log = torch.empty(32, device="cuda").uniform_(0, 2.7, generator=g)
    dt_bias = torch.randn(32, device="cuda", generator=g).bfloat16()
    gk, bk = rows.gdn_gates(a, b, A_log, dt_bias)
    gr, br = rows.gdn_gates_torch(a, b, A_log, dt_bias)
    torch.testing.assert_close(gk, gr, rtol=1e-5, atol=1e-6)
    _close(bk, br)
    assert torch.equal(rows.gdn_gates(a[5:6], b[5:6], A_log, dt_bias)[0], gk[5:6])


def test_silu_mul_and_grad_through_reference() -> None:
    from titan_rl_ext.kernels import rows

    g = torch.Generator(device="cuda").manual_seed(2)
    h = torch.randn(333, 2 * 12288, device="cuda", generator=g).bfloat16().requires_grad_(True)
    gate, up = h.split(12288, dim=-1)
    y = rows.silu_mul(gate, up)
    _close(y.detach(), rows.silu_mul_torch(gate.detach(), up.detach()))
    y.float().square().sum().backward()
    g_fused = h.grad.clone()
    h.grad = None
    gate, up = h.split(12288, dim=-1)
    rows.silu_mul_torch(gate, up).float().square().sum().backward()
    # the backward is the reference's at the kernel's inputs; its upstream gradient (2y) differs only
    # where the forward bits do
    torch.testing.assert_close(g_fused.float(), h.grad.float(), rtol=2 * 2.0**-7, atol=1e-2)


def test_conv_backward_kernel_no_worse_than_the_reference_gradient() -> None:
    """The trainer's conv backward (``causal_conv1d`` with grad on CUDA: the backward kernel) at the 9B GDN
    conv width, packed sequences: dx and dw against float64, each at most as far as the torch reference's
    gradient (``rows.reference_backward``, what the trainer ran before) plus half a bf16 ulp of slack."""
    import contextlib

    from titan_rl_ext.kernels import conv, rows

    g = torch.Generator(device="cuda").manual_seed(5)
    C, W = 8192, 4
    cu = torch.tensor([0, 1000, 3000, 3001, 4096], device="cuda", dtype=torch.int32)
    T = 4096
    wide = torch.randn(T, C + 4096, device="cuda", generator=g).bfloat16()
    w = (torch.randn(C, W, device="cuda", generator=g) * 0.5).bfloat16()
    dy = torch.randn(T, C, device="cuda", generator=g).bfloat16()
    grads = {}
    for path, ctx in (("1", contextlib.nullcontext), ("0", rows.reference_backward)):
        with ctx():
            x = wide[:, 1024 : 1024 + C].detach().requires_grad_(True)  # a column slice, as the GDN hands it over
            ww = w.detach().requires_grad_(True)
            y, _ = conv.causal_conv1d(x, ww, cu)
            grads[path] = torch.autograd.grad(y, (x, ww), dy)
    x64 = wide[:, 1024 : 1024 + C].double().requires_grad_(True)
    w64 = w.double().requires_grad_(True)
    y64, _ = conv.causal_conv1d_torch(x64, w64, cu.long())
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
    for i, ref64 in enumerate((dx64, dw64)):
        err_fused = (grads["1"][i].double() - ref64).abs().max().item()
        err_ref = (grads["0"][i].double() - ref64).abs().max().item()
        assert err_fused <= err_ref + 2.0**-9 * ref64.abs().max().item(), (i, err_fused, err_ref)


@pytest.mark.parametrize("name", ["rms_zc", "rms", "gated", "l2", "silu_mul", "sigmoid_mul"])
def test_row_backward_kernels_no_worse_than_the_reference_gradient(name: str) -> None:
    """The norms', SwiGLU's and the output gate's backward kernels at the 9B slice's widths (hidden 4096, GDN heads
    128, MLP 12288, attention heads 256),
    bf16 rows as the layers hand them over: each gradient against float64 at most as far as the bf16 reference's
    gradient (what the trainer ran before the backward kernels) plus half a bf16 ulp of the largest entry."""
    from row_grad_cases import reference_grads, row_grad_cases

    g = torch.Generator(device="cuda").manual_seed(11)
    R = 4096
    D = {"rms_zc": 4096, "rms": 4096, "gated": 128, "l2": 128, "silu_mul": 12288, "sigmoid_mul": 256}[name]
    shape = (R, D) if D > 256 else (R, 16, D)
    x = (torch.randn(*shape, device="cuda", generator=g) * 2).bfloat16()
    z = torch.randn(*shape, device="cuda", generator=g).bfloat16()
    w = (torch.randn(D, device="cuda", generator=g) * 0.3 + 1).bfloat16()
    ref, ins, bwd = row_grad_cases(x, z, w)[name]
    dy = torch.randn(*shape, device="cuda", generator=g).to(torch.float32 if name == "l2" else torch.bfloat16)
    got = bwd(*ins, dy)
    want64 = reference_grads(ref, tuple(t.double() for t in ins), dy.double())
    before = reference_grads(ref, ins, dy)
    for i, (a, b64, r) in enumerate(zip(got, want64, before)):
        big = b64.abs().max().item()
        err, err_ref = (a.double() - b64).abs().max().item(), (r.double() - b64).abs().max().item()
        assert err <= err_ref + 2.0**-9 * big, (name, i, err, err_ref, big)
