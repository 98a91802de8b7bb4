"""``titan_ipc``: our trainer pushes through vLLM's weight-transfer calls with CUDA IPC handles (issue 43).

The generator shares the trainer's host and sees its GPU, and runs the ``titan_ipc`` engine
(``vllm_titan_plugin.swap.transfer_engine``; ``--weight-transfer-config '{"backend": "titan_ipc"}'``), which
takes vLLM's ``ipc`` engine's update infos (names, dtype names, shapes, per-tensor handles) and stages what
it opens instead of loading it chunk by chunk. The call sequence and the commit are ``titan_gloo``'s
(``vllm_transfer``): ``/init_weight_transfer_engine`` once per generator boot (``{}``: IPC needs no
rendezvous), per version ``/start_weight_update``, one ``/update_weights`` per bucket, then
``/finish_weight_update`` with the version, committed through the server's ``locked_swap`` (all-or-none,
version tags, re-salted prefix cache, ``?mode=keep|recompute&pause=0|1``). A push that fails before the
finishes commits nowhere and the old weights keep serving; a generator that refuses or dies gets a failed
``PushResult``, as on every transport.

The handles travel as our JSON manifest (``wire.cuda_ipc``, field ``ipc_manifest``: no pickle, so the
server needs no ``VLLM_ALLOW_INSECURE_SERIALIZATION``); a foreign trainer may send vLLM's own
``ipc_handles_pickled`` instead. Each ``update_weights`` answers once the worker has copied the bucket into its
staging, so the trainer holds a bucket's exported tensors only for that call.

Options: ``bucket_bytes`` (per ``update_weights``; default 256 MiB) and ``timeout_s`` (kept for symmetry with
``titan_gloo``: the bound the pusher's calls run under). Needs CUDA on the trainer, and CUDA tensors in the
state dict: refused at start-up (``check_options``) on a host without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from titan_rl_ext.rl.transports import register_transport
from titan_rl_ext.rl.transports.vllm_transfer import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_TIMEOUT_S,
    INIT,
    UPDATE,
    Bucket,
    Topology,
    VllmTransferTransport,
)

NAME = "titan_ipc"
OPTION_KEYS = ("bucket_bytes", "timeout_s")


def cuda_problem() -> str | None:
    """Why this host cannot push by CUDA IPC, or None when it can."""
    if not torch.cuda.is_available():
        return (f"{NAME} needs CUDA on the trainer (it exports CUDA IPC handles to generators that see its GPU), "
                f"but torch.cuda.is_available() is False on this host; use titan_gloo (or safetensors) here")
    return None


def check_option_values(opts: Mapping[str, Any]) -> dict[str, Any]:
    """The options checked (``ValueError`` naming a key or a value) with defaults filled in; no CUDA check."""
    if not isinstance(opts, Mapping):
        raise ValueError(f"{NAME} options must be a JSON object, got {type(opts).__name__}")
    if unknown := sorted(set(opts) - set(OPTION_KEYS)):
        raise ValueError(f"{NAME}: unknown transport options {unknown}; it takes {list(OPTION_KEYS)}")
    size = opts.get("bucket_bytes", DEFAULT_BUCKET_BYTES)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{NAME} transport option 'bucket_bytes' must be an integer >= 1, got {size!r}")
    timeout = opts.get("timeout_s", DEFAULT_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
        raise ValueError(f"{NAME} transport option 'timeout_s' must be a number of seconds in (0, 3600], "
                         f"got {timeout!r}")
    return {"bucket_bytes": size, "timeout_s": float(timeout)}


def update_meta(bucket: Bucket) -> dict[str, Any]:
    """What an ``update_weights`` says of its bucket besides the handles: names (the served model's own,
    ``name_format: titan``, as ``titan_gloo`` sends them), torch dtype names and shapes, in order."""
    info = bucket.info()
    return {k: info[k] for k in ("names", "dtype_names", "shapes", "name_format")}


def update_info(bucket: Bucket) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The bucket's ``update_info`` with its IPC manifest, and the exported tensors (alive until the call answers)."""
    from titan_rl_ext.wire.cuda_ipc import export_tensors

    manifest, keep = export_tensors(dict(zip(bucket.names, bucket.tensors)))
    return {**update_meta(bucket), "ipc_manifest": manifest}, keep


@register_transport(NAME)
class TitanIpcTransport(VllmTransferTransport):
    """``VllmTransferTransport``'s push (sessions, retries without lost generators, the finish's commit) with no
    group: the bytes are IPC handles inside each ``update_weights``."""

    relay = False

    @staticmethod
    def check_options(opts: Mapping[str, Any]) -> dict[str, Any]:
        checked = check_option_values(opts)
        if problem := cuda_problem():
            raise ValueError(problem)
        return checked

    @staticmethod
    def server_engine(opts: Mapping[str, Any]) -> str:
        return NAME  # the engine is this transport's namesake whatever the options

    @property
    def name(self) -> str:
        return NAME

    def _ensure_group(self, boots: dict[str, str]) -> None:
        """No group: ``init_weight_transfer_engine`` (empty) once per generator boot, so its engine exists."""
        topo = Topology(dict(boots), list(boots))
        if self._topology == topo:
            return
        # the init calls are signed for these boots (``_call_all`` reads a kept topology's boots first)
        self._topology, self._building = None, topo.boots
        got = self._call_all(INIT, {u: {"init_info": {}} for u in boots})()
        self._topology = topo  # a refusal below fails the push, whose ``_close`` forgets it again
        self._check(got, INIT)

    def _transfer(self, live: list[str], buckets: list[Bucket]) -> None:
        self._start(live)
        try:
            for bucket in buckets:
                info, keep = update_info(bucket)
                torch.cuda.synchronize()  # the bytes behind the handles are written before a generator reads them
                got = self._call_all(UPDATE, {u: {"update_info": info} for u in live})()
                del keep  # every answer is in: each generator copied the bucket (or refused it)
                self._check(got, UPDATE)
        finally:
            # the exports' memory goes back to the trainer's allocator only once no generator holds it open
            torch.cuda.ipc_collect()
