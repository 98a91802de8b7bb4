"""A loss defined outside ``titan_rl_ext.rl.losses``, the way a user adds one: this file alone. Plain
REINFORCE on the sampled tokens, ``l_t = -scale * A_t * lp_new_t`` (no ratio, no trust region), for
``tests/test_rl_registries.py``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_rl_ext.rl.losses import register_loss
from titan_rl_ext.rl.losses.base import Metrics, PolicyLoss

NAME = "example_reinforce"


@register_loss(NAME)
class ReinforceLoss(PolicyLoss):
    @dataclass(kw_only=True, slots=True)
    class Config(PolicyLoss.Config):
        scale: float = 1.0

    def token_loss(
        self, lp_new_T: torch.Tensor, lp_old_T: torch.Tensor, adv_T: torch.Tensor, mask_T: torch.Tensor
    ) -> tuple[torch.Tensor, Metrics]:
        return -self.config.scale * adv_T * lp_new_T, {}
