"""One server's swap state: the weight version, its boot id, the engine's event loop, the push lock, the
served spec, whether the weights may be mixed (``dirty``) and the staging slot."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

from vllm_titan_plugin import compat
from vllm_titan_plugin.swap.auth import PushAuth
from vllm_titan_plugin.swap.ledger import VersionLedger
from vllm_titan_plugin.swap.validate import PushRejected

T = TypeVar("T")


class SwapState:
    """Per-server state: the weight version, the push lock (held on the engine's loop), the served spec."""

    def __init__(self, token: str, app: Any, ledger: VersionLedger | None = None) -> None:
        self.app = app  # the OpenAI app: vLLM stores its engine client there once it is built
        self.ledger = ledger if ledger is not None else VersionLedger()  # per-token versions (swap.ledger)
        self.version = 0
        self.boot_id = uuid.uuid4().hex  # a restarted server is a different generator, even on the same port
        self.auth = PushAuth(token, self.boot_id)
        self.push_port: int | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the API server's (the engine client's)
        self.listener_loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None
        self._spec: dict[str, list[Any]] | None = None
        # why the served weights may be a mix of two versions (a push failed after its copy began): while
        # set, generation routes answer 503 (tagging.WeightVersionMiddleware) until a full push lands
        self.dirty: str | None = None
        # the failed push carried adapter tensors only (the base is whole), so an adapter-only push may clear it
        self.dirty_adapters_only = False
        # one payload staged at a time (orchestrator.staging_slot); a thread semaphore: pushes arrive on two loops
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

    async def spec(self) -> dict[str, list[Any]]:
        """The served parameters' names, dtypes and shapes (asked once; the model does not change shape)."""
        if self._spec is None:
            self._spec = await self.on_engine_loop(self._ask_spec())
        return self._spec

    async def _ask_spec(self) -> dict[str, list[Any]]:
        return (await compat.worker_rpc(self.engine, "titan_weight_spec"))[0]
