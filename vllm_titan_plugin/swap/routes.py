"""HTTP routes of the weight push (served by the OpenAI app and by the weights listener): each request is
authenticated from its headers (``swap.auth``) before a byte of its body is read, its query checked, then
handed to the intake of its transport (``swap.intake``) and the swap (``swap.orchestrator``).

- ``POST /titan/v1/weights?version=N[&mode=keep|recompute][&pause=1]``, ``Authorization: Titan-HMAC ...`` (a
  signature of this request for this boot, ``wire.signing``) or ``Bearer <token>``, body = the bytes of a
  safetensors file with the full titan state dict under titan names. 401 no token, a replayed or stale
  signature, 403 wrong token or signature, 400 bad query or unparseable payload, 409 ``version`` not above the current one,
  413 payload over ``2 * model bytes + 1 MiB`` (refused from ``Content-Length`` before reading, or as
  soon as the stream passes the bound), 422 wrong/missing/extra names, shapes, dtypes or NaN/Inf,
  naming the tensors. Everything is validated before any weight changes. Then, between two engine
  steps, in one engine-core utility call: copy the tensors into the parameters in place in the workers
  (``keep``: in-flight requests keep their KV/GDN state; ``recompute``: they are preempted and
  recompute), set the engine core's version (outputs carry it from the next step on; waiting requests
  get its salt). An engine with a batch in flight (async scheduling), or ``pause=1``, gets the same
  steps inside a pause of the scheduler instead.
- ``POST /titan/v1/weights?version=N&transport=cuda_ipc`` (same host, GPU): the body is a JSON manifest of
  CUDA IPC handles (``titan_rl_ext.wire.cuda_ipc``). Names, dtypes and shapes are checked from the
  manifest (422), then, paused, each worker opens the handles, checks every tensor is finite (422,
  nothing copied) and copies device to device.
- ``GET /titan/v1/weights/version`` -> ``{"version": N, "boot_id": B, "push_port": P}`` (``B``: drawn at
  start-up, ``P``: the weights listener).
- ``GET /titan/v1/weights/checksums`` (token required) -> per-parameter sha256 of the live weights.
- ``POST /titan/v1/batch_invariant?enabled=0|1`` (token required): the BI switch.
- vLLM's ``/finish_weight_update`` of a server started with the ``titan_gloo`` weight-transfer engine becomes a
  commit of the staged transfer through the same swap (``swap.transfer_commit``, docs/transfer_engines.md).

Reading and validating a payload happen on whichever event loop serves the route (the listener's own,
see ``swap.listener``); everything that talks to the engine runs on the API server's loop, where vLLM's
engine client lives (``SwapState.on_engine_loop``, ``swap.state``). The payload reaches the workers as a file path
(``/dev/shm`` when available), never as pickled tensors, one payload at a time (``staging_slot``: a second push
waits, its body unread, until the first has swapped or failed). The token is never logged.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request  # module level: FastAPI resolves the string annotations

from titan_rl_ext import settings
from titan_rl_ext.wire.protocol import BI_ROUTE, CHECKSUMS_ROUTE, MODES, VERSION_ROUTE, WEIGHTS_ROUTE
from vllm_titan_plugin import checks, compat
from vllm_titan_plugin.swap.intake import INTAKES, Push, stale
from vllm_titan_plugin.swap.orchestrator import flip_batch_invariant
from vllm_titan_plugin.swap.state import SwapState
from vllm_titan_plugin.swap.validate import PushRejected

logger = logging.getLogger("vllm.titan_plugin")


class PushResponse(BaseModel):
    version: int
    boot_id: str
    num_tensors: int
    bytes: int
    swap_seconds: float
    validate_seconds: float
    # requests that held tokens of the old weights when the swap landed: their later tokens carry ``version``
    in_flight: int
    resalted: int = 0  # requests waiting in the engine, salted for the old version, given the new one
    # where a push's time goes: the server's wall clock when the route started (a pusher on the same host
    # gets the queueing before it), reading the body, and waiting for the engine's event loop
    entered_unix: float
    receive_seconds: float
    hop_seconds: float


class BatchInvariantResponse(BaseModel):
    batch_invariant: bool


class VersionResponse(BaseModel):
    version: int
    boot_id: str
    push_port: int | None = None
    # set while the weights may be mixed after a failed push (generation answers 503 meanwhile)
    dirty: str | None = None
    gdn_recurrent: str | None = None  # protocol.GDN_RECURRENT_FIELD


class ChecksumsResponse(BaseModel):
    version: int
    checksums: dict[str, str]


def _error(status: int, message: str, tensors: list[str] | None = None) -> Any:
    from fastapi.responses import JSONResponse

    body: dict[str, Any] = {"detail": message}
    if tensors:
        body["tensors"] = tensors
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


def make_router(state: SwapState) -> Any:
    from fastapi import APIRouter

    from vllm_titan_plugin.swap import transfer_commit

    # vLLM's own /finish_weight_update (a dev route, behind the push token) on a server whose weight-transfer
    # backend is titan_gloo commits through this server's swap path (swap.transfer_commit)
    transfer_commit.bind(state)
    router = APIRouter()

    @router.get(VERSION_ROUTE, response_model=VersionResponse)
    async def weight_version() -> VersionResponse:
        from titan_rl_ext.kernels.gdn import recurrent_kernel

        try:
            kernel = recurrent_kernel()
        except ValueError:  # refused at start-up for a titan model; a native one does not run it
            kernel = settings.GDN_RECURRENT.raw()
        return VersionResponse(version=state.version, boot_id=state.boot_id, push_port=state.push_port,
                               dirty=state.dirty, gdn_recurrent=kernel)

    @router.get(CHECKSUMS_ROUTE, response_model=ChecksumsResponse)
    async def weight_checksums(request: Request) -> Any:
        if (err := state.auth.request_error(request)) is not None:
            return _error(*err)

        async def read() -> ChecksumsResponse:
            async with state.lock:  # not in the middle of a swap
                sums = (await compat.worker_rpc(state.engine, "titan_weight_checksums"))[0]
                return ChecksumsResponse(version=state.version, checksums=sums)

        try:
            return await state.on_engine_loop(read())
        except PushRejected as e:
            return _error(e.status, e.message)

    @router.post(BI_ROUTE, response_model=BatchInvariantResponse)
    async def set_batch_invariant(request: Request) -> Any:
        """BI as a debug switch, flipped together with the trainer. The engine is paused with its caches
        cleared: BI attention keeps keys/values in its own paged layout, which the backend's kernels must
        not read (and vice versa), so in-flight requests are recomputed under the new setting."""
        if (err := state.auth.request_error(request)) is not None:
            return _error(*err)
        raw = request.query_params.get("enabled")
        if raw not in ("0", "1", "true", "false"):
            return _error(400, "query parameter 'enabled' must be 0/1/true/false")
        enabled = raw in ("1", "true")
        config = getattr(state.engine, "vllm_config", None)
        if enabled and config is not None and (problem := checks.batch_invariance_problem(config)) is not None:
            return _error(409, problem)  # refused before anything is paused: the engine keeps serving as it was

        try:
            now = await state.on_engine_loop(flip_batch_invariant(state, enabled))
        except PushRejected as e:
            return _error(e.status, e.message)
        logger.info("titan batch invariance %s", "on" if enabled else "off")
        return BatchInvariantResponse(batch_invariant=bool(all(now)))

    @router.post(WEIGHTS_ROUTE, response_model=PushResponse)
    async def push_weights(request: Request) -> Any:
        entered = time.time()
        if (err := state.auth.request_error(request)) is not None:
            return _error(*err)
        q = request.query_params
        raw = q.get("version", "")
        # plain ASCII decimal below 2**63: int() would also take "1_0", " 13 ", other scripts' digits,
        # and a huge version would block every later push (and overflow the trainer's int64 versions)
        if not re.fullmatch(r"-?[0-9]{1,19}", raw) or int(raw) >= 2**63:
            return _error(400, "query parameter 'version' must be a decimal integer below 2**63")
        version = int(raw)
        mode = q.get("mode", "keep")
        if mode not in MODES:
            return _error(400, f"mode must be one of {MODES}, got {mode!r}")
        transport = q.get("transport", "safetensors")
        intake = INTAKES.get(transport)
        if intake is None:
            return _error(400, f"transport must be one of {tuple(INTAKES)}, got {transport!r}")
        if q.get("pause", "0") not in ("0", "1"):
            return _error(400, "query parameter 'pause' must be 0 or 1")
        pause = q.get("pause") == "1"
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype not in ("", *intake.content_types):
            return _error(415, f"Content-Type must be application/octet-stream (a safetensors file), got {ctype!r}")
        if version <= state.version:
            return _error(409, stale(version, state.version).message)
        try:
            spec = await state.spec()
        except PushRejected as e:
            return _error(e.status, e.message)
        try:
            got = await intake.receive(state, request, spec, Push(version, mode, pause))
        except PushRejected as e:
            logger.warning("titan weight push v%d (%s) rejected (%d): %s", version, transport, e.status, e.message[:500])
            return _error(e.status, e.message, e.tensors)
        except ClientDisconnect:  # the pusher died or gave up mid-upload: nothing was swapped
            logger.warning("titan weight push v%d rejected: the client disconnected before the whole payload", version)
            return _error(400, "client disconnected before the whole payload arrived")
        except Exception as e:  # the workers check everything before the first copy: the weights are the old ones
            logger.exception("titan weight push v%d (%s) failed", version, transport)
            return _error(500, f"weight swap failed: {type(e).__name__}: {e}")
        done = got.done
        logger.info("titan weights v%d swapped in %.3f s over %s (validated in %.3f s, %d tensors, %d bytes, mode=%s, "
                    "%d requests in flight)", version, done.seconds, transport, got.validate_seconds, got.num_tensors,
                    got.bytes, mode, done.in_flight)
        return PushResponse(version=version, boot_id=state.boot_id, num_tensors=got.num_tensors, bytes=got.bytes,
                            swap_seconds=done.seconds, validate_seconds=got.validate_seconds, in_flight=done.in_flight,
                            resalted=done.resalted, entered_unix=entered, receive_seconds=got.receive_seconds,
                            hop_seconds=done.started - got.ready)

    return router
