"""Qwen3 / Qwen3-MoE checkpoints (``model.*`` keys; MoE experts fused or per expert)."""

from __future__ import annotations

from titan_rl_ext.models.common.state_dict_adapter import HFStateDictAdapter


class Qwen3StateDictAdapter(HFStateDictAdapter):
    text_prefixes = {"text": "model."}
