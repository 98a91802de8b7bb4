"""Qwen3.5 / Qwen3.5-MoE checkpoints: text (``Qwen3_5ForCausalLM``: ``model.*``) and multimodal
(``Qwen3_5ForConditionalGeneration``: ``model.language_model.*``) layouts. The vision tower
(``model.visual.*``) and the multi-token-prediction head (``mtp.*``) are not part of the text model
and are skipped on load."""

from __future__ import annotations

from titan_rl_ext.models.common.state_dict_adapter import HFStateDictAdapter


class Qwen3_5StateDictAdapter(HFStateDictAdapter):
    skipped_prefixes = ("model.visual.", "mtp.")
    text_prefixes = {"text": "model.", "vlm": "model.language_model."}
