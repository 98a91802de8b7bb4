"""Gated delta rule and causal conv kernels against their plain references."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from titan_rl_ext.kernels.conv import causal_conv1d_reference, causal_conv1d_torch
from titan_rl_ext.kernels.gdn import chunk_gated_delta_rule_torch, recurrent_gated_delta_rule_torch


def _inputs(lens: list[int], H: int = 2, HV: int = 4, K: int = 16, V: int = 8, seed: int = 0, grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    t = {
        "q": F.normalize(torch.randn(T, H, K, generator=g), dim=-1),
        "k": F.normalize(torch.randn(T, H, K, generator=g), dim=-1),
        "v": torch.randn(T, HV, V, generator=g),
        "g": -torch.rand(T, HV, generator=g) * 0.7,
        "beta": torch.rand(T, HV, generator=g),
        "initial_state": torch.randn(len(lens), HV, K, V, generator=g),
    }
    if grad:
        for x in t.values():
            x.requires_grad_(True)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return t, cu, K**-0.5


# fp32, T up to 150: the chunked form re-associates the same sums (triangular solve instead of a
# token loop); measured max deviation ~3e-7 on outputs of magnitude ~1, so 1e-5 is a safe bound.
FWD_ATOL = 1e-5


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_matches_recurrent_forward(chunk_size: int, with_state: bool) -> None:
    t, cu, scale = _inputs([5, 70, 1, 130, 0])
    if not with_state:
        t["initial_state"] = None
    o_ref, s_ref = recurrent_gated_delta_rule_torch(cu_seqlens=cu, scale=scale, **t)
    o, s = chunk_gated_delta_rule_torch(cu_seqlens=cu, scale=scale, chunk_size=chunk_size, **t)
    torch.testing.assert_close(o, o_ref, atol=FWD_ATOL, rtol=0)
    torch.testing.assert_close(s, s_ref, atol=FWD_ATOL, rtol=0)
    assert s.dtype == torch.float32


def test_chunk_backward_matches_autograd_through_recurrent() -> None:
    t, cu, scale = _inputs([9, 40, 77], grad=True)
    names = list(t)
    o_ref, s_ref = recurrent_gated_delta_rule_torch(cu_seqlens=cu, scale=scale, **t)
    gen = torch.Generator().manual_seed(3)
    w_o, w_s = torch.randn(o_ref.shape, generator=gen), torch.randn(s_ref.shape, generator=gen)
    grads_ref = torch.autograd.grad((o_ref * w_o).sum() + (s_ref * w_s).sum(), [t[n] for n in names])
    o, s = chunk_gated_delta_rule_torch(cu_seqlens=cu, scale=scale, chunk_size=16, **t)
    grads = torch.autograd.grad((o * w_o).sum() + (s * w_s).sum(), [t[n] for n in names])
    for n, a, b in zip(names, grads, grads_ref):
        # gradients reach ~10 in magnitude; 1e-4 absolute is ~1e-5 relative in fp32
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5, msg=lambda m: f"grad of {n}: {m}")


def test_recurrent_matches_explicit_matrix_formula() -> None:
    """The reference itself, against S_t = e^g (I - b k k^T) S + b k v^T written with matrices."""
    t, cu, scale = _inputs([6], H=1, HV=2, K=4, V=3)
    o, s = recurrent_gated_delta_rule_torch(cu_seqlens=cu, scale=scale, **t)
    S = t["initial_state"][0].double()
    for i in range(6):
        for h in range(2):
            k = t["k"][i, h // 2].double()
            outer = torch.eye(4, dtype=torch.float64) - t["beta"][i, h] * torch.outer(k, k)
            S[h] = t["g"][i, h].double().exp() * outer @ S[h] + t["beta"][i, h] * torch.outer(k, t["v"][i, h].double())
            ref_o = S[h].T @ (t["q"][i, h // 2].double() * scale)
            torch.testing.assert_close(o[i, h].double(), ref_o, atol=1e-5, rtol=0)
    torch.testing.assert_close(s[0].double(), S, atol=1e-5, rtol=0)


def test_causal_conv_state_carry_matches_full() -> None:
    # C a multiple of the CPU vector width: elementwise kernels (SiLU) then never take their scalar
    # tail path, whose bits differ from the vector path; real conv dims are multiples of 64.
    g = torch.Generator().manual_seed(0)
    C, W = 16, 4
    lens = [11, 3, 7]
    x = torch.randn(sum(lens), C, generator=g)
    w = torch.randn(C, W, generator=g)
    cu = torch.tensor([0, 11, 14, 21], dtype=torch.int32)
    y_full, st_full = causal_conv1d_torch(x, w, cu)
    # reference: HF-style zero left padding per sequence
    for s, e in [(0, 11), (11, 14), (14, 21)]:
        ref = F.silu(F.conv1d(x[s:e].t()[None], w[:, None], padding=W - 1, groups=C)[0, :, : e - s].t())
        torch.testing.assert_close(y_full[s:e], ref, atol=1e-6, rtol=0)
    # split each sequence in two steps; second step starts from the carried state
    a = [5, 1, 7]
    b = [6, 2, 0]
    xa = torch.cat([x[s : s + n] for s, n in zip([0, 11, 14], a)])
    xb = torch.cat([x[s + n : s + n + m] for s, n, m in zip([0, 11, 14], a, b)])
    cua = torch.tensor([0, *torch.tensor(a).cumsum(0).tolist()], dtype=torch.int32)
    cub = torch.tensor([0, *torch.tensor(b).cumsum(0).tolist()], dtype=torch.int32)
    ya, sta = causal_conv1d_torch(xa, w, cua)
    yb, stb = causal_conv1d_torch(xb, w, cub, initial_state=sta)
    got = torch.cat([torch.cat([p, q]) for p, q in zip(ya.split(a), yb.split(b))])
    assert torch.equal(got, y_full)
    assert torch.equal(stb, st_full)


@pytest.mark.parametrize("with_state", [False, True])
def test_vectorised_conv_equals_per_sequence_reference(with_state: bool) -> None:
    """The model's conv (all sequences in one gather per tap) against the per-sequence reference: same
    bits forward (same tap order), gradients within fp32 rounding (scatter-add order may differ).
    Includes empty sequences (state passes through) and decode-like length-1 sequences."""
    g = torch.Generator().manual_seed(1)
    C, W = 64, 4
    lens = [1, 0, 17, 1, 1, 5, 0, 3]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.randn(sum(lens), C, generator=g, requires_grad=True)
    w = torch.randn(C, W, generator=g, requires_grad=True)
    st = torch.randn(len(lens), W - 1, C, generator=g, requires_grad=True) if with_state else None
    y, fin = causal_conv1d_torch(x, w, cu, initial_state=st)
    y_ref, fin_ref = causal_conv1d_reference(x, w, cu, initial_state=st)
    assert torch.equal(y, y_ref) and torch.equal(fin, fin_ref)
    gy, gf = torch.randn(y.shape, generator=g), torch.randn(fin.shape, generator=g)
    inputs = [x, w] + ([st] if with_state else [])
    grads = torch.autograd.grad((y * gy).sum() + (fin * gf).sum(), inputs)
    grads_ref = torch.autograd.grad((y_ref * gy).sum() + (fin_ref * gf).sum(), inputs)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-6)


def test_recurrent_forward_chunk_backward_function() -> None:
    """BI mode's GDN: forward is the recurrent kernel bit for bit, gradients match autograd through it."""
    from titan_rl_ext.kernels.gdn import gated_delta_rule_bi

    t, cu, scale = _inputs([9, 40, 77], grad=True)
    names = list(t)
    o, s = gated_delta_rule_bi(cu_seqlens=cu, scale=scale, backend="torch", **t)
    with torch.no_grad():
        o_rec, s_rec = recurrent_gated_delta_rule_torch(cu_seqlens=cu, scale=scale, **t)
    assert torch.equal(o, o_rec) and torch.equal(s, s_rec)
    gen = torch.Generator().manual_seed(4)
    w_o, w_s = torch.randn(o.shape, generator=gen), torch.randn(s.shape, generator=gen)
    grads = torch.autograd.grad((o * w_o).sum() + (s * w_s).sum(), [t[n] for n in names])
    o_ref, s_ref = recurrent_gated_delta_rule_torch(cu_seqlens=cu, scale=scale, **t)
    grads_ref = torch.autograd.grad((o_ref * w_o).sum() + (s_ref * w_s).sum(), [t[n] for n in names])
    for n, a, b in zip(names, grads, grads_ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5, msg=lambda m: f"grad of {n}: {m}")


