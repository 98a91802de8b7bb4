"""Hand-computed checks of the policy-gradient losses in titan_rl_ext.rl.losses (torch only, CPU, fast)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from titan_rl_ext.rl.losses.base import Configurable, MismatchCorrection, PolicyLoss
from titan_rl_ext.rl.losses.dapo import DAPOLoss
from titan_rl_ext.rl.losses.dppo import DPPOLoss
from titan_rl_ext.rl.losses.grpo import GRPOLoss

F32 = torch.float32


def exact_log(target: float | torch.Tensor) -> torch.Tensor:
    """A float32 x with ``torch.exp(x) == target`` bit for bit (target rounded to float32), so
    boundary tests hit the threshold exactly instead of within rounding."""
    t = torch.as_tensor(target, dtype=F32)
    x = torch.log(t.double()).float()
    for _ in range(200):
        e = torch.exp(x)
        if e == t:
            return x
        x = torch.nextafter(x, torch.tensor(math.inf if e < t else -math.inf, dtype=F32))
    raise AssertionError(f"no float32 log for {float(t)!r}")


def above(v: float) -> torch.Tensor:
    return torch.nextafter(torch.tensor(v, dtype=F32), torch.tensor(math.inf, dtype=F32))


def below(v: float) -> torch.Tensor:
    return torch.nextafter(torch.tensor(v, dtype=F32), torch.tensor(-math.inf, dtype=F32))


def run(loss_fn, lp_new_T, lp_old_T, adv_T, mask_T=None, **kw):
    """(loss, grad wrt lp_new_T, metrics)"""
    lp_new_T = lp_new_T.detach().clone().requires_grad_(True)
    if mask_T is None:
        mask_T = torch.ones(lp_new_T.shape, dtype=torch.bool)
    loss, metrics = loss_fn(lp_new_T, lp_old_T, adv_T, mask_T, **kw)
    (grad_T,) = torch.autograd.grad(loss, lp_new_T)
    return loss.detach(), grad_T, metrics


# ---------------------------------------------------------------------------------------------
# PPO clip (GRPO symmetric, DAPO asymmetric)


@pytest.mark.parametrize(
    "cfg,eps_low,eps_high",
    [
        (GRPOLoss.Config(aggregation="token_mean"), 0.2, 0.2),
        (DAPOLoss.Config(), 0.2, 0.28),
    ],
)
def test_ppo_clip_boundaries(cfg, eps_low: float, eps_high: float) -> None:
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    # lp_old = 0 so r = exp(lp_new) exactly; each row: (ratio, advantage, gradient expected to flow)
    cases = [
        (torch.tensor(hi, dtype=F32), 1.0, True),   # A>0 exactly at 1+eps_high: still inside
        (above(hi), 1.0, False),                     # A>0 just beyond: clipped, no gradient
        (torch.tensor(lo, dtype=F32), -1.0, True),  # A<0 exactly at 1-eps_low: inside
        (below(lo), -1.0, False),                    # A<0 just beyond: clipped
        (torch.tensor(0.5, dtype=F32), 2.0, True),  # A>0 below the band: min picks r*A, gradient flows
        (torch.tensor(1.5, dtype=F32), -2.0, True), # A<0 above the band: pessimistic r*A, gradient flows
        (below(lo), 1.0, True),                      # the lower bound only binds for A<0
        (above(hi), -1.0, True),                     # the upper bound only binds for A>0
    ]
    T = len(cases)
    lp_new_T = torch.stack([exact_log(r) for r, _, _ in cases])
    ratio_T = torch.exp(lp_new_T)
    adv_T = torch.tensor([a for _, a, _ in cases], dtype=F32)
    loss, grad_T, m = run(cfg.build(), lp_new_T, torch.zeros(T), adv_T)

    flows = torch.tensor([f for _, _, f in cases])
    expected_grad_T = torch.where(flows, -adv_T * ratio_T / T, 0.0)
    torch.testing.assert_close(grad_T, expected_grad_T, rtol=0, atol=0)

    # value: the textbook min form, in float64
    r64, a64 = ratio_T.double(), adv_T.double()
    ref = (-torch.minimum(r64 * a64, r64.clamp(lo, hi) * a64)).mean()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-7)
    assert m["clip_frac_high"].item() == pytest.approx(1 / T)
    assert m["clip_frac_low"].item() == pytest.approx(1 / T)
    assert m["ratio_mean"].item() == pytest.approx(ratio_T.mean().item(), rel=1e-6)


def test_grpo_seq_mean_then_mean_over_sequences() -> None:
    # seq 0: 2 prompt + 3 completion tokens, A=+1; seq 1: 1 prompt + 2 completion, A=-0.5; r=1 everywhere
    mask_T = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    adv_T = torch.tensor([1, 1, 1, 1, 1, -0.5, -0.5, -0.5])
    lp_T = torch.full((8,), -1.0)
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    loss, grad_T, _ = run(GRPOLoss.Config().build(), lp_T, lp_T, adv_T, mask_T, cu_seqlens=cu)
    # (mean(-1,-1,-1) + mean(0.5,0.5)) / 2
    assert loss.item() == pytest.approx((-1.0 + 0.5) / 2)
    # d/dlp of -A r: -A r / (|M_i| * N)
    expected = torch.tensor([0, 0, -1 / 6, -1 / 6, -1 / 6, 0, 0.5 / 4, 0.5 / 4])
    torch.testing.assert_close(grad_T, expected)

    # the same batch with token-level normalisation: (-3 + 1) / 5
    loss_tok, _, _ = run(GRPOLoss.Config(aggregation="token_mean").build(), lp_T, lp_T, adv_T, mask_T)
    assert loss_tok.item() == pytest.approx(-0.4)


def test_grpo_sequence_without_loss_tokens_does_not_dilute() -> None:
    mask_T = torch.tensor([0, 1, 1, 0, 0], dtype=torch.bool)  # seq 1 has no completion tokens
    adv_T = torch.tensor([2.0, 2.0, 2.0, 7.0, 7.0])
    lp_T = torch.zeros(5)
    cu = torch.tensor([0, 3, 5])
    loss, _, _ = run(GRPOLoss.Config().build(), lp_T, lp_T, adv_T, mask_T, cu_seqlens=cu)
    assert loss.item() == pytest.approx(-2.0)


# ---------------------------------------------------------------------------------------------
# masking


def _random_batch(T: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lp_old_T = -torch.rand(T, generator=g) * 2 - 0.05
    lp_new_T = lp_old_T + (torch.rand(T, generator=g) - 0.5) * 0.8
    lp_gen_T = lp_old_T + (torch.rand(T, generator=g) - 0.5) * 1.2
    adv_T = torch.randn(T, generator=g)
    mask_T = torch.rand(T, generator=g) > 0.35
    mask_T[0] = False  # a sequence's first token: NaN from token_logprobs
    mask_T[1] = True
    return lp_new_T, lp_old_T, lp_gen_T, adv_T, mask_T


ALL_LOSSES = [
    GRPOLoss.Config(),
    GRPOLoss.Config(kl_coef=0.05, mismatch=MismatchCorrection.Config(tis=True, mask_ratio_cap=1.6)),
    DAPOLoss.Config(mismatch=MismatchCorrection.Config(tis=True, mask_max_abs_log_ratio=0.4)),
    DPPOLoss.Config(delta=0.05, mismatch=MismatchCorrection.Config(tis=True, mask_ratio_cap=1.5)),
]


@pytest.mark.parametrize("cfg", ALL_LOSSES, ids=lambda c: type(c).__qualname__.split(".")[0])
def test_masked_tokens_contribute_nothing(cfg: PolicyLoss.Config) -> None:
    lp_new_T, lp_old_T, lp_gen_T, adv_T, mask_T = _random_batch()
    lp_ref_T = lp_old_T - 0.1
    cu = torch.tensor([0, 5, 12])
    fn = cfg.build()
    kw = dict(cu_seqlens=cu, lp_ref_T=lp_ref_T)
    loss, grad_T, m = run(fn, lp_new_T, lp_old_T, adv_T, mask_T, lp_gen_T=lp_gen_T, **kw)
    assert torch.isfinite(loss) and torch.isfinite(grad_T).all()
    assert (grad_T[~mask_T] == 0).all()

    # garbage (NaN, inf, huge) everywhere outside the mask: bit-identical loss and gradient
    def junk(x_T: torch.Tensor, fill: float) -> torch.Tensor:
        return torch.where(mask_T, x_T, torch.full_like(x_T, fill))

    loss2, grad2_T, m2 = run(fn, junk(lp_new_T, math.nan), junk(lp_old_T, -math.inf), junk(adv_T, 1e30), mask_T,
                             lp_gen_T=junk(lp_gen_T, math.nan), cu_seqlens=cu, lp_ref_T=junk(lp_ref_T, math.nan))
    assert torch.equal(loss, loss2)
    assert torch.equal(grad_T, grad2_T)
    for k in m:
        assert torch.equal(m[k], m2[k]), k


def test_all_masked_batch_gives_zero_loss_and_backward_works() -> None:
    T = 4
    lp_T = torch.full((T,), math.nan)
    for cfg in ALL_LOSSES:
        loss, grad_T, m = run(cfg.build(), lp_T, lp_T, torch.ones(T), torch.zeros(T, dtype=torch.bool),
                              cu_seqlens=torch.tensor([0, T]), lp_gen_T=lp_T, lp_ref_T=lp_T)
        assert loss.item() == 0.0 and (grad_T == 0).all() and m["num_tokens"].item() == 0


# ---------------------------------------------------------------------------------------------
# DAPO global token normalisation across ranks


def test_dapo_global_normalisation_across_fake_ranks() -> None:
    lp_new_T, lp_old_T, lp_gen_T, adv_T, mask_T = _random_batch(T=16, seed=3)
    lp_new_T = lp_old_T + (lp_new_T - lp_old_T) * 2  # push some tokens past the clip
    fn = DAPOLoss.Config(mismatch=MismatchCorrection.Config(tis=True)).build()
    full, grad_full_T, m_full = run(fn, lp_new_T, lp_old_T, adv_T, mask_T, lp_gen_T=lp_gen_T)
    assert m_full["clip_frac_high"].item() + m_full["clip_frac_low"].item() > 0

    n_global = int(mask_T.sum())  # what an all-reduce of the per-rank counts returns
    parts = [slice(0, 7), slice(7, 16)]  # uneven split: the ranks hold different token counts
    for n in (n_global, torch.tensor(n_global)):
        losses, grads = [], []
        for s in parts:
            loss_r, grad_r, _ = run(fn, lp_new_T[s], lp_old_T[s], adv_T[s], mask_T[s], lp_gen_T=lp_gen_T[s],
                                    num_global_valid_tokens=n)
            losses.append(loss_r)
            grads.append(grad_r)
        torch.testing.assert_close(sum(losses), full, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(torch.cat(grads), grad_full_T, rtol=1e-6, atol=1e-8)

    # without the global count each rank would normalise by its own tokens: not the global mean
    local = [run(fn, lp_new_T[s], lp_old_T[s], adv_T[s], mask_T[s], lp_gen_T=lp_gen_T[s])[0] for s in parts]
    assert not torch.allclose(sum(local), full)


def test_grpo_global_sequence_count_across_fake_ranks() -> None:
    lp_new_T, lp_old_T, _, adv_T, mask_T = _random_batch(T=12, seed=5)
    mask_T[[1, 5, 9]] = True
    fn = GRPOLoss.Config().build()
    full, grad_T, _ = run(fn, lp_new_T, lp_old_T, adv_T, mask_T, cu_seqlens=torch.tensor([0, 4, 8, 12]))
    # rank 0: sequences 0-1, rank 1: sequence 2; 3 sequences globally
    l0, g0, _ = run(fn, lp_new_T[:8], lp_old_T[:8], adv_T[:8], mask_T[:8], cu_seqlens=torch.tensor([0, 4, 8]),
                    num_global_seqs=3)
    l1, g1, _ = run(fn, lp_new_T[8:], lp_old_T[8:], adv_T[8:], mask_T[8:], cu_seqlens=torch.tensor([0, 4]),
                    num_global_seqs=3)
    torch.testing.assert_close(l0 + l1, full)
    torch.testing.assert_close(torch.cat([g0, g1]), grad_T)


# ---------------------------------------------------------------------------------------------
# DPPO total-variation trust region


def test_dppo_tv_boundary() -> None:
    # exact binary fractions: p_old = 0.5, delta = 0.125, so dp = p_new - 0.5 is exact in float32
    delta = 0.125
    p_old = 0.5
    cases = [  # (lp_new, A, gradient flows)
        (exact_log(0.625), 1.0, True),        # A>0, moved up exactly delta: inside
        (exact_log(above(0.625)), 1.0, False), # A>0, moved up just beyond delta: blocked
        (exact_log(0.375), -1.0, True),       # A<0, moved down exactly delta: inside
        (exact_log(below(0.375)), -1.0, False),# A<0, moved down just beyond: blocked
        (torch.log(torch.tensor(0.9)), -1.0, True),  # A<0 but moved up far: pushing back is allowed
        (torch.log(torch.tensor(0.1)), 1.0, True),   # A>0 but moved down far: pushing back is allowed
        (torch.log(torch.tensor(0.9)), 1.0, False),  # A>0 and moved up far: blocked
    ]
    T = len(cases)
    lp_new_T = torch.stack([lp for lp, _, _ in cases])
    lp_old_T = exact_log(p_old).expand(T).clone()
    assert (torch.exp(lp_new_T[[0, 2]]) - torch.exp(lp_old_T[[0, 2]])).abs().eq(delta).all()
    adv_T = torch.tensor([a for _, a, _ in cases])
    loss, grad_T, m = run(DPPOLoss.Config(delta=delta).build(), lp_new_T, lp_old_T, adv_T)

    ratio_T = torch.exp(lp_new_T - lp_old_T)
    flows = torch.tensor([f for _, _, f in cases])
    torch.testing.assert_close(grad_T, torch.where(flows, -adv_T * ratio_T / T, 0.0))
    # value: the unclipped surrogate -A r (blocked tokens keep their value, lose their gradient)
    torch.testing.assert_close(loss, (-adv_T * ratio_T).mean())
    assert m["clip_frac_high"].item() == pytest.approx(2 / T)
    assert m["clip_frac_low"].item() == pytest.approx(1 / T)


def test_dppo_ratio_cap() -> None:
    # A<0 on a token that rose from 1e-4 to 0.05: inside the TV region (dp < 0.1), ratio 500
    lp_old_T = torch.log(torch.tensor([1e-4]))
    lp_new_T = torch.log(torch.tensor([0.05]))
    adv_T = torch.tensor([-1.0])
    r = torch.exp(lp_new_T - lp_old_T).item()
    loss, grad_T, _ = run(DPPOLoss.Config().build(), lp_new_T, lp_old_T, adv_T)
    assert loss.item() == pytest.approx(20.0) and grad_T.item() == pytest.approx(20.0)
    loss, grad_T, _ = run(DPPOLoss.Config(ratio_cap=None).build(), lp_new_T, lp_old_T, adv_T)
    assert loss.item() == pytest.approx(r, rel=1e-5) and grad_T.item() == pytest.approx(r, rel=1e-5)


# ---------------------------------------------------------------------------------------------
# train/inference mismatch corrections


def test_truncated_is_weights() -> None:
    rho = torch.tensor([0.5, 1.0, 1.5, 3.0])
    lp_old_T = torch.full((4,), -1.0)  # trainer recompute
    lp_gen_T = lp_old_T - torch.log(rho)  # generator: rho = exp(lp_old - lp_gen)
    adv_T = torch.ones(4)
    cfg = DAPOLoss.Config(mismatch=MismatchCorrection.Config(tis=True))  # default cap C = 2
    loss, grad_T, m = run(cfg.build(), lp_old_T, lp_old_T, adv_T, lp_gen_T=lp_gen_T)  # r = 1
    w = torch.tensor([0.5, 1.0, 1.5, 2.0])
    assert loss.item() == pytest.approx(-w.mean().item(), rel=1e-6)
    torch.testing.assert_close(grad_T, -w / 4)  # the weight scales, but is not differentiated
    assert m["tis_weight_mean"].item() == pytest.approx(1.25, rel=1e-6)
    assert m["tis_clip_frac"].item() == pytest.approx(0.25)
    assert m["masked_frac"].item() == 0.0

    fn = MismatchCorrection.Config(tis=True, tis_cap=1.2).build()
    weight_T, keep_T, _ = fn(torch.ones(4, dtype=torch.bool), lp_old_T, lp_gen_T)
    torch.testing.assert_close(weight_T, torch.tensor([0.5, 1.0, 1.2, 1.2]))
    assert keep_T.all() and not weight_T.requires_grad


@pytest.mark.parametrize("loss_cls", [GRPOLoss, DAPOLoss, DPPOLoss])
def test_mismatch_token_masking(loss_cls) -> None:
    # |lp_old - lp_gen| = 0.1, 0.6, 0.7, 0.4  -> drop tokens 1 and 2 at threshold 0.5
    lp_old_T = torch.full((4,), -1.0)
    lp_gen_T = lp_old_T - torch.tensor([0.1, 0.6, -0.7, 0.4])
    adv_T = torch.tensor([1.0, 1.0, -1.0, -1.0])
    for mm in (MismatchCorrection.Config(mask_max_abs_log_ratio=0.5),
               MismatchCorrection.Config(mask_ratio_cap=math.exp(0.5))):  # the same band, as a ratio
        cfg = loss_cls.Config(aggregation="token_mean", mismatch=mm)
        loss, grad_T, m = run(cfg.build(), lp_old_T, lp_old_T, adv_T, lp_gen_T=lp_gen_T)  # r = 1
        keep = torch.tensor([True, False, False, True])
        torch.testing.assert_close(grad_T, torch.where(keep, -adv_T / 4, 0.0))
        # dropped tokens count in the denominator (weight 0): (-1 + 1) / 4
        assert loss.item() == pytest.approx(0.0)
        assert m["masked_frac"].item() == pytest.approx(0.5)


def test_mismatch_ratio_band() -> None:
    rho = torch.tensor([1.9, 2.1, 0.45, 0.55])
    lp_gen_T = -torch.log(rho)
    fn = MismatchCorrection.Config(mask_ratio_cap=2.0).build()
    _, keep_T, m = fn(torch.ones(4, dtype=torch.bool), torch.zeros(4), lp_gen_T)
    assert keep_T.tolist() == [True, False, False, True]
    assert m["masked_frac"].item() == pytest.approx(0.5)


def test_mismatch_needs_generator_logprobs() -> None:
    fn = GRPOLoss.Config(mismatch=MismatchCorrection.Config(tis=True)).build()
    with pytest.raises(ValueError, match="lp_gen_T"):
        run(fn, torch.zeros(2), torch.zeros(2), torch.ones(2), cu_seqlens=torch.tensor([0, 2]))
    # off by default: no generator logprobs needed, and giving them only adds a metric
    fn = GRPOLoss.Config().build()
    _, _, m = run(fn, torch.zeros(2), torch.zeros(2), torch.ones(2), cu_seqlens=torch.tensor([0, 2]),
                  lp_gen_T=torch.tensor([0.0, -0.1]))
    assert m["masked_frac"].item() == 0.0 and m["tis_weight_mean"].item() == 1.0 and m["mismatch_kl"].item() > 0


# ---------------------------------------------------------------------------------------------
# KL term, config, validation


def test_grpo_kl_term_k3() -> None:
    lp_new_T = torch.tensor([-1.0])
    lp_ref_T = torch.tensor([-1.5])
    cfg = GRPOLoss.Config(kl_coef=0.1)
    loss, grad_T, m = run(cfg.build(), lp_new_T, lp_new_T, torch.zeros(1), cu_seqlens=torch.tensor([0, 1]),
                          lp_ref_T=lp_ref_T)
    d = -0.5
    assert loss.item() == pytest.approx(0.1 * (math.exp(d) - d - 1), rel=1e-6)
    assert grad_T.item() == pytest.approx(0.1 * (1 - math.exp(d)), rel=1e-6)
    assert m["kl_ref"].item() == pytest.approx(math.exp(d) - d - 1, rel=1e-6)
    with pytest.raises(ValueError, match="lp_ref_T"):
        run(cfg.build(), lp_new_T, lp_new_T, torch.zeros(1), cu_seqlens=torch.tensor([0, 1]))


def test_config_build_pattern() -> None:
    assert isinstance(GRPOLoss.Config().build(), GRPOLoss)
    assert isinstance(DAPOLoss.Config().build(), DAPOLoss)
    assert isinstance(DPPOLoss.Config().build(), DPPOLoss)
    g, d, p = GRPOLoss.Config(), DAPOLoss.Config(), DPPOLoss.Config()
    assert (g.eps, g.aggregation, g.kl_coef) == (0.2, "seq_mean", 0.0)
    assert (d.eps_low, d.eps_high, d.aggregation) == (0.2, 0.28, "token_mean")
    assert (p.delta, p.aggregation) == (0.1, "token_mean")
    assert not g.mismatch.tis and g.mismatch.tis_cap == 2.0 and g.mismatch.mask_ratio_cap is None

    cfg = DAPOLoss.Config(eps_high=0.3)
    fn = cfg.build()
    cfg.eps_high = 0.5  # built objects hold a copy
    assert fn.config.eps_high == 0.3
    with pytest.raises(TypeError):
        DAPOLoss.Config(0.1)  # keyword-only, as torchtitan requires
    with pytest.raises(TypeError, match="slots"):

        class Bad(Configurable):
            @dataclass(kw_only=True)
            class Config(Configurable.Config):
                x: int = 0

    assert DAPOLoss.Config().to_dict()["mismatch"]["tis_cap"] == 2.0


def test_input_validation() -> None:
    z = torch.zeros(3)
    ones = torch.ones(3, dtype=torch.bool)
    fn = DAPOLoss.Config().build()
    with pytest.raises(ValueError, match="shape"):
        fn(z, torch.zeros(4), z, ones)
    with pytest.raises(TypeError, match="bool"):
        fn(z, z, z, torch.ones(3))
    with pytest.raises(ValueError, match="num_global_seqs"):
        fn(z, z, z, ones, num_global_seqs=2)
    with pytest.raises(ValueError, match="positive"):
        fn(z, z, z, ones, num_global_valid_tokens=0)
    grpo = GRPOLoss.Config().build()
    with pytest.raises(ValueError, match="cu_seqlens"):
        grpo(z, z, z, ones)
    with pytest.raises(ValueError, match="num_global_valid_tokens"):
        grpo(z, z, z, ones, cu_seqlens=torch.tensor([0, 3]), num_global_valid_tokens=3)
    with pytest.raises(ValueError, match="spans"):
        grpo(z, z, z, ones, cu_seqlens=torch.tensor([0, 2]))
