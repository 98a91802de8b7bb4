"""GPU: batch-invariant (BI) mode on CUDA -- the Triton GEMM and row reductions, the recurrent-forward /
chunked-backward gated delta rule, and the whole titan Qwen3.5 model (trainer logprobs == generator
logprobs, bit for bit). Skipped where there is no CUDA device (GDN/model tests also need ``fla``).

Run on the GPU machine:  python -m pytest -q -s tests/gpu/test_batch_invariant_cuda.py

Tolerances against float64 (probe rows, per element, K = reduction length):
- GEMM, bf16 output: |y - y64| <= 2^-8 |y64| + K 2^-24 (|x| @ |w|)  -- half a bf16 ulp (round to
  nearest) plus the worst-case fp32 accumulation error; fp32 output: 2^-24 |y64| + K 2^-24 (|x| @ |w|).
- row sums of squares (all terms >= 0): relative 1e-5 (the bound is (D/BLOCK + log2 BLOCK) 2^-24).
"""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]


def _fla_available() -> bool:
    from titan_rl_ext.kernels.gdn import fla_available

    return fla_available()


needs_fla = pytest.mark.skipif(not torch.cuda.is_available() or not _fla_available(), reason="needs fla")

DEV = "cuda"
N_PROBES = 8
ALL_ROWS = list(range(1, 2049))

# Qwen3.5-9B projections as (K, N) of y = x @ W^T with W [N, K]; hidden 4096. The model merges the
# projections of one input (ops.MergedLinear), so these are its GEMMs; k_proj/v_proj-sized and
# in_proj_a/b-sized N stay as the narrow cases (a Qwen3.5 checkpoint without the merge would run them).
GEMM_SHAPES = {
    "gdn.in_proj(qkv+z+b+a)": (4096, 12352),  # 2*16*128 + 32*128 + 32*128 + 2*32
    "attn.wqkv(q+gate, k, v)": (4096, 10240),  # 16 heads * 256 * 2 + 2 * 4 * 256
    "gdn.out_proj/attn.wo": (4096, 4096),
    "narrow N=1024 (k/v)": (4096, 1024),
    "narrow N=32 (a/b)": (4096, 32),
    "mlp.w13(gate+up)": (4096, 24576),
    "mlp.w2": (12288, 4096),
}
LM_HEAD = (4096, 248_320)
LM_HEAD_ROWS = list(range(1, 257)) + list(range(257, 2049, 13)) + [2048]
LM_HEAD_ROWS_FP32 = list(range(1, 65)) + [100, 127, 128, 129, 255, 256, 257, 511, 1000, 1024, 2048]


