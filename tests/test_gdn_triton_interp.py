"""The project's recurrent gated-delta-rule kernel (``kernels.gdn_triton``) on CPU under the Triton interpreter,
against the token-by-token reference (``kernels.gdn.recurrent_gated_delta_rule_torch``).

What must hold exactly (``torch.equal``), because BI parity rests on it -- the trainer runs a whole sequence
in one call, the generator a prefill split anywhere and then one token per call with the state carried:
- one call == the same tokens split into calls at any points, state carried == one token per call;
- a sequence alone == the same sequence packed among others, in any order, beside an empty one;
- a strided head view of a wider buffer (how the layer hands q/k/v over) == a contiguous copy;
- loading tokens ahead (``prefetch`` 0, 1, 2) changes when the inputs arrive, not the arithmetic.
What holds to a tolerance: the values against the reference -- fp32 outputs and states 2e-6 (the rearranged
step rounds differently: ``(dS)^T k`` is computed as ``d (S^T k)``); bf16 outputs two bf16 ulps (the
interpreter's fp32 -> bf16 cast truncates); the fused q/k norm and gates against ``kernels.rows``' references
run first, 2e-6 (with beta truncated to bf16 as the interpreter's cast does).

Runs in a subprocess with ``TRITON_INTERPRET=1``. Skipped where triton is missing.
"""

from __future__ import annotations

import importlib.util

import pytest

from triton_interp import run_checks, run_checks_under_interpreter


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_gdn_recurrent_kernel_under_interpreter() -> None:
    run_checks_under_interpreter(__file__)


# ------------------------------------------------------------------------------------------------
# the checks, run in the subprocess

H, HV, K, V = 2, 4, 24, 20  # grouped value heads; K and V not powers of two (masked lanes); BV 8: V over 3 blocks


def _inputs(lens: list[int], dtype, seed: int = 0):  # type: ignore[no-untyped-def]
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = F.normalize(torch.randn(T, H, K, generator=g), dim=-1)
    k = F.normalize(torch.randn(T, H, K, generator=g), dim=-1)
    v = torch.randn(T, HV, V, generator=g).to(dtype)
    gate = -torch.rand(T, HV, generator=g) * 0.5
    beta = torch.rand(T, HV, generator=g).to(dtype)
    s0 = torch.randn(len(lens), HV, K, V, generator=g) * 0.1
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, gate, beta, s0, cu


def _check_values() -> None:
    import torch

    from titan_rl_ext.kernels import gdn_triton as gt
    from titan_rl_ext.kernels.gdn import recurrent_gated_delta_rule_torch

    cases = [(gt.CONFIG, dtype, with_state) for dtype in (torch.float32, torch.bfloat16) for with_state in (True, False)]
    cases += [(gt.RecurrentConfig(BV=4), torch.bfloat16, True),
              (gt.RecurrentConfig(BV=8), torch.float32, True)]  # several value blocks (the default's BV spans V)
    for cfg, dtype, with_state in cases:
        q, k, v, g, beta, s0, cu = _inputs([5, 0, 9, 1], dtype)
        state = s0 if with_state else None
        o, s = gt.gated_delta_rule_recurrent(q, k, v, g, beta, cu, K**-0.5, state, config=cfg)
        o_ref, s_ref = recurrent_gated_delta_rule_torch(q, k, v, g, beta, cu, K**-0.5, state)
        assert o.dtype == dtype and s.dtype == torch.float32 and s.shape == (4, HV, K, V)
        torch.testing.assert_close(s, s_ref, rtol=2e-6, atol=2e-6)
        if dtype == torch.float32:
            torch.testing.assert_close(o, o_ref, rtol=2e-6, atol=2e-6)
        else:
            torch.testing.assert_close(o.float(), o_ref.float(), rtol=2 * 2.0**-7, atol=1e-3)
        # the empty sequence's final state is its initial state
        assert torch.equal(s[1], s0[1] if state is not None else torch.zeros_like(s[1]))


