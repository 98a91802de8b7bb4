"""CUDA IPC weight transport: the trainer hands the generator *handles* to its GPU tensors instead of bytes.

When the trainer and a vLLM generator run on the same host and the generator's process can see the
trainer's GPU, a push does not need to move 18 GB through host memory: the trainer exports a CUDA IPC
handle per tensor, the generator's worker opens them and copies device to device into its parameters.

The manifest is plain JSON (no pickle): for every tensor its dtype, shape, stride, offsets and the
base64 of the handles torch's own CUDA sharing produces (``UntypedStorage._share_cuda_``); the
receiver rebuilds the tensors with ``torch.multiprocessing.reductions.rebuild_cuda_tensor``, the same
function torch uses behind ``multiprocessing`` queues. The sender must keep its tensors alive until
the receiver has copied them (``WeightPusher`` holds them for the duration of the request).

A process cannot open its own IPC handles, so sender and receiver are always different processes.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import torch

FORMAT = "titan-cuda-ipc/1"


def _b64(v: bytes | str | None) -> str | None:
    """Handles are bytes (the ref-counter one may be a str, depending on the torch build): keep the type."""
    if v is None:
        return None
    return "s:" + v if isinstance(v, str) else "b:" + base64.b64encode(v).decode()


def _unb64(v: str | None) -> bytes | str | None:
    if v is None:
        return None
    kind, _, body = v.partition(":")
    return body if kind == "s" else base64.b64decode(body)


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def export_tensors(state_dict: Mapping[str, torch.Tensor]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The JSON manifest of ``state_dict`` and the tensors it points to (keep them alive until the
    receiver is done). Every tensor must be on a CUDA device; non-contiguous ones are copied."""
    from torch.multiprocessing.reductions import reduce_tensor

    keep: list[torch.Tensor] = []
    entries: dict[str, Any] = {}
    uuids: dict[int, str] = {}
    for name, t in state_dict.items():
        if t.device.type != "cuda":
            raise ValueError(f"CUDA IPC transport needs CUDA tensors; {name} is on {t.device}")
        t = t.detach().contiguous()
        if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # the receiver accepts only a tensor that is its whole storage (see _check_entry)
        keep.append(t)
        _, args = reduce_tensor(t)
        (_, size, stride, offset, _, dtype, dev, handle, nbytes, off_bytes, _, rc_handle, rc_off, ev_handle, ev_sync) = args
        if dev not in uuids:
            uuids[dev] = device_uuid(dev)
        entries[name] = {
            "dtype": str(dtype).removeprefix("torch."), "shape": list(size), "stride": list(stride), "offset": offset,
            "device_uuid": uuids[dev], "handle": _b64(handle), "storage_bytes": nbytes, "storage_offset_bytes": off_bytes,
            "ref_counter_handle": _b64(rc_handle), "ref_counter_offset": rc_off,
            "event_handle": _b64(ev_handle), "event_sync_required": bool(ev_sync),
        }
    return {"format": FORMAT, "tensors": entries}, keep


def manifest_spec(manifest: Mapping[str, Any]) -> dict[str, tuple[torch.dtype, list[int]]]:
    """name -> (dtype, shape), checking the manifest's structure (``ValueError`` names what is wrong)."""
    if manifest.get("format") != FORMAT:
        raise ValueError(f"manifest format must be {FORMAT!r}, got {manifest.get('format')!r}")
    tensors = manifest.get("tensors")
    if not isinstance(tensors, dict):
        raise ValueError("manifest 'tensors' must be an object of name -> entry")
    out = {}
    for name, e in tensors.items():
        out[name] = _check_entry(name, e)
    return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_entry(name: str, e: Any) -> tuple[torch.dtype, list[int]]:
    """Everything torch's rebuild would trust, checked: the tensor must be exactly its whole storage
    (contiguous strides, element offset 0, storage bytes = numel x element size -- what ``export_tensors``
    sends), offsets non-negative integers, handles in this module's encoding. A forged view reaching
    beyond its storage would otherwise read (and copy into the model) memory the sender did not share."""
    dtype = getattr(torch, str(e.get("dtype")), None) if isinstance(e, dict) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name}: unknown dtype {e.get('dtype') if isinstance(e, dict) else e!r}")
    shape = e.get("shape")
    if not (isinstance(shape, list) and all(_is_int(s) and s >= 0 for s in shape)):
        raise ValueError(f"{name}: shape must be a list of non-negative integers, got {shape!r}")
    contiguous = list(torch.empty(shape, device="meta").stride()) if shape else []
    if e.get("stride") != contiguous:
        raise ValueError(f"{name}: stride must be the contiguous {contiguous} for shape {shape}, got {e.get('stride')!r}")
    if e.get("offset") != 0 or not _is_int(e.get("offset")):
        raise ValueError(f"{name}: offset must be 0 (a tensor is its whole storage), got {e.get('offset')!r}")
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype, device="meta").element_size()
    if e.get("storage_bytes") != nbytes or not _is_int(e.get("storage_bytes")):
        raise ValueError(f"{name}: storage_bytes must be {nbytes} ({numel} x {dtype}), got {e.get('storage_bytes')!r}")
    for field in ("storage_offset_bytes", "ref_counter_offset"):
        if not (_is_int(e.get(field)) and e[field] >= 0):
            raise ValueError(f"{name}: {field} must be a non-negative integer, got {e.get(field)!r}")
    if not isinstance(e.get("device_uuid"), str):
        raise ValueError(f"{name}: device_uuid must be a string")
    if not isinstance(e.get("event_sync_required"), bool):
        raise ValueError(f"{name}: event_sync_required must be true or false")
    for field, required in (("handle", True), ("ref_counter_handle", False), ("event_handle", False)):
        v = e.get(field)
        if v is None and not required:
            continue
        if not (isinstance(v, str) and v[:2] in ("b:", "s:")):
            raise ValueError(f"{name}: {field} must be an encoded handle ('b:<base64>' or 's:<text>'), got {v!r}")
        if v.startswith("b:"):
            try:
                base64.b64decode(v[2:], validate=True)
            except ValueError:
                raise ValueError(f"{name}: {field} is not valid base64") from None
    return dtype, shape


def _local_device(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    raise ValueError(f"the sender's GPU {uuid} is not visible in this process (CUDA_VISIBLE_DEVICES); "
                     "CUDA IPC needs both processes to see the GPU that holds the weights")


def import_tensors(manifest: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Open every handle of a manifest (in a process other than the sender's)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    manifest_spec(manifest)
    out = {}
    devices: dict[str, int] = {}
    for name, e in manifest["tensors"].items():
        dev = devices.setdefault(e["device_uuid"], _local_device(e["device_uuid"]))
        out[name] = rebuild_cuda_tensor(
            torch.Tensor, torch.Size(e["shape"]), tuple(e["stride"]), int(e["offset"]), torch.UntypedStorage,
            getattr(torch, e["dtype"]), dev, _unb64(e["handle"]), int(e["storage_bytes"]), int(e["storage_offset_bytes"]),
            False, _unb64(e["ref_counter_handle"]), int(e["ref_counter_offset"]), _unb64(e["event_handle"]),
            bool(e["event_sync_required"]),
        )
    return out