def _probe_positions(M: int) -> tuple[list[int], list[int]]:
    """Where the probes go in an M-row batch (distinct, spread out, offsets varying with M) and
    which probe goes where."""
    p = min(N_PROBES, M)
    span = M // p
    pos = [(i * M) // p + (M * 31 + i * 17) % span for i in range(p)]
    idx = [(i + M) % N_PROBES for i in range(p)]
    return pos, idx


def _sweep_rows(fn, probes: torch.Tensor, filler: torch.Tensor, rows: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    """``fn`` maps [M, ...] -> [M, ...] row-wise. Returns the M for which some probe row's result
    differs (bitwise) from its result in the batch of the probes alone."""
    ref = fn(probes)
    bad = torch.zeros(max(rows) + 1, dtype=torch.bool, device=DEV)
    for M in rows:
        pos, idx = _probe_positions(M)
        pos_t = torch.tensor(pos, device=DEV)
        idx_t = torch.tensor(idx, device=DEV)
        x = filler[:M].clone()
        x[pos_t] = probes[idx_t]
        y = fn(x)
        bad[M] = (y[pos_t] != ref[idx_t]).any()
    return bad.nonzero().flatten().tolist()


def _gemm_bound(x: torch.Tensor, w_NK: torch.Tensor, y64: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    half_ulp = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}[out_dtype]
    K = x.shape[1]
    return half_ulp * y64.abs() + K * 2.0**-24 * (x.double().abs() @ w_NK.double().abs().t()) + 1e-30


def _gemm_case(K: int, N: int, dtype: torch.dtype, rows: list[int], seed: int = 0) -> None:
    from titan_rl_ext.kernels import batch_invariant as bi

    assert bi._triton() is not None, "triton must be importable: CUDA bi.mm would fall back to the torch path"
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = (torch.randn(N, K, device=DEV, generator=g) * K**-0.5).to(dtype)
    probes = torch.randn(N_PROBES, K, device=DEV, generator=g).to(dtype)
    filler = torch.randn(max(rows), K, device=DEV, generator=g).to(dtype)
    t0 = time.time()
    bad = _sweep_rows(lambda x: bi.linear(x, w), probes, filler, rows)  # the dispatch the model layers use
    dt = time.time() - t0
    assert not bad, f"K={K} N={N} {dtype}: probe rows changed bits at M in {bad[:20]} ({len(bad)} of {len(rows)})"
    y = bi.linear(probes, w)
    y64 = probes.double() @ w.double().t()
    err = (y.double() - y64).abs()
    bound = _gemm_bound(probes, w, y64, dtype)
    assert (err <= bound).all(), f"max err {err.max().item():.3e}, worst err/bound {(err / bound).max().item():.3f}"
    print(f"\n  K={K} N={N} {dtype}: {len(rows)} row counts bit-identical in {dt:.1f}s; "
          f"max |err| vs fp64 {err.max().item():.2e} (max err/bound {(err / bound).max().item():.2f})")


@pytest.mark.parametrize("name", list(GEMM_SHAPES))
def test_bi_gemm_invariant_all_row_counts_bf16(name: str) -> None:
    K, N = GEMM_SHAPES[name]
    _gemm_case(K, N, torch.bfloat16, ALL_ROWS)


# the trainer's and a prefill's row counts, across every M-bucket bound a tile table may have (issue 25: invariant
# at every row count 1..16384 on every shape both sides use)
LARGE_ROWS = [1023, 1024, 1025, 2047, 2049, 3001, 4095, 4096, 4097, 8191, 8192, 8193, 12289, 16383, 16384]


@pytest.mark.parametrize("name", list(GEMM_SHAPES))
def test_bi_gemm_invariant_large_row_counts_bf16(name: str) -> None:
    K, N = GEMM_SHAPES[name]
    _gemm_case(K, N, torch.bfloat16, LARGE_ROWS)


def test_bi_gemm_lm_head_bf16() -> None:
    _gemm_case(*LM_HEAD, torch.bfloat16, LM_HEAD_ROWS)


def test_bi_gemm_lm_head_fp32() -> None:
    """The model's head runs in fp32 (``logits(h, fp32=True)``): ieee fp32 dot, no TF32."""
    _gemm_case(*LM_HEAD, torch.float32, LM_HEAD_ROWS_FP32)


def test_bi_gemm_lm_head_fp32_over_bf16_weight() -> None:
    """The fp32 head over a bf16 weight (``Decoder.logits(fp32=True)`` in BI mode): the kernel widens the
    weight per tile -- bit for bit the GEMM of an fp32 copy, batch invariant, and no fp32 copy of the
    4 GB head is allocated."""
    from titan_rl_ext.kernels import batch_invariant as bi
    from titan_rl_ext.kernels.batch_invariant_triton import bi_matmul

    K, N = LM_HEAD
    g = torch.Generator(device=DEV).manual_seed(5)
    w = (torch.randn(N, K, device=DEV, generator=g) * K**-0.5).to(torch.bfloat16)
    x = torch.randn(64, K, device=DEV, generator=g)
    y = bi.linear(x, w)
    assert y.dtype == torch.float32
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y2 = bi.linear(x, w)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= y2.numel() * 4 + (64 << 20), f"{extra / 2**30:.2f} GiB allocated: the weight was copied"
    assert torch.equal(y, bi_matmul(x, w.float().t()))
    for M in (1, 7, 33):
        assert torch.equal(bi.linear(x[:M], w), y[:M])


def test_bi_gemm_lm_head_bf16_operands_fp32_output() -> None:
    """The model's fp32 head on CUDA (``head_logits_fp32`` in BI mode): bf16 hidden states and weight on
    the tensor cores, fp32 accumulator stored as is. Probe rows bit-identical at every row count swept
    (decode sizes 1..256 all of them), fp32-accurate against float64."""
    from titan_rl_ext.kernels.batch_invariant import batch_invariant
    from titan_rl_ext.kernels.lm_head import head_logits_fp32

    K, N = LM_HEAD
    g = torch.Generator(device=DEV).manual_seed(6)
    w = (torch.randn(N, K, device=DEV, generator=g) * K**-0.5).bfloat16()
    probes = torch.randn(N_PROBES, K, device=DEV, generator=g).bfloat16()
    filler = torch.randn(max(LM_HEAD_ROWS), K, device=DEV, generator=g).bfloat16()
    with batch_invariant(True):
        bad = _sweep_rows(lambda x: head_logits_fp32(x, w), probes, filler, LM_HEAD_ROWS)
        y = head_logits_fp32(probes, w)
    assert not bad, f"fp32-output head changed probe bits at M in {bad[:20]} ({len(bad)} of {len(LM_HEAD_ROWS)})"
    assert y.dtype == torch.float32
    y64 = probes.double() @ w.double().t()
    err = (y.double() - y64).abs()
    bound = _gemm_bound(probes, w, y64, torch.float32)
    assert (err <= bound).all(), f"max err {err.max().item():.3e}, worst err/bound {(err / bound).max().item():.3f}"
    print(f"\n  fp32-output head bf16 operands: {len(LM_HEAD_ROWS)} row counts bit-identical; max |err| vs fp64 "
          f"{err.max().item():.2e} (max err/bound {(err / bound).max().item():.2f})")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_bi_gemm_other_dtypes(dtype: torch.dtype) -> None:
    _gemm_case(4096, 1024, dtype, list(range(1, 300)) + [511, 512, 513, 1000, 2048])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_gemm_matches_torch_reference(dtype: torch.dtype) -> None:
    """The Triton GEMM against the plain-PyTorch BI GEMM (``bi.mm_torch``), odd shapes included."""
    from titan_rl_ext.kernels import batch_invariant as bi
    from titan_rl_ext.kernels.batch_invariant_triton import bi_matmul

    g = torch.Generator(device=DEV).manual_seed(3)
    for M, K, N in ((1, 4096, 4096), (37, 1000, 333), (300, 12288, 4096), (2048, 4096, 1024), (5, 17, 3)):
        a = torch.randn(M, K, device=DEV, generator=g).to(dtype)
        w = (torch.randn(N, K, device=DEV, generator=g) * K**-0.5).to(dtype)
        y = bi_matmul(a, w.t())
        ref = bi.mm_torch(a.float(), w.float().t())  # fp32 reference (TF32 off by default)
        # bf16: both within half an ulp of the same fp32 value -> at most 1 bf16 ulp apart
        # fp32: two summation orders over K up to 12288 differ by ~K*2^-24*|x||w|, ~1e-4 relative
        rtol, atol = (2.0**-7, 1e-4) if dtype == torch.bfloat16 else (1e-4, 1e-4)
        torch.testing.assert_close(y.float(), ref, rtol=rtol, atol=atol)
        assert torch.equal(bi.mm(a, w.t()), y)  # CUDA dispatch == the Triton kernel


def test_stock_cublas_witness() -> None:
    """Informational: how often the stock GEMM changes a row's bits with M (not asserted)."""
    g = torch.Generator(device=DEV).manual_seed(5)
    K, N = 4096, 4096
    w = (torch.randn(N, K, device=DEV, generator=g) * K**-0.5).bfloat16()
    probes = torch.randn(N_PROBES, K, device=DEV, generator=g).bfloat16()
    filler = torch.randn(2048, K, device=DEV, generator=g).bfloat16()
    rows = list(range(1, 2049, 7))
    bad = _sweep_rows(lambda x: F.linear(x, w), probes, filler, rows)
    print(f"\n  stock F.linear bf16 4096->4096: probe bits changed at {len(bad)} of {len(rows)} row counts")


# ------------------------------------------------------------------------------------------------
# row reductions (RMSNorm / l2norm statistics)


@pytest.mark.parametrize("D", [128, 256, 4096])
@pytest.mark.parametrize("kind", ["sum", "mean"])
def test_row_reductions_invariant_and_accurate(D: int, kind: str) -> None:
    from titan_rl_ext.kernels import batch_invariant as bi

    fn = bi.row_sum_sq if kind == "sum" else bi.row_mean_sq
    g = torch.Generator(device=DEV).manual_seed(6)
    probes = torch.randn(N_PROBES, D, device=DEV, generator=g) * 3
    filler = torch.randn(65536, D, device=DEV, generator=g)
    rows = ALL_ROWS + [4095, 4096, 4097, 16384, 32768 + 5, 65536]  # q/k norm: T*heads rows
    bad = _sweep_rows(fn, probes, filler, rows)
    assert not bad, f"{kind} D={D}: probe rows changed bits at row counts {bad[:20]}"
    x = torch.cat([probes, filler[:1000]])
    got = fn(x)
    ref = (x.double() ** 2).sum(-1) / (1 if kind == "sum" else D)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=0)
    # bf16 input and leading dims (the [T, H, K] layout of q/k)
    xb = filler[:96].bfloat16().view(12, 8, D)
    refb = (xb.double() ** 2).sum(-1) / (1 if kind == "sum" else D)
    torch.testing.assert_close(fn(xb).double(), refb, rtol=1e-5, atol=0)
    # stock torch reduction, for information
    stock = (lambda t: (t * t).sum(-1)) if kind == "sum" else (lambda t: t.pow(2).mean(-1))
    stock_bad = _sweep_rows(stock, probes, filler, rows)
    print(f"\n  {kind} D={D}: BI invariant over {len(rows)} row counts; stock torch differs at {len(stock_bad)}")


# ------------------------------------------------------------------------------------------------
# gated delta rule: recurrent (FLA) forward, chunked (torch) backward


def _gdn_inputs(lens: list[int], H: int = 4, HV: int = 8, K: int = 128, V: int = 128, model_dtypes: bool = True):  # type: ignore[no-untyped-def]
    """model_dtypes: q/k/g fp32 (the layer L2-normalises in fp32), v/beta bf16 -- what GatedDeltaNet passes."""
    g = torch.Generator(device=DEV).manual_seed(8)
    T = sum(lens)
    low = torch.bfloat16 if model_dtypes else torch.float32
    q = F.normalize(torch.randn(T, H, K, device=DEV, generator=g), dim=-1)
    k = F.normalize(torch.randn(T, H, K, device=DEV, generator=g), dim=-1)
    v = torch.randn(T, HV, V, device=DEV, generator=g).to(low)
    gate = -torch.rand(T, HV, device=DEV, generator=g) * 0.5
    beta = torch.rand(T, HV, device=DEV, generator=g).to(low)
    s0 = torch.randn(len(lens), HV, K, V, device=DEV, generator=g) * 0.1
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    return q, k, v, gate, beta, s0, cu, K**-0.5


@needs_fla
@pytest.mark.parametrize("grad", [False, True])
def test_gdn_bi_forward_packed_equals_alone_and_split(grad: bool) -> None:
    from titan_rl_ext.kernels.gdn import gated_delta_rule_bi

    lens = [40, 200, 7, 1]
    q, k, v, g, beta, s0, cu, scale = _gdn_inputs(lens)
    ins = [t.requires_grad_(grad) for t in (q, k, v, g, beta, s0)]
    q, k, v, g, beta, s0 = ins
    o, s = gated_delta_rule_bi(q, k, v, g, beta, cu, scale, s0, backend="fla")
    bounds = cu.tolist()
    for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        one = torch.tensor([0, b - a], dtype=torch.int32, device=DEV)
        o1, s1 = gated_delta_rule_bi(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], one, scale, s0[n : n + 1], backend="fla")
        assert torch.equal(o1, o[a:b]) and torch.equal(s1, s[n : n + 1]), n
        # generator-style: a prefill chunk, then one token at a time, state carried in between
        state, outs, t = s0[n : n + 1], [], a
        for step in [min(5, b - a)] + [1] * (b - a - min(5, b - a)):
            c = torch.tensor([0, step], dtype=torch.int32, device=DEV)
            o_c, state = gated_delta_rule_bi(q[t : t + step], k[t : t + step], v[t : t + step], g[t : t + step],
                                             beta[t : t + step], c, scale, state, backend="fla")
            outs.append(o_c)
            t += step
        assert torch.equal(torch.cat(outs), o[a:b]) and torch.equal(state, s[n : n + 1]), n
    if grad:  # the autograd path's forward is the same kernel call as the no-grad path
        with torch.no_grad():
            o_ng, s_ng = gated_delta_rule_bi(q, k, v, g, beta, cu, scale, s0, backend="fla")
        assert torch.equal(o_ng, o) and torch.equal(s_ng, s)


