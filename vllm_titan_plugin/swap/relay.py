"""Per-host relay for broadcast weight pushes: one engine per host takes the trainer's broadcast, the
others on that host take it from that engine (issue 43, item 2). Also the group helper both sides use.

Why here, beside the engines, and not as a process of its own: the relay *is* one of the host's engines (the
"lead", chosen by the trainer: the first live generator of each host). Its worker joins the trainer's
broadcast group once per group build, exactly as a directly connected engine does, and passes every buffer it
receives on to a host-local group in which it is rank 0; the host's other engines ("followers") join only
that local group. So:

- network bytes per version are one model per host (trainer -> lead), however many engines the host runs;
- no extra process to deploy or supervise, and no extra port: every group is formed on the trainer's one
  rendezvous store (``TCPStore`` at the address and port the operator gave the trainer), under its own key
  prefix, so the lead opens no listening socket for its followers (gloo's pair transport still binds
  ephemeral ports for the life of a group, as in any gloo group);
- the control path stays vLLM's weight-transfer HTTP calls, authenticated by the push token: every engine,
  lead or follower, receives ``/update_weights`` with the same metadata and blocks in its own receive; the
  lead's receive loop simply forwards each buffer after it lands;
- if a lead dies, the trainer rebuilds the groups at the next version with another engine of that host as
  lead (``titan_rl_ext.rl.transports.vllm_transfer``).

The hand-off inside a host is the seam ``LocalFanout``: ``pass_on`` on the lead, ``take`` on a follower,
called once per buffer in the same order on every engine of the host. ``GlooFanout`` (CPU, and a GPU
fallback) broadcasts over the host's gloo group, through loopback. On GPU the intended implementation is
CUDA IPC (``CudaIpcFanout``, not written here): the lead keeps each received buffer on its device, exports
one IPC handle for it (``torch.multiprocessing.reductions.reduce_tensor``) and broadcasts only the handle's
few hundred bytes over the same host gloo group; each follower opens the handle, copies device to device into
its own staging tensor, and a barrier on the host group lets the lead reuse or free the buffer. Only
``make_fanout`` chooses between them, from the group's backend; the engine's receive loop does not change.

Imports only torch: the trainer side imports ``process_group`` from here without vLLM.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Protocol

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


class LocalFanout(Protocol):
    """How one host's lead hands each received buffer to the host's other engines. Called once per buffer,
    in the trainer's order, on every engine of the host (``pass_on`` on the lead, ``take`` elsewhere)."""

    def pass_on(self, buf: torch.Tensor) -> None:
        """Lead: ``buf`` (filled from the trainer) reaches every follower before this returns or fails."""
        ...

    def take(self, buf: torch.Tensor) -> None:
        """Follower: fill ``buf`` (allocated with the metadata the trainer sent) with the lead's buffer."""
        ...

    def close(self) -> None: ...


class GlooFanout:
    """The host's engines in one gloo group, the lead as root 0: a loopback broadcast per buffer."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def pass_on(self, buf: torch.Tensor) -> None:
        self.group.broadcast(buf, 0).wait()

    def take(self, buf: torch.Tensor) -> None:
        self.group.broadcast(buf, 0).wait()

    def close(self) -> None:
        close_group(self.group)


def make_fanout(store: Any, prefix: str, rank: int, world_size: int, backend: str, timeout_s: float) -> LocalFanout:
    """The host's local group. CPU: gloo. A CUDA IPC fanout (see the module docstring) would be chosen here
    for ``backend == "nccl"``; until it exists the host group is gloo on GPU too (a device buffer is staged
    through host memory by gloo)."""
    return GlooFanout(process_group(store, prefix, rank, world_size, GLOO, timeout_s))


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
