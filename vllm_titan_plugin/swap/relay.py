"""Per-host relay for broadcast weight pushes: one engine per host takes the trainer's broadcast, the
others on that host take it from that engine (issue 43, item 2).

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

The groups and the packed-bucket layout it uses are ``titan_rl_ext.wire.collective``'s, shared with the
trainer's side (re-exported here for the engine).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from titan_rl_ext.wire.collective import (  # noqa: F401 - re-exported for the engine
    ALIGN_BYTES, BACKENDS, GLOO, NCCL, client_store, close_group, pack, packed_layout, process_group, unpack,
)


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
