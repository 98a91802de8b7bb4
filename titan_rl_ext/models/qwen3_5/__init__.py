"""Qwen3.5 (hybrid Gated DeltaNet + gated attention; dense and MoE)."""

from __future__ import annotations

from typing import Any


def model_registry(flavor: str) -> Any:
    """torchtitan ``ModelSpec`` for a Qwen3.5 flavor (needs torchtitan; the model itself does not)."""
    from titan_rl_ext.models.common.titan_protocol import make_model_spec
    from titan_rl_ext.models.qwen3_5.flavors import qwen3_5_flavors
    from titan_rl_ext.models.qwen3_5.state_dict_adapter import Qwen3_5StateDictAdapter

    flavors = qwen3_5_flavors()
    if flavor not in flavors:
        raise ValueError(f"unknown qwen3_5 flavor {flavor!r}; choose from {sorted(flavors)}")
    return make_model_spec("qwen3_5", flavor, flavors[flavor], Qwen3_5StateDictAdapter)
