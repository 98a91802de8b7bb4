"""API-server side of the ``titan_gloo`` (and ``titan_nccl``) weight-transfer engine (``swap.transfer_engine``): vLLM's
``finish_weight_update(weight_version)`` becomes a titan commit.

vLLM's own ``AsyncLLM.finish_weight_update`` tells the workers the update is over and then sets the engine
core's version string; the weights were already written chunk by chunk, with no pause, no per-token ledger
and no cache salt. On a titan server whose backend is ``titan_gloo`` the workers have only staged the
tensors, and the finish goes through ``orchestrator.locked_swap`` instead -- the push lock, the copy between
two engine steps, the engine's version, the per-token spans and the re-salt, all-or-none -- exactly as an
HTTP push does. Every other backend keeps vLLM's behaviour.

Reached through vLLM's dev route ``/finish_weight_update``, which ``swap.guard`` already puts behind the push
token; the bind happens where the swap routes are made (``routes.make_router``).
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

from vllm_titan_plugin.swap.orchestrator import locked_swap
from vllm_titan_plugin.swap.state import SwapState
from vllm_titan_plugin.swap.validate import PushRejected

logger = logging.getLogger("vllm.titan_plugin")

BACKEND = "titan_gloo"  # transfer_engine.NAME (not imported: that module imports vLLM's engine classes)
BACKENDS = (BACKEND, "titan_nccl")  # transfer_engine.TORCH_BACKEND's names: the same engine over gloo or NCCL
COMMIT_METHOD = "titan_commit_transfer"  # transfer_engine.COMMIT_METHOD
_MARK = "__titan_transfer_commit__"
_STATE: list[SwapState] = []  # this API server's swap state, once its routes exist


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


async def commit(engine_client: Any, state: SwapState, weight_version: Any) -> int:
    """The staged transfer becomes version ``weight_version`` through the swap path, then the workers'
    update session closes (vLLM's bookkeeping: its next ``start_weight_update`` needs it closed) whatever the
    commit answered. Returns the version; ``PushRejected`` when refused, the old weights and version serving."""
    try:
        version = parse_version(weight_version)
        done = await state.on_engine_loop(locked_swap(state, COMMIT_METHOD, None, version, keep_cache=True))
    finally:
        try:
            await engine_client.collective_rpc("finish_weight_update")  # drops whatever is still staged
        except Exception as e:  # no session open (a failed update_weights closed it): nothing to close
            logger.info("titan: closing the workers' weight-update session: %s", e)
    logger.info("titan weights v%d committed from a %s transfer in %.3f s (%d requests in flight)", version, BACKEND,
                done.seconds, done.in_flight)
    return version


def bind(state: SwapState) -> None:
    """Route ``AsyncLLM.finish_weight_update`` of a ``titan_gloo`` server through ``commit`` (idempotent)."""
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
            await commit(self, _STATE[0], weight_version)
        except PushRejected as e:  # vLLM's route turns this into the answer's status and detail
            logger.warning("titan %s commit refused (%d): %s", BACKEND, e.status, e.message[:500])
            raise HTTPException(e.status, e.message) from None

    setattr(finish_weight_update, _MARK, True)
    AsyncLLM.finish_weight_update = finish_weight_update  # type: ignore[method-assign]