def test_fla_chunk_guard_override_is_one_mechanism(monkeypatch) -> None:
    """fla-core's #640 guard (a module flag read at call time): active on Hopper + Triton 3.4..3.7.0, the project
    overrides it unless ``TITAN_FLA_CHUNK_BWD=0``; the benchmarks report and keep it through the same functions."""
    import sys
    import types

    from titan_rl_ext.kernels import gdn

    names = ["fla", "fla.ops", "fla.ops.common", "fla.ops.common.chunk_o"]
    mods = [types.ModuleType(n) for n in names]
    for parent, child, n in zip(mods, mods[1:], names[1:]):
        setattr(parent, n.rsplit(".", 1)[1], child)
    co = mods[-1]
    co.IS_NVIDIA_HOPPER, co.TRITON_ABOVE_3_4_0, co.TRITON_ABOVE_3_7_1 = True, True, False
    for n, m in zip(names, mods):
        monkeypatch.setitem(sys.modules, n, m)
    monkeypatch.setattr(gdn, "_guard_overridden", False)
    assert gdn.fla_chunk_guard() == (co, "active")
    monkeypatch.setenv(gdn.FLA_CHUNK_BWD_ENV, "0")
    assert gdn.allow_fla_chunk_backward().startswith("kept") and co.TRITON_ABOVE_3_7_1 is False
    monkeypatch.delenv(gdn.FLA_CHUNK_BWD_ENV)
    assert gdn.allow_fla_chunk_backward().startswith("overridden") and co.TRITON_ABOVE_3_7_1 is True
    assert gdn.fla_chunk_guard()[1].startswith("not active")
    assert gdn.allow_fla_chunk_backward().startswith("overridden")  # stays reported as overridden


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_gdn_qk_dtype_follows_the_kernel_that_reads_them(monkeypatch) -> None:
    """The layer hands q/k over (after their l2norm) in v's dtype where FLA's kernels run the call without a gradient
    (they cast to it: the l2norm writes that rounding itself), else in fp32: with a gradient, for the project's
    recurrent kernel (in place on an engine's cache, or gathered), and for the torch references (CPU)."""
    from titan_rl_ext.kernels import batch_invariant as bi
    from titan_rl_ext.models.qwen3_5 import gdn as layer
    from vllm_titan_plugin import gdn_slots

    q, v = torch.zeros(6, 2, 8), torch.zeros(6, 4, 8, dtype=torch.bfloat16)
    kern = layer.GatedDeltaRuleKernel("chunk")
    with torch.no_grad():
        assert kern.qk_dtype(q, v, 2, None) == torch.float32  # CPU: the torch references
        for resolved, want in (("fla", torch.bfloat16), ("titan", torch.float32), ("torch", torch.float32)):
            monkeypatch.setattr(layer, "resolve_backend", lambda *a, r=resolved: r)
            assert kern.qk_dtype(q, v, 2, None) == want, resolved
            with bi.batch_invariant(True):  # BI's recurrent forward: FLA's (TITAN_GDN_RECURRENT=fla) casts too
                assert kern.qk_dtype(q, v, 2, None) == want, resolved
        assert layer.GatedDeltaRuleKernel("chunk", backend="torch").qk_dtype(q, v, 2, None) == torch.float32
        monkeypatch.setattr(layer, "resolve_backend", lambda *a: "fla")
        cached = gdn_slots.CachedStateRuleKernel(kern)
        cache = torch.zeros(5, 4, 8, 8)
        cached.bind(torch.tensor([3, 1]), None)
        monkeypatch.setattr(cached, "_in_place", lambda *a: True)
        assert cached.qk_dtype(q, v, 2, cache) == torch.float32  # the project's kernel, on the cache in place
        monkeypatch.setattr(cached, "_in_place", lambda *a: False)
        assert cached.qk_dtype(q, v, 2, cache) == torch.bfloat16  # gathered for FLA
    assert kern.qk_dtype(q, v, 2, None) == torch.float32  # a gradient: fp32 leaves, FLA casts inside autograd


