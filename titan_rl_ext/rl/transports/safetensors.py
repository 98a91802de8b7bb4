"""``safetensors``: the state dict as the bytes of a safetensors file over HTTP (CPU or GPU, any host)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from titan_rl_ext.rl.transports import register_transport
from titan_rl_ext.rl.transports.base import HttpTransport, Staged
from titan_rl_ext.wire.weights import serialize


@register_transport("safetensors")
class SafetensorsTransport(HttpTransport):
    def stage(self, state_dict: Mapping[str, torch.Tensor]) -> Staged:
        return self.stage_bytes(serialize(state_dict))

    @staticmethod
    def stage_bytes(payload: bytes) -> Staged:
        """A state dict serialised already (``wire.weights.serialize``, maybe in another thread or process)."""
        return Staged(payload)
