"""The bytes of a weight push and the checksums both sides compare.

A push is a safetensors file (never pickle) holding the full titan state dict under titan names; the
server validates all of it before it touches a weight. ``tensor_checksum`` is the one digest function of
the protocol: the trainer compares its tensors with the server's ``GET /titan/v1/weights/checksums``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch


def tensor_checksum(t: torch.Tensor) -> str:
    """sha256 over dtype, shape and the raw bytes: equal digests mean bit-identical tensors."""
    t = t.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{str(t.dtype).removeprefix('torch.')}|{tuple(t.shape)}|".encode())
    # A uint8 view exposes the raw bytes of any dtype (bf16 included) without numpy dtype support.
    h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def checksum(state_dict: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Per-tensor checksums, comparable with the server's ``GET /titan/v1/weights/checksums``."""
    return {name: tensor_checksum(t) for name, t in state_dict.items()}


def serialize(state_dict: Mapping[str, torch.Tensor]) -> bytes:
    """The safetensors bytes of a state dict (CPU, contiguous; shared storage is copied apart)."""
    from safetensors.torch import save

    return save({name: t.detach().to("cpu").contiguous().clone() for name, t in state_dict.items()})