@needs_fla
def test_gdn_bi_gradients_match_recurrent_reference() -> None:
    """Gradients of (o, final state) through the BI function (chunked torch backward) vs autograd
    through the fp32 torch recurrent reference; fp32 inputs, small T."""
    from titan_rl_ext.kernels.gdn import gated_delta_rule_bi, recurrent_gated_delta_rule_torch

    lens = [23, 64, 5]
    base = _gdn_inputs(lens, H=2, HV=4, K=64, V=64, model_dtypes=False)
    cu, scale = base[6], base[7]
    g = torch.Generator(device=DEV).manual_seed(9)
    T = sum(lens)
    w_o = torch.randn(T, 4, 64, device=DEV, generator=g)
    w_s = torch.randn(len(lens), 4, 64, 64, device=DEV, generator=g)

    def grads(fn):  # type: ignore[no-untyped-def]
        ins = [t.detach().clone().requires_grad_(True) for t in base[:6]]
        o, s = fn(*ins[:5], cu, scale, ins[5])
        ((o.float() * w_o).sum() + (s * w_s).sum()).backward()
        return o.detach(), s.detach(), [t.grad for t in ins]

    o, s, got = grads(lambda *a: gated_delta_rule_bi(*a, backend="fla"))
    o_r, s_r, ref = grads(recurrent_gated_delta_rule_torch)
    torch.testing.assert_close(o, o_r, rtol=1e-4, atol=1e-4)  # FLA fp32 recurrent vs torch fp32
    torch.testing.assert_close(s, s_r, rtol=1e-4, atol=1e-4)
    # the backward is FLA's chunk kernel, whose fp32 dots run in TF32 (10-bit mantissa): relative
    # norm errors near 1e-3 are its precision; FLA #640's miscompile gives O(1)
    errs = {n: ((a - b).norm() / b.norm().clamp_min(1e-30)).item() for n, a, b in zip("q k v g beta s0".split(), got, ref)}
    print("\n  BI GDN backward (FLA chunk) vs fp32 recurrent autograd: " + ", ".join(f"d{n} {e:.1e}" for n, e in errs.items()))
    assert all(e < 1e-2 for e in errs.values()), errs


