"""The fused fp32 head (``kernels.lm_head``): the sampled token's logprob in row chunks, equal bit for bit to
``log_softmax`` of the full fp32 logits (what the generator's sampler computes), and its backward."""

from __future__ import annotations

import pytest
import torch

from titan_rl_ext.kernels import lm_head
from titan_rl_ext.kernels.batch_invariant import batch_invariant
from titan_rl_ext.models.common.batch import SeqBatch
from titan_rl_ext.models.flavors import FLAVORS
from titan_rl_ext.rl.logprobs import logprobs_from_logits, token_logprobs


def _inputs(T: int = 45, D: int = 24, V: int = 97, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, D, generator=g)
    w = torch.randn(V, D, generator=g) * 0.3
    tgt = torch.randint(0, V, (T,), generator=g)
    return h, w, tgt


@pytest.mark.parametrize("chunk_rows", [7, 1000])  # several chunks with a ragged last one, and one chunk
def test_fused_logprobs_equal_full_log_softmax_in_bi_mode(monkeypatch: pytest.MonkeyPatch, chunk_rows: int) -> None:
    h, w, tgt = _inputs()
    monkeypatch.setattr(lm_head, "CHUNK_BYTES", chunk_rows * 4 * w.shape[0])
    assert lm_head.chunk_rows(w.shape[0]) == chunk_rows
    with batch_invariant(True):
        lp = lm_head.token_logprobs_fused(h, w, tgt)
        full = logprobs_from_logits(lm_head.head_logits_fp32(h, w)).gather(1, tgt[:, None]).squeeze(1)
    assert lp.dtype == torch.float32 and torch.equal(lp, full)


@pytest.mark.parametrize("kept_chunks", [0, 2, 6])  # recompute every chunk's logits / the first two kept / all kept
def test_fused_logprobs_backward_matches_autograd_of_the_full_head(monkeypatch: pytest.MonkeyPatch, kept_chunks: int) -> None:
    h, w, tgt = _inputs(seed=1)
    monkeypatch.setattr(lm_head, "CHUNK_BYTES", 8 * 4 * w.shape[0])  # 45 rows: 6 chunks of 8 rows, the last ragged
    monkeypatch.setattr(lm_head, "SAVE_BYTES", kept_chunks * 8 * 4 * w.shape[0])
    g_T = torch.randn(h.shape[0], generator=torch.Generator().manual_seed(2))
    g_T[3] = 0.0  # an unused row (a sequence's last token) contributes nothing
    grads = []
    real_linear = torch.nn.functional.linear
    for fused in (True, False):
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        if fused:
            lp = lm_head.token_logprobs_fused(hh, ww, tgt)
        else:
            lp = (hh @ ww.t()).log_softmax(-1).gather(1, tgt[:, None]).squeeze(1)
        gemms: list[int] = []
        if fused:  # the logits GEMMs the backward runs: one per chunk it did not keep
            monkeypatch.setattr(lm_head.F, "linear", lambda *a, **k: gemms.append(1) or real_linear(*a, **k))
        (lp * g_T).sum().backward()
        monkeypatch.setattr(lm_head.F, "linear", real_linear)
        assert len(gemms) == (6 - kept_chunks if fused else 0)
        grads.append((hh.grad, ww.grad))
    # fp32 on both sides, reductions over V=97 / T=45 terms of size O(1): 1e-5 covers fp32 rounding
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[0][1], grads[1][1], atol=1e-5, rtol=1e-5)


