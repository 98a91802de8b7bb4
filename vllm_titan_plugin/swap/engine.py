"""Engine-core side of a swap: the weight version every step's outputs carry, and the prefix-cache salt a
request has when it is first scheduled.

Both live in the engine-core process and change in the engine core's own loop, between two steps: in
``swap_between_steps`` (copy, version, re-salt in one utility call) or, where a batch may be in flight, in
``titan_set_weight_version`` called while generation is paused. Two consequences:

- The answer counts every unfinished request's output tokens at that moment: the API server's
  ``swap.ledger`` turns the counts into per-token versions, so a token's tag cannot depend on how late
  the API server gets to send it (vLLM's own ``EngineCoreOutputs.weight_version`` is also set where the
  release has it, for vLLM's own outputs).
- A request salted ``titan-v<N>`` by the API server at arrival, but still waiting in the engine (or
  in transit to it) when version ``N+1`` lands, is re-salted ``titan-v<N+1>`` before it is first
  scheduled: it cannot reuse prefix blocks that other weights computed. A salt the client chose is left
  alone.
- A running request that has computed part of its prompt but sampled nothing yet starts its prompt over
  under the new version (preempted, then re-salted): every token it samples is counted new, so its
  context must be the new weights' too.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from titan_rl_ext.wire.protocol import SALT_PREFIX
from vllm_titan_plugin import compat
from vllm_titan_plugin.swap.worker import first_refusal

logger = logging.getLogger("vllm.titan_plugin")

_MARK = "__titan_salt__"
UTILITY = "titan_set_weight_version"
SWAP_UTILITY = "titan_swap_between_steps"


class EngineVersion:
    """The engine core's weight version (one per engine-core process)."""

    version = 0

    @classmethod
    def salt(cls) -> str:
        return f"{SALT_PREFIX}{cls.version}"


def is_titan_salt(salt: str | None) -> bool:
    return bool(salt) and salt.startswith(SALT_PREFIX) and salt[len(SALT_PREFIX):].lstrip("-").isdigit()


def resalt(request: Any) -> bool:
    """Give a not-yet-computed request the current version's salt; True if it changed. Its block hashes are
    recomputed from the first block, since the salt enters the first block's hash and every later one
    chains on it."""
    salt = EngineVersion.salt()
    if not is_titan_salt(request.cache_salt) or request.cache_salt == salt or request.num_computed_tokens:
        return False
    request.cache_salt = salt
    compat.rehash_request_blocks(request)
    return True


def set_weight_version(engine_core: Any, version: int) -> dict[str, Any]:
    """The utility method (installed on vLLM's ``EngineCore``): runs between engine steps with no batch in
    flight. Returns ``counts`` (output tokens of every unfinished request: its tokens from that index on
    are the new version's), how many waiting requests were re-salted, and how many requests straddle the
    swap (``in_flight``: they hold tokens of the old weights). A swap that lands while the engine holds no
    such request changed no sample's history: the pusher can tell. A prompt half computed by the old weights
    starts over first (``compat.restart_partial_prefills``): its tokens, all counted new, must be the new
    weights' alone."""
    EngineVersion.version = int(version)
    compat.set_engine_weight_version(engine_core, str(int(version)))
    if restarted := compat.restart_partial_prefills(engine_core):
        logger.info("titan weights v%d: %d half-computed prompt(s) start over", version, len(restarted))
    n = sum(resalt(r) for r in compat.unscheduled_requests(engine_core))
    if n:
        logger.info("titan weights v%d: re-salted %d waiting request(s)", version, n)
    counts = compat.output_token_counts(engine_core)
    return {"resalted": n, "in_flight": sum(1 for k in counts.values() if k > 0), "counts": counts}


def swap_between_steps(engine_core: Any, method: str, arg: Any, version: int, keep_cache: bool) -> dict[str, Any]:
    """The whole swap as one utility call (installed on ``EngineCore``). The engine core runs utilities
    between steps, so when no batch is in flight this is as atomic as pause + copy + resume, with one round
    trip through the API server's busy loop instead of four. Returns ``{"busy": True}`` (nothing done: the
    caller pauses instead) when a batch is in flight or the caches cannot be reset here; the workers'
    ``{"problems": ...}`` when they refused (nothing copied); else ``set_weight_version``'s answer."""
    if compat.engine_has_batches_in_flight(engine_core) or (not keep_cache and not compat.can_reset_engine_caches(engine_core)):
        return {"busy": True}
    compat.synchronize_workers(engine_core)
    results = compat.engine_collective_rpc(engine_core, method, arg)
    if (refused := first_refusal(results)) is not None:
        return refused
    if not keep_cache:  # "recompute": running requests are preempted and recompute on the new weights
        compat.reset_engine_caches(engine_core)
    return set_weight_version(engine_core, version)


def install() -> None:
    """In every process (only the engine core's copy ever runs): the utility, and the re-salt of each request
    as the scheduler receives it (a request can pass the API server before a swap and reach the engine
    after it)."""
    cls = compat.engine_core_class()
    for name, fn in ((UTILITY, set_weight_version), (SWAP_UTILITY, swap_between_steps)):
        if getattr(cls, name, None) is not fn:
            setattr(cls, name, fn)
    orig = cls.add_request
    if getattr(orig, _MARK, False):
        return

    @functools.wraps(orig)
    def add_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        resalt(request)
        return orig(self, request, *args, **kwargs)

    setattr(add_request, _MARK, True)
    cls.add_request = add_request
