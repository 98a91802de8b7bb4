"""Weight push + in-place swap for the OpenAI API server (issue 5). On only when ``TITAN_SWAP_TOKEN`` is set.

Routes (added to vLLM's app by wrapping its ``build_app``, see ``compat.wrap_api_server_build_app``):

- ``POST /titan/v1/weights?version=N[&mode=keep|recompute]``, ``Authorization: Bearer <token>``, body =
  the bytes of a safetensors file with the full titan state dict under titan names. 401 no token,
  403 wrong token, 400 bad query or unparseable payload, 409 ``version`` not above the current one,
  413 payload over ``2 * model bytes + 1 MiB`` (refused from ``Content-Length`` before reading, or as
  soon as the stream passes the bound), 422 wrong/missing/extra names, shapes, dtypes or NaN/Inf,
  naming the tensors. Everything is validated before any weight changes. Then: pause the engine
  (``keep``: in-flight requests keep their KV/GDN state; ``recompute``: they are preempted and
  recompute), copy the tensors into the parameters in place in the workers, bump the version, resume.
- ``POST /titan/v1/weights?version=N&transport=cuda_ipc`` (same host, GPU): the body is a JSON manifest of
  CUDA IPC handles (``titan_rl_ext.wire.cuda_ipc``) instead of bytes. Names, dtypes and shapes are checked
  from the manifest (422), then, paused, each worker opens the handles, checks every tensor is finite
  (422, nothing copied) and copies device to device.
- ``GET /titan/v1/weights/version`` -> ``{"version": N}``.
- ``GET /titan/v1/weights/checksums`` (token required) -> per-parameter sha256 of the live weights.

A middleware on ``/v1/completions`` and ``/v1/chat/completions`` injects ``cache_salt="titan-v<N>"``
unless the client set one (no prefix computed with old weights is reused after a swap), adds the
``x-titan-weight-version`` response header and, in streams, a top-level ``"titan_weight_version"``
field to every SSE JSON chunk, set to the version current when the chunk leaves the server.

The payload reaches the workers as a file path (``/dev/shm`` when available), never as pickled
tensors; the worker-side functions are worker methods called by name through ``collective_rpc``.
The token is never logged.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import torch
from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request  # module level: FastAPI resolves the string annotations

from titan_rl_ext.wire.protocol import (
    BI_ROUTE, CHECKSUMS_ROUTE, MODES, SALT_PREFIX, TOKEN_ENV, TRANSPORTS, VERSION_FIELD, VERSION_HEADER, VERSION_ROUTE,
    WEIGHTS_ROUTE,
)
from vllm_titan_plugin import checks, compat

logger = logging.getLogger("vllm.titan_plugin")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
# After the pause returns, outputs of the last engine step may still be on their way through the
# API server's output handler; they carry the old weights and must be tagged with the old version.
FLUSH_SECONDS = 0.05
_MARK = "__titan_swap__"
_SHM = "/dev/shm"

# safetensors dtype names (the header's "dtype" strings) of the torch dtypes a parameter can have.
_ST_DTYPE: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_FLOAT_ST = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


# -- plugin hook -----------------------------------------------------------------------------------------
def install() -> None:
    """Called by the plugin entry point in every vLLM process; a no-op unless ``TITAN_SWAP_TOKEN`` is set.
    Workers get the swap methods; the API-server process gets the routes and the middleware."""
    if not os.environ.get(TOKEN_ENV):
        return
    compat.install_worker_methods({
        "titan_weight_spec": worker_weight_spec,
        "titan_load_weights": worker_load_weights,
        "titan_load_weights_ipc": worker_load_weights_ipc,
        "titan_weight_checksums": worker_weight_checksums,
        "titan_set_batch_invariant": worker_set_batch_invariant,
    })
    compat.wrap_api_server_build_app(_attach, _MARK)


def _attach(app: Any) -> Any:
    token = os.environ.get(TOKEN_ENV, "")
    if not token:  # unset between plugin load and app build: stay off
        return app
    state = SwapState(token)
    app.state.titan_swap = state
    app.include_router(_make_router(state))
    compat.add_asgi_middleware(app, WeightVersionMiddleware, state=state)
    logger.info("titan weight swap enabled: POST %s (token from $%s)", WEIGHTS_ROUTE, TOKEN_ENV)
    return app


# -- worker side (run inside each vLLM worker through collective_rpc) ------------------------------------
def _titan_params(worker: Any) -> dict[str, torch.nn.Parameter]:
    model = compat.worker_model(worker)
    get = getattr(model, "titan_parameters", None)
    if get is None:
        raise RuntimeError(f"weight push needs --model-impl titan (served model is {type(model).__name__})")
    return {name: p for name, (_, p) in get().items()}


def _spec_of(params: dict[str, torch.Tensor]) -> dict[str, list[Any]]:
    return {name: [_ST_DTYPE[p.dtype], list(p.shape)] for name, p in params.items()}


def worker_weight_spec(worker: Any) -> dict[str, list[Any]]:
    """titan name -> [safetensors dtype, shape] of every parameter (JSON-friendly for the RPC reply)."""
    return _spec_of(_titan_params(worker))


@torch.no_grad()
def worker_load_weights(worker: Any, path: str) -> int:
    """Copy every tensor of the safetensors file at ``path`` into the parameter of the same titan name, in
    place (the engine is paused). Names, shapes and dtypes are re-checked before the first copy, so a
    mismatch never leaves a half-swapped model."""
    from safetensors import safe_open

    params = _titan_params(worker)
    with safe_open(path, framework="pt", device="cpu") as f:
        problems = _spec_problems(_spec_of(params), _file_spec(f))
        if problems:
            raise ValueError("; ".join(problems))
        for name, p in params.items():
            p.copy_(f.get_tensor(name))
    return len(params)


@torch.no_grad()
def worker_load_weights_ipc(worker: Any, manifest: dict[str, Any]) -> dict[str, Any]:
    """Open the sender's CUDA IPC handles, check names/shapes/dtypes and finiteness of *every* tensor,
    then copy device to device. Returns ``{"num_tensors": n}`` or ``{"problems": [...], "tensors": [...]}``
    with nothing copied."""
    from titan_rl_ext.wire.cuda_ipc import import_tensors

    params = _titan_params(worker)
    if any(p.device.type != "cuda" for p in params.values()):
        return {"problems": ["transport=cuda_ipc needs a generator on CUDA; this one serves on "
                             f"{next(iter(params.values())).device.type} (use the default safetensors transport)"],
                "tensors": [], "status": 400}
    problems = _spec_problems(_spec_of(params), _manifest_spec(manifest))
    if problems:
        return {"problems": problems, "tensors": [], "status": 422}
    tensors = import_tensors(manifest)
    try:
        nonfinite = [n for n, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
        if nonfinite:
            return {"problems": [f"NaN/Inf in tensors: {_names(nonfinite)}"], "tensors": nonfinite, "status": 422}
        for name, p in params.items():
            p.copy_(tensors[name])
        torch.cuda.synchronize()  # the sender may free its tensors once we answer
    finally:
        del tensors
    return {"num_tensors": len(params)}


def worker_weight_checksums(worker: Any) -> dict[str, str]:
    from titan_rl_ext.wire.weights import tensor_checksum

    return {name: tensor_checksum(p) for name, p in _titan_params(worker).items()}


def worker_set_batch_invariant(worker: Any, enabled: bool) -> bool:
    """The batch-invariance switch inside a worker (the model's kernels read it on every call)."""
    from titan_rl_ext.kernels.batch_invariant import is_batch_invariant, set_batch_invariant

    set_batch_invariant(bool(enabled))
    return is_batch_invariant()


# -- validation (API-server process, off the event loop) -------------------------------------------------
class PushRejected(Exception):
    def __init__(self, status: int, message: str, tensors: list[str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.tensors = status, message, tensors or []


def _manifest_spec(manifest: dict[str, Any]) -> dict[str, list[Any]]:
    """A CUDA IPC manifest's [safetensors dtype, shape] per name (``ValueError`` on a malformed one)."""
    from titan_rl_ext.wire.cuda_ipc import manifest_spec

    return {n: [_ST_DTYPE.get(dt, str(dt)), shape] for n, (dt, shape) in manifest_spec(manifest).items()}


def _file_spec(f: Any) -> dict[str, list[Any]]:
    out = {}
    for name in f.keys():
        sl = f.get_slice(name)
        out[name] = [sl.get_dtype(), list(sl.get_shape())]
    return out


def _names(names: list[str], limit: int = 20) -> str:
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def _spec_problems(expected: dict[str, list[Any]], got: dict[str, list[Any]]) -> list[str]:
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    common = sorted(set(expected) & set(got))
    shape = [f"{n} {tuple(got[n][1])} != {tuple(expected[n][1])}" for n in common if got[n][1] != expected[n][1]]
    dtype = [f"{n} {got[n][0]} != {expected[n][0]}" for n in common if got[n][0] != expected[n][0]]
    problems = []
    if missing:
        problems.append(f"missing tensors: {_names(missing)}")
    if extra:
        problems.append(f"unexpected tensors: {_names(extra)}")
    if shape:
        problems.append(f"wrong shape: {_names(shape)}")
    if dtype:
        problems.append(f"wrong dtype: {_names(dtype)}")
    return problems


def _check_spec(expected: dict[str, list[Any]], got: dict[str, list[Any]]) -> None:
    """``PushRejected(422)`` naming every missing, extra or mismatched tensor."""
    problems = _spec_problems(expected, got)
    if problems:
        bad = sorted((set(expected) ^ set(got)) | {n for n in set(expected) & set(got) if got[n] != expected[n]})
        raise PushRejected(422, "; ".join(problems), bad)


def _duplicate_names(path: str) -> list[str]:
    """Names that occur more than once in the safetensors header (``safe_open`` keeps the last one)."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")  # already bounded by safe_open
        header = fh.read(n)
    dups: set[str] = set()

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for k, _ in items:
            (dups if k in seen else seen).add(k)
        return dict(items)

    json.loads(header, object_pairs_hook=pairs)
    return sorted(dups)


def validate_payload(path: str, expected: dict[str, list[Any]]) -> int:
    """Raise ``PushRejected`` (400 unparseable, 422 mismatched or non-finite) or return the tensor count."""
    from safetensors import safe_open

    try:
        f = safe_open(path, framework="pt", device="cpu")
    except Exception as e:  # SafetensorError, OSError, ...: truncated or corrupted bytes
        raise PushRejected(400, f"payload is not a valid safetensors file: {e}") from None
    with f:
        try:
            got = _file_spec(f)
        except Exception as e:
            raise PushRejected(400, f"payload is not a valid safetensors file: {e}") from None
        if dups := _duplicate_names(path):
            # the format forbids them, and two readers could pick different entries
            raise PushRejected(400, f"payload is not a valid safetensors file: duplicate tensor names: {_names(dups)}", dups)
        _check_spec(expected, got)
        nonfinite = []
        for name, (dt, _) in got.items():
            if dt in _FLOAT_ST and not bool(torch.isfinite(f.get_tensor(name)).all()):
                nonfinite.append(name)
        if nonfinite:
            raise PushRejected(422, f"NaN/Inf in tensors: {_names(nonfinite)}", nonfinite)
    return len(got)


# -- API-server state, routes ---------------------------------------------------------------------------
class PushResponse(BaseModel):
    version: int
    num_tensors: int
    bytes: int
    swap_seconds: float
    validate_seconds: float


class BatchInvariantResponse(BaseModel):
    batch_invariant: bool


class VersionResponse(BaseModel):
    version: int


class ChecksumsResponse(BaseModel):
    version: int
    checksums: dict[str, str]


class SwapState:
    """Per-app state: the weight version, the push lock, and an event that is clear while swapping."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()
        self.version = 0
        self.lock = asyncio.Lock()
        self.idle = asyncio.Event()
        self.idle.set()
        self._spec: dict[str, list[Any]] | None = None

    def __repr__(self) -> str:  # never show the token
        return f"SwapState(version={self.version})"

    def auth_error(self, authorization: str | None) -> tuple[int, str] | None:
        if not authorization:
            return 401, "missing Authorization: Bearer token"
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return 401, "Authorization must be 'Bearer <token>'"
        if not hmac.compare_digest(given.strip().encode(), self._token):
            return 403, "invalid token"
        return None

    async def spec(self, engine: Any) -> dict[str, list[Any]]:
        """The served parameters' names, dtypes and shapes (asked once; the model does not change shape)."""
        if self._spec is None:
            self._spec = (await compat.worker_rpc(engine, "titan_weight_spec"))[0]
        return self._spec

    @staticmethod
    def max_bytes(spec: dict[str, list[Any]]) -> int:
        model_bytes = 0
        for dt, shape in spec.values():
            n = 1
            for s in shape:
                n *= s
            model_bytes += n * torch.tensor([], dtype=_TORCH_DTYPE[dt]).element_size()
        return 2 * model_bytes + (1 << 20)


_TORCH_DTYPE = {v: k for k, v in _ST_DTYPE.items()}


def _error(status: int, message: str, tensors: list[str] | None = None) -> Any:
    from fastapi.responses import JSONResponse

    body: dict[str, Any] = {"detail": message}
    if tensors:
        body["tensors"] = tensors
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


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


def _make_router(state: SwapState) -> Any:
    from fastapi import APIRouter

    router = APIRouter()

    @router.get(VERSION_ROUTE, response_model=VersionResponse)
    async def weight_version() -> VersionResponse:
        return VersionResponse(version=state.version)

    @router.get(CHECKSUMS_ROUTE, response_model=ChecksumsResponse)
    async def weight_checksums(request: Request) -> Any:
        if (err := state.auth_error(request.headers.get("authorization"))) is not None:
            return _error(*err)
        engine = compat.engine_client_of(request.app)
        async with state.lock:  # not in the middle of a swap
            sums = (await compat.worker_rpc(engine, "titan_weight_checksums"))[0]
            return ChecksumsResponse(version=state.version, checksums=sums)

    @router.post(BI_ROUTE, response_model=BatchInvariantResponse)
    async def set_batch_invariant(request: Request) -> Any:
        """BI as a debug switch, flipped together with the trainer. The engine is paused with its caches
        cleared: BI attention keeps keys/values in its own paged layout, which the backend's kernels must
        not read (and vice versa), so in-flight requests are recomputed under the new setting."""
        if (err := state.auth_error(request.headers.get("authorization"))) is not None:
            return _error(*err)
        raw = request.query_params.get("enabled")
        if raw not in ("0", "1", "true", "false"):
            return _error(400, "query parameter 'enabled' must be 0/1/true/false")
        enabled = raw in ("1", "true")
        engine = compat.engine_client_of(request.app)
        config = getattr(engine, "vllm_config", None)
        if enabled and config is not None and (problem := checks.batch_invariance_problem(config)) is not None:
            return _error(409, problem)  # refused before anything is paused: the engine keeps serving as it was
        async with state.lock:
            await compat.pause_generation(engine, keep_cache=False)
            try:
                now = await compat.worker_rpc(engine, "titan_set_batch_invariant", enabled)
            finally:
                await compat.resume_generation(engine)
        logger.info("titan batch invariance %s", "on" if enabled else "off")
        return BatchInvariantResponse(batch_invariant=bool(all(now)))

    @router.post(WEIGHTS_ROUTE, response_model=PushResponse)
    async def push_weights(request: Request) -> Any:
        if (err := state.auth_error(request.headers.get("authorization"))) is not None:
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
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        allowed = ("", "application/octet-stream") + (("application/json",) if transport == "cuda_ipc" else ())
        if ctype not in allowed:
            return _error(415, f"Content-Type must be application/octet-stream (a safetensors file), got {ctype!r}")
        if version <= state.version:
            return _error(409, f"version {version} is not greater than the current version {state.version}")
        engine = compat.engine_client_of(request.app)
        spec = await state.spec(engine)
        if transport == "cuda_ipc":
            return await _push_cuda_ipc(state, engine, request, spec, version, mode)
        limit = state.max_bytes(spec)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return _error(413, f"payload of {declared} bytes exceeds {limit} bytes (2x the model's size + 1 MiB)")
        path = None
        try:
            path, size = await _receive_to_file(request, limit)
            async with state.lock:
                if version <= state.version:  # a concurrent push got there first
                    return _error(409, f"version {version} is not greater than the current version {state.version}")
                t0 = time.perf_counter()
                num = await asyncio.to_thread(validate_payload, path, spec)
                validate_s = time.perf_counter() - t0
                swap_s = await _swap(state, engine, "titan_load_weights", path, version, keep_cache=(mode == "keep"))
        except PushRejected as e:
            logger.warning("titan weight push v%d rejected (%d): %s", version, e.status, e.message[:500])
            return _error(e.status, e.message, e.tensors)
        except ClientDisconnect:  # the pusher died or gave up mid-upload: nothing was swapped
            logger.warning("titan weight push v%d rejected: the client disconnected before the whole payload", version)
            return _error(400, "client disconnected before the whole payload arrived")
        except Exception as e:  # the workers re-check before copying, so the weights are still the old ones
            logger.exception("titan weight push v%d failed", version)
            return _error(500, f"weight swap failed: {type(e).__name__}: {e}")
        finally:
            if path is not None and os.path.exists(path):
                os.unlink(path)
        logger.info("titan weights v%d swapped in %.3f s (validated in %.3f s, %d tensors, %d bytes, mode=%s)",
                    version, swap_s, validate_s, num, size, mode)
        return PushResponse(version=version, num_tensors=num, bytes=size, swap_seconds=swap_s,
                            validate_seconds=validate_s)

    return router


async def _swap(state: SwapState, engine: Any, method: str, arg: Any, version: int, keep_cache: bool) -> float:
    """Pause, run the worker loader ``method(arg)`` in every worker, bump the version, resume; returns the
    seconds paused. A worker answering ``{"problems": ...}`` copied nothing: the version stays and the
    push is rejected (``PushRejected``)."""
    t0 = time.perf_counter()
    state.idle.clear()  # new generation requests wait in the middleware: they get the new salt
    try:
        await compat.pause_generation(engine, keep_cache=keep_cache)
        try:
            await asyncio.sleep(FLUSH_SECONDS)  # let chunks produced by the old weights leave as the old version
            results = await compat.worker_rpc(engine, method, arg)
            bad = [r for r in results if isinstance(r, dict) and r.get("problems")]
            if bad:
                raise PushRejected(int(bad[0].get("status", 422)), "; ".join(bad[0]["problems"]), bad[0].get("tensors"))
            state.version = version  # paused: the next token is the first of the new weights
        finally:
            await compat.resume_generation(engine)
    finally:
        state.idle.set()
    return time.perf_counter() - t0


MAX_MANIFEST_BYTES = 64 << 20


async def _push_cuda_ipc(state: SwapState, engine: Any, request: Request, spec: dict[str, list[Any]], version: int,
                         mode: str) -> Any:
    """``transport=cuda_ipc``: a JSON manifest of CUDA IPC handles (``titan_rl_ext.wire.cuda_ipc``)."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_MANIFEST_BYTES:
            return _error(413, f"CUDA IPC manifest exceeds {MAX_MANIFEST_BYTES} bytes")
    try:
        manifest = json.loads(body)
        if not isinstance(manifest, dict):
            raise ValueError("the manifest must be a JSON object")
        got = _manifest_spec(manifest)
    except ValueError as e:
        return _error(400, f"invalid CUDA IPC manifest: {e}")
    try:
        _check_spec(spec, got)
        async with state.lock:
            if version <= state.version:
                return _error(409, f"version {version} is not greater than the current version {state.version}")
            swap_s = await _swap(state, engine, "titan_load_weights_ipc", manifest, version, keep_cache=(mode == "keep"))
    except PushRejected as e:
        logger.warning("titan weight push v%d (cuda_ipc) rejected (%d): %s", version, e.status, e.message[:500])
        return _error(e.status, e.message, e.tensors)
    except Exception as e:  # the workers check everything before the first copy
        logger.exception("titan weight push v%d (cuda_ipc) failed", version)
        return _error(500, f"weight swap failed: {type(e).__name__}: {e}")
    logger.info("titan weights v%d swapped in %.3f s over CUDA IPC (%d tensors, mode=%s)", version, swap_s, len(got), mode)
    return PushResponse(version=version, num_tensors=len(got), bytes=len(body), swap_seconds=swap_s, validate_seconds=0.0)


# -- middleware: cache salt per version, version on responses --------------------------------------------
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class WeightVersionMiddleware:
    """Pure ASGI (streams pass through chunk by chunk, unlike ``BaseHTTPMiddleware``)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], state: SwapState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].rstrip("/").endswith(GENERATION_PATHS):
            await self.app(scope, receive, send)
            return
        if scope.get("method") == "POST":
            scope, receive = await self._salted(scope, receive)
        await self.app(scope, receive, self._annotating(send))

    async def _salted(self, scope: Scope, receive: Receive) -> tuple[Scope, Receive]:
        """Read the JSON body, add ``cache_salt`` for the current version unless present, replay it."""
        chunks = []
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # disconnected before the body arrived
                return scope, _replay([msg], receive)
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        await self.state.idle.wait()  # a request must not take the salt of weights being replaced
        try:
            data = json.loads(body)
        except ValueError:
            data = None  # not JSON: vLLM answers with its own 400
        if isinstance(data, dict) and data.get("cache_salt") is None:
            data["cache_salt"] = f"{SALT_PREFIX}{self.state.version}"
            body = json.dumps(data).encode()
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            scope = {**scope, "headers": headers}
        return scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive)

    def _annotating(self, send: Send) -> Send:
        stream = False
        pending = b""

        async def wrapped(msg: Message) -> None:
            nonlocal stream, pending
            if msg["type"] == "http.response.start":
                headers = list(msg.get("headers", []))
                ctype = next((v for k, v in headers if k.lower() == b"content-type"), b"")
                stream = ctype.startswith(b"text/event-stream")
                headers.append((VERSION_HEADER.encode(), str(self.state.version).encode()))
                msg = {**msg, "headers": headers}
            elif msg["type"] == "http.response.body" and stream:
                # SSE events end with a blank line; annotate complete events, keep a partial one.
                data = pending + msg.get("body", b"")
                more = msg.get("more_body", False)
                head, sep, pending = data.rpartition(b"\n\n")
                out = b"".join(_annotate_event(e, self.state.version) + b"\n\n" for e in head.split(b"\n\n")) if sep else b""
                if not more:
                    out, pending = out + pending, b""
                msg = {**msg, "body": out}
            await send(msg)

        return wrapped


def _replay(first: list[Message], receive: Receive) -> Receive:
    queue = list(first)

    async def replay() -> Message:
        return queue.pop(0) if queue else await receive()

    return replay


def _annotate_event(event: bytes, version: int) -> bytes:
    """Add the version to each ``data: {json}`` line of one SSE event (``[DONE]`` and others untouched).
    The field is spliced in as the object's first member instead of parsing and re-serialising the
    chunk: the API server does this for every token of every stream."""
    lines = event.split(b"\n")
    for i, line in enumerate(lines):
        if not line.startswith(b"data:"):
            continue
        body = line[5:].strip()
        if body.startswith(b"{") and body.endswith(b"}"):
            rest = body[1:].lstrip()
            lines[i] = b'data: {"%s":%d%s%s' % (VERSION_FIELD.encode(), version, b"" if rest.startswith(b"}") else b",", rest)
    return b"\n".join(lines)