# ------------------------------------------------------------------------------------------------
# whole model: trainer logprobs vs a generator-style run


def _model_9b_shapes():  # type: ignore[no-untyped-def]
    from titan_rl_ext.models.qwen3_5.gdn import GDNConfig
    from titan_rl_ext.models.qwen3_5.model import Qwen3_5Config, hybrid_layer_types

    cfg = Qwen3_5Config(
        vocab_size=4096, dim=4096, n_layers=4, n_heads=16, n_kv_heads=4, head_dim=256, ffn_dim=12288,
        rope_theta=1e7, partial_rotary_factor=0.25, layer_types=hybrid_layer_types(4, 4),
        gdn=GDNConfig(16, 32, 128, 128, 4),
    )
    torch.manual_seed(0)
    with torch.device(DEV):
        model = cfg.build()
    model = model.to(torch.bfloat16)
    model.init_weights()
    return cfg, model


# Every sequence needs the same number of generator steps (ceil(P / 32) prefill + L - P decode = 40),
# so no step carries a zero-length sequence; prefill and decode steps still mix within a step.
LENS = [78, 59, 136, 44, 40]
PROMPTS = [40, 20, 100, 5, 1]
PREFILL_CHUNK = 32


def _trainer_logprobs(model, toks: torch.Tensor, backward: bool) -> torch.Tensor:  # type: ignore[no-untyped-def]
    from titan_rl_ext.models.common.batch import SeqBatch
    from titan_rl_ext.rl.logprobs import token_logprobs

    lp = token_logprobs(model, toks, SeqBatch.from_lengths(LENS, device=DEV))
    if backward:
        lp.nansum().backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(gr).all() for gr in grads)
        model.zero_grad(set_to_none=True)
    return lp.detach()