def _check_splits_and_decode() -> None:
    import torch

    from titan_rl_ext.kernels import gdn_triton as gt

    q, k, v, g, beta, s0, cu = _inputs([11], torch.bfloat16, seed=1)
    scale = K**-0.5
    o_all, s_all = gt.gated_delta_rule_recurrent(q, k, v, g, beta, cu, scale, s0)
    # a split prefill, then one token per call (decode: the tokens loaded two ahead lie past the sequence)
    for cuts in ([4], [1, 2, 7], list(range(1, 11))):
        bounds = [0, *cuts, 11]
        state, outs = s0, []
        for a, b in zip(bounds[:-1], bounds[1:]):
            one = torch.tensor([0, b - a], dtype=torch.int32)
            o, state = gt.gated_delta_rule_recurrent(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], one, scale, state)
            outs.append(o)
        assert torch.equal(torch.cat(outs), o_all), cuts
        assert torch.equal(state, s_all), cuts


def _check_batch_invariance_and_views() -> None:
    import torch

    from titan_rl_ext.kernels import gdn_triton as gt

    lens = [6, 0, 13, 3]
    q, k, v, g, beta, s0, cu = _inputs(lens, torch.bfloat16, seed=2)
    scale = K**-0.5
    o, s = gt.gated_delta_rule_recurrent(q, k, v, g, beta, cu, scale, s0)
    bounds = cu.tolist()
    for n in range(len(lens)):
        a, b = bounds[n], bounds[n + 1]
        one = torch.tensor([0, b - a], dtype=torch.int32)
        o1, s1 = gt.gated_delta_rule_recurrent(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], one, scale, s0[n : n + 1])
        assert torch.equal(o1, o[a:b]) and torch.equal(s1[0], s[n]), n
    # reversed packing order
    order = list(reversed(range(len(lens))))
    cat = lambda x: torch.cat([x[bounds[n] : bounds[n + 1]] for n in order])  # noqa: E731
    cu_r = torch.tensor([0, *torch.tensor([lens[n] for n in order]).cumsum(0).tolist()], dtype=torch.int32)
    o_r, s_r = gt.gated_delta_rule_recurrent(cat(q), cat(k), cat(v), cat(g), cat(beta), cu_r, scale, s0[order])
    assert torch.equal(o_r, cat(o)) and torch.equal(s_r, s[order])
    # q/k/v as head views of one wide buffer (the conv output), g/beta as column views: read in place
    T = sum(lens)
    wide = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.float().reshape(T, -1)], dim=1)
    qv = wide[:, : H * K].view(T, H, K)
    kv = wide[:, H * K : 2 * H * K].view(T, H, K)
    gb = torch.cat([g, beta.float()], dim=1)
    o_v, s_v = gt.gated_delta_rule_recurrent(qv, kv, v, gb[:, :HV], beta, cu, scale, s0)
    assert qv.stride(0) == wide.shape[1] and not qv.is_contiguous()
    assert torch.equal(o_v, o) and torch.equal(s_v, s)


def _bf16_truncated(x):  # type: ignore[no-untyped-def]
    """fp32 -> bf16 the way the interpreter casts (truncation), for comparing a kernel's 16-bit stores."""
    import torch

    return (x.float().contiguous().view(torch.int32) & -65536).view(torch.float32).bfloat16()


