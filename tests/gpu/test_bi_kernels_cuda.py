"""GPU: the kernels that make batch invariance cheap in the trainer, checked on the device they run on.

- the Triton BI flash-attention forward: packed = alone = paged (vLLM's block table, two block sizes) =
  chunked prefill + decode, bit for bit, at Qwen3.5-9B attention shapes; error against float64;
- its backward (FlashAttention varlen through torch) and the non-BI flash path against float64;
- the fused fp32 head: BI logprobs bit-equal to ``log_softmax`` of the full logits at any row count, and
  the gradient error of its bf16 backward against float64;
- the head's log-softmax statistics kernel (``log_softmax_triton``): ``(x - max) - logsum`` equals
  ``torch.log_softmax`` on every column of many rows at the vocabularies the models use, as does its plain-
  PyTorch emulation of torch's order; the head through it equals the head through torch's kernel, forward and
  gradients;
- FLA's chunk backward with its Hopper/Triton-3.6 guard overridden (FLA #640): gradients against a
  float64 reference at the shapes the project trains (9B heads, packed varlen, T = 8192 and 16384).

Run on the GPU machine:  python -m pytest -q -s tests/gpu
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from titan_rl_ext.kernels.attention import causal_attention_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]
DEV = "cuda"
LENS_9B = [1000, 3000, 2500, 1692]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _qkv(lens: list[int], N: int, Kh: int, H: int, seed: int = 0, grad: bool = False):  # type: ignore[no-untyped-def]
    g = torch.Generator(device=DEV).manual_seed(seed)
    T = sum(lens)
    q, k, v = (torch.randn(T, n, H, device=DEV, generator=g).bfloat16() for n in (N, Kh, Kh))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    if grad:
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    return q, k, v, cu


def _paged(k: torch.Tensor, v: torch.Tensor, lens: list[int], bs: int, seed: int):  # type: ignore[no-untyped-def]
    """Scatter each sequence's keys/values over shuffled blocks of a NaN-filled paged cache."""
    n_blk = [-(-n // bs) for n in lens]
    nb = sum(n_blk) + 3
    kc = torch.full((nb, bs, *k.shape[1:]), float("nan"), dtype=k.dtype, device=DEV)
    vc = torch.full_like(kc, float("nan"))
    order = torch.randperm(nb, generator=torch.Generator().manual_seed(seed)).to(DEV)
    bt = torch.zeros(len(lens), max(n_blk), dtype=torch.int32, device=DEV)
    used, s = 0, 0
    for i, n in enumerate(lens):
        bt[i, : n_blk[i]] = order[used : used + n_blk[i]]
        used += n_blk[i]
        pos = torch.arange(n, device=DEV)
        kc[bt[i, pos // bs].long(), pos % bs] = k[s : s + n]
        vc[bt[i, pos // bs].long(), pos % bs] = v[s : s + n]
        s += n
    return kc, vc, bt


@pytest.mark.parametrize("N,Kh,H", [(16, 4, 256), (32, 8, 128), (8, 8, 64)])  # Qwen3.5-9B, Qwen3-8B, MHA
def test_bi_attention_packed_alone_paged_decode_bit_identical(N: int, Kh: int, H: int) -> None:
    from titan_rl_ext.kernels.attention_triton import bi_attention_fwd

    lens = LENS_9B if H == 256 else [300, 1, 777, 64]
    q, k, v, cu = _qkv(lens, N, Kh, H)
    scale = H**-0.5
    sl = cu[1:] - cu[:-1]
    o = bi_attention_fwd(q, k, v, cu, sl, max(lens), scale, k_start=cu[:-1])
    ref = causal_attention_reference(q, k, v, lens, scale)
    err = (o.double() - ref).abs().max().item() / ref.abs().max().item()
    print(f"\n  BI attention N={N} K={Kh} H={H} T={sum(lens)}: max err / max |ref| = {err:.2e}")
    assert err < 2**-6, err  # bf16 p and bf16 output
    starts = cu[:-1].tolist()
    for i, n in enumerate(lens):  # alone
        s = starts[i]
        one = torch.tensor([0, n], dtype=torch.int32, device=DEV)
        alone = bi_attention_fwd(q[s : s + n], k[s : s + n], v[s : s + n], one, sl[i : i + 1], n, scale,
                                 k_start=torch.zeros(1, dtype=torch.int32, device=DEV))
        assert torch.equal(alone, o[s : s + n]), i
    for bs in (16, 544):  # vLLM's default, and a hybrid model's attention page (not a power of two)
        kc, vc, bt = _paged(k, v, lens, bs, seed=bs)
        for take in ([min(n, 37) for n in lens], [1] * len(lens)):  # a prefill chunk, then a decode step
            qs = torch.cat([q[s + n - t : s + n] for s, n, t in zip(starts, lens, take)])
            cuq = torch.tensor([0, *torch.tensor(take).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
            got = bi_attention_fwd(qs, kc, vc, cuq, sl, max(take), scale, block_table=bt)
            want = torch.cat([o[s + n - t : s + n] for s, n, t in zip(starts, lens, take)])
            assert torch.equal(got, want), (bs, take)


@pytest.mark.parametrize("dtype,N,Kh,H", [(torch.bfloat16, 16, 4, 256), (torch.float32, 32, 8, 128)])
def test_bi_attention_split_kv_decode_equals_packed(dtype: torch.dtype, N: int, Kh: int, H: int) -> None:
    """Decode queries at positions around the split boundaries, reduced by 1 (per-tile), 2, 7 or the launch's
    own number of split programs, equal the trainer's packed launch bit for bit; fp32 (full-precision dots,
    fp32 output) shows any difference of the fold that a bf16 output's rounding could hide; one sequence of
    40 000 keys (79 splits) decoded at its end."""
    from titan_rl_ext.kernels.attention_triton import SPLIT, bi_attention_fwd

    lens = [2 * SPLIT + 76, SPLIT + 1, SPLIT, 40_000]
    q, k, v, cu = _qkv(lens, N, Kh, H, seed=5)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    scale = H**-0.5
    o = bi_attention_fwd(q, k, v, cu, cu[1:] - cu[:-1], max(lens), scale, k_start=cu[:-1])
    kc, vc, bt = _paged(k, v, lens, 544, seed=11)
    starts = cu[:-1].tolist()
    cuq = torch.arange(len(lens) + 1, dtype=torch.int32, device=DEV)
    for pos in (SPLIT - 1, SPLIT, SPLIT + 1, 2 * SPLIT - 1, 2 * SPLIT, 2 * SPLIT + 75, 39_999):
        d_lens = [min(pos + 1, n) for n in lens]
        qs = torch.cat([q[s + n - 1 : s + n] for s, n in zip(starts, d_lens)])
        want = torch.cat([o[s + n - 1 : s + n] for s, n in zip(starts, d_lens)])
        sl = torch.tensor(d_lens, dtype=torch.int32, device=DEV)
        for progs in (None, 1, 2, 7):
            got = bi_attention_fwd(qs, kc, vc, cuq, sl, 1, scale, block_table=bt, split_programs_override=progs)
            assert torch.equal(got, want), (dtype, pos, progs)


def test_packed_attention_backward_and_flash_forward_against_float64() -> None:
    from titan_rl_ext.kernels.batch_invariant import batch_invariant
    from titan_rl_ext.kernels.varlen_attention import flash_usable, packed_causal_attention

    lens = [300, 1, 700, 45]
    N, Kh, H = 16, 4, 256
    q, k, v, cu = _qkv(lens, N, Kh, H, seed=1, grad=True)
    assert flash_usable(q), "torch's FlashAttention should take bf16 head_dim 256 on this GPU"
    scale = H**-0.5
    gy = torch.randn_like(q)
    ins64 = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref = causal_attention_reference(*ins64, lens, scale)
    ref.backward(gy.double())
    for bi_on in (True, False):
        with batch_invariant(bi_on):
            o = packed_causal_attention(q, k, v, cu, max(lens), scale)
        o.backward(gy)
        errs = [_rel(o.detach(), ref.detach())] + [_rel(t.grad, r.grad) for t, r in zip((q, k, v), ins64)]
        print(f"\n  packed attention BI={bi_on}: rel err out {errs[0]:.1e}, dq {errs[1]:.1e}, dk {errs[2]:.1e}, dv {errs[3]:.1e}")
        assert max(errs) < 2e-2, errs  # bf16 operands (2^-8 per element), fp32 accumulation
        for t in (q, k, v):
            t.grad = None


def test_fused_head_bits_and_gradient_error() -> None:
    from titan_rl_ext.kernels.batch_invariant import batch_invariant
    from titan_rl_ext.kernels.lm_head import head_logits_fp32, token_logprobs_fused

    g = torch.Generator(device=DEV).manual_seed(2)
    D, V = 4096, 248320
    w = (torch.randn(V, D, device=DEV, generator=g) * 0.02).bfloat16()
    h = torch.randn(1024, D, device=DEV, generator=g).bfloat16()
    tgt = torch.randint(0, V, (1024,), device=DEV, generator=g)
    with batch_invariant(True):
        lp = token_logprobs_fused(h, w, tgt)
        for a, n in ((0, 1), (5, 7), (100, 256), (0, 1024)):  # decode-sized and prefill-sized row counts
            full = head_logits_fp32(h[a : a + n], w).log_softmax(-1, dtype=torch.float32)
            assert torch.equal(full.gather(1, tgt[a : a + n, None]).squeeze(1), lp[a : a + n]), (a, n)
    # gradient error of the bf16 backward, against float64 (smaller vocabulary: the reference is dense)
    Vs, T = 32768, 256
    ws, hs, ts = w[:Vs].clone(), h[:T].clone(), tgt[:T] % Vs
    gl = torch.randn(T, device=DEV, generator=g)
    hh, ww = hs.clone().requires_grad_(True), ws.clone().requires_grad_(True)
    (token_logprobs_fused(hh, ww, ts) * gl).sum().backward()
    h64, w64 = hs.double().requires_grad_(True), ws.double().requires_grad_(True)
    lp64 = (h64 @ w64.t()).log_softmax(-1).gather(1, ts[:, None]).squeeze(1)
    (lp64 * gl.double()).sum().backward()
    e_h, e_w = _rel(hh.grad, h64.grad), _rel(ww.grad, w64.grad)
    print(f"\n  fused head bf16 backward vs float64: rel err dh {e_h:.1e}, dW {e_w:.1e}")
    assert e_h < 1e-2 and e_w < 1e-2, (e_h, e_w)


@pytest.mark.parametrize("V", [248320, 151936, 128256, 32000, 16384, 16388])  # Qwen3.5, Qwen3, Llama 3, Llama 2
def test_head_log_softmax_stats_equal_torch(V: int) -> None:
    """torch's CUDA log-softmax replicated: the probe finds a build variant that gives ``torch.log_softmax``'s bits
    on every column of 512 rows (logit-like spreads from 0.1 to 30, spikes, rows whose exponentials underflow into
    denormals); each variant's count and the plain-PyTorch emulation's are printed."""
    from titan_rl_ext.kernels.lm_head import _probe_variant
    from titan_rl_ext.kernels.log_softmax import log_softmax_stats_reference
    from titan_rl_ext.kernels.log_softmax_triton import VARIANTS, log_softmax_stats

    g = torch.Generator(device=DEV).manual_seed(V)
    scale = torch.logspace(-1, 1.5, 512, device=DEV)[:, None]
    x = torch.randn(512, V, device=DEV, generator=g) * scale
    x[::7, V // 5] += 50.0
    x[3::11, : V // 3] -= 100.0  # exp(x - max) in [2^-149, 2^-126): denormals in torch's sum
    tgt = torch.randint(0, V, (512,), device=DEV, generator=g)
    want = x.log_softmax(-1)
    variant = _probe_variant(torch.device(DEV, torch.cuda.current_device()), V)
    for v in VARIANTS:  # what each build variant gives; the probe's choice must give torch's bits
        _, m, logsum = log_softmax_stats(x, **v)
        print(f"\n  V={V} {v}: rows differing from torch.log_softmax "
              f"{int((((x - m[:, None]) - logsum[:, None]) != want).any(1).sum())}/512", end="")
    print(f"\n  probe's choice: {variant}")
    assert variant is not None
    lp, m, logsum = log_softmax_stats(x, tgt, **variant)
    got = (x - m[:, None]) - logsum[:, None]
    assert torch.equal(got, want)
    assert torch.equal(lp, want.gather(1, tgt[:, None]).squeeze(1))
    # the plain-PyTorch emulation of the order, elementwise exp and adds as separate kernels: reported, not
    # asserted (whether nvcc contracted expf's last multiply into torch's sum shows here as a difference)
    m_ref, logsum_ref = log_softmax_stats_reference(x[:64])
    ref = (x[:64] - m_ref[:, None]) - logsum_ref[:, None]
    print(f"  emulation in torch ops: rows differing from torch.log_softmax {int((ref != want[:64]).any(1).sum())}/64")


def test_head_through_stats_kernel_equals_torch_log_softmax(monkeypatch: pytest.MonkeyPatch) -> None:
    """``token_logprobs_fused`` with the statistics kernel vs with torch's log-softmax (``_lse_variant`` says None):
    the same logprob bits (BI and not) and the same gradient bits. The kernel must have run in the first and not
    in the second: were the probe to find no variant, both would be torch's and equal for nothing."""
    from titan_rl_ext.kernels.batch_invariant import batch_invariant
    from titan_rl_ext.kernels import lm_head, log_softmax_triton
    from titan_rl_ext.kernels.lm_head import token_logprobs_fused

    calls = [0]
    kernel = log_softmax_triton.log_softmax_stats

    def counted(x_TV: torch.Tensor, targets_T: torch.Tensor | None = None, **kwargs: bool | int
                ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        calls[0] += targets_T is not None  # the head's calls; the variant probe's pass no targets
        return kernel(x_TV, targets_T, **kwargs)

    # the head imports the kernel at each call, so the module's attribute is what it runs
    monkeypatch.setattr(log_softmax_triton, "log_softmax_stats", counted)

    g = torch.Generator(device=DEV).manual_seed(7)
    D, V, T = 1024, 151936, 768
    w0 = (torch.randn(V, D, device=DEV, generator=g) * 0.03).bfloat16()
    h0 = torch.randn(T, D, device=DEV, generator=g).bfloat16()
    tgt = torch.randint(0, V, (T,), device=DEV, generator=g)
    gl = torch.randn(T, device=DEV, generator=g)

    def run(bi_on: bool) -> tuple[torch.Tensor, ...]:
        h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        with batch_invariant(bi_on):
            lp = token_logprobs_fused(h, w, tgt)
        (lp * gl).sum().backward()
        return lp.detach(), h.grad, w.grad

    for bi_on in (True, False):
        calls[0] = 0
        fast = run(bi_on)
        assert calls[0] > 0, bi_on  # the statistics kernel computed the head's log-softmax
        with monkeypatch.context() as m:
            m.setattr(lm_head, "_lse_variant", lambda logits: None)
            calls[0] = 0
            ref = run(bi_on)
            assert calls[0] == 0, bi_on  # and the reference did not
        assert all(torch.equal(a, b) for a, b in zip(fast, ref)), bi_on


@pytest.mark.parametrize("lens", [LENS_9B, [5000, 11384]])
def test_fla_chunk_backward_gradients_against_float64(lens: list[int]) -> None:
    """The gradient the BI GDN backward uses (FLA chunk, guard overridden) vs a float64 chunked reference,
    at Qwen3.5-9B GDN heads (16 key / 32 value heads x 128), bf16 inputs as the layer passes them."""
    if importlib.util.find_spec("fla") is None:
        pytest.skip("needs fla")
    from titan_rl_ext.kernels.gdn import allow_fla_chunk_backward, chunk_gated_delta_rule_torch, gated_delta_rule_bi

    print(f"\n  FLA #640 guard: {allow_fla_chunk_backward()}")
    g = torch.Generator(device=DEV).manual_seed(3)
    T, H, HV, K = sum(lens), 16, 32, 128
    q = F.normalize(torch.randn(T, H, K, device=DEV, generator=g), dim=-1).bfloat16()
    k = F.normalize(torch.randn(T, H, K, device=DEV, generator=g), dim=-1).bfloat16()
    v = torch.randn(T, HV, K, device=DEV, generator=g).bfloat16()
    gate = -F.softplus(torch.randn(T, HV, device=DEV, generator=g)) * 0.3
    beta = torch.rand(T, HV, device=DEV, generator=g).bfloat16()
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    w_o = torch.randn(T, HV, K, device=DEV, generator=g)
    scale = K**-0.5
    ins = [t.clone().requires_grad_(True) for t in (q, k, v, gate, beta)]
    o, _ = gated_delta_rule_bi(*ins, cu, scale)
    (o.float() * w_o).sum().backward()
    ref_in = [t.detach().double().requires_grad_(True) for t in (q, k, v, gate, beta)]
    o64, _ = chunk_gated_delta_rule_torch(*ref_in, cu, scale, compute_dtype=torch.float64)
    (o64 * w_o.double()).sum().backward()
    errs = {n: _rel(a.grad, b.grad) for n, a, b in zip("q k v g beta".split(), ins, ref_in)}
    print(f"  FLA chunk backward, T={T} {lens}: rel err vs float64 " + ", ".join(f"d{n} {e:.1e}" for n, e in errs.items()))
    assert _rel(o.detach(), o64.detach()) < 1e-2
    assert all(e < 2e-2 for e in errs.values()), errs  # bf16 inputs and intermediates; #640 gives O(1)