def test_l2norm_rounded_output_only_without_gradient() -> None:
    """``rows.l2norm(out_dtype=)`` is the fp32 result rounded once (CPU: the reference, then the cast; the CUDA
    kernel's store is checked against that on the GPU) and refuses a gradient (the trainer keeps fp32 q/k)."""
    from titan_rl_ext.kernels import rows

    x = torch.randn(5, 3, 16)
    with torch.no_grad():
        assert torch.equal(rows.l2norm(x, out_dtype=torch.bfloat16), rows.l2norm_torch(x).to(torch.bfloat16))
    with pytest.raises(ValueError, match="without a gradient"):
        rows.l2norm(x.requires_grad_(True), out_dtype=torch.bfloat16)


def test_conv_backward_launch_table(tmp_path, monkeypatch) -> None:
    """The conv backward's launch comes from its GPU's entry of the measured table over the default; a GPU
    without an entry (and CPU) gets the default; a malformed entry is an error naming the file."""
    import json

    from titan_rl_ext.kernels import conv_triton as ct

    table = tmp_path / "conv_bwd_tables.json"
    table.write_text(json.dumps({"GPU A": {"variant": "two_pass", "block_t": 16},
                                 "GPU B": {"variant": "fused", "blk": 8}}))
    monkeypatch.setattr(ct, "BWD_TABLE_FILE", table)
    ct._bwd_table.cache_clear()
    try:
        assert ct.bwd_config_for("GPU A") == {**ct.BWD_DEFAULT, "variant": "two_pass", "block_t": 16}
        assert ct.bwd_config_for("GPU C") == ct.BWD_DEFAULT
        assert ct.bwd_config(torch.device("cpu")) == ct.BWD_DEFAULT
        with pytest.raises(ValueError, match="conv_bwd_tables.json.*GPU B"):
            ct.bwd_config_for("GPU B")
    finally:
        ct._bwd_table.cache_clear()


