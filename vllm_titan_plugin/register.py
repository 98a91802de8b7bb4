"""Entry point of the ``vllm.general_plugins`` group; runs once in every vLLM process."""

from __future__ import annotations


def register() -> None:
    """Idempotent. Model routing for ``--model-impl titan`` is added by the plugin issue."""
    return None
