"""How each transport's push body becomes a swap: read it, check it against the served spec, hand it to
the workers' loader (``orchestrator.locked_swap``). One intake per transport name (``wire.protocol.TRANSPORTS``).

- ``safetensors``: the body is a safetensors file, streamed into a temp file (``/dev/shm`` when available)
  inside the staging slot, refused (413) from ``Content-Length`` or as soon as it passes ``2 * model bytes
  + 1 MiB``, validated whole (names, shapes, dtypes, NaN/Inf) before any weight changes; the workers get its
  path, never pickled tensors.
- ``cuda_ipc`` (same host, GPU): the body is a JSON manifest of CUDA IPC handles (``wire.cuda_ipc``), its
  names, dtypes and shapes checked here; paused, each worker opens the handles, checks every tensor is
  finite and copies device to device.

Either carries the whole served set or, on a model serving LoRA adapters, exactly its adapter tensors
(``validate.push_spec``: all or none; the base weights stay as they are).

An intake raises ``PushRejected`` for a push it refuses; the route turns it into the answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from vllm_titan_plugin.swap.orchestrator import SwapDone, locked_swap, staging_slot
from vllm_titan_plugin.swap.state import SwapState
from vllm_titan_plugin.swap.validate import PushRejected, check_push, manifest_spec, max_bytes, validate_payload

MAX_MANIFEST_BYTES = 64 << 20
_SHM = "/dev/shm"
OCTET_STREAM = "application/octet-stream"


@dataclass(frozen=True)
class Push:
    """A push's query, parsed and checked by the route."""

    version: int
    mode: str
    pause: bool

    @property
    def keep_cache(self) -> bool:
        return self.mode == "keep"


@dataclass(frozen=True)
class Received:
    num_tensors: int
    bytes: int
    validate_seconds: float
    receive_seconds: float
    ready: float  # perf_counter when the payload was ready for the engine (the hop to its loop starts here)
    done: SwapDone


@dataclass(frozen=True)
class Intake:
    content_types: tuple[str, ...]  # besides none at all
    receive: Callable[[SwapState, Request, dict[str, list[Any]], Push], Awaitable[Received]]


def _payload_dir() -> str | None:
    # Shared memory keeps the handoff to the workers off the disk; fall back to the default temp dir.
    return _SHM if os.path.isdir(_SHM) and os.access(_SHM, os.W_OK) else None


async def _receive_to_file(request: Request, limit: int) -> tuple[str, int]:
    """Stream the body into a temp file, refusing (413) as soon as it passes ``limit`` bytes."""
    fd, path = tempfile.mkstemp(prefix="titan-weights-", suffix=".safetensors", dir=_payload_dir())
    size = 0
    try:
        with os.fdopen(fd, "wb") as out:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise PushRejected(413, f"payload exceeds {limit} bytes (2x the model's size + 1 MiB)")
                out.write(chunk)
    except BaseException:
        os.unlink(path)
        raise
    return path, size


def stale(version: int, current: int) -> PushRejected:
    return PushRejected(409, f"version {version} is not greater than the current version {current}")


async def receive_safetensors(state: SwapState, request: Request, spec: dict[str, list[Any]], push: Push) -> Received:
    limit = max_bytes(spec)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PushRejected(413, f"payload of {declared} bytes exceeds {limit} bytes (2x the model's size + 1 MiB)")
    path = None
    async with staging_slot(state):
        try:
            t0 = time.perf_counter()
            path, size = await _receive_to_file(request, limit)
            receive_s = time.perf_counter() - t0
            if push.version <= state.version:  # a concurrent push got there first (checked again under the lock)
                raise stale(push.version, state.version)
            t0 = time.perf_counter()
            num = await asyncio.to_thread(validate_payload, path, spec)
            ready = time.perf_counter()
            done = await state.on_engine_loop(
                locked_swap(state, "titan_load_weights", path, push.version, push.keep_cache, push.pause,
                            partial=num < len(spec)))  # validated: fewer tensors is an adapter-only push
        finally:
            if path is not None and os.path.exists(path):
                os.unlink(path)
    return Received(num, size, ready - t0, receive_s, ready, done)


async def receive_cuda_ipc(state: SwapState, request: Request, spec: dict[str, list[Any]], push: Push) -> Received:
    t0 = time.perf_counter()
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_MANIFEST_BYTES:
            raise PushRejected(413, f"CUDA IPC manifest exceeds {MAX_MANIFEST_BYTES} bytes")
    try:
        manifest = json.loads(body)
        if not isinstance(manifest, dict):
            raise ValueError("the manifest must be a JSON object")
        got = manifest_spec(manifest)
    except ValueError as e:
        raise PushRejected(400, f"invalid CUDA IPC manifest: {e}") from None
    check_push(spec, got)  # the whole set, or an adapter-only push (validate.push_spec)
    ready = time.perf_counter()
    done = await state.on_engine_loop(
        locked_swap(state, "titan_load_weights_ipc", manifest, push.version, push.keep_cache, push.pause,
                    partial=len(got) < len(spec)))
    return Received(len(got), len(body), 0.0, ready - t0, ready, done)


INTAKES: dict[str, Intake] = {
    "safetensors": Intake((OCTET_STREAM,), receive_safetensors),
    "cuda_ipc": Intake((OCTET_STREAM, "application/json"), receive_cuda_ipc),
}
