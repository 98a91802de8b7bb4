"""API-server side of the staging weight-transfer engines (``titan_gloo``, ``titan_nccl``, ``titan_ipc``:
``swap.transfer_engine``): vLLM's ``finish_weight_update(weight_version)`` becomes a titan commit.

vLLM's own ``AsyncLLM.finish_weight_update`` tells the workers the update is over and then sets the engine
core's version string; the weights were already written chunk by chunk, with no pause, no per-token ledger
and no cache salt. On a titan server whose backend is one of them the workers have only staged the
tensors, and the finish goes through ``orchestrator.locked_swap`` instead -- the push lock, the copy between
two engine steps, the engine's version, the per-token spans and the re-salt, all-or-none -- exactly as an
HTTP push does. Every other backend keeps vLLM's behaviour.

Reached through vLLM's dev route ``/finish_weight_update``, which ``swap.guard`` already puts behind the push
token; the bind happens where the swap routes are made (``routes.make_router``).

The commit's mode travels as the finish request's query, ``?mode=keep|recompute&pause=0|1``, with the meaning it
has on the push route (``keep``: in-flight requests keep their KV cache; ``recompute``: they are preempted and
recompute on the new weights; ``pause=1``: the copy inside a pause of the scheduler). vLLM's route hands the
engine client the version alone, so ``FinishQuery`` (ASGI middleware) passes the query down in a context variable;
being part of the URL, it is covered by the request's signature. No query: ``keep``, no pause, what a foreign
trainer gets.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl

from titan_rl_ext.wire.protocol import MODES

from vllm_titan_plugin.swap.orchestrator import locked_swap
from vllm_titan_plugin.swap.state import SwapState
from vllm_titan_plugin.swap.validate import PushRejected

logger = logging.getLogger("vllm.titan_plugin")

BACKEND = "titan_gloo"  # transfer_engine.NAME (not imported: that module imports vLLM's engine classes)
# transfer_engine's staging engines: the same engine over gloo or NCCL, and titan_ipc (vLLM's ipc wire)
BACKENDS = (BACKEND, "titan_nccl", "titan_ipc")
COMMIT_METHOD = "titan_commit_transfer"  # transfer_engine.COMMIT_METHOD
_MARK = "__titan_transfer_commit__"
_STATE: list[SwapState] = []  # this API server's swap state, once its routes exist
FINISH_ROUTE = "/finish_weight_update"
QUERY_KEYS = ("mode", "pause")
# the query of the /finish_weight_update request being served (set by FinishQuery, read by the wrapped finish)
_FINISH_QUERY: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar("titan_finish_query",
                                                                                        default=None)


class FinishQuery:
    """Pure ASGI middleware: a ``/finish_weight_update`` request's query, visible to the wrapped
    ``AsyncLLM.finish_weight_update`` (vLLM's route passes it the version only). A context variable, not the
    swap state: two finishes in flight each see their own."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"].rstrip("/") != FINISH_ROUTE:
            await self.app(scope, receive, send)
            return
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True))
        token = _FINISH_QUERY.set(query)
        try:
            await self.app(scope, receive, send)
        finally:
            _FINISH_QUERY.reset(token)


def parse_mode(query: Mapping[str, str] | None) -> tuple[bool, bool]:
    """(keep_cache, pause) of a finish's query, as the push route reads ``mode`` and ``pause``;
    ``PushRejected(400)`` naming an unknown key or a bad value (a mistyped ``mode`` must not commit as keep)."""
    query = query or {}
    if unknown := sorted(set(query) - set(QUERY_KEYS)):
        raise PushRejected(400, f"{BACKEND}: finish_weight_update takes the query keys {list(QUERY_KEYS)}, got "
                                f"{unknown}")
    mode = query.get("mode", "keep")
    if mode not in MODES:
        raise PushRejected(400, f"{BACKEND}: mode must be one of {MODES}, got {mode!r}")
    if query.get("pause", "0") not in ("0", "1"):
        raise PushRejected(400, f"{BACKEND}: query parameter 'pause' must be 0 or 1, got {query['pause']!r}")
    return mode == "keep", query.get("pause") == "1"


def parse_version(raw: Any) -> int:
    """``weight_version`` as the titan version: a decimal integer below 2**63, as on the push route
    (``PushRejected(400)`` otherwise: per-token tags and the cache salt are integers)."""
    if raw is None:
        raise PushRejected(400, f"{BACKEND}: finish_weight_update needs a weight_version (a decimal integer above "
                                "the served version)")
    text = str(raw)
    if not re.fullmatch(r"-?[0-9]{1,19}", text) or int(text) >= 2**63:
        raise PushRejected(400, f"{BACKEND}: weight_version must be a decimal integer below 2**63, got {text[:40]!r}")
    return int(text)


def backend_of(engine_client: Any) -> str | None:
    config = getattr(getattr(engine_client, "vllm_config", None), "weight_transfer_config", None)
    return getattr(config, "backend", None)


async def commit(engine_client: Any, state: SwapState, weight_version: Any,
                 query: Mapping[str, str] | None = None) -> int:
    """The staged transfer becomes version ``weight_version`` through the swap path, in the mode ``query`` asks
    (``parse_mode``), then the workers' update session closes (vLLM's bookkeeping: its next
    ``start_weight_update`` needs it closed) whatever the commit answered. Returns the version; ``PushRejected``
    when refused, the old weights and version serving."""
    try:
        version = parse_version(weight_version)
        keep_cache, pause = parse_mode(query)
        done = await state.on_engine_loop(locked_swap(state, COMMIT_METHOD, None, version, keep_cache=keep_cache,
                                                      pause=pause))
    finally:
        try:
            await engine_client.collective_rpc("finish_weight_update")  # drops whatever is still staged
        except Exception as e:  # no session open (a failed update_weights closed it): nothing to close
            logger.info("titan: closing the workers' weight-update session: %s", e)
    logger.info("titan weights v%d committed from a %s transfer in %.3f s (mode=%s%s, %d requests in flight)",
                version, backend_of(engine_client) or BACKEND, done.seconds, "keep" if keep_cache else "recompute",
                ", paused" if pause else "", done.in_flight)
    return version


def bind(state: SwapState) -> None:
    """Route ``AsyncLLM.finish_weight_update`` of a server on one of ``BACKENDS`` through ``commit`` (idempotent)."""
    _STATE[:] = [state]
    from vllm.v1.engine.async_llm import AsyncLLM

    orig = AsyncLLM.finish_weight_update
    if getattr(orig, _MARK, False):
        return

    @functools.wraps(orig)
    async def finish_weight_update(self: Any, weight_version: str | None = None) -> None:
        if not _STATE or backend_of(self) not in BACKENDS:
            return await orig(self, weight_version)
        from fastapi import HTTPException

        try:
            await commit(self, _STATE[0], weight_version, _FINISH_QUERY.get())
        except PushRejected as e:  # vLLM's route turns this into the answer's status and detail
            logger.warning("titan %s commit refused (%d): %s", backend_of(self), e.status, e.message[:500])
            raise HTTPException(e.status, e.message) from None

    setattr(finish_weight_update, _MARK, True)
    AsyncLLM.finish_weight_update = finish_weight_update  # type: ignore[method-assign]
