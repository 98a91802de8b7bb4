"""The swap itself, whatever carried the weights: one payload staged at a time, the version check under the
push lock, the copy between two engine steps (or inside a pause), the engine core's version and the
per-token ledger set together, and a server marked dirty when a copy failed part-way.

Everything here runs on the API server's event loop (``SwapState.on_engine_loop``) except the staging
slot, which a route holds from before it reads a body. Whatever fails, the engine is resumed: it keeps
serving (the old weights when nothing was copied; 503 on generation while dirty).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from vllm_titan_plugin import compat
from vllm_titan_plugin.swap import engine as engine_side
from vllm_titan_plugin.swap.state import SwapState
from vllm_titan_plugin.swap.validate import PushRejected
from vllm_titan_plugin.swap.worker import first_refusal

logger = logging.getLogger("vllm.titan_plugin")


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



@dataclass(frozen=True)
class SwapDone:
    started: float  # perf_counter when the swap began on the engine's loop (before the lock)
    seconds: float  # from the first engine call to the new version being live
    in_flight: int  # requests holding tokens of the old weights
    resalted: int  # waiting requests re-salted for the new version


async def locked_swap(state: SwapState, method: str, arg: Any, version: int, keep_cache: bool,
                       pause: bool = False, partial: bool = False) -> SwapDone:
    """``partial``: an adapter-only push (``validate.push_spec``), which cannot mend a base a failed whole push
    left mixed."""
    started = time.perf_counter()
    async with state.lock:
        if version <= state.version:
            raise PushRejected(409, f"version {version} is not greater than the current version {state.version}")
        if partial and state.dirty and not state.dirty_adapters_only:
            raise PushRejected(409, f"adapter-only push refused: {state.dirty}")
        seconds, answer = await swap(state, method, arg, version, keep_cache, pause, partial)
        return SwapDone(started, seconds, int(answer.get("in_flight", 0)), int(answer.get("resalted", 0)))


def _rejected(answer: dict[str, Any]) -> PushRejected:
    return PushRejected(int(answer.get("status", 422)), "; ".join(answer["problems"]), answer.get("tensors"))


@contextlib.contextmanager
def _dirty_on_failure(state: SwapState, version: int, where: str, partial: bool = False) -> Iterator[None]:
    """An exception here may come after some tensors were copied: the weights are then neither the old
    version nor the new one. Mark the server dirty (generation answers 503) until a full push lands (an
    adapter-only push when the failed one was one: the base was not touched)."""
    try:
        yield
    except Exception as e:
        state.dirty_adapters_only = partial
        state.dirty = f"push of v{version} failed {where} ({type(e).__name__}: {str(e)[:200]}); the weights may " \
                      f"mix v{state.version} and v{version} until a full push lands"
        logger.error("titan: %s", state.dirty)
        raise


async def flip_batch_invariant(state: SwapState, enabled: bool) -> list[Any]:
    """Pause (caches cleared), flip BI on every worker, resume -- resumed whatever raised, the pause included."""
    async with state.lock:
        try:
            await compat.pause_generation(state.engine, keep_cache=False)
            return await compat.worker_rpc(state.engine, "titan_set_batch_invariant", enabled)
        finally:
            await compat.resume_generation(state.engine)


async def swap(state: SwapState, method: str, arg: Any, version: int, keep_cache: bool,
                pause: bool = False, partial: bool = False) -> tuple[float, dict[str, Any]]:
    """Copy the weights with the worker loader ``method(arg)``, set the engine core's version; returns the
    seconds it took and the engine core's answer (``engine.set_weight_version``). First as one engine-core utility between two steps (``engine.swap_between_steps``);
    when the engine has a batch in flight (or ``pause``), the long way: pause, copy, set, resume. A worker
    answering ``{"problems": ...}`` copied nothing: the version stays and the push is rejected."""
    engine = state.engine
    t0 = time.perf_counter()
    if not pause:
        with _dirty_on_failure(state, version, "between engine steps", partial):
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
        with _dirty_on_failure(state, version, "in a worker", partial):
            results = await compat.worker_rpc(engine, method, arg)
        if (refused := first_refusal(results)) is not None:
            raise _rejected(refused)  # that worker copied nothing
        # paused: no step ran since the copy, so the engine's token counts now are where the new weights begin
        with _dirty_on_failure(state, version, "after the copy, setting the engine's version", partial):
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
