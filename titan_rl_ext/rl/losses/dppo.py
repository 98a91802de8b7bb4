"""DPPO-Binary-TV: a trust region on the sampled token's probability change (its share of the total
variation) instead of its ratio."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from titan_rl_ext.rl.losses import register_loss
from titan_rl_ext.rl.losses.base import Aggregation, PolicyLoss, masked_mean


@register_loss("dppo")
class DPPOLoss(PolicyLoss):
    """DPPO-Binary-TV (arXiv:2602.04879): a trust region on the sampled token's probability change
    instead of its ratio. With ``dp_t = exp(lp_new_t) - exp(lp_old_t)``::

        blocked_t = (A_t > 0 and dp_t > delta) or (A_t < 0 and dp_t < -delta)
        l_t = -A_t * sg(min(r_t, ratio_cap)) * (1 if blocked_t else exp(lp_new_t - sg(lp_new_t)))

    Value ``-A_t min(r_t, C)``; gradient ``-A_t min(r_t, C) grad(lp_new_t)`` for unblocked tokens,
    zero for blocked ones (strict ``>``: a token exactly at ``delta`` still learns). ``ratio_cap``
    (default 20, as in the authors' code; None = off) bounds the weight of a token whose probability
    rose a lot from a tiny value, which the TV test alone allows for ``A < 0``. Moving back towards the
    old probability is never blocked.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(PolicyLoss.Config):
        aggregation: Aggregation = "token_mean"
        delta: float = 0.1
        """TV threshold on |p_new - p_old| of the sampled token."""
        ratio_cap: float | None = 20.0

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        if config.delta < 0:
            raise ValueError(f"delta must be >= 0, got {config.delta}")
        if config.ratio_cap is not None and config.ratio_cap <= 0:
            raise ValueError(f"ratio_cap must be > 0, got {config.ratio_cap}")

    def token_loss(self, lp_new_T, lp_old_T, adv_T, mask_T):  # type: ignore[override]
        c = self.config
        with torch.no_grad():
            dp_T = torch.exp(lp_new_T) - torch.exp(lp_old_T)
            block_hi_T = (adv_T > 0) & (dp_T > c.delta)
            block_lo_T = (adv_T < 0) & (dp_T < -c.delta)
            log_r_T = lp_new_T - lp_old_T
            if c.ratio_cap is not None:
                log_r_T = log_r_T.clamp(max=math.log(c.ratio_cap))
            w_T = torch.exp(log_r_T)
        # exp(lp - sg(lp)) is 1 in value with gradient grad(lp): value -A w, gradient -A w grad(lp)
        unit_T = torch.exp(lp_new_T - lp_new_T.detach())
        pg_T = -adv_T * w_T * torch.where(block_hi_T | block_lo_T, torch.ones_like(unit_T), unit_T)
        metrics = {
            "clip_frac_low": masked_mean(block_lo_T.float(), mask_T),
            "clip_frac_high": masked_mean(block_hi_T.float(), mask_T),
            "tv_mean": masked_mean(dp_T.abs(), mask_T),
        }
        return pg_T, metrics
