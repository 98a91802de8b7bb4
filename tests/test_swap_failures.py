"""Failures inside a swap leave the server in a state that cannot hand out wrong samples (issue 23, risks 5
and 6). The routes' own swap and flip functions run against a stand-in engine client whose pause or
worker copy fails the way vLLM's can; the tagging middleware answers for the server. (The same paths
against a real server are still to do: making a real worker fail part-way needs a fault hook.)

- Risk 6: vLLM marks the engine paused before the cache reset of ``pause_generation(clear_cache=True)``,
  and that reset can raise. The swap (``mode=recompute``) and the BI switch must resume the engine anyway.
- Risk 5: a worker that raises once it has started copying leaves weights that are neither version. The
  server is then *dirty*: the generation routes answer 503 (without reading the body), the version
  endpoint says why, the version number stays, and the next full push clears it. A clean refusal (the
  worker answered ``{"problems": ...}`` before copying) does not make it dirty.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("fastapi")


class FakeEngine:
    """An engine client; ``fail_pause``: the pause marks it paused then raises (a failing cache reset);
    ``worker_answer``: what the weight copy does (an exception to raise, or a value to return)."""

    def __init__(self, fail_pause: bool = False, worker_answer: Any = 3) -> None:
        self.paused = False
        self.fail_pause = fail_pause
        self.worker_answer = worker_answer
        self.worker_calls: list[str] = []
        self.engine_core = SimpleNamespace(call_utility_async=self._utility)
        self.output_processor = SimpleNamespace(request_states={})

    async def pause_generation(self, mode: str = "keep", clear_cache: bool = True) -> None:
        self.paused = True
        if self.fail_pause:
            raise RuntimeError("reset_prefix_cache failed")

    async def resume_generation(self) -> None:
        self.paused = False

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        self.worker_calls.append(method)
        if method == "titan_synchronize_device":  # the wait before a copy (vLLM 0.26's pause has none)
            return [None]
        if isinstance(self.worker_answer, Exception):
            raise self.worker_answer
        return [self.worker_answer]

    async def _utility(self, name: str, *args: Any) -> dict[str, Any]:
        return {"resalted": 0, "in_flight": 0, "counts": {}}


def _state(engine: FakeEngine) -> Any:
    from vllm_titan_plugin.swap.state import SwapState

    app = SimpleNamespace(state=SimpleNamespace(engine_client=engine))
    return SwapState("token", app)


def _swap(state: Any, version: int) -> Any:
    from vllm_titan_plugin.swap import orchestrator

    return asyncio.run(orchestrator.swap(state, "titan_load_weights", "/payload", version, keep_cache=False, pause=True))


def test_swap_resumes_after_a_failed_pause() -> None:
    engine = FakeEngine(fail_pause=True)
    state = _state(engine)
    with pytest.raises(RuntimeError, match="reset_prefix_cache failed"):
        _swap(state, 5)
    assert not engine.paused, "engine left paused"
    assert engine.worker_calls == [], "weights were copied although the pause failed"
    assert state.version == 0 and state.dirty is None  # nothing copied: the weights are whole


def test_batch_invariance_switch_resumes_after_a_failed_pause() -> None:
    from vllm_titan_plugin.swap.orchestrator import flip_batch_invariant

    engine = FakeEngine(fail_pause=True)
    with pytest.raises(RuntimeError, match="reset_prefix_cache failed"):
        asyncio.run(flip_batch_invariant(_state(engine), True))
    assert not engine.paused, "engine left paused"
    assert engine.worker_calls == [], "BI flipped although the pause failed"


async def _call(app: Any, path: str, body: bytes = b"{}") -> tuple[int, dict[str, Any], int]:
    """One ASGI request; returns (status, JSON body, how many body messages the app read)."""
    sent: list[dict[str, Any]] = []
    reads = 0

    async def receive() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"content-length", str(len(body)).encode())]}
    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    raw = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(raw or b"{}"), reads


async def _inner_app(scope: Any, receive: Any, send: Any) -> None:  # stands in for vLLM's routes
    await receive()
    raw = json.dumps({"served": scope["path"]}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(raw)).encode())]})
    await send({"type": "http.response.body", "body": raw})


def test_failed_copy_makes_the_server_dirty_until_a_full_push() -> None:
    from vllm_titan_plugin.swap.tagging import ALL_GENERATION_PATHS, GENERATION_PATHS, WeightVersionMiddleware

    engine = FakeEngine(worker_answer=RuntimeError("CUDA error: out of memory (after 17 of 56 tensors)"))
    state = _state(engine)
    app = WeightVersionMiddleware(_inner_app, state)
    with pytest.raises(RuntimeError, match="out of memory"):
        _swap(state, 5)
    assert not engine.paused and state.version == 0
    assert state.dirty and "v5" in state.dirty and "out of memory" in state.dirty
    for path in GENERATION_PATHS:  # the routes that run the model refuse, before reading the body
        status, body, reads = asyncio.run(_call(app, path))
        assert status == 503 and "weights unavailable" in body["detail"] and reads == 0, (path, status, body)
    for path in set(ALL_GENERATION_PATHS) - set(GENERATION_PATHS):  # untagged routes: refused dirty or not
        assert asyncio.run(_call(app, path))[0] == 501
    assert asyncio.run(_call(app, "/v1/models"))[0] == 200  # the rest of the server still answers
    # a full push lands: clean again
    engine.worker_answer = 56
    _swap(state, 6)
    assert state.version == 6 and state.dirty is None
    status, body, _ = asyncio.run(_call(app, "/v1/completions"))
    assert status == 200 and body == {"served": "/v1/completions"}


def test_clean_refusal_is_not_dirty() -> None:
    from vllm_titan_plugin.swap.validate import PushRejected

    engine = FakeEngine(worker_answer={"problems": ["w: shape [2] vs [3]"], "tensors": ["w"], "status": 422})
    state = _state(engine)
    with pytest.raises(PushRejected):
        _swap(state, 5)
    assert state.dirty is None and state.version == 0 and not engine.paused


def test_version_route_reports_dirty() -> None:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from vllm_titan_plugin.swap.routes import VERSION_ROUTE, make_router

    state = _state(FakeEngine())
    app = FastAPI()
    app.include_router(make_router(state))
    client = TestClient(app)
    assert client.get(VERSION_ROUTE).json()["dirty"] is None
    state.dirty = "push of v3 failed in a worker"
    from titan_rl_ext.kernels.gdn import recurrent_kernel

    assert client.get(VERSION_ROUTE).json() == {"version": 0, "boot_id": state.boot_id, "push_port": None,
                                                "dirty": "push of v3 failed in a worker",
                                                "gdn_recurrent": recurrent_kernel()}


def test_pushes_stage_one_payload_at_a_time() -> None:
    """Concurrent pushes to one server, on its two event loops (the API server's and the weights listener's),
    hold the staging slot one at a time -- shared memory holds one model's bytes, not one per push -- and a push
    cancelled while it waits for the slot leaves it free."""
    import threading

    from vllm_titan_plugin.swap.orchestrator import staging_slot

    state = _state(FakeEngine())
    inside, peak, entries = [0], [0], [0]
    guard = threading.Lock()

    async def push() -> None:
        async with staging_slot(state, poll_s=0.001):
            with guard:
                inside[0] += 1
                entries[0] += 1
                peak[0] = max(peak[0], inside[0])
            await asyncio.sleep(0.005)
            with guard:
                inside[0] -= 1

    async def pushes() -> None:
        await asyncio.gather(*(push() for _ in range(4)))

    loops = [threading.Thread(target=asyncio.run, args=(pushes(),)) for _ in range(2)]
    for t in loops:
        t.start()
    for t in loops:
        t.join(timeout=30)
    assert entries[0] == 8 and peak[0] == 1, (entries, peak)

    async def cancelled_waiter() -> None:
        async with staging_slot(state):
            waiter = asyncio.create_task(push())
            await asyncio.sleep(0.02)
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
        assert state.staging.acquire(blocking=False)  # free: the cancelled push took nothing
        state.staging.release()

    asyncio.run(cancelled_waiter())
