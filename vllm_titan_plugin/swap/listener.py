"""The weights listener: the push routes on their own port, served by their own thread and event loop.

Why: under load the OpenAI event loop spends its turns streaming tokens, and a push that arrives on it
waits behind them (0.2–2 s here, ~12 s on a 2-core CI machine) before its body is even read. On the
listener a push is received and validated without that loop; only the engine calls (pause, copy in the
workers, set the version, resume) hop over to it (``SwapState.on_engine_loop``), a handful of turns.

Port: ``TITAN_SWAP_PORT`` (default: a free one; ``off``: no listener, the routes stay on the OpenAI app
only, as they always are). The OpenAI app's version route advertises the port as ``push_port``, and
``WeightPusher`` sends there.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from typing import Any

logger = logging.getLogger("vllm.titan_plugin")

PORT_ENV = "TITAN_SWAP_PORT"


def wanted_port() -> int | None:
    """The port asked for (0: any free one), or None for no listener. A bad value stops start-up."""
    raw = os.environ.get(PORT_ENV, "").strip().lower()
    if raw == "off":
        return None
    if not raw:
        return 0
    if not raw.isdigit() or not 0 <= int(raw) < 65536:
        raise ValueError(f"{PORT_ENV} must be a TCP port number or 'off', got {raw!r}")
    return int(raw)


def start(state: Any, host: str | None, port: int) -> int:
    """Bind ``host:port`` now (so a taken port fails at start-up, naming it) and serve the push routes
    from a daemon thread. Returns the bound port."""
    import uvicorn
    from fastapi import FastAPI

    from vllm_titan_plugin.swap.routes import make_router

    host = host or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"titan weights listener cannot bind {host}:{port} ({e}); set {PORT_ENV} to a free port "
                      "or to 'off'") from None
    sock.listen(128)
    bound = sock.getsockname()[1]

    app = FastAPI(title="titan weights listener", docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(make_router(state))
    server = uvicorn.Server(uvicorn.Config(app, loop="asyncio", lifespan="off", log_level="warning",
                                           access_log=False))

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        state.listener_loop = loop
        try:
            loop.run_until_complete(server.serve(sockets=[sock]))
        except Exception:  # noqa: BLE001 - the OpenAI app keeps the routes; say why pushes moved there
            logger.exception("titan weights listener stopped; pushes go to the OpenAI port")
            state.push_port = None

    threading.Thread(target=run, name="titan-weights-listener", daemon=True).start()
    return bound
