"""Who may change a running server: the push token, checked from the request's headers alone.

Every route that changes the server (a push, the BI switch) or reads its weights asks here first, before a
byte of the body is read. A request passes with a ``Titan-HMAC`` signature of itself (method, path, query)
for this boot (``wire.signing``: good once, on this process only), or -- unless ``TITAN_SWAP_SIGNED_ONLY=1``
-- with ``Bearer <token>``. The token is never logged or shown.
"""

from __future__ import annotations

import hmac
from typing import Any

from titan_rl_ext import settings
from titan_rl_ext.wire import signing

SIGNED_ONLY_ENV = "TITAN_SWAP_SIGNED_ONLY"
"""``1``: refuse ``Bearer`` (the token on the wire) and take only signed requests (``wire.signing``)."""


class PushAuth:
    def __init__(self, token: str, boot_id: str) -> None:
        """``boot_id``: this server process's, part of what a signature covers."""
        self._token = token.encode()
        self._nonces = signing.NonceLedger()
        self.boot_id = boot_id
        self.signed_only = settings.SWAP_SIGNED_ONLY.get()

    def __repr__(self) -> str:  # never show the token
        return f"PushAuth(signed_only={self.signed_only})"

    def error(self, authorization: str | None, method: str = "", path: str = "",
              query: list[tuple[str, str]] | None = None) -> tuple[int, str] | None:
        """401/403 and why, or None when the request may go on."""
        if not authorization:
            return 401, "missing Authorization (Bearer <token> or a Titan-HMAC signature)"
        scheme, _, given = authorization.partition(" ")
        if scheme == signing.SCHEME:
            try:
                nonce, ts, sig = signing.parse(authorization)
            except ValueError as e:
                return 401, str(e)
            want = signing.signature(self._token, method, path, query or [], self.boot_id, nonce, ts)
            if not hmac.compare_digest(sig, want):
                return 403, "invalid signature (wrong token, another request, or another boot of this server)"
            if (why := self._nonces.admit(nonce, ts)) is not None:
                return 401, why
            return None
        if self.signed_only:
            return 401, f"this server takes {signing.SCHEME}-signed requests only ({SIGNED_ONLY_ENV}=1)"
        if scheme.lower() != "bearer" or not given.strip():
            return 401, "Authorization must be 'Bearer <token>' or a Titan-HMAC signature"
        if not hmac.compare_digest(given.strip().encode(), self._token):
            return 403, "invalid token"
        return None

    def request_error(self, request: Any) -> tuple[int, str] | None:
        """``error`` of a Starlette request, from its headers, method, path and query (never its body)."""
        return self.error(request.headers.get("authorization"), request.method, request.url.path,
                          list(request.query_params.multi_items()))