@torch.no_grad()
def _generator_logprobs(model, toks: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """vLLM-style schedule: all sequences in every step, chunked prefill (<= PREFILL_CHUNK tokens of a
    prompt per step) mixed with single-token decode steps of the sequences already past their prompt."""
    from titan_rl_ext.models.common.batch import SeqBatch

    starts = [0, *torch.tensor(LENS).cumsum(0).tolist()]
    states = model.init_states(len(LENS))
    done = [0] * len(LENS)
    rows: list[list[torch.Tensor]] = [[] for _ in LENS]
    while any(d < L for d, L in zip(done, LENS)):
        n_new = [min(PREFILL_CHUNK, P - d) if d < P else min(1, L - d) for d, P, L in zip(done, PROMPTS, LENS)]
        t = torch.cat([toks[starts[i] + done[i] : starts[i] + done[i] + n_new[i]] for i in range(len(LENS))])
        h, states = model.hidden(t, SeqBatch.from_lengths(n_new, done, device=DEV), states)
        lp = model.logits(h, fp32=True).log_softmax(dim=-1, dtype=torch.float32)
        for i, c in enumerate(lp.split(n_new)):
            rows[i].append(c)
            done[i] += n_new[i]
    out = torch.full((sum(LENS),), float("nan"), device=DEV)
    for i in range(len(LENS)):
        lp_i = torch.cat(rows[i])  # [L, V]: row j predicts token j + 1
        tok_i = toks[starts[i] : starts[i + 1]]
        out[starts[i] + 1 : starts[i + 1]] = lp_i[:-1].gather(1, tok_i[1:, None]).squeeze(1)
    return out


def _compare(model, cfg, bi_on: bool, backward: bool) -> tuple[int, float, int]:  # type: ignore[no-untyped-def]
    from titan_rl_ext.kernels.batch_invariant import batch_invariant

    g = torch.Generator(device=DEV).manual_seed(10)
    toks = torch.randint(0, cfg.vocab_size, (sum(LENS),), device=DEV, generator=g)
    with batch_invariant(bi_on):
        train = _trainer_logprobs(model, toks, backward)
        gen = _generator_logprobs(model, toks)
    nan_t, nan_g = train.isnan(), gen.isnan()
    assert torch.equal(nan_t, nan_g), "first-token NaN pattern differs"
    valid = ~nan_t
    diff = (train[valid] - gen[valid]).abs()
    return int((diff != 0).sum()), diff.max().item(), int(valid.sum())


@needs_fla
def test_model_trainer_vs_generator_logprobs_bit_identical() -> None:
    """Qwen3.5-9B layer shapes, 4 layers (3 GDN + 1 gated full attention), bf16, vocab 4096."""
    cfg, model = _model_9b_shapes()
    t0 = time.time()
    n_bad, max_diff, n = _compare(model, cfg, bi_on=True, backward=True)
    t_bi = time.time() - t0
    off_bad, off_max, _ = _compare(model, cfg, bi_on=False, backward=False)
    print(f"\n  BI on : {n_bad}/{n} token logprobs differ, max |diff| {max_diff:.3e} ({t_bi:.1f}s)"
          f"\n  BI off: {off_bad}/{n} token logprobs differ, max |diff| {off_max:.3e}")
    assert n_bad == 0, f"BI on: {n_bad}/{n} token logprobs differ between trainer and generator (max {max_diff:.3e})"
