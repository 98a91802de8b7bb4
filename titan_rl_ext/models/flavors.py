"""Every named flavor, ``FLAVORS[name].build()`` -> model. Imports torch only."""

from __future__ import annotations

from titan_rl_ext.models.common.decoder import DecoderConfig
from titan_rl_ext.models.qwen3.flavors import qwen3_flavors
from titan_rl_ext.models.qwen3_5.flavors import qwen3_5_flavors

FLAVORS: dict[str, DecoderConfig] = {**qwen3_flavors(), **qwen3_5_flavors()}
