"""``cuda_ipc``: only CUDA IPC handles travel (a JSON manifest, ``wire.cuda_ipc``); generators on this host
that see the trainer's GPU open them and copy device to device."""

from __future__ import annotations

import json
from collections.abc import Mapping

import torch

from titan_rl_ext.rl.transports import register_transport
from titan_rl_ext.rl.transports.base import HttpTransport, Staged

NAME = "cuda_ipc"


@register_transport(NAME)
class CudaIpcTransport(HttpTransport):
    def stage(self, state_dict: Mapping[str, torch.Tensor]) -> Staged:
        from titan_rl_ext.wire.cuda_ipc import export_tensors

        manifest, keep_alive = export_tensors(state_dict)
        # the exported tensors stay alive (``hold``) until every generator has copied them: commit or abort
        return Staged(json.dumps(manifest).encode(), {"transport": NAME}, hold=keep_alive)