def test_nothing_is_kept_for_a_backward_that_cannot_come(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under no_grad (the parity and stale-gap recomputes) the forward keeps no log-softmax chunk: it would
    only raise the peak memory."""
    h, w, tgt = _inputs(seed=3)
    kept: list[bool] = []
    real = lm_head._TokenLogprobs.forward
    monkeypatch.setattr(lm_head._TokenLogprobs, "forward",
                        staticmethod(lambda ctx, *a: (kept.append(a[-1]), real(ctx, *a))[1]))
    hh = h.clone().requires_grad_(True)
    with torch.no_grad():
        lm_head.token_logprobs_fused(hh, w, tgt)
    lm_head.token_logprobs_fused(hh, w, tgt)
    lm_head.token_logprobs_fused(h, w, tgt)  # nothing requires grad
    assert kept == [False, True, False]


def test_fused_logprobs_refuse_bad_shapes() -> None:
    h, w, tgt = _inputs()
    with pytest.raises(ValueError, match="expected h"):
        lm_head.token_logprobs_fused(h, w[:, :5], tgt)
    with pytest.raises(ValueError, match="targets must be"):
        lm_head.token_logprobs_fused(h, w, tgt[:-1])


def test_token_logprobs_equal_the_unfused_formula_bit_for_bit() -> None:
    cfg = FLAVORS["qwen3_5-debug"]
    torch.manual_seed(0)
    model = cfg.build()
    model.init_weights()
    lens = [9, 1, 17]
    toks = torch.randint(0, cfg.vocab_size, (sum(lens),))
    batch = SeqBatch.from_lengths(lens)
    with torch.no_grad(), batch_invariant(True):
        lp = token_logprobs(model, toks, batch)
        lp_TV = logprobs_from_logits(model.packed_logits(toks, batch, fp32=True))
    starts = {0, 9, 10}
    for t in range(sum(lens)):
        if t in starts:
            assert torch.isnan(lp[t])
        else:
            assert torch.equal(lp[t], lp_TV[t - 1, toks[t]]), t


def test_chunks_are_balanced_tile_aligned_and_within_the_cap() -> None:
    """The head's row chunks cover [0, T) in order, none above ``chunk_rows``, as few as that allows, balanced and
    multiples of 128 rows where that fits (the 9B head at T = 8192: two of 4096, not 4323 + 3869)."""
    V = 248320
    cap = lm_head.chunk_rows(V)
    assert lm_head.chunk_bounds(8192, V) == [(0, 4096), (4096, 8192)]
    assert lm_head.chunk_bounds(9000, V) == [(0, 3072), (3072, 6144), (6144, 9000)]
    assert lm_head.chunk_bounds(100, V) == [(0, 100)] and lm_head.chunk_bounds(0, V) == []
    for T in (1, 127, 4323, 4324, 20000, 65537):
        b = lm_head.chunk_bounds(T, V)
        assert b[0][0] == 0 and b[-1][1] == T and all(x[1] == y[0] for x, y in zip(b, b[1:]))
        assert all(0 < r1 - r0 <= cap for r0, r1 in b) and len(b) == -(-T // cap)


def test_probe_picks_the_build_variant_with_torchs_bits_or_falls_back(monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """The statistics kernel stands in for torch's log-softmax only in a build variant whose bits a probe finds
    equal to torch's: the first such variant is kept; a kernel that rounds one value differently in every variant,
    or that raises (a Triton that cannot build it), leaves torch's kernel on. Here "torch's" log-softmax is the
    reference's (x - max) - logsum, and the fake kernels return those."""
    from titan_rl_ext.kernels import log_softmax_triton as lst
    from titan_rl_ext.kernels.log_softmax import MIN_V, log_softmax_stats_reference

    monkeypatch.setattr(lm_head, "torch_log_softmax",
                        lambda x: (lambda m, ls: (x - m[:, None]) - ls[:, None])(*log_softmax_stats_reference(x)))

    def exact_without_fusion(x: torch.Tensor, targets: torch.Tensor | None = None, *, fp_fusion: bool = True,
                             ftz: bool = False) -> tuple[None, torch.Tensor, torch.Tensor]:
        m, logsum = log_softmax_stats_reference(x)
        if fp_fusion:  # this "build" matches torch only without contraction
            logsum = torch.nextafter(logsum, torch.full_like(logsum, float("inf")))
        return None, m, logsum

    def off_by_one_ulp(x: torch.Tensor, targets: torch.Tensor | None = None, **variant: bool) -> tuple[None, torch.Tensor, torch.Tensor]:
        m, logsum = log_softmax_stats_reference(x)
        return None, m, torch.nextafter(logsum, torch.full_like(logsum, float("inf")))

    def broken(x: torch.Tensor, targets: torch.Tensor | None = None, **variant: bool) -> None:
        raise RuntimeError("PassManager::run failed")

    cases = ((exact_without_fusion, {"fp_fusion": False, "ftz": False}), (off_by_one_ulp, None), (broken, None))
    try:
        for fn, want in cases:
            lm_head._probe_variant.cache_clear()
            monkeypatch.setattr(lst, "log_softmax_stats", fn)
            assert lm_head._probe_variant(torch.device("cpu"), MIN_V) == want, fn.__name__
    finally:
        lm_head._probe_variant.cache_clear()
    assert "failed" in caplog.text and "no build" in caplog.text
