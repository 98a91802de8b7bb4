"""GPU: FLA's gated-delta-rule kernels behind the project's wrapper, against the torch reference,
and the titan Qwen3.5 model on CUDA. Skipped where there is no CUDA device or no ``fla``.

Run on the GPU machine:  python -m pytest -q tests/gpu
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from titan_rl_ext.kernels.gdn import fla_available, gated_delta_rule, recurrent_gated_delta_rule_torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not fla_available(), reason="needs flash-linear-attention (fla)"),
]


def _inputs(lens: list[int], dtype: torch.dtype, H: int = 4, HV: int = 8, K: int = 64, V: int = 64):
    g = torch.Generator(device="cuda").manual_seed(0)
    T = sum(lens)
    q = F.normalize(torch.randn(T, H, K, device="cuda", generator=g), dim=-1).to(dtype)
    k = F.normalize(torch.randn(T, H, K, device="cuda", generator=g), dim=-1).to(dtype)
    v = torch.randn(T, HV, V, device="cuda", generator=g).to(dtype)
    gate = -torch.rand(T, HV, device="cuda", generator=g) * 0.5
    beta = torch.rand(T, HV, device="cuda", generator=g).to(dtype)
    s0 = torch.randn(len(lens), HV, K, V, device="cuda", generator=g) * 0.1
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return q, k, v, gate, beta, s0, cu, K**-0.5


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_matches_torch_reference(mode: str, dtype: torch.dtype) -> None:
    q, k, v, g, beta, s0, cu, scale = _inputs([17, 300, 1, 129], dtype)
    o, s = gated_delta_rule(q, k, v, g, beta, cu, scale, initial_state=s0, mode=mode, backend="fla")
    o_ref, s_ref = recurrent_gated_delta_rule_torch(q.float(), k.float(), v.float(), g, beta.float(), cu, scale, s0)
    assert s.dtype == torch.float32 and s.shape == s0.shape
    # fp32: TF32 matmuls inside the chunk kernel -> ~1e-3; bf16 inputs/outputs -> bf16 rounding (~1e-2)
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(o.float(), o_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(s, s_ref, atol=tol, rtol=tol)


def test_fla_sequence_alone_equals_packed() -> None:
    """FLA's recurrent kernel: a sequence's bits do not depend on what it is packed with."""
    q, k, v, g, beta, s0, cu, scale = _inputs([40, 200, 7], torch.bfloat16)
    o, s = gated_delta_rule(q, k, v, g, beta, cu, scale, initial_state=s0, mode="recurrent", backend="fla")
    a, b = 40, 240
    one = torch.tensor([0, b - a], dtype=torch.int32, device="cuda")
    o1, s1 = gated_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], one, scale,
                              initial_state=s0[1:2], mode="recurrent", backend="fla")
    assert torch.equal(o1, o[a:b]) and torch.equal(s1, s[1:2])


@torch.no_grad()
def test_titan_qwen3_5_on_cuda_matches_cpu_reference() -> None:
    from titan_rl_ext.models.common.batch import SeqBatch
    from titan_rl_ext.models.flavors import FLAVORS

    torch.manual_seed(0)
    cfg = FLAVORS["qwen3_5-debug"]
    cpu = cfg.build()
    cpu.init_weights()
    gpu = cfg.build()
    gpu.load_state_dict(cpu.state_dict())
    gpu = gpu.cuda()
    lens = [5, 70, 33]
    toks = torch.randint(0, cfg.vocab_size, (sum(lens),))
    ref = cpu(toks, SeqBatch.from_lengths(lens))
    out = gpu(toks.cuda(), SeqBatch.from_lengths(lens, device="cuda"))
    torch.testing.assert_close(out.cpu(), ref, atol=5e-3, rtol=5e-3)  # TF32/FLA vs CPU fp32

    # inference-state path on CUDA: split prefill + decode == full forward
    states = gpu.init_states(len(lens))
    done, got = [0] * len(lens), [[] for _ in lens]
    for step in ([3, 40, 20], [2, 29, 12], *([[0, 1, 1]] * 1)):
        n_new = [min(n, L - d) for n, L, d in zip(step, lens, done)]
        t = torch.cat([toks[sum(lens[:i]) + done[i]: sum(lens[:i]) + done[i] + n_new[i]] for i in range(len(lens))])
        logits, states = gpu.step(t.cuda(), SeqBatch.from_lengths(n_new, done, device="cuda"), states)
        for i, c in enumerate(logits.split(n_new)):
            got[i].append(c)
            done[i] += n_new[i]
    full = gpu(toks.cuda(), SeqBatch.from_lengths(lens, device="cuda")).split(lens)
    for i in range(len(lens)):
        torch.testing.assert_close(torch.cat(got[i]), full[i], atol=5e-3, rtol=5e-3)
