"""DAPO: the PPO clipped surrogate with clip-higher, normalised over the global batch's loss tokens."""

from __future__ import annotations

from dataclasses import dataclass

from titan_rl_ext.rl.losses import register_loss
from titan_rl_ext.rl.losses.base import Aggregation, PolicyLoss, ppo_clip_token_loss


@register_loss("dapo")
class DAPOLoss(PolicyLoss):
    """DAPO (Yu et al. 2025): clip-higher (asymmetric ``eps_low=0.2``, ``eps_high=0.28``) and
    token-level normalisation over the loss tokens of the *global* batch::

        L_rank = sum_{t in M_rank} -min(r_t A_t, clip(r_t, 1-eps_low, 1+eps_high) A_t) / N_global

    ``N_global`` = ``num_global_valid_tokens`` passed by the caller (all-reduced loss-token count of
    the whole optimizer step); then ``sum over ranks of L_rank`` is the global token mean.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(PolicyLoss.Config):
        aggregation: Aggregation = "token_mean"
        eps_low: float = 0.2
        eps_high: float = 0.28

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        if not 0 <= config.eps_low < 1 or config.eps_high < 0:
            raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {config.eps_low}, {config.eps_high}")

    def token_loss(self, lp_new_T, lp_old_T, adv_T, mask_T):  # type: ignore[override]
        return ppo_clip_token_loss(lp_new_T, lp_old_T, adv_T, mask_T, self.config.eps_low, self.config.eps_high)
