"""Qwen3.5 (hybrid Gated DeltaNet + gated attention; dense and MoE)."""

from __future__ import annotations

from typing import Any


def model_registry(flavor: str) -> Any:
    """torchtitan ``ModelSpec`` for a Qwen3.5 flavor (needs torchtitan; the model itself does not)."""
    from titan_rl_ext.models.common.titan_protocol import flavor_model_spec

    return flavor_model_spec("qwen3_5", flavor)