def _check_state_slots() -> None:
    """An engine's state cache read and written by slot in place == gathering the slots, running, scattering;
    a slot without prior state starts from zeros whatever it holds (NaN here); other slots untouched."""
    import torch

    from titan_rl_ext.kernels import gdn_triton as gt

    lens = [5, 1, 0, 3]
    q, k, v, g, beta, _, cu = _inputs(lens, torch.bfloat16, seed=5)
    scale = K**-0.5
    gen = torch.Generator().manual_seed(6)
    for dtype in (torch.float32, torch.bfloat16):
        # 7 slots inside a wider buffer (a slot stride larger than one state, as vLLM's shared pages have)
        buf = torch.randn(7, HV * K * V + 40, generator=gen).to(dtype)
        cache = buf[:, : HV * K * V].view(7, HV, K, V)
        slots = torch.tensor([4, 0, 6, 2], dtype=torch.int32)
        keep = torch.tensor([True, False, True, True])
        cache[0] = float("nan")  # a recycled slot's leftovers
        h0 = torch.where(keep[:, None, None, None], cache[slots.long()].float(), 0.0)
        o_ref, s_ref = gt.gated_delta_rule_recurrent(q, k, v, g, beta, cu, scale, h0)
        before, pad = cache.clone(), buf[:, HV * K * V :].clone()
        o, s = gt.gated_delta_rule_recurrent(q, k, v, g, beta, cu, scale, cache, state_slots=slots, state_keep=keep)
        assert s is cache and torch.equal(o, o_ref), dtype
        # a bf16 cache: the kernel's fp32 -> bf16 store truncates under the interpreter (the GPU rounds)
        s_want = s_ref if dtype == torch.float32 else _bf16_truncated(s_ref)
        assert torch.equal(cache[slots.long()], s_want), dtype
        others = [i for i in range(7) if i not in slots.tolist()]
        assert torch.equal(cache[others], before[others]) and torch.equal(buf[:, HV * K * V :], pad)
        # decode from the cache: one token per sequence, the slot carried, bits as the whole-sequence call
    cache = torch.zeros(2, HV, K, V)
    slots = torch.tensor([1], dtype=torch.int32)
    a, b = 0, 5
    o_all, s_all = gt.gated_delta_rule_recurrent(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b],
                                                 torch.tensor([0, 5], dtype=torch.int32), scale)
    outs = []
    for t in range(a, b):
        o_t, _ = gt.gated_delta_rule_recurrent(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1],
                                               torch.tensor([0, 1], dtype=torch.int32), scale, cache, state_slots=slots)
        outs.append(o_t)
    assert torch.equal(torch.cat(outs), o_all) and torch.equal(cache[1], s_all[0]) and not cache[0].any()
    try:
        gt.gated_delta_rule_recurrent(q, k, v, g, beta, cu, scale, cache.transpose(2, 3), state_slots=slots)
    except ValueError as e:
        assert "contiguous" in str(e)
    else:
        raise AssertionError("a cache with transposed slots accepted")


