"""Qwen3 dense and Qwen3-MoE."""

from __future__ import annotations

from typing import Any


def model_registry(flavor: str) -> Any:
    """torchtitan ``ModelSpec`` for a Qwen3 flavor (needs torchtitan; the model itself does not)."""
    from titan_rl_ext.models.common.titan_protocol import make_model_spec
    from titan_rl_ext.models.qwen3.flavors import qwen3_flavors
    from titan_rl_ext.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    flavors = qwen3_flavors()
    if flavor not in flavors:
        raise ValueError(f"unknown qwen3 flavor {flavor!r}; choose from {sorted(flavors)}")
    return make_model_spec("qwen3", flavor, flavors[flavor], Qwen3StateDictAdapter)
