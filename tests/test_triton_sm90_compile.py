"""The Triton kernels not yet run on a GPU compile for Hopper (sm_90), here on CPU (``triton_sm90``).

Each wrapper runs on small CPU tensors with its launches captured; every captured launch is compiled to a cubin
with the options it passes, and with the CUDA-only choices a CPU wrapper does not take (libdevice ``exp``, no
flush-to-zero) forced. What this catches before device time: globals that are not ``tl.constexpr``, shapes or
layouts the lowering refuses, types that do not meet. The interpreter tests check the arithmetic.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from triton_sm90 import compile_sm90, record_launches

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


@pytest.fixture(autouse=True)
def _fresh_triton_cache(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """A compile must happen here, not be answered from another run's cache."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))


def _cubin(launch, **override) -> bytes:  # type: ignore[no-untyped-def]
    compiled = compile_sm90(launch, **override)
    assert compiled.asm.get("cubin"), launch.kernel.__name__
    return compiled.asm["cubin"]


def test_head_log_softmax_stats_kernel() -> None:
    from titan_rl_ext.kernels import log_softmax_triton as lst
    from titan_rl_ext.kernels.log_softmax import MIN_V

    x = torch.randn(4, MIN_V + 2564)
    with record_launches(lst._stats_kernel) as launches:
        lst.log_softmax_stats(x, torch.zeros(4, dtype=torch.int64))
        lst.log_softmax_stats(x)
    assert [launch.args["HAS_TGT"] for launch in launches] == [True, False]
    for launch in launches:  # as on CUDA: libdevice exp/log, each build variant the head's probe may try
        for variant in lst.VARIANTS:
            _cubin(launch, LIBDEVICE=True, **lst.cuda_options(**variant))


def test_head_grad_kernel_from_logits_and_from_log_softmax() -> None:
    from titan_rl_ext.kernels.lm_head_triton import _head_grad_kernel, head_grad

    x, g, tgt = torch.randn(3, 5000), torch.randn(3), torch.zeros(3, dtype=torch.int64)
    with record_launches(_head_grad_kernel) as launches:
        head_grad(x, g, tgt, torch.bfloat16, row_max=torch.zeros(3), row_logsum=torch.zeros(3))
        head_grad(x, g, tgt, torch.bfloat16)
    assert [launch.args["FROM_LOGITS"] for launch in launches] == [True, False]
    for launch in launches:
        _cubin(launch)


def test_gdn_recurrent_kernel() -> None:
    from titan_rl_ext.kernels import gdn_triton as gt

    T, H, HV, K, V = 6, 2, 4, 128, 128
    q, k = torch.randn(T, H, K), torch.randn(T, H, K)
    v, g, beta = torch.randn(T, HV, V).bfloat16(), torch.randn(T, HV), torch.rand(T, HV).bfloat16()
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with record_launches(gt._gdn_recurrent_kernel) as launches:
        gt.gated_delta_rule_recurrent(q, k, v, g, beta, cu, K**-0.5)
    _cubin(launches[0])


def test_conv_backward_kernels_fused_and_two_pass() -> None:
    """Both variants of the conv backward (the fused kernel was refactored onto shared helpers with the two-pass
    one, after its last GPU run)."""
    from titan_rl_ext.kernels import conv_triton as ct

    x, w, dy = torch.randn(40, 96).bfloat16(), torch.randn(96, 4).bfloat16(), torch.randn(40, 96).bfloat16()
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    kernels = (ct._conv_bwd_kernel, ct._conv_bwd_dz_kernel, ct._conv_bwd_dx_kernel)
    with record_launches(*kernels) as launches:
        ct.causal_conv1d_backward_triton(x, w, cu, dy, "silu", variant="fused")
        ct.causal_conv1d_backward_triton(x, w, cu, dy, "silu", variant="two_pass", block_t=16, block_c=64)
    assert [launch.kernel for launch in launches] == list(kernels)
    for launch in launches:
        _cubin(launch)