def _check_cached_state_rule_kernel() -> None:
    """The engine's rule kernel (``CachedStateRuleKernel``): where the project's kernel runs the call (forced here:
    the dispatch asks for CUDA) the cache is updated in place and returned; the same step through its gather
    path (FLA/torch) returns N states to scatter; both agree to the reference tolerance."""
    import torch

    from titan_rl_ext.kernels import batch_invariant as bi
    from titan_rl_ext.models.common.batch import SeqBatch
    from titan_rl_ext.models.qwen3_5 import gdn as layer
    from vllm_titan_plugin import gdn_slots

    lens = [4, 2, 3]
    q, k, v, g, beta, _, cu = _inputs(lens, torch.bfloat16, seed=8)
    seq = SeqBatch(cu_seqlens=cu, positions=torch.zeros(sum(lens), dtype=torch.long), max_seqlen=4)
    cache0 = torch.randn(5, HV, K, V) * 0.1
    slots = torch.tensor([3, 1, 4])
    keep = torch.tensor([True, True, False])
    kern = gdn_slots.CachedStateRuleKernel(layer.GatedDeltaRuleKernel("chunk"))
    results = {}
    forced = gdn_slots.runs_titan_recurrent
    for path in ("in_place", "gather"):
        gdn_slots.runs_titan_recurrent = (lambda *a: True) if path == "in_place" else (lambda *a: False)
        cache = cache0.clone()
        kern.bind(slots, keep)
        try:
            with bi.batch_invariant(True):
                o, s = kern(q, k, v, g, beta, seq, K**-0.5, cache)
        finally:
            kern.unbind()
            gdn_slots.runs_titan_recurrent = forced
        if path == "in_place":
            assert s is cache and torch.equal(cache[[0, 2]], cache0[[0, 2]])
            s = cache[slots]
        else:
            assert s is not cache and s.shape == (3, HV, K, V) and torch.equal(cache, cache0)
        results[path] = (o, s)
    (o1, s1), (o2, s2) = results["in_place"], results["gather"]
    torch.testing.assert_close(s1, s2, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(o1.float(), o2.float(), rtol=2 * 2.0**-7, atol=1e-3)
    # unbound (a profiling run): the plain kernel, state as given
    o3, _ = kern(q, k, v, g, beta, seq, K**-0.5, None)
    assert o3.shape == o1.shape


def _check_mixed_step_peels_decodes() -> None:
    """A non-BI mixed step (decodes first, then prefills), as vLLM's GDN backend lays it out: the engine's rule
    kernel runs the decodes on the project's kernel in place and only the prefills through the chunk form on
    their gathered states -- the same outputs and final states, to the two forms' fp32 agreement, as the
    one-call path that gathers every slot; slots outside the step untouched; the prefills' chunk indices reach
    the chunk kernel only where they describe its call. The dispatch is forced as on CUDA (decode-sized calls
    on the project's kernel)."""
    import torch

    from titan_rl_ext.kernels import batch_invariant as bi
    from titan_rl_ext.models.common.batch import SeqBatch
    from titan_rl_ext.models.qwen3_5 import gdn as layer
    from vllm_titan_plugin import gdn_slots

    class Spy(layer.GatedDeltaRuleKernel):
        def forward(self, *args, chunk_indices=None, **kw):  # type: ignore[no-untyped-def]
            self.seen.append((args[0].shape[0], chunk_indices))
            return super().forward(*args, chunk_indices=chunk_indices, **kw)

    lens = [1, 1, 1, 9, 5]
    nd = 3
    q, k, v, g, beta, _, cu = _inputs(lens, torch.bfloat16, seed=11)
    seq = SeqBatch(cu_seqlens=cu, positions=torch.arange(sum(lens)), max_seqlen=9)
    cache0 = torch.randn(8, HV, K, V) * 0.1
    slots = torch.tensor([6, 2, 0, 5, 3])
    keep = torch.tensor([True, True, True, True, False])
    chunk_idx = torch.tensor([[0, 0], [1, 0]], dtype=torch.int32)  # the prefills' chunks, as vLLM's builder makes
    base = Spy("chunk")
    base.seen = []
    kern = gdn_slots.CachedStateRuleKernel(base)
    forced = gdn_slots.runs_titan_recurrent
    gdn_slots.runs_titan_recurrent = lambda q, n, mode, needs_grad: q.shape[0] <= 2 * n  # as on CUDA, non-BI
    try:
        cache = cache0.clone()
        kern.bind(slots, keep, n_decodes=nd, chunk_indices=chunk_idx)
        assert kern._peels_decodes(q, v, cache) and kern.qk_dtype(q, v, len(lens), cache) == torch.float32
        with bi.batch_invariant(True):
            assert not kern._peels_decodes(q, v, cache)  # BI: the whole step on the recurrent kernel
        o, s = kern(q, k, v, g, beta, seq, K**-0.5, cache)
        kern.unbind()
        assert s is cache and base.seen == [(14, chunk_idx)], base.seen
        others = [i for i in range(8) if i not in slots.tolist()]
        assert torch.equal(cache[others], cache0[others])
        # one call over the whole step: every slot gathered, N states back; the prefills' indices withheld
        base.seen.clear()
        ref_cache = cache0.clone()
        kern.bind(slots, keep, n_decodes=nd, chunk_indices=chunk_idx)
        gdn_slots.runs_titan_recurrent = lambda *a: False  # no project kernel: nothing to peel onto
        try:
            assert not kern._peels_decodes(q, v, ref_cache)
            o_ref, s_ref = kern(q, k, v, g, beta, seq, K**-0.5, ref_cache)
        finally:
            kern.unbind()
        assert base.seen == [(17, None)] and torch.equal(ref_cache, cache0) and s_ref.shape == (5, HV, K, V)
    finally:
        gdn_slots.runs_titan_recurrent = forced
    # fp32 states through two forms of one recurrence (a step of the recurrent kernel vs the chunked WY form)
    torch.testing.assert_close(cache[slots], s_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o.float(), o_ref.float(), rtol=2 * 2.0**-7, atol=1e-3)  # bf16 outputs

    # a short mixed step (two tokens a sequence or fewer): whole on the recurrent kernel, the l2norms and gates
    # apart (a prefill's serial chain), unless TITAN_GDN_MIXED_STEPS=peel; the decodes alone, bound as a
    # decode-only step, take them fused; a bad value is refused by name
    import os

    short = gdn_slots.CachedStateRuleKernel(layer.GatedDeltaRuleKernel("chunk"))
    qs, vs = q[:5], v[:5]  # three decodes and a 2-token prefill
    gdn_slots.runs_titan_recurrent = lambda q, n, mode, needs_grad: q.shape[0] <= 2 * n
    try:
        short.bind(slots[:3], keep[:3])
        assert short.prep_in_kernel(qs[:3], vs[:3], cache)
        short.bind(slots[:4], keep[:4], n_decodes=3)
        assert not short.prep_in_kernel(qs, vs, cache) and not short._peels_decodes(qs, vs, cache)
        assert short._in_place(qs, vs, cache, "chunk")  # the whole step in place, as BI runs it
        os.environ["TITAN_GDN_MIXED_STEPS"] = "peel"
        assert not short.prep_in_kernel(qs, vs, cache) and short._peels_decodes(qs, vs, cache)
        os.environ["TITAN_GDN_MIXED_STEPS"] = "chunky"
        try:
            short._peels_decodes(qs, vs, cache)
        except ValueError as e:
            assert "TITAN_GDN_MIXED_STEPS='chunky'" in str(e), e
        else:
            raise AssertionError("a bad TITAN_GDN_MIXED_STEPS accepted")
    finally:
        os.environ.pop("TITAN_GDN_MIXED_STEPS", None)
        short.unbind()
        gdn_slots.runs_titan_recurrent = forced


def _check_fused_prep() -> None:
    import torch

    from titan_rl_ext.kernels import gdn_triton as gt
    from titan_rl_ext.kernels import rows

    gen = torch.Generator().manual_seed(3)
    lens = [7, 5]
    T = sum(lens)
    q_raw = torch.randn(T, H, K, generator=gen).bfloat16()
    k_raw = torch.randn(T, H, K, generator=gen).bfloat16()
    v = torch.randn(T, HV, V, generator=gen).bfloat16()
    a = torch.randn(T, HV, generator=gen).bfloat16()
    b = torch.randn(T, HV, generator=gen).bfloat16()
    a[0, 0] = 30.0  # softplus past its threshold
    A_log = torch.rand(HV, generator=gen) * 2
    dt_bias = torch.randn(HV, generator=gen).bfloat16()
    s0 = torch.randn(len(lens), HV, K, V, generator=gen) * 0.1
    cu = torch.tensor([0, 7, 12], dtype=torch.int32)
    scale = K**-0.5
    g_ref, beta_ref = rows.gdn_gates_torch(a, b, A_log, dt_bias)
    # the interpreter's fp32 -> bf16 cast truncates where the GPU rounds: the kernel's beta is sigmoid(b)
    # truncated to bf16 here, so the reference takes the same (one bf16 ulp of beta moves the state ~4e-3)
    beta_ref = _bf16_truncated(torch.sigmoid(b.float()))
    o_ref, s_ref = gt.gated_delta_rule_recurrent(
        rows.l2norm_torch(q_raw), rows.l2norm_torch(k_raw), v, g_ref, beta_ref, cu, scale, s0)
    fused = dict(A_log=A_log, dt_bias=dt_bias, norm_qk=True)
    o, s = gt.gated_delta_rule_recurrent(q_raw, k_raw, v, a, b, cu, scale, s0, **fused)
    torch.testing.assert_close(s, s_ref, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(o.float(), o_ref.float(), rtol=2 * 2.0**-7, atol=1e-3)
    # fused prep, decode: one token per call gives the one call's bits
    state, outs = s0[1:], []
    for t in range(7, 12):
        one = torch.tensor([0, 1], dtype=torch.int32)
        o_t, state = gt.gated_delta_rule_recurrent(q_raw[t : t + 1], k_raw[t : t + 1], v[t : t + 1], a[t : t + 1],
                                                   b[t : t + 1], one, scale, state, **fused)
        outs.append(o_t)
    assert torch.equal(torch.cat(outs), o[7:]) and torch.equal(state[0], s[1])


def _check_layer_prep_in_kernel() -> None:
    """Non-BI decode through the engine's rule kernel hands the kernel raw q/k/a/b (it forms the l2norms and
    gates itself, three launches fewer per layer): the layer's output and cache agree with the separate kernels'
    path; BI steps, prefill-sized steps, caches with non-contiguous slots and unbound kernels keep the separate
    kernels (a BI step must give the trainer's bits, and the fused l2norm sums in another order).
    Tolerance: the interpreter truncates the kernel's beta to bf16 where ``rows.gdn_gates`` rounds (see
    ``_check_fused_prep``), one bf16 ulp of beta, which moves the state by up to ~4e-3 per step."""
    import torch

    from titan_rl_ext.kernels import batch_invariant as bi
    from titan_rl_ext.models.common.batch import SeqBatch
    from titan_rl_ext.models.qwen3_5 import gdn as layer
    from vllm_titan_plugin import gdn_slots

    cfg = layer.GDNConfig(n_k_heads=H, n_v_heads=HV, k_head_dim=K, v_head_dim=V)
    torch.manual_seed(0)
    net = layer.GatedDeltaNet(32, cfg, 1e-6).bfloat16()
    kern = gdn_slots.CachedStateRuleKernel(net.rule_kernel)
    net.rule_kernel = kern
    n = 3
    x = torch.randn(n, 32).bfloat16()
    seq = SeqBatch(cu_seqlens=torch.arange(n + 1, dtype=torch.int32), positions=torch.zeros(n, dtype=torch.long),
                   max_seqlen=1)
    conv0 = (torch.randn(n, *cfg.conv_state_shape()) * 0.1).bfloat16()
    cache0 = torch.randn(5, HV, K, V) * 0.1
    slots, keep = torch.tensor([3, 1, 4]), torch.tensor([True, True, False])
    forced, l2norm = gdn_slots.runs_titan_recurrent, layer.rows.l2norm
    norms = []
    gdn_slots.runs_titan_recurrent = lambda *a: True  # the dispatch asks for CUDA
    layer.rows.l2norm = lambda t, *a, **kw: norms.append(1) or l2norm(t, *a, **kw)
    try:
        results = {}
        for fused in (True, False):
            cache, norms[:] = cache0.clone(), []
            if not fused:
                kern.prep_in_kernel = lambda *a: False
            kern.bind(slots, keep)
            try:
                with torch.no_grad():
                    y, st = net(x, seq, layer.GDNState(conv0.clone(), cache))
            finally:
                kern.unbind()
                if not fused:
                    del kern.prep_in_kernel
            assert st.ssm is cache and torch.equal(cache[[0, 2]], cache0[[0, 2]])
            assert len(norms) == (0 if fused else 2), norms  # the separate l2norms ran only without the fusion
            results[fused] = (y, cache[slots])
        (y1, s1), (y2, s2) = results[True], results[False]
        torch.testing.assert_close(s1, s2, rtol=0, atol=4e-3)
        torch.testing.assert_close(y1.float(), y2.float(), rtol=2 * 2.0**-7, atol=4e-3)  # bf16: two ulps
        assert not torch.equal(s1, s2)  # a different rounding, so the fused path did run
        q, v = torch.zeros(n, H, K), torch.zeros(n, HV, V)
        assert not kern.prep_in_kernel(q, v, cache0)  # unbound
        kern.bind(slots, keep)
        assert kern.prep_in_kernel(q, v, cache0)
        with bi.batch_invariant(True):
            assert not kern.prep_in_kernel(q, v, cache0)
        assert not kern.prep_in_kernel(torch.zeros(3 * n, H, K), torch.zeros(3 * n, HV, V), cache0)
        assert not kern.prep_in_kernel(q, v, cache0.transpose(2, 3))
        kern.unbind()
    finally:
        gdn_slots.runs_titan_recurrent, layer.rows.l2norm = forced, l2norm


def _check_layer_on_engine_caches() -> None:
    """The GDN layer as the vLLM wrapper runs it -- both caches handed over whole, the step's slots bound to its
    conv and rule kernels, the kernels reading and writing the slots in place (forced here: the dispatch asks for
    CUDA) -- gives the bits of the layer run on states gathered from the slots (zeros where a slot holds no prior
    state), and the caches hold those final states at the slots and nothing else changed. BI mode: the trainer's
    kernels, so the check is exact."""
    import torch

    from titan_rl_ext.kernels import batch_invariant as bi
    from titan_rl_ext.kernels import conv as cv
    from titan_rl_ext.kernels import gdn as gdn_kernels
    from titan_rl_ext.models.common.batch import SeqBatch
    from titan_rl_ext.models.qwen3_5 import gdn as layer
    from vllm_titan_plugin import gdn_slots

    cfg = layer.GDNConfig(n_k_heads=H, n_v_heads=HV, k_head_dim=K, v_head_dim=V)
    torch.manual_seed(1)
    net = layer.GatedDeltaNet(32, cfg, 1e-6).bfloat16()
    plain = (net.conv_kernel, net.rule_kernel)
    engine = (gdn_slots.CachedStateConvKernel(net.conv_kernel), gdn_slots.CachedStateRuleKernel(net.rule_kernel))
    lens = [3, 1, 2]  # a prefill chunk and decodes
    T = sum(lens)
    x = torch.randn(T, 32).bfloat16()
    seq = SeqBatch(cu_seqlens=torch.tensor([0, 3, 4, 6], dtype=torch.int32),
                   positions=torch.zeros(T, dtype=torch.long), max_seqlen=3)
    conv0 = (torch.randn(6, *cfg.conv_state_shape()) * 0.5).bfloat16()
    ssm0 = torch.randn(6, HV, K, V) * 0.1
    slots, keep = torch.tensor([3, 1, 4]), torch.tensor([True, False, True])
    forced = cv._on_kernel, gdn_slots.runs_titan_recurrent, gdn_kernels.runs_titan_recurrent
    cv._on_kernel = lambda x: True
    gdn_slots.runs_titan_recurrent = gdn_kernels.runs_titan_recurrent = lambda *a: True
    try:
        with torch.no_grad(), bi.batch_invariant(True):
            net.conv_kernel, net.rule_kernel = engine
            conv_cache, ssm_cache = conv0.clone(), ssm0.clone()
            for kernel in engine:
                kernel.bind(slots, keep)
            try:
                y, st = net(x, seq, layer.GDNState(conv_cache, ssm_cache))
            finally:
                for kernel in engine:
                    kernel.unbind()
            assert st.conv is conv_cache and st.ssm is ssm_cache
            net.conv_kernel, net.rule_kernel = plain
            m = keep[:, None, None]
            gathered = layer.GDNState(torch.where(m, conv0[slots], 0).bfloat16(), torch.where(m[..., None], ssm0[slots], 0))
            y_ref, st_ref = net(x, seq, gathered)
    finally:
        cv._on_kernel, gdn_slots.runs_titan_recurrent, gdn_kernels.runs_titan_recurrent = forced
    assert torch.equal(y, y_ref)
    assert torch.equal(conv_cache[slots], st_ref.conv) and torch.equal(ssm_cache[slots], st_ref.ssm)
    rest = [0, 2, 5]
    assert torch.equal(conv_cache[rest], conv0[rest]) and torch.equal(ssm_cache[rest], ssm0[rest])


def _check_dispatch_and_errors() -> None:
    import torch

    from titan_rl_ext.kernels import gdn
    from titan_rl_ext.kernels import gdn_triton as gt

    q, k, v, g, beta, s0, cu = _inputs([4, 3], torch.bfloat16, seed=4)
    direct = gt.gated_delta_rule_recurrent(q, k, v, g, beta, cu, 0.5, s0)
    via = gdn.gated_delta_rule(q, k, v, g, beta, cu, 0.5, s0, mode="recurrent", backend="titan")
    assert torch.equal(direct[0], via[0]) and torch.equal(direct[1], via[1])
    bad = [
        lambda: gt.gated_delta_rule_recurrent(q, k[:, :1], v, g, beta, cu, 0.5),  # k heads differ
        lambda: gt.gated_delta_rule_recurrent(q, k, v[:, :3], g, beta, cu, 0.5),  # HV not a multiple of H
        lambda: gt.gated_delta_rule_recurrent(q, k, v, g[:, :2], beta, cu, 0.5),  # g shape
        lambda: gt.gated_delta_rule_recurrent(q, k, v, g, beta, cu, 0.5, s0[:1]),  # one state for two seqs
        lambda: gt.gated_delta_rule_recurrent(q, k, v, g, beta, cu, 0.5, A_log=torch.zeros(HV)),  # no dt_bias
    ]
    for fn in bad:
        try:
            fn()
        except ValueError:
            continue
        raise AssertionError("bad input accepted")


def _main() -> None:
    run_checks((_check_values, _check_splits_and_decode, _check_batch_invariance_and_views, _check_state_slots,
                _check_cached_state_rule_kernel, _check_mixed_step_peels_decodes, _check_fused_prep, _check_layer_prep_in_kernel,
                _check_layer_on_engine_caches, _check_dispatch_and_errors))


if __name__ == "__main__":
    _main()
