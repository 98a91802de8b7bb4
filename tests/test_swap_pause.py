"""A pause that fails part-way is still resumed (issue 23, risk 6).

vLLM marks the engine paused before the cache reset of ``pause_generation(clear_cache=True)``, and that
reset can raise. The weight swap (``mode=recompute``) and the BI switch must then resume the engine anyway,
or it never schedules again. Here the engine client is a stand-in that does exactly that (paused, then
raises); the routes' own swap and flip functions run against it. Before the fix both left it paused.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("fastapi")


class PauseFailsPartWay:
    """An engine client whose pause marks it paused, then raises (as a failing cache reset does)."""

    def __init__(self) -> None:
        self.paused = False
        self.worker_calls: list[str] = []

    async def pause_generation(self, mode: str = "keep", clear_cache: bool = True) -> None:
        self.paused = True
        raise RuntimeError("reset_prefix_cache failed")

    async def resume_generation(self) -> None:
        self.paused = False

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        self.worker_calls.append(method)
        return [True]


def _state(engine: PauseFailsPartWay) -> Any:
    from vllm_titan_plugin.swap.routes import SwapState

    app = SimpleNamespace(state=SimpleNamespace(engine_client=engine))
    return SwapState("token", app, engine_tags=False)


def test_swap_resumes_after_a_failed_pause() -> None:
    from vllm_titan_plugin.swap.routes import _swap

    engine = PauseFailsPartWay()
    state = _state(engine)
    with pytest.raises(RuntimeError, match="reset_prefix_cache failed"):
        asyncio.run(_swap(state, "titan_load_weights", "/nonexistent", 5, keep_cache=False, pause=True))
    assert not engine.paused, "engine left paused"
    assert engine.worker_calls == [], "weights were copied although the pause failed"
    assert state.version == 0


def test_batch_invariance_switch_resumes_after_a_failed_pause() -> None:
    from vllm_titan_plugin.swap.routes import _flip_batch_invariant

    engine = PauseFailsPartWay()
    with pytest.raises(RuntimeError, match="reset_prefix_cache failed"):
        asyncio.run(_flip_batch_invariant(_state(engine), True))
    assert not engine.paused, "engine left paused"
    assert engine.worker_calls == [], "BI flipped although the pause failed"