def test_conv_forward_and_state_kernels_with_cache_slots() -> None:
    """The conv's forward and state kernels in each state form: none, gathered states, an engine cache read and
    written by slot (the in-place form, with its barrier between the state tile's loads and stores), with and
    without the recycled-slot mask; and the forward writing its output in two parts."""
    from titan_rl_ext.kernels import conv_triton as ct

    x, w = torch.randn(9, 160).bfloat16(), torch.randn(160, 4).bfloat16()
    cu = torch.tensor([0, 1, 2, 9], dtype=torch.int32)
    cache = torch.zeros(6, 3, 160).bfloat16()
    slots, keep = torch.tensor([4, 0, 2], dtype=torch.int32), torch.tensor([True, False, True])
    with record_launches(ct._conv_fwd_kernel, ct._conv_state_kernel) as launches:
        ct.causal_conv1d_triton(x, w, cu)
        ct.causal_conv1d_triton(x, w, cu, None, cache[:3])
        ct.causal_conv1d_triton(x, w, cu, None, cache, state_slots=slots)
        ct.causal_conv1d_triton(x, w, cu, None, cache, state_slots=slots, state_keep=keep)
        ct.causal_conv1d_triton(x, w, cu, None, cache, state_slots=slots, state_keep=keep, split=64)
    flags = [(launch.args["HAS_STATE"], launch.args["SLOTS"], launch.args["KEEP"]) for launch in launches]
    assert flags == [(False, False, False)] * 2 + [(True, False, False)] * 2 + [(True, True, False)] * 2 + [(True, True, True)] * 4
    assert [launch.args["SPLIT"] for launch in launches if launch.kernel is ct._conv_fwd_kernel] == [False] * 4 + [True]
    for launch in launches:
        _cubin(launch)


def test_activation_times_kernels_silu_and_sigmoid() -> None:
    """SwiGLU's ``silu(g) * u`` and the attention gate's ``sigmoid(g) * o`` share one kernel pair (rows strided in
    two levels: the gate is a head view of the merged projection), forward and backward."""
    from titan_rl_ext.kernels import rows_triton as rt

    merged = torch.randn(5, 2 * 96).bfloat16()
    gate_h, o = torch.randn(5, 3, 2 * 64).bfloat16()[..., 64:], torch.randn(5, 3, 64).bfloat16()
    with record_launches(rt._act_mul_kernel, rt._act_mul_bwd_kernel) as launches:
        rt.silu_mul(merged[:, :96], merged[:, 96:])
        rt.silu_mul_backward(merged[:, :96], merged[:, 96:], torch.randn(5, 96).bfloat16())
        rt.sigmoid_mul(gate_h, o)
        rt.sigmoid_mul_backward(gate_h, o, torch.randn(5, 3, 64).bfloat16())
    assert [launch.args["SILU"] for launch in launches] == [True, True, False, False]
    for launch in launches:
        _cubin(launch)


def test_norm_kernel_with_rotary_and_residual() -> None:
    """The q/k norm with its rotary embedding (both Qwen norm flavours, the 9B's partial rotary of 64 of 256 dims),
    the residual add fused into the norm, and the plain norm modes the same kernel keeps."""
    from titan_rl_ext.kernels import rows_triton as rt

    x = torch.randn(3, 4, 2 * 256).bfloat16()[..., 256:]
    w = torch.randn(256).bfloat16()
    cos, sin = torch.randn(3, 64).bfloat16(), torch.randn(3, 64).bfloat16()
    with record_launches(rt._norm_rows_kernel) as launches:
        rt.norm_rows(x, w, 1e-6, 1, cos=cos, sin=sin)
        rt.norm_rows(x, w, 1e-6, 0, cos=cos, sin=sin)
        rt.norm_rows(x, w, 1e-6, 1)
        rt.norm_rows(x, w, 1e-6, 2, gate=x)
        rt.norm_rows(x, w, 1e-6, 1, residual=x)
        rt.norm_rows(x, None, 1e-6, 3, out_dtype=torch.bfloat16)  # l2norm written in bf16 for FLA's kernels
    assert [(launch.args["MODE"], launch.args["ROT"], launch.args["RES"]) for launch in launches] == [
        (1, 64, False), (0, 64, False), (1, 0, False), (2, 0, False), (1, 0, True), (3, 0, False)]
    for launch in launches:
        _cubin(launch)
