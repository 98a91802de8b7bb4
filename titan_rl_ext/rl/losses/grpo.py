"""GRPO: the PPO clipped surrogate with a symmetric clip range, mean per sequence then over sequences."""

from __future__ import annotations

from dataclasses import dataclass

from titan_rl_ext.rl.losses import register_loss
from titan_rl_ext.rl.losses.base import Aggregation, PolicyLoss, ppo_clip_token_loss


@register_loss("grpo")
class GRPOLoss(PolicyLoss):
    """GRPO (Shao et al. 2024): PPO clipped surrogate, symmetric ``eps`` (0.2), per-sequence mean
    then mean over sequences (``aggregation="seq_mean"``, needs ``cu_seqlens``), KL-free unless
    ``kl_coef > 0``::

        L = (1/N) sum_i (1/|M_i|) sum_{t in M_i} -min(r_t A_t, clip(r_t, 1-eps, 1+eps) A_t)
            [+ kl_coef * k3(pi_new, pi_ref) per token]
    """

    @dataclass(kw_only=True, slots=True)
    class Config(PolicyLoss.Config):
        aggregation: Aggregation = "seq_mean"
        eps: float = 0.2
        """Clip range: r is clipped to [1 - eps, 1 + eps]."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        if not 0 <= config.eps < 1:
            raise ValueError(f"eps must be in [0, 1), got {config.eps}")

    def token_loss(self, lp_new_T, lp_old_T, adv_T, mask_T):  # type: ignore[override]
        return ppo_clip_token_loss(lp_new_T, lp_old_T, adv_T, mask_T, self.config.eps, self.config.eps)
