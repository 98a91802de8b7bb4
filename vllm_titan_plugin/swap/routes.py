"""HTTP routes of the weight push (served by the OpenAI app and by the weights listener).

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

Reading and validating a payload happen on whichever event loop serves the route (the listener's own,
see ``swap.listener``); everything that talks to the engine runs on the API server's loop, where vLLM's
engine client lives (``SwapState.on_engine_loop``). The payload reaches the workers as a file path
(``/dev/shm`` when available), never as pickled tensors, one payload at a time (``staging_slot``: a second push
waits, its body unread, until the first has swapped or failed). The token is never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import re
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request  # module level: FastAPI resolves the string annotations

from titan_rl_ext.wire import signing
from titan_rl_ext.wire.protocol import (
    BI_ROUTE, CHECKSUMS_ROUTE, MODES, TRANSPORTS, VERSION_ROUTE, WEIGHTS_ROUTE,
)
from vllm_titan_plugin import checks, compat
from vllm_titan_plugin.swap import engine as engine_side
from vllm_titan_plugin.swap.ledger import VersionLedger
from vllm_titan_plugin.swap.validate import PushRejected, check_spec, manifest_spec, max_bytes, validate_payload
from vllm_titan_plugin.swap.worker import first_refusal

logger = logging.getLogger("vllm.titan_plugin")

SIGNED_ONLY_ENV = "TITAN_SWAP_SIGNED_ONLY"
"""``1``: refuse ``Bearer`` (the token on the wire) and take only signed requests (``wire.signing``)."""

MAX_MANIFEST_BYTES = 64 << 20
_SHM = "/dev/shm"
T = TypeVar("T")


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


class SwapState:
    """Per-server state: the weight version, the push lock (held on the engine's loop), the served spec."""

    def __init__(self, token: str, app: Any, ledger: VersionLedger | None = None) -> None:
        self._token = token.encode()
        self._nonces = signing.NonceLedger()
        self.signed_only = os.environ.get(SIGNED_ONLY_ENV, "0") == "1"
        self.app = app  # the OpenAI app: vLLM stores its engine client there once it is built
        self.ledger = ledger if ledger is not None else VersionLedger()  # per-token versions (swap.ledger)
        self.version = 0
        self.boot_id = uuid.uuid4().hex  # a restarted server is a different generator, even on the same port
        self.push_port: int | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the API server's (the engine client's)
        self.listener_loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None
        self._spec: dict[str, list[Any]] | None = None
        # why the served weights may be a mix of two versions (a push failed after its copy began): while
        # set, generation routes answer 503 (tagging.WeightVersionMiddleware) until a full push lands
        self.dirty: str | None = None
        # one payload staged at a time (see staging_slot); a thread semaphore: pushes arrive on two event loops
        self.staging = threading.BoundedSemaphore(1)

    def __repr__(self) -> str:  # never show the token
        return f"SwapState(version={self.version})"

    def note_loop(self) -> None:
        """Called on the API server's loop (app start, each generation request): where the engine lives."""
        if self.loop is None:
            self.loop = asyncio.get_running_loop()

    @property
    def engine(self) -> Any:
        return compat.engine_client_of(self.app)

    @property
    def lock(self) -> asyncio.Lock:
        if self._lock is None:  # created on the engine's loop, the only one that takes it
            self._lock = asyncio.Lock()
        return self._lock

    async def on_engine_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the API server's loop and wait for it from this one."""
        here = asyncio.get_running_loop()
        if self.loop is None and here is not self.listener_loop:
            self.loop = here
        if self.loop is here:
            return await coro
        if self.loop is None:
            coro.close()
            raise PushRejected(503, "the API server has not started serving yet; retry")
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def auth_error(self, authorization: str | None, method: str = "", path: str = "",
                   query: list[tuple[str, str]] | None = None) -> tuple[int, str] | None:
        """401/403 and why, or None: a ``Titan-HMAC`` signature of this request (method, path, query) for this
        boot (``wire.signing``), or -- unless ``TITAN_SWAP_SIGNED_ONLY=1`` -- ``Bearer <token>``."""
        if not authorization:
            return 401, "missing Authorization (Bearer <token> or a Titan-HMAC signature)"
        scheme, _, given = authorization.partition(" ")
        if scheme == signing.SCHEME:
            try:
                nonce, ts, sig = signing.parse(authorization)
            except ValueError as e:
                return 401, str(e)
            want = signing.signature(self._token, method, path, query or [], self.boot_id, nonce, ts)
            if not hmac.compare_digest(sig, want):
                return 403, "invalid signature (wrong token, another request, or another boot of this server)"
            if (why := self._nonces.admit(nonce, ts)) is not None:
                return 401, why
            return None
        if self.signed_only:
            return 401, f"this server takes {signing.SCHEME}-signed requests only ({SIGNED_ONLY_ENV}=1)"
        if scheme.lower() != "bearer" or not given.strip():
            return 401, "Authorization must be 'Bearer <token>' or a Titan-HMAC signature"
        if not hmac.compare_digest(given.strip().encode(), self._token):
            return 403, "invalid token"
        return None

    def request_auth_error(self, request: Request) -> tuple[int, str] | None:
        return self.auth_error(request.headers.get("authorization"), request.method, request.url.path,
                               list(request.query_params.multi_items()))

    async def spec(self) -> dict[str, list[Any]]:
        """The served parameters' names, dtypes and shapes (asked once; the model does not change shape)."""
        if self._spec is None:
            self._spec = await self.on_engine_loop(self._ask_spec())
        return self._spec

    async def _ask_spec(self) -> dict[str, list[Any]]:
        return (await compat.worker_rpc(self.engine, "titan_weight_spec"))[0]