def test_gpu_table_entry_own_then_same_die_then_none() -> None:
    """A launch table's entry for a GPU: its own; else one measured on a GPU cut from the same die (the H100s and
    the H200 run the same machine code); else none -- never another die's, and none for CPU."""
    from titan_rl_ext.kernels.gpu_tables import table_entry

    tables = {"NVIDIA H200": "h200", "NVIDIA A100-SXM4-80GB": "a100"}
    assert table_entry(tables, "NVIDIA H200") == ("NVIDIA H200", "h200")
    assert table_entry(tables, "NVIDIA H100 80GB HBM3") == ("NVIDIA H200", "h200")
    assert table_entry(tables, "NVIDIA GH200 480GB") == ("NVIDIA H200", "h200")
    assert table_entry({**tables, "NVIDIA H100 PCIe": "pcie"}, "NVIDIA H100 PCIe") == ("NVIDIA H100 PCIe", "pcie")
    assert table_entry(tables, "NVIDIA A100-SXM4-40GB") is None  # A100 has no family listed: its own entry only
    assert table_entry(tables, "NVIDIA L40S") is None
    assert table_entry(tables, "") is None
    assert table_entry({}, "NVIDIA H100 80GB HBM3") is None


def test_shipped_launch_tables_serve_the_h100() -> None:
    """The lent machines are mostly H100s: the shipped tables reach them (the GEMM's measured on the H100 itself,
    the convolution's on the H200)."""
    from titan_rl_ext.kernels import conv_triton as ct

    tri = pytest.importorskip("titan_rl_ext.kernels.batch_invariant_triton")
    tri.device_table.cache_clear()
    ct._bwd_table.cache_clear()
    try:
        assert tri.device_table("NVIDIA H100 80GB HBM3") != () and tri.device_table("NVIDIA H200") != ()
        assert tri.device_table("NVIDIA GH200 480GB") != ()  # no entry of its own: its die's
        assert ct.bwd_config_for("NVIDIA H100 80GB HBM3") == ct.bwd_config_for("NVIDIA H200") != ct.BWD_DEFAULT
    finally:
        tri.device_table.cache_clear()
        ct._bwd_table.cache_clear()


def test_log_softmax_order_reference_counts_each_column_once() -> None:
    """The plain-PyTorch emulation of torch's CUDA log-softmax order (``kernels.log_softmax``): with an "exp" of 1
    everywhere its sum counts the columns, so every column enters exactly once, tail rounds included; with the
    real exp it is torch's log-softmax to fp32 rounding (the CPU kernel sums in another order); and which logits
    the order holds for."""
    from titan_rl_ext.kernels.log_softmax import MIN_V, log_softmax_stats_reference, replicates

    g = torch.Generator().manual_seed(0)
    for V in (MIN_V, MIN_V + 4, 4096 * 5 + 2564):
        x = torch.randn(3, V, generator=g) * 3
        m, logsum = log_softmax_stats_reference(x, exp=torch.ones_like)
        assert torch.equal(m, x.max(1).values) and torch.equal(logsum, torch.full((3,), float(V)).log())
        m, logsum = log_softmax_stats_reference(x)
        torch.testing.assert_close((x - m[:, None]) - logsum[:, None], x.log_softmax(-1), rtol=0, atol=1e-5)
    assert replicates(torch.zeros(2, MIN_V)) and not replicates(torch.zeros(2, MIN_V - 4))
    assert not replicates(torch.zeros(2, MIN_V + 4)[:, 1:]) and not replicates(torch.zeros(2, MIN_V, dtype=torch.float64))
