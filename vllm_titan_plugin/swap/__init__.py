"""Weight push + in-place swap for vLLM servers running ``--model-impl titan``.

On only when ``TITAN_SWAP_TOKEN`` is set. The concerns, one file each:

- ``routes``: the HTTP routes (push, version, checksums, BI switch): query checks and answers;
- ``auth``: who may call them (signed requests or the bearer token), from the headers alone;
- ``intake``: per transport, how a push's body becomes a validated payload for the workers;
- ``orchestrator``: the swap itself (staging slot, version check under the lock, between steps or paused,
  dirty on a part-way failure);
- ``state``: one server's swap state (version, boot id, engine loop, lock, served spec);
- ``listener``: those routes on their own port and thread, so a busy OpenAI loop cannot delay a push;
- ``validate``: what a payload must satisfy before any weight changes;
- ``worker``: the methods the workers gain (copy in place, checksums, BI switch);
- ``engine``: the engine core's weight version (with each request's token count at the swap) and the
  re-salt of waiting requests;
- ``ledger``: the API server's per-request spans of versions, from those counts;
- ``tagging``: the OpenAI middleware (cache salt in, per-token versions out);
- ``guard``: vLLM's dev-mode routes (``/pause``, ``/collective_rpc``, ...) behind the push token.
"""

from __future__ import annotations

import logging
from typing import Any

from titan_rl_ext import settings
from titan_rl_ext.wire.protocol import TOKEN_ENV, WEIGHTS_ROUTE
from vllm_titan_plugin import compat

logger = logging.getLogger("vllm.titan_plugin")

_MARK = "__titan_swap__"


def install() -> None:
    """Called by the plugin entry point in every vLLM process; a no-op unless ``TITAN_SWAP_TOKEN`` is set.
    Workers get the swap methods, the engine core its version utility, the API-server process the routes,
    the listener and the middleware."""
    if not settings.SWAP_TOKEN.get():
        return
    from vllm_titan_plugin.swap import engine, worker

    compat.install_worker_methods(worker.METHODS)
    engine.install()
    compat.wrap_api_server_build_app(_attach, _MARK)


def _attach(app: Any, args: Any = None) -> Any:
    from vllm_titan_plugin.swap import listener, tagging
    from vllm_titan_plugin.swap.routes import make_router
    from vllm_titan_plugin.swap.state import SwapState

    token = settings.SWAP_TOKEN.get()
    if not token:  # unset between plugin load and app build: stay off
        return app
    from vllm_titan_plugin.checks import swap_topology_problem

    if problem := swap_topology_problem(args):  # before serving: a swap that reaches one engine of several
        raise RuntimeError(problem)
    port = listener.wanted_port()  # a bad TITAN_SWAP_PORT stops start-up here, naming it
    state = SwapState(token, app, tagging.install())
    try:
        state.note_loop()  # build_app runs inside the API server's loop
    except RuntimeError:
        pass  # no loop yet: the first request on the OpenAI app records it
    app.state.titan_swap = state
    app.include_router(make_router(state))
    compat.add_asgi_middleware(app, tagging.WeightVersionMiddleware, state=state)
    from vllm_titan_plugin.swap.transfer_commit import FinishQuery

    # a transfer's commit mode rides on /finish_weight_update's query, which vLLM's route does not pass on
    compat.add_asgi_middleware(app, FinishQuery)
    if dev_paths := compat.dev_mode_paths():
        from vllm_titan_plugin.swap.guard import DevRoutesGuard

        compat.add_asgi_middleware(app, DevRoutesGuard, state=state, paths=dev_paths)
        logger.info("titan: vLLM's dev routes (%d) need the push token while pushes are on", len(dev_paths))
    if port is not None:
        state.push_port = listener.start(state, args, port)
    logger.info("titan weight swap enabled: POST %s on the OpenAI port%s (token from $%s)", WEIGHTS_ROUTE,
                f" and on port {state.push_port}" if state.push_port else "", TOKEN_ENV)
    return app


__all__ = ["install"]