def _error(status: int, message: str, tensors: list[str] | None = None) -> Any:
    from fastapi.responses import JSONResponse

    body: dict[str, Any] = {"detail": message}
    if tensors:
        body["tensors"] = tensors
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


@contextlib.asynccontextmanager
async def staging_slot(state: SwapState, poll_s: float = 0.02) -> AsyncIterator[None]:
    """Held from before a push reads its body until its payload file is deleted: concurrent pushes to one server
    stage one model's bytes in shared memory at a time, not one each (``/dev/shm`` is a share of the host's RAM).
    A later push waits here -- its body unread, so TCP holds the sender -- and then meets the version check as
    usual. Polled rather than awaited: the semaphore is shared by the API server's loop and the listener's, and
    a push cancelled while it waits has taken nothing."""
    while not state.staging.acquire(blocking=False):
        await asyncio.sleep(poll_s)
    try:
        yield
    finally:
        state.staging.release()


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


def _stale(version: int, current: int) -> Any:
    return _error(409, f"version {version} is not greater than the current version {current}")


def make_router(state: SwapState) -> Any:
    from fastapi import APIRouter

    router = APIRouter()

    @router.get(VERSION_ROUTE, response_model=VersionResponse)
    async def weight_version() -> VersionResponse:
        from titan_rl_ext.kernels.gdn import RECURRENT_ENV, recurrent_kernel

        try:
            kernel = recurrent_kernel()
        except ValueError:  # refused at start-up for a titan model; a native one does not run it
            kernel = os.environ.get(RECURRENT_ENV)
        return VersionResponse(version=state.version, boot_id=state.boot_id, push_port=state.push_port,
                               dirty=state.dirty, gdn_recurrent=kernel)

    @router.get(CHECKSUMS_ROUTE, response_model=ChecksumsResponse)
    async def weight_checksums(request: Request) -> Any:
        if (err := state.request_auth_error(request)) is not None:
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
        if (err := state.request_auth_error(request)) is not None:
            return _error(*err)
        raw = request.query_params.get("enabled")
        if raw not in ("0", "1", "true", "false"):
            return _error(400, "query parameter 'enabled' must be 0/1/true/false")
        enabled = raw in ("1", "true")
        config = getattr(state.engine, "vllm_config", None)
        if enabled and config is not None and (problem := checks.batch_invariance_problem(config)) is not None:
            return _error(409, problem)  # refused before anything is paused: the engine keeps serving as it was

        try:
            now = await state.on_engine_loop(_flip_batch_invariant(state, enabled))
        except PushRejected as e:
            return _error(e.status, e.message)
        logger.info("titan batch invariance %s", "on" if enabled else "off")
        return BatchInvariantResponse(batch_invariant=bool(all(now)))

    @router.post(WEIGHTS_ROUTE, response_model=PushResponse)
    async def push_weights(request: Request) -> Any:
        entered = time.time()
        if (err := state.request_auth_error(request)) is not None:
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
        if transport not in TRANSPORTS:
            return _error(400, f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if q.get("pause", "0") not in ("0", "1"):
            return _error(400, "query parameter 'pause' must be 0 or 1")
        pause = q.get("pause") == "1"
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        allowed = ("", "application/octet-stream") + (("application/json",) if transport == "cuda_ipc" else ())
        if ctype not in allowed:
            return _error(415, f"Content-Type must be application/octet-stream (a safetensors file), got {ctype!r}")
        if version <= state.version:
            return _stale(version, state.version)
        try:
            spec = await state.spec()
        except PushRejected as e:
            return _error(e.status, e.message)
        if transport == "cuda_ipc":
            return await _push_cuda_ipc(state, request, spec, version, mode, pause, entered)
        limit = max_bytes(spec)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return _error(413, f"payload of {declared} bytes exceeds {limit} bytes (2x the model's size + 1 MiB)")
        path = None
        try:
            async with staging_slot(state):
                try:
                    t0 = time.perf_counter()
                    path, size = await _receive_to_file(request, limit)
                    receive_s = time.perf_counter() - t0
                    if version <= state.version:  # a concurrent push got there first (checked again under the lock)
                        return _stale(version, state.version)
                    t0 = time.perf_counter()
                    num = await asyncio.to_thread(validate_payload, path, spec)
                    validate_s = time.perf_counter() - t0
                    done = await state.on_engine_loop(
                        _locked_swap(state, "titan_load_weights", path, version, keep_cache=(mode == "keep"), pause=pause))
                finally:
                    if path is not None and os.path.exists(path):
                        os.unlink(path)
        except PushRejected as e:
            logger.warning("titan weight push v%d rejected (%d): %s", version, e.status, e.message[:500])
            return _error(e.status, e.message, e.tensors)
        except ClientDisconnect:  # the pusher died or gave up mid-upload: nothing was swapped
            logger.warning("titan weight push v%d rejected: the client disconnected before the whole payload", version)
            return _error(400, "client disconnected before the whole payload arrived")
        except Exception as e:  # the workers re-check before copying, so the weights are still the old ones
            logger.exception("titan weight push v%d failed", version)
            return _error(500, f"weight swap failed: {type(e).__name__}: {e}")
        logger.info("titan weights v%d swapped in %.3f s (validated in %.3f s, %d tensors, %d bytes, mode=%s, "
                    "%d requests in flight)", version, done.seconds, validate_s, num, size, mode, done.in_flight)
        return PushResponse(version=version, boot_id=state.boot_id, num_tensors=num, bytes=size,
                            swap_seconds=done.seconds, validate_seconds=validate_s, in_flight=done.in_flight,
                            resalted=done.resalted,
                            entered_unix=entered, receive_seconds=receive_s,
                            hop_seconds=done.started - t0 - validate_s)

    return router


@dataclass(frozen=True)
class SwapDone:
    started: float  # perf_counter when the swap began on the engine's loop (before the lock)
    seconds: float  # from the first engine call to the new version being live
    in_flight: int  # requests holding tokens of the old weights
    resalted: int  # waiting requests re-salted for the new version


async def _locked_swap(state: SwapState, method: str, arg: Any, version: int, keep_cache: bool,
                       pause: bool = False) -> SwapDone:
    started = time.perf_counter()
    async with state.lock:
        if version <= state.version:
            raise PushRejected(409, f"version {version} is not greater than the current version {state.version}")
        seconds, answer = await _swap(state, method, arg, version, keep_cache, pause)
        return SwapDone(started, seconds, int(answer.get("in_flight", 0)), int(answer.get("resalted", 0)))


def _rejected(answer: dict[str, Any]) -> PushRejected:
    return PushRejected(int(answer.get("status", 422)), "; ".join(answer["problems"]), answer.get("tensors"))


@contextlib.contextmanager
def _dirty_on_failure(state: SwapState, version: int, where: str) -> Iterator[None]:
    """An exception here may come after some tensors were copied: the weights are then neither the old
    version nor the new one. Mark the server dirty (generation answers 503) until a full push lands."""
    try:
        yield
    except Exception as e:
        state.dirty = f"push of v{version} failed {where} ({type(e).__name__}: {str(e)[:200]}); the weights may " \
                      f"mix v{state.version} and v{version} until a full push lands"
        logger.error("titan: %s", state.dirty)
        raise


async def _flip_batch_invariant(state: SwapState, enabled: bool) -> list[Any]:
    """Pause (caches cleared), flip BI on every worker, resume -- resumed whatever raised, the pause included."""
    async with state.lock:
        try:
            await compat.pause_generation(state.engine, keep_cache=False)
            return await compat.worker_rpc(state.engine, "titan_set_batch_invariant", enabled)
        finally:
            await compat.resume_generation(state.engine)


async def _swap(state: SwapState, method: str, arg: Any, version: int, keep_cache: bool,
                pause: bool = False) -> tuple[float, dict[str, Any]]:
    """Copy the weights with the worker loader ``method(arg)``, set the engine core's version; returns the
    seconds it took and the engine core's answer (``engine.set_weight_version``). First as one engine-core utility between two steps (``engine.swap_between_steps``);
    when the engine has a batch in flight (or ``pause``), the long way: pause, copy, set, resume. A worker
    answering ``{"problems": ...}`` copied nothing: the version stays and the push is rejected."""
    engine = state.engine
    t0 = time.perf_counter()
    if not pause:
        with _dirty_on_failure(state, version, "between engine steps"):
            answer = await _set_version(state, version, engine_side.SWAP_UTILITY, method, arg, version, keep_cache)
        if answer.get("problems"):
            raise _rejected(answer)  # refused before the first copy: the weights are whole
        if not answer.get("busy"):
            state.version, state.dirty = version, None
            return time.perf_counter() - t0, answer
    try:
        # inside the try: vLLM marks the engine paused before the cache reset that can raise, so a pause that
        # fails part-way must still be resumed, or the engine stays paused for good
        await compat.pause_generation(engine, keep_cache=keep_cache)
        # vLLM 0.32's pause waits for the device; 0.26's does not: wait here before any weight changes
        await compat.worker_rpc(engine, "titan_synchronize_device")
        with _dirty_on_failure(state, version, "in a worker"):
            results = await compat.worker_rpc(engine, method, arg)
        if (refused := first_refusal(results)) is not None:
            raise _rejected(refused)  # that worker copied nothing
        # paused: no step ran since the copy, so the engine's token counts now are where the new weights begin
        with _dirty_on_failure(state, version, "after the copy, setting the engine's version"):
            answer = await _set_version(state, version, engine_side.UTILITY, version)
        state.version, state.dirty = version, None
    finally:
        await compat.resume_generation(engine)
    return time.perf_counter() - t0, answer


async def _set_version(state: SwapState, version: int, utility: str, *args: Any) -> dict[str, Any]:
    """Call an engine-core utility that may set ``version``, keeping the per-token versions exact
    (``swap.ledger``): ``begin`` in the same event-loop turn as the utility is sent, then ``commit`` with
    the engine's token counts when it set the version, ``cancel`` otherwise."""
    ledger = state.ledger
    ledger.begin(version)
    try:
        answer = await compat.call_engine_utility(state.engine, utility, *args)
    except BaseException:
        ledger.cancel()
        raise
    if "counts" in answer:
        ledger.commit(version, answer["counts"], compat.api_request_states(state.engine))
    else:  # busy, or the workers refused: nothing changed
        ledger.cancel()
    return answer


async def _push_cuda_ipc(state: SwapState, request: Request, spec: dict[str, list[Any]], version: int,
                         mode: str, pause: bool, entered: float) -> Any:
    """``transport=cuda_ipc``: a JSON manifest of CUDA IPC handles (``titan_rl_ext.wire.cuda_ipc``)."""
    t0 = time.perf_counter()
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_MANIFEST_BYTES:
            return _error(413, f"CUDA IPC manifest exceeds {MAX_MANIFEST_BYTES} bytes")
    try:
        manifest = json.loads(body)
        if not isinstance(manifest, dict):
            raise ValueError("the manifest must be a JSON object")
        got = manifest_spec(manifest)
    except ValueError as e:
        return _error(400, f"invalid CUDA IPC manifest: {e}")
    try:
        check_spec(spec, got)
        received = time.perf_counter()
        done = await state.on_engine_loop(
            _locked_swap(state, "titan_load_weights_ipc", manifest, version, keep_cache=(mode == "keep"), pause=pause))
    except PushRejected as e:
        logger.warning("titan weight push v%d (cuda_ipc) rejected (%d): %s", version, e.status, e.message[:500])
        return _error(e.status, e.message, e.tensors)
    except Exception as e:  # the workers check everything before the first copy
        logger.exception("titan weight push v%d (cuda_ipc) failed", version)
        return _error(500, f"weight swap failed: {type(e).__name__}: {e}")
    logger.info("titan weights v%d swapped in %.3f s over CUDA IPC (%d tensors, mode=%s)", version, done.seconds,
                len(got), mode)
    return PushResponse(version=version, boot_id=state.boot_id, num_tensors=len(got), bytes=len(body),
                        swap_seconds=done.seconds, validate_seconds=0.0, in_flight=done.in_flight,
                        resalted=done.resalted,
                        entered_unix=entered, receive_seconds=received - t0, hop_seconds=done.started - received)
