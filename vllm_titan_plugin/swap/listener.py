"""The weights listener: the push routes on their own port, served by their own thread and event loop.

Why: under load the OpenAI event loop spends its turns streaming tokens, and a push that arrives on it
waits behind them (seconds on a small machine: docs/decisions.md) before its body is even read. On the
listener a push is received and validated without that loop; only the engine calls (pause, copy in the
workers, set the version, resume) hop over to it (``SwapState.on_engine_loop``), a handful of turns.

Port: ``TITAN_SWAP_PORT`` -- unset or ``off`` (the default): no listener, the routes stay on the OpenAI app
only (a server opens no TCP port its operator did not ask for); ``0``: a free port; ``N``: that port. The
listener binds where the API server binds (all interfaces when vLLM was given no ``--host``, as vLLM does;
loopback when vLLM serves a Unix socket only), and serves TLS with the API server's certificate under
``--ssl-certfile``. The OpenAI app's version route advertises the port as ``push_port``, and
``WeightPusher`` sends there once it has checked the listener belongs to the same server boot.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from typing import Any

from titan_rl_ext import settings
from titan_rl_ext.wire.protocol import SWAP_PORT_ENV

logger = logging.getLogger("vllm.titan_plugin")

PORT_ENV = SWAP_PORT_ENV


def wanted_port() -> int | None:
    """The port asked for (0: any free one), or None for no listener (unset or "off"). A bad value stops
    start-up."""
    raw = settings.SWAP_PORT.get().strip().lower()
    if raw in ("", "off"):
        return None
    if not raw.isdigit() or not 0 <= int(raw) < 65536:
        raise ValueError(f"{PORT_ENV} must be a TCP port number or 'off', got {raw!r}")
    return int(raw)


def bind_host(args: Any) -> str:
    """Where the listener binds: the API server's ``--host``; all interfaces when it has none (vLLM then
    listens on all of them too); loopback when vLLM serves a Unix socket only (``--uds``: it opens no TCP
    port, so the only TCP port is the one asked for here, and it stays on this machine)."""
    if getattr(args, "uds", None):
        return "127.0.0.1"
    return getattr(args, "host", None) or "0.0.0.0"


def start(state: Any, args: Any, port: int) -> int:
    """Bind the listener now (so a taken port fails at start-up, naming it) and serve the push routes from
    a daemon thread, with TLS when the API server has it. Returns the bound port."""
    import uvicorn
    from fastapi import FastAPI

    from vllm_titan_plugin.swap.routes import make_router

    host = bind_host(args)
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
    tls = {k: getattr(args, k) for k in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs")
           if getattr(args, k, None) is not None}
    config = uvicorn.Config(app, loop="asyncio", lifespan="off", log_level="warning", access_log=False, **tls)
    if tls.get("ssl_certfile"):
        config.load()  # builds the SSL context now: a bad certificate stops start-up here
    server = uvicorn.Server(config)

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
