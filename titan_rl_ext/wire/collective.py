"""The collective primitives both ends of a broadcast weight push share (issue 43): process groups on one
rendezvous store, and packed buckets. The trainer's transport (``vllm_transfer``) and the generators' engine and
relay (``vllm_titan_plugin.swap.transfer_engine``, ``swap.relay``) import them from here, so the bucket layout is
one function, and the trainer needs neither vLLM nor the serving plugin. torch only.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch

GLOO = "gloo"
NCCL = "nccl"
BACKENDS = (GLOO, NCCL)


def client_store(address: str, port: int, timeout_s: float) -> Any:
    """A client of the trainer's rendezvous store (the trainer listens; this side only dials)."""
    from torch.distributed import TCPStore

    return TCPStore(address, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def process_group(store: Any, prefix: str, rank: int, world_size: int, backend: str, timeout_s: float) -> Any:
    """A process group of its own (no global torch.distributed state) on ``store`` under ``prefix``: every
    group of one trainer shares its one store, so a rebuild or a host's local group needs a fresh prefix,
    never a fresh port. ``timeout_s`` bounds each collective: a peer that dies mid-transfer frees the others
    after it, not after torch's 30-minute default. ``GLOO_SOCKET_IFNAME`` picks gloo's interface."""
    from torch.distributed import PrefixStore

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside a group of {world_size}")
    scoped = PrefixStore(prefix, store)
    timeout = timedelta(seconds=timeout_s)
    if backend == GLOO:
        from torch.distributed import ProcessGroupGloo

        opts = ProcessGroupGloo._Options()
        opts._timeout = timeout
        ifname = os.environ.get("GLOO_SOCKET_IFNAME")
        opts._devices = [ProcessGroupGloo.create_device(interface=ifname) if ifname
                         else ProcessGroupGloo.create_default_device()]
        return ProcessGroupGloo(scoped, rank, world_size, opts)
    from torch.distributed import ProcessGroupNCCL  # only on a CUDA build

    nccl_opts = ProcessGroupNCCL.Options()
    nccl_opts._timeout = timeout
    return ProcessGroupNCCL(scoped, rank, world_size, nccl_opts)


def close_group(group: Any) -> None:
    """Best effort: a group whose peer is gone may refuse a clean shutdown; it is dropped either way."""
    try:
        group.shutdown()
    except Exception:  # noqa: BLE001 - nothing to recover: the group is not used again
        pass


# -- packed buckets: many tensors in one broadcast -------------------------------------------------------------
ALIGN_BYTES = 16  # every tensor starts at a multiple of this in a packed buffer, so it can be viewed in place


def packed_layout(dtypes: list[torch.dtype], shapes: list[list[int]]) -> tuple[list[tuple[int, int]], int]:
    """(byte offset, byte length) of each tensor in a packed bucket, and the bucket's size. Both sides compute
    it from the same metadata, so only the names, dtypes and shapes travel by HTTP."""
    spans, at = [], 0
    for dt, shape in zip(dtypes, shapes):
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()
        spans.append((at, n))
        at += -(-n // ALIGN_BYTES) * ALIGN_BYTES
    return spans, at


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One uint8 buffer holding ``tensors`` at ``packed_layout``'s offsets (on their device)."""
    spans, total = packed_layout([t.dtype for t in tensors], [list(t.shape) for t in tensors])
    buf = torch.zeros(total, dtype=torch.uint8, device=tensors[0].device if tensors else "cpu")
    for t, (off, n) in zip(tensors, spans):
        buf[off:off + n] = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return buf


def unpack(buf: torch.Tensor, dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[torch.Tensor]:
    """Views of ``buf`` as the tensors ``pack`` put there (no copy: they keep ``buf`` alive)."""
    spans, total = packed_layout(dtypes, shapes)
    if buf.numel() != total:
        raise ValueError(f"packed bucket of {buf.numel()} bytes, the metadata describes {total}")
    return [buf[off:off + n].view(dt).reshape(shape) for (off, n), dt, shape in zip(spans, dtypes, shapes)]
