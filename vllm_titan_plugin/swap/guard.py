"""vLLM's dev-mode routes behind the push token.

With ``VLLM_SERVER_DEV_MODE=1`` vLLM serves ``/pause``, ``/collective_rpc``, ``/update_weights``, ``/sleep``
and more without any credential (``--api-key`` guards only ``/v1``-style prefixes). On a server that takes
weight pushes, any of them can change what the engine serves, so they need what a push needs: the push
token (``Bearer``) or a signature made with it (``wire.signing``). The guard answers 401/403 from the headers alone.
"""

from __future__ import annotations

from typing import Any

from vllm_titan_plugin.swap.tagging import Receive, Scope, Send, send_json


class DevRoutesGuard:
    """Pure ASGI middleware: ``paths`` (vLLM's dev routes) require the push token; everything else passes."""

    def __init__(self, app: Any, state: Any, paths: frozenset[str]) -> None:
        self.app = app
        self.state = state
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].rstrip("/") in self.paths and scope.get("method") != "OPTIONS":
            from urllib.parse import parse_qsl

            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
            if (err := self.state.auth.error(headers.get("authorization"), scope.get("method", ""), scope["path"],
                                             query)) is not None:
                status, message = err
                await send_json(send, status, {"detail": f"vLLM dev route {scope['path']} with titan weight pushes "
                                                         f"on: {message} (the push token)"})
                return
        await self.app(scope, receive, send)
