"""GPU: the project's recurrent gated-delta-rule kernel (``kernels.gdn_triton``) at Qwen3.5-9B GDN shapes
(16 qk heads, 32 v heads, dim 128) -- the bit equalities BI parity rests on, compiled for the real device, and
its values against a float64 reference. Skipped where there is no CUDA device or no triton.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_gdn_triton_cuda.py
"""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

H, HV, K, V = 16, 32, 128, 128


def _inputs(lens: list[int], seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lens)
    q = F.normalize(torch.randn(T, H, K, device="cuda", generator=g), dim=-1)
    k = F.normalize(torch.randn(T, H, K, device="cuda", generator=g), dim=-1)
    v = torch.randn(T, HV, V, device="cuda", generator=g).bfloat16()
    gate = -torch.rand(T, HV, device="cuda", generator=g) * 0.5
    beta = torch.rand(T, HV, device="cuda", generator=g).bfloat16()
    s0 = torch.randn(len(lens), HV, K, V, device="cuda", generator=g) * 0.1
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    return q, k, v, gate, beta, s0, cu


def test_split_prefill_and_decode_give_one_calls_bits() -> None:
    from titan_rl_ext.kernels.gdn_triton import gated_delta_rule_recurrent as rec

    q, k, v, g, beta, s0, cu = _inputs([200])
    o_all, s_all = rec(q, k, v, g, beta, cu, K**-0.5, s0)
    bounds = [0, 64, 150, *range(151, 201)]  # two prefill chunks, then 50 decode steps
    state, outs = s0, []
    for a, b in zip(bounds[:-1], bounds[1:]):
        one = torch.tensor([0, b - a], dtype=torch.int32, device="cuda")
        o, state = rec(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], one, K**-0.5, state)
        outs.append(o)
    assert torch.equal(torch.cat(outs), o_all)
    assert torch.equal(state, s_all)


def test_sequence_alone_equals_packed() -> None:
    from titan_rl_ext.kernels.gdn_triton import gated_delta_rule_recurrent as rec

    lens = [40, 0, 257, 3, 100]
    q, k, v, g, beta, s0, cu = _inputs(lens, seed=1)
    o, s = rec(q, k, v, g, beta, cu, K**-0.5, s0)
    c = cu.tolist()
    for n in range(len(lens)):
        a, b = c[n], c[n + 1]
        one = torch.tensor([0, b - a], dtype=torch.int32, device="cuda")
        o1, s1 = rec(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], one, K**-0.5, s0[n : n + 1])
        assert torch.equal(o1, o[a:b]) and torch.equal(s1[0], s[n]), n


def test_values_against_float64_as_close_as_fla() -> None:
    """bf16 outputs: the kernel's error against the float64 chunked form is within one bf16 ulp of values
    ~1 (7.8e-3) and no larger than 1.5x FLA's recurrent kernel's on the same inputs, where FLA is installed."""
    from titan_rl_ext.kernels.gdn import chunk_gated_delta_rule_torch, fla_available, gated_delta_rule
    from titan_rl_ext.kernels.gdn_triton import gated_delta_rule_recurrent as rec

    q, k, v, g, beta, s0, cu = _inputs([300, 1000, 77], seed=2)
    o, s = rec(q, k, v, g, beta, cu, K**-0.5, s0)
    o64, s64 = chunk_gated_delta_rule_torch(q, k, v.float(), g, beta.float(), cu, K**-0.5, s0,
                                            compute_dtype=torch.float64)
    err = (o.double() - o64.double()).abs().max().item()
    assert err < 7.8e-3, err
    torch.testing.assert_close(s.double(), s64.double(), rtol=1e-4, atol=1e-4)  # fp32 state, T = 1000 steps
    if fla_available():
        o_fla, _ = gated_delta_rule(q, k, v, g, beta, cu, K**-0.5, s0, "recurrent", "fla")
        err_fla = (o_fla.double() - o64.double()).abs().max().item()
        assert err <= 1.5 * err_fla + 1e-6, (err, err_fla)


