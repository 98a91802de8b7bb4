"""Reading HF ``config.json`` dicts (plain dicts: no transformers needed)."""

from __future__ import annotations

from typing import Any


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The text part of a (possibly multimodal) config. Multimodal Qwen3.5 nests it in ``text_config``."""
    return hf["text_config"] if isinstance(hf.get("text_config"), dict) else hf


def rope_settings(tc: dict[str, Any], default_partial: float) -> tuple[float, float]:
    """(theta, partial_rotary_factor) from ``rope_parameters`` (transformers 5), ``rope_scaling`` or top level."""
    rp = tc.get("rope_parameters") or tc.get("rope_scaling") or {}
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in ("default", None):
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported (only plain/default RoPE)")
    theta = rp.get("rope_theta", tc.get("rope_theta", 10000.0))
    partial = rp.get("partial_rotary_factor", tc.get("partial_rotary_factor", default_partial))
    return float(theta), float(partial)


def tie_embeddings(hf: dict[str, Any]) -> bool:
    # The multimodal wrapper's top-level flag governs tying of its language model head.
    if "tie_word_embeddings" in hf:
        return bool(hf["tie_word_embeddings"])
    return bool(text_config(hf).get("tie_word_embeddings", False))