def test_fused_prep_matches_the_layers_kernels() -> None:
    """Raw q/k/a/b with the norm and gates in the kernel vs ``rows.l2norm`` / ``rows.gdn_gates`` then the kernel:
    the same math, rounded in other places (the l2norm's sum runs in another order: fp32 state 5e-5 after 500
    steps; bf16 output two ulps)."""
    from titan_rl_ext.kernels import rows
    from titan_rl_ext.kernels.gdn_triton import gated_delta_rule_recurrent as rec

    gen = torch.Generator(device="cuda").manual_seed(3)
    T = 500
    q_raw = torch.randn(T, H, K, device="cuda", generator=gen).bfloat16()
    k_raw = torch.randn(T, H, K, device="cuda", generator=gen).bfloat16()
    v = torch.randn(T, HV, V, device="cuda", generator=gen).bfloat16()
    a = torch.randn(T, HV, device="cuda", generator=gen).bfloat16()
    b = torch.randn(T, HV, device="cuda", generator=gen).bfloat16()
    A_log = torch.empty(HV, device="cuda").uniform_(1, 16, generator=gen).log()
    dt_bias = torch.ones(HV, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    g_ref, beta_ref = rows.gdn_gates(a, b, A_log, dt_bias)
    o_ref, s_ref = rec(rows.l2norm(q_raw), rows.l2norm(k_raw), v, g_ref, beta_ref, cu, K**-0.5)
    o, s = rec(q_raw, k_raw, v, a, b, cu, K**-0.5, A_log=A_log, dt_bias=dt_bias, norm_qk=True)
    torch.testing.assert_close(s, s_ref, rtol=5e-5, atol=5e-5)
    torch.testing.assert_close(o.float(), o_ref.float(), rtol=2 * 2.0**-7, atol=1e-3)


def test_state_cache_in_place_equals_gather_scatter() -> None:
    """An engine's state cache updated by slot in place gives the bits of gathering the slots, running the
    kernel and scattering (a slot without prior state starts from zeros whatever it holds)."""
    from titan_rl_ext.kernels.gdn_triton import gated_delta_rule_recurrent as rec

    lens = [1] * 64 + [37, 5]  # a decode batch and two prefills
    q, k, v, g, beta, _, cu = _inputs(lens, seed=4)
    n = len(lens)
    gen = torch.Generator(device="cuda").manual_seed(5)
    cache = torch.randn(2 * n, HV, K, V, device="cuda", generator=gen) * 0.1
    slots = torch.randperm(2 * n, device="cuda", generator=gen)[:n]
    keep = torch.ones(n, dtype=torch.bool, device="cuda")
    keep[-2:] = False
    cache[slots[-1]] = float("nan")
    h0 = torch.where(keep[:, None, None, None], cache[slots], 0.0)
    o_ref, s_ref = rec(q, k, v, g, beta, cu, K**-0.5, h0)
    o, s = rec(q, k, v, g, beta, cu, K**-0.5, cache, state_slots=slots, state_keep=keep)
    assert s is cache and torch.equal(o, o_ref) and torch.equal(cache[slots], s_ref)


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs fla-core (the non-BI chunk kernel)")
def test_mixed_step_peeled_decodes_as_close_as_one_chunk_call() -> None:
    """A non-BI mixed step as vLLM lays it out (64 one-token decodes, then prefills of 300 and 77 tokens): the
    engine's rule kernel peels the decodes onto the project's kernel in place and runs FLA's chunk kernel on the
    prefills alone, with chunk indices made on the host as vLLM's builder makes them. Against the float64
    chunked form its outputs and final states are no further off than one FLA chunk call over the whole step on
    gathered states (1.25x: FLA keeps intra-chunk terms in bf16, so the two paths' errors differ by rounding;
    session 34 measured the paths 4.6e-3 apart on 105 of 34.6M state elements, a bf16 ulp of the update);
    other slots untouched. q/k are bf16 values, so both paths read the same inputs."""
    from fla.ops.utils.index import prepare_chunk_indices

    from titan_rl_ext.kernels.gdn import chunk_gated_delta_rule_torch
    from titan_rl_ext.models.common.batch import SeqBatch
    from titan_rl_ext.models.qwen3_5 import gdn as layer
    from vllm_titan_plugin import gdn_slots

    nd, lens = 64, [1] * 64 + [300, 77]
    q, k, v, g, beta, _, cu = _inputs(lens, seed=5)
    q, k = q.bfloat16().float(), k.bfloat16().float()
    seq = SeqBatch(cu_seqlens=cu, positions=torch.arange(cu[-1].item(), device="cuda"), max_seqlen=300)
    cache0 = torch.randn(100, HV, K, V, device="cuda") * 0.1
    slots = torch.randperm(100, device="cuda")[: len(lens)]
    keep = torch.ones(len(lens), dtype=torch.bool, device="cuda")
    keep[-1] = False  # a new request in a recycled slot
    chunks = prepare_chunk_indices((cu[nd:] - nd).cpu(), 64).to(device="cuda", dtype=torch.int32)
    kern = gdn_slots.CachedStateRuleKernel(layer.GatedDeltaRuleKernel("chunk"))
    cache = cache0.clone()
    kern.bind(slots, keep, n_decodes=nd, chunk_indices=chunks)
    try:
        assert kern._peels_decodes(q, v, cache)
        o, s = kern(q, k, v, g, beta, seq, K**-0.5, cache)
    finally:
        kern.unbind()
    ref_cache = cache0.clone()
    kern.bind(slots, keep)
    try:
        o_ref, s_ref = kern(q, k, v, g, beta, seq, K**-0.5, ref_cache)
    finally:
        kern.unbind()
    assert s is cache and torch.equal(ref_cache, cache0)
    others = torch.ones(100, dtype=torch.bool, device="cuda")
    others[slots] = False
    assert torch.equal(cache[others], cache0[others])
    h0 = torch.where(keep[:, None, None, None], cache0[slots], torch.zeros_like(cache0[slots]))
    o64, s64 = chunk_gated_delta_rule_torch(q, k, v.float(), g, beta.float(), cu, K**-0.5, h0,
                                            compute_dtype=torch.float64)

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a.double() - b.double()).abs().max().item()

    assert err(cache[slots], s64) <= 1.25 * err(s_ref, s64) + 1e-6, (err(cache[slots], s64), err(s_ref, s64))
    assert err(o, o64) <= 1.25 * err(o_ref, o64) + 1e-6, (err(o, o64), err(o_ref, o64))
